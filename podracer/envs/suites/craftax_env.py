"""Craftax (`craftax:Craftax-Classic-Symbolic-v1`, and the other Craftax ids).

Craftax ends an episode at death or at `max_timesteps` (10,000 steps); the
second is a time limit, reported as truncation. Symbolic variants give a flat
vector (an MLP), pixel variants an image (the CNN torso).
"""

from __future__ import annotations

import jax
import numpy as np
import jax.numpy as jnp

from podracer.envs.suites.base import SuiteEnv, discrete_spec
from podracer.errors import PodracerError

IDS = ("Craftax-Classic-Symbolic-v1", "Craftax-Classic-Pixels-v1", "Craftax-Symbolic-v1",
       "Craftax-Pixels-v1")


def make(env_id: str, name: str) -> SuiteEnv:
    from craftax.craftax_env import make_craftax_env_from_name

    if name not in IDS:
        raise PodracerError(f"unknown Craftax environment {name!r}; use one of {', '.join(IDS)}")
    env = make_craftax_env_from_name(name, auto_reset=False)
    params = env.default_params

    def reset_fn(key):
        obs, state = env.reset_env(key, params)
        return state, obs

    def step_fn(key, state, action):
        obs, state, reward, done, _ = env.step_env(key, state, action, params)
        out_of_time = state.timestep >= params.max_timesteps
        alive = state.player_health > 0
        truncated = done & out_of_time & alive
        return state, obs, reward, done & ~truncated, truncated

    obs = jax.eval_shape(reset_fn, jax.random.PRNGKey(0))[1]
    spec = discrete_spec(jnp.zeros(obs.shape, obs.dtype), env.action_space(params).n)
    renderer = []  # built on first use: loading the textures takes seconds

    def render(state):
        if not renderer:
            if "Classic" in name:
                from craftax.craftax_classic.renderer import make_craftax_pixel_renderer
            else:
                from craftax.craftax.renderer import make_craftax_pixel_renderer
            renderer.append(jax.jit(make_craftax_pixel_renderer(16)))
        return np.asarray(renderer[0](state))

    return SuiteEnv(env_id, spec, reset_fn, step_fn, lambda o: jnp.asarray(o, spec.obs_dtype),
                    int(params.max_timesteps), render_fn=render, costly_reset=True)
