"""brax's own environments (`brax:inverted_pendulum`, `brax:fast`), on any of its backends.

`brax:NAME` uses the spring backend, the fastest on CPU; `brax:NAME:BACKEND`
picks another (`generalized`, `positional`, `mjx`). brax environments never
end on time themselves: as brax's own training does, an episode is truncated
after 1000 steps. Actions are continuous, clipped to [-1, 1].
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

from podracer.envs.suites.base import SuiteEnv, box_spec
from podracer.errors import PodracerError

EPISODE_LENGTH = 1000
BACKENDS = ("spring", "generalized", "positional", "mjx")


def make(env_id: str, name: str) -> SuiteEnv:
    from brax import envs

    name, _, backend = name.partition(":")
    backend = backend or "spring"
    if name not in envs._envs:
        raise PodracerError(f"unknown brax environment {name!r}; use one of {', '.join(sorted(envs._envs))}")
    if backend not in BACKENDS:
        raise PodracerError(f"unknown brax backend {backend!r} in --env={env_id}; use one of {', '.join(BACKENDS)}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # brax's notice that it is no longer maintained
        env = envs.get_environment(name, backend=backend) if name != "fast" else envs.get_environment(name)

    def reset_fn(key):
        state = env.reset(key)
        return state, state.obs

    def step_fn(key, state, action):
        del key  # brax steps are deterministic
        state = env.step(state, action)
        return state, state.obs, state.reward, state.done > 0.5, jnp.array(False)

    obs = jax.eval_shape(reset_fn, jax.random.PRNGKey(0))[1]
    size = env.action_size
    spec = box_spec(jnp.zeros(obs.shape, jnp.float32), -jnp.ones(size), jnp.ones(size))
    render = None
    if name != "fast":
        def render(state):
            from brax.io import image

            return image.render_array(env.sys, state.pipeline_state, 160, 120)
    return SuiteEnv(env_id, spec, reset_fn, step_fn, lambda o: jnp.asarray(o, jnp.float32),
                    EPISODE_LENGTH, time_limit=EPISODE_LENGTH, render_fn=render)
