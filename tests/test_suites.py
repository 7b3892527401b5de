"""Each suite adapter against its library's own reset and step on a fixed action sequence.

The library side is driven by hand: its step until an episode ends, then its
reset with the key the adapter drew for that step, so observations, rewards
and done flags must agree at every step, across episode boundaries.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from podracer.anakin.env import make_env

STEPS = 60


def _compare(env, lib_reset, lib_step, lib_obs, actions, seed=0):
    """Step the adapter and the library side by side; returns how many episodes ended."""
    key = jax.random.PRNGKey(seed)
    reset_key, key = jax.random.split(key)
    state, ts = jax.jit(env.reset)(reset_key)
    inner, raw = lib_reset(reset_key)
    np.testing.assert_allclose(ts.obs, lib_obs(raw), rtol=1e-6, atol=1e-6)
    step, draw = jax.jit(env.step_with), jax.jit(env.draw)
    ends = {"terminated": 0, "truncated": 0}
    for t, action in enumerate(actions):
        draws = draw(jax.random.fold_in(key, t))
        state, ts = step(draws, state, action)
        inner, raw, reward, terminated, truncated = lib_step(draws.step_key, inner, action)
        np.testing.assert_allclose(ts.final_obs, lib_obs(raw), rtol=1e-5, atol=1e-5, err_msg=f"step {t}")
        np.testing.assert_allclose(ts.reward, reward, rtol=1e-5, atol=1e-6, err_msg=f"step {t}")
        assert (bool(ts.terminated), bool(ts.truncated)) == (bool(terminated), bool(truncated)), t
        if terminated or truncated:
            ends["terminated" if terminated else "truncated"] += 1
            inner, raw = lib_reset(jax.random.split(jax.random.fold_in(key, t))[1])  # the adapter's reset key
            np.testing.assert_allclose(ts.obs, lib_obs(raw), rtol=1e-6, atol=1e-6)
            assert int(ts.episode_length) >= 1
        else:
            np.testing.assert_allclose(ts.obs, ts.final_obs)
    return ends


def test_brax_matches_brax_step():
    pytest.importorskip("brax")
    from brax import envs

    env = make_env("brax:inverted_pendulum")
    lib = envs.get_environment("inverted_pendulum", backend="spring")
    reset, step = jax.jit(lib.reset), jax.jit(lib.step)

    def lib_step(key, state, action):
        state = step(state, jnp.clip(action, -1, 1))
        return state, state.obs, state.reward, state.done > 0.5, False

    actions = np.random.default_rng(0).uniform(-3, 3, (STEPS, 1)).astype(np.float32)
    ends = _compare(env, lambda k: (lambda s: (s, s.obs))(reset(k)), lib_step, np.asarray, actions)
    assert ends["terminated"] >= 1  # the pole falls under random pushes


def test_jumanji_matches_jumanji_step():
    pytest.importorskip("jumanji")
    import jumanji

    env = make_env("jumanji:Snake-v1")
    lib = jumanji.make("Snake-v1")
    reset, step = jax.jit(lib.reset), jax.jit(lib.step)

    def lib_obs(o):  # the grid, the step count, then the mask: the adapter's layout
        return np.concatenate([np.ravel(o.grid), [o.step_count], o.action_mask]).astype(np.float32)

    def lib_step(key, state, action):
        state, ts = step(state, action)
        last = bool(ts.last())
        return state, ts.observation, ts.reward, last and ts.discount == 0, last and ts.discount != 0

    assert env.spec.action_mask
    actions = np.random.default_rng(0).integers(0, 4, STEPS)
    ends = _compare(env, lambda k: (lambda s, t: (s, t.observation))(*reset(k)), lib_step, lib_obs, actions)
    assert ends["terminated"] >= 1  # the snake hits a wall or itself


def test_craftax_matches_craftax_step():
    pytest.importorskip("craftax")
    from craftax.craftax_env import make_craftax_env_from_name

    env = make_env("craftax:Craftax-Classic-Symbolic-v1")
    lib = make_craftax_env_from_name("Craftax-Classic-Symbolic-v1", auto_reset=False)
    params = lib.default_params
    reset, step = jax.jit(lib.reset), jax.jit(lib.step)

    def lib_step(key, state, action):
        obs, state, reward, done, _ = step(key, state, action, params)
        return state, obs, reward, bool(done), False

    actions = np.random.default_rng(0).integers(0, 17, STEPS)
    _compare(env, lambda k: reset(k, params)[::-1], lib_step, np.asarray, actions)


def test_navix_matches_navix_step():
    pytest.importorskip("navix")
    import navix

    env = make_env("navix:Navix-Empty-5x5-v0")
    lib = navix.make("Navix-Empty-5x5-v0")
    reset, step = jax.jit(lib.reset), jax.jit(lib.step)

    def lib_step(key, timestep, action):
        timestep = step(timestep, action)
        return (timestep, timestep.observation, timestep.reward, timestep.step_type == 2,
                timestep.step_type == 1)

    actions = np.random.default_rng(1).integers(0, 3, 250)  # turns and forward: reaches the goal or times out
    ends = _compare(env, lambda k: (lambda t: (t, t.observation))(reset(k)), lib_step, np.asarray, actions)
    assert sum(ends.values()) >= 2


def test_a_missing_suite_is_one_line_naming_its_extra(monkeypatch):
    from podracer.errors import PodracerError

    monkeypatch.setitem(__import__("sys").modules, "navix", None)  # as if not installed
    make_env.cache_clear()  # an environment made by an earlier test would be answered from the cache
    with pytest.raises(PodracerError, match=r'needs navix: pip install -e "\.\[navix\]"') as err:
        make_env("navix:Navix-Empty-5x5-v0")
    assert "\n" not in str(err.value)
    with pytest.raises(PodracerError, match="arch=sebulba"):
        make_env("gymnasium:CartPole-v1")
