"""The docs' Python snippets run as written, and the own loop learns."""

import contextlib
import io
import re

import jax
import numpy as np

from conftest import REPO_ROOT
from podracer.evaluate import gymnax_returns


PAGE = "docs/architecture.md"  # the agent contract's own-loop snippet


def _snippet(name: str) -> str:
    text = open(f"{REPO_ROOT}/{PAGE}").read()
    match = re.search(rf"<!-- snippet: {name} -->\s*```python\n(.*?)```", text, re.S)
    assert match, f"{PAGE} has no snippet {name!r}"
    return match.group(1)


def _run_own_loop(iterations: int, learning_rate: str) -> dict:
    """The own-loop snippet with its loop count and Adam's learning rate replaced."""
    source = _snippet("own-loop")
    for written in ("range(3)", "optax.adam(1e-3)"):
        assert source.count(written) == 1, f"the own-loop snippet no longer has {written!r}; update this test"
    source = source.replace("range(3)", f"range({iterations})").replace(
        "optax.adam(1e-3)", f"optax.adam({learning_rate})")
    namespace: dict = {}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(source, PAGE, "exec"), namespace)
    return namespace


def _policy_return(namespace: dict) -> float:
    """Mean return of 32 CartPole episodes played by the snippet's `act` with its final state."""
    act, state = namespace["act"], namespace["state"]

    def policy(obs, key):
        return act(state.params, state.obs_stats, obs, jax.random.split(key, obs.shape[0]))[0]

    return float(gymnax_returns(policy, "CartPole-v1", episodes=32).mean())


def test_own_loop_snippet_runs_and_updates(capsys):
    namespace: dict = {}
    exec(compile(_snippet("own-loop"), PAGE, "exec"), namespace)
    state = namespace["state"]
    assert int(state.step) == 3
    moved = [np.abs(np.asarray(a) - np.asarray(b)).max()
             for a, b in zip(jax.tree.leaves(namespace["params"]), jax.tree.leaves(state.params))]
    assert max(moved) > 1e-4  # the three updates applied their gradients
    printed = capsys.readouterr().out.split("\n")
    assert [line.split()[0] for line in printed if line] == ["0", "1", "2"]


def test_own_loop_snippet_learns_where_a_zero_learning_rate_cannot():
    # 30 iterations of the snippet's loop (7,680 steps): a random CartPole policy averages about 22.
    trained = _run_own_loop(30, "1e-3")
    assert int(trained["state"].step) == 30
    assert _policy_return(trained) >= 100
    # The same loop with a learning rate of zero: its update applies nothing.
    control = _run_own_loop(30, "0.0")
    for before, after in zip(jax.tree.leaves(control["params"]), jax.tree.leaves(control["state"].params)):
        np.testing.assert_array_equal(before, after)
    assert _policy_return(control) < 40
