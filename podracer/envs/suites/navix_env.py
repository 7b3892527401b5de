"""Navix (`navix:Navix-Empty-5x5-v0`): MiniGrid in JAX.

Navix's own `step` resets an episode on the step after it ends; the adapter
steps with its `_step` and resets in the same step, as every Anakin
environment does. Its step type says termination (2) or truncation (1).
"""

from __future__ import annotations

import jax
import numpy as np
import jax.numpy as jnp

from podracer.envs.suites.base import SuiteEnv, discrete_spec
from podracer.errors import PodracerError


def make(env_id: str, name: str) -> SuiteEnv:
    import navix

    if name not in navix.registry():
        raise PodracerError(f"unknown Navix environment {name!r}; use one of navix.registry()")
    env = navix.make(name)

    def reset_fn(key):
        timestep = env.reset(key)
        return timestep, timestep.observation

    def step_fn(key, timestep, action):
        del key  # Navix carries its randomness in the state
        timestep = env._step(timestep, action)
        return (timestep, timestep.observation, timestep.reward, timestep.step_type == 2,
                timestep.step_type == 1)

    obs = jax.eval_shape(reset_fn, jax.random.PRNGKey(0))[1]
    num_actions = int(env.action_space.maximum) + 1
    spec = discrete_spec(jnp.zeros(obs.shape, obs.dtype), num_actions)
    return SuiteEnv(env_id, spec, reset_fn, step_fn, lambda o: jnp.asarray(o, spec.obs_dtype),
                    int(env.max_steps),
                    render_fn=lambda timestep: np.asarray(navix.observations.rgb(timestep.state)))
