"""The planted-bug check (`tests/mutations.py`, run whole by `.ci/run` after the suite) still
fits the code: each bug's source text occurs once where it says, and the tests named to catch
it exist. A refactor that moves the text fails here in a second, not in CI minutes later."""

import ast
import os

import pytest

from mutations import MUTATIONS, REPO_ROOT


def _test_functions(path):
    with open(path) as f:
        tree = ast.parse(f.read())
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m.name for m in MUTATIONS])
def test_each_planted_bug_still_fits_the_code(mutation):
    with open(os.path.join(REPO_ROOT, mutation.path)) as f:
        assert f.read().count(mutation.original) == 1, mutation.original
    assert mutation.replacement != mutation.original and mutation.tests
    for test in mutation.tests:
        path, _, function = test.partition("::")
        assert os.path.isfile(os.path.join(REPO_ROOT, path)), test
        if function:
            assert function in _test_functions(os.path.join(REPO_ROOT, path)), test


def test_the_losses_actors_restore_and_every_agent_have_planted_bugs():
    names = {m.name for m in MUTATIONS}
    assert {"ppo lower clip bound removed", "advantages divided by the variance",
            "v-trace importance weights inverted", "sebulba actors keep stale parameters",
            "restore without the optimizer state", "pqn td target of the flipped sign",
            "dqn without double q-learning", "sac actor's entropy term of the wrong sign",
            "muzero value target bootstraps one step early"} <= names
    assert len(MUTATIONS) >= 8
