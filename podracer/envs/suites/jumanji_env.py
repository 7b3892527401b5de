"""Jumanji environments (`jumanji:Snake-v1`): dict observations flattened, the action mask kept.

Jumanji marks an episode's last step with `step_type == LAST`; a discount of
0 there is termination, any other a time limit (truncation). Observation
fields are flattened into one vector in their order; an `action_mask` field is
left out of it and passed on as the last `action_dim` entries, which the
network reads as the legal-action mask.

PacMan's observation is mostly what never changes: the maze (31 x 28 walls,
the same in every episode) and the fixed place of each of its 318 pellets,
zeroed once eaten. The adapter passes each pellet as one flag (still there or
not) and leaves the maze out: 343 numbers instead of 1,529, with nothing lost
to an MLP (a constant input is a bias; a pellet's place times its flag is its
flag times a constant), and a first layer and rollout buffers 4.5 times
smaller, which is most of what PPO on PacMan costs.

Jumanji's reset is made only where an episode ended (`costly_reset`), not
drawn ahead for every (step, environment): a PacMan state holds 1,582 numbers,
which drawn ahead would be written and selected on every step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from podracer.envs.suites.base import SuiteEnv, discrete_spec, flatten_obs, with_mask
from podracer.errors import PodracerError


def make(env_id: str, name: str) -> SuiteEnv:
    import jumanji
    from jumanji import specs

    if name not in jumanji.registered_environments():
        raise PodracerError(f"unknown Jumanji environment {name!r}; use one of jumanji.registered_environments()")
    env = jumanji.make(name)
    action_spec = env.action_spec
    if not isinstance(action_spec, specs.DiscreteArray):
        raise PodracerError(f"--env={env_id} has {type(action_spec).__name__} actions; podracer runs "
                            f"Jumanji environments with one discrete action (DiscreteArray)")

    compact = _pacman_features if _fixed_maze_pacman(env) else (lambda raw: raw)

    def obs_fn(raw):
        return with_mask(*flatten_obs(compact(raw), "action_mask"))

    def reset_fn(key):
        state, timestep = env.reset(key)
        return state, timestep.observation

    def step_fn(key, state, action):
        del key  # Jumanji carries its randomness in the state
        state, timestep = env.step(state, action)
        last = timestep.last()
        terminated = last & (timestep.discount == 0)
        return state, timestep.observation, timestep.reward, terminated, last & ~terminated

    raw = jax.eval_shape(reset_fn, jax.random.PRNGKey(0))[1]
    masked = flatten_obs(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), raw), "action_mask")[1] is not None
    obs = jax.eval_shape(obs_fn, raw)
    spec = discrete_spec(jnp.zeros(obs.shape, obs.dtype), action_spec.num_values, masked)
    return SuiteEnv(env_id, spec, reset_fn, step_fn, obs_fn, int(getattr(env, "time_limit", 1000)),
                    costly_reset=True)


def _fixed_maze_pacman(env) -> bool:
    """Whether `env` is PacMan on one maze for every episode (Jumanji's ASCII generator, its default)."""
    from jumanji.environments.routing.pac_man import PacMan
    from jumanji.environments.routing.pac_man.generator import AsciiGenerator

    return isinstance(env, PacMan) and isinstance(env.generator, AsciiGenerator)


def _pacman_features(raw) -> dict:
    """PacMan's observation without its maze, each pellet's (row, column) as one still-there flag."""
    fields = raw._asdict()
    del fields["grid"]
    fields["pellets_left"] = jnp.any(fields.pop("pellet_locations") != 0, axis=-1)
    return fields
