"""A killed run's checkpoint restores leaf by leaf: parameters, optimizer state, environment
state, keys. The kill lands mid-run by construction: the run is far from its end when a
checkpoint appears, and the test checks the process died of the kill, not of finishing."""

import os
import signal
import subprocess

import jax
import numpy as np
import pytest

from conftest import LAUNCHER, PYTHON, wait_for
from podracer.orchestrate.parse import parse_configs
from podracer.session.checkpoint import checkpoint_steps, restore_on_host
from podracer.session.session import RunSession

# 16 envs x 16 steps per update, a save every 4 updates, and a total no test waits for.
NEVER_ENDS = 10**9
RUN = ["--num-envs=16", "--rollout-len=16", "--updates-per-call=1", "--checkpoint-every=1024",
       f"--total-steps={NEVER_ENDS}"]



@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
    """A run killed (SIGKILL) once its first checkpoint is complete; its argv and run dir."""
    run_dir = tmp_path_factory.mktemp("killed") / "run"
    argv = [*RUN, f"--run-dir={run_dir}"]
    proc = subprocess.Popen([PYTHON, LAUNCHER, *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ))
    try:
        appeared = wait_for(lambda: checkpoint_steps(str(run_dir)), 180)
    finally:
        proc.kill()
        _, stderr = proc.communicate(timeout=60)
    assert appeared, stderr[-3000:]
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, stderr[-3000:])
    return argv, run_dir


def _leaves(tree):
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def test_killed_mid_run_then_every_leaf_restores_as_saved(killed_run):
    argv, run_dir = killed_run
    steps = checkpoint_steps(str(run_dir))
    assert steps and steps[-1] < NEVER_ENDS
    saved = restore_on_host(str(run_dir / "checkpoints" / str(steps[-1]) / "state"))
    saved_leaves = _leaves(saved)
    # What a resumed run restores into: the same shapes, every value different from the saved one.
    like = jax.tree.map(lambda x: x + jax.numpy.ones_like(x), saved)

    session = RunSession(parse_configs(argv))
    assert session.resuming and session.resume_steps == steps[-1]
    restored, meta = session.open(like)
    assert meta["env_steps"] == steps[-1]
    restored_leaves = _leaves(restored)
    assert restored_leaves.keys() == saved_leaves.keys()
    for path, value in saved_leaves.items():
        np.testing.assert_array_equal(restored_leaves[path], value, err_msg=path)
    # Every part of the state is among them, and carries what training put there.
    for part in ("['train']['params']", "['train']['opt_state']", "['train']['step']", "['env_state']",
                 "['key']", "['train']['obs_stats']"):
        assert any(path.startswith(part) for path in saved_leaves), part
    moments = [v for p, v in saved_leaves.items() if p.startswith("['train']['opt_state']") and v.size > 1]
    assert moments and all(np.abs(m).max() > 0 for m in moments)  # Adam's moments after updates
    assert int(saved_leaves["['train']['step']"]) * 256 == steps[-1]
