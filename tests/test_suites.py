"""Each suite adapter against its library's own reset and step on a fixed action sequence.

The library side is driven by hand: its step until an episode ends, then its
reset with the key the adapter drew for that step, so observations, rewards
and done flags must agree at every step, across episode boundaries.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from podracer.envs.jax_envs import make_env

STEPS = 60
# Each comparison is one program that runs once: without LLVM's optimisation it
# compiles in about half the time (Craftax's world generation most of all).
RUN_ONCE = {"xla_backend_optimization_level": 0}


def _select(done, new, old):
    return jax.tree.map(lambda a, b: jax.lax.select(done, a, b), new, old)


def _compare(env, lib_reset, lib_step, lib_obs, actions, seed=0):
    """Step the adapter and the library side by side; returns how many episodes ended.

    Both run in one jitted scan. The library is stepped with the key the adapter
    drew for the step and, where its episode ended, reset with the key the
    adapter drew for that reset (`draw`: step key, reset key).
    """
    key = jax.random.PRNGKey(seed)
    reset_key, key = jax.random.split(key)

    def run(actions):
        state, first = env.reset(reset_key)
        inner, lib_first = lib_reset(reset_key)

        def step(carry, xs):
            state, inner = carry
            t, action = xs
            step_key = jax.random.fold_in(key, t)
            draws = env.draw(step_key)
            state, ts = env.step_with(draws, state, action)
            inner, raw, reward, terminated, truncated = lib_step(draws.step_key, inner, action)
            done = jnp.logical_or(terminated, truncated)
            reset_inner, reset_raw = lib_reset(jax.random.split(step_key)[1])
            lib = (lib_obs(raw), reward, terminated, truncated, jnp.where(done, lib_obs(reset_raw), lib_obs(raw)))
            return (state, _select(done, reset_inner, inner)), (ts, lib)

        _, (ts, lib) = jax.lax.scan(step, (state, inner), (jnp.arange(len(actions)), actions))
        return first.obs, lib_obs(lib_first), ts, lib

    first, lib_first, ts, lib = jax.jit(run, compiler_options=RUN_ONCE)(jnp.asarray(actions))
    final_obs, reward, terminated, truncated, next_obs = jax.device_get(lib)
    np.testing.assert_allclose(first, lib_first, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ts.final_obs, final_obs, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ts.reward, reward, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(ts.terminated, terminated)
    np.testing.assert_array_equal(ts.truncated, truncated)
    np.testing.assert_allclose(ts.obs, next_obs, rtol=1e-6, atol=1e-6)  # the next episode's start where one ended
    ended = np.asarray(terminated | truncated)
    assert (np.asarray(ts.episode_length)[ended] >= 1).all()
    return {"terminated": int(np.sum(terminated)), "truncated": int(np.sum(truncated & ~terminated))}


def test_brax_matches_brax_step():
    pytest.importorskip("brax")
    from brax import envs

    env = make_env("brax:inverted_pendulum")
    lib = envs.get_environment("inverted_pendulum", backend="spring")

    def lib_step(key, state, action):
        state = lib.step(state, jnp.clip(action, -1, 1))
        return state, state.obs, state.reward, state.done > 0.5, jnp.array(False)

    actions = np.random.default_rng(0).uniform(-3, 3, (STEPS, 1)).astype(np.float32)
    ends = _compare(env, lambda k: (lambda s: (s, s.obs))(lib.reset(k)), lib_step, jnp.asarray, actions)
    assert ends["terminated"] >= 1  # the pole falls under random pushes


def test_jumanji_matches_jumanji_step():
    pytest.importorskip("jumanji")
    import jumanji

    env = make_env("jumanji:Snake-v1")
    lib = jumanji.make("Snake-v1")

    def lib_obs(o):  # the grid, the step count, then the mask: the adapter's layout
        return jnp.concatenate([jnp.ravel(o.grid), o.step_count[None], o.action_mask]).astype(jnp.float32)

    def lib_step(key, state, action):
        state, ts = lib.step(state, action)
        last = ts.last()
        return state, ts.observation, ts.reward, last & (ts.discount == 0), last & (ts.discount != 0)

    assert env.spec.action_mask
    actions = np.random.default_rng(0).integers(0, 4, STEPS)
    ends = _compare(env, lambda k: (lambda s, t: (s, t.observation))(*lib.reset(k)), lib_step, lib_obs, actions)
    assert ends["terminated"] >= 1  # the snake hits a wall or itself


def test_jumanji_pacman_observation_leaves_out_only_what_never_changes():
    pytest.importorskip("jumanji")
    import jumanji

    env = make_env("jumanji:PacMan-v1")
    lib = jumanji.make("PacMan-v1")

    def lib_obs(o):  # the fields in sorted order, no maze, one flag per pellet, then the mask
        return jnp.concatenate([
            jnp.ravel(o.frightened_state_time), jnp.ravel(o.ghost_locations), jnp.any(o.pellet_locations != 0, -1),
            jnp.ravel(o.player_locations.x), jnp.ravel(o.player_locations.y), jnp.ravel(o.power_up_locations),
            jnp.ravel(o.score), o.action_mask]).astype(jnp.float32)

    def lib_step(key, state, action):
        state, ts = lib.step(state, action)
        last = ts.last()
        return state, ts.observation, ts.reward, last & (ts.discount == 0), last & (ts.discount != 0)

    assert env.spec.obs_shape == (343,) and env.spec.action_mask
    actions = np.random.default_rng(0).integers(0, 5, STEPS)
    _compare(env, lambda k: (lambda s, t: (s, t.observation))(*lib.reset(k)), lib_step, lib_obs, actions)

    # What the adapter leaves out never changes: the maze in every episode and step, and
    # each pellet's place, which the library zeroes once eaten (so its flag says it all).
    def observations(key):
        state, ts = lib.reset(key)
        step = lambda state, action: (lambda s, t: (s, t.observation))(*lib.step(state, action))
        return jax.lax.scan(step, state, jnp.asarray(actions))[1]

    first = jax.jit(lib.reset)(jax.random.PRNGKey(0))[1].observation
    for seed in (1, 2):
        seen = jax.jit(observations)(jax.random.PRNGKey(seed))
        np.testing.assert_array_equal(seen.grid, np.broadcast_to(first.grid, seen.grid.shape))
        left = np.any(np.asarray(seen.pellet_locations) != 0, axis=-1)
        assert (~left).any()  # pellets were eaten, so the flags were put to the test
        np.testing.assert_array_equal(seen.pellet_locations, left[..., None] * np.asarray(first.pellet_locations))


def test_craftax_matches_craftax_step():
    pytest.importorskip("craftax")
    from craftax.craftax_env import make_craftax_env_from_name

    env = make_env("craftax:Craftax-Classic-Symbolic-v1")
    lib = make_craftax_env_from_name("Craftax-Classic-Symbolic-v1", auto_reset=False)
    params = lib.default_params

    def lib_step(key, state, action):
        obs, state, reward, done, _ = lib.step(key, state, action, params)
        return state, obs, reward, done, jnp.array(False)

    actions = np.random.default_rng(0).integers(0, 17, STEPS)
    _compare(env, lambda k: lib.reset(k, params)[::-1], lib_step, jnp.asarray, actions)


def test_navix_matches_navix_step():
    pytest.importorskip("navix")
    import navix

    env = make_env("navix:Navix-Empty-5x5-v0")
    lib = navix.make("Navix-Empty-5x5-v0")

    def lib_step(key, timestep, action):
        timestep = lib.step(timestep, action)
        return (timestep, timestep.observation, timestep.reward, timestep.step_type == 2,
                timestep.step_type == 1)

    actions = np.random.default_rng(1).integers(0, 3, 250)  # turns and forward: reaches the goal or times out
    ends = _compare(env, lambda k: (lambda t: (t, t.observation))(lib.reset(k)), lib_step, jnp.asarray, actions)
    assert sum(ends.values()) >= 2


def _countdown_env(costly_reset):
    """A toy suite whose episodes last 1-3 steps, so many end on the same step."""
    from podracer.envs.suites.base import SuiteEnv, discrete_spec

    def reset_fn(key):
        left = jax.random.randint(key, (), 1, 4)
        return left, jnp.stack([left.astype(jnp.float32), jax.random.uniform(key)])

    def step_fn(key, left, action):
        left = left - 1
        obs = jnp.stack([left.astype(jnp.float32), jax.random.uniform(key) + action])
        return left, obs, action.astype(jnp.float32), left == 0, jnp.array(False)

    spec = discrete_spec(jnp.zeros(2), 2)
    return SuiteEnv("toy:countdown", spec, reset_fn, step_fn, lambda o: o, 3, costly_reset=costly_reset)


def test_costly_resets_made_only_where_episodes_end_equal_resets_drawn_ahead():
    """`step_batch` of a costly-reset suite (Craftax's) resets in passes of a few environments;
    here up to 16 of 16 end on a step, many passes of 2, and it equals resets drawn for every step."""
    costly, ahead = _countdown_env(True), _countdown_env(False)
    num_envs, steps = 16, 12
    keys = jax.random.split(jax.random.PRNGKey(3), (steps, num_envs))
    actions = jax.random.randint(jax.random.PRNGKey(4), (steps, num_envs), 0, 2)

    def run(env):
        state, _ = jax.vmap(env.reset)(jax.random.split(jax.random.PRNGKey(5), num_envs))

        def step(state, xs):
            step_keys, action = xs
            return env.step_batch(jax.vmap(env.draw)(step_keys), state, action)

        return jax.lax.scan(step, state, (keys, actions))

    assert costly.draw(keys[0, 0]).reset_obs is None  # nothing made ahead
    (state, ts), (state_ahead, ts_ahead) = jax.jit(run, static_argnums=0)(costly), jax.jit(run, static_argnums=0)(ahead)
    ended = np.asarray(ts.terminated).sum(axis=1)
    assert ended.max() > 2 and ended.sum() > steps * 2, ended  # several passes on some steps
    for x, y in zip(jax.tree.leaves((state, ts)), jax.tree.leaves((state_ahead, ts_ahead))):
        np.testing.assert_array_equal(x, y)


def test_a_missing_suite_is_one_line_naming_its_extra(monkeypatch):
    from podracer.errors import PodracerError

    monkeypatch.setitem(__import__("sys").modules, "navix", None)  # as if not installed
    make_env.cache_clear()  # an environment made by an earlier test would be answered from the cache
    with pytest.raises(PodracerError, match=r'needs navix: pip install -e "\.\[navix\]"') as err:
        make_env("navix:Navix-Empty-5x5-v0")
    assert "\n" not in str(err.value)
    with pytest.raises(PodracerError, match="arch=sebulba"):
        make_env("gymnasium:CartPole-v1")
