"""The launcher as a user runs it: bad input is one line, exit 2, and harms nothing."""

import os
import subprocess

import pytest

from conftest import LAUNCHER, PYTHON

BAD_INVOCATIONS = {
    "mistyped flag": ["--totl-steps=10"],
    "unknown env": ["--env=CartPol-v1"],
    "unknown arch": ["--arch=podracer"],
    "unknown algo": ["--algo=a2c"],
    "zero total steps": ["--total-steps=0"],
    "negative envs": ["--num-envs=-4"],
    "zero rollout": ["--rollout-len=0"],
    "zero epochs": ["--epochs=0"],
    "zero minibatches": ["--minibatches=0"],
    "not a number": ["--num-envs=many"],
    "envs do not split over devices": ["--cpu-devices=4", "--num-envs=30"],
    "rollout does not split into minibatches": ["--rollout-len=30", "--minibatches=4"],
    "negative cpu devices": ["--cpu-devices=-1"],
    "zero updates per call": ["--updates-per-call=0"],
    "bad activation": ["--activation=swish"],
    "zero hidden width": ["--hidden", "64", "0"],
    "negative learning rate": ["--lr=-0.1"],
    "zero grad norm": ["--max-grad-norm=0"],
    "negative checkpoint interval": ["--checkpoint-every=-1"],
    "zero checkpoints kept": ["--keep-checkpoints=0"],
    "flag without value": ["--seed"],
    "bool flag with a value": ["--anneal-lr=yes"],
    "abbreviated flag": ["--total=1000"],
    "positional junk": ["train"],
    "eval of a missing run": ["eval", "--run-dir=/nonexistent/podracer-run"],
    "eval of zero episodes": ["eval", "--episodes=0"],
    "eval with a training flag": ["eval", "--num-envs=4"],
    "sebulba overlapping devices": ["--arch=sebulba", "--actor-devices", "0", "--learner-devices", "0", "1"],
    "sebulba device out of range": ["--arch=sebulba", "--actor-devices", "9"],
    "sebulba unknown env": ["--arch=sebulba", "--env=Pongg-v5"],
    "sebulba negative checkpoint interval": ["--arch=sebulba", "--checkpoint-every=-5"],
    "sebulba zero checkpoints kept": ["--arch=sebulba", "--keep-checkpoints=0"],
    "es zero population": ["--algo=es", "--population=0"],
    "unknown network": ["--network=transformer"],
    "recurrent impala": ["--algo=impala", "--network=lstm"],
    "recurrent es": ["--algo=es", "--network=gru"],
    "recurrent dataset recording": ["--network=lstm", "--record-dataset=/tmp/podracer-never-written"],
    "recurrent envs do not split into minibatches": ["--network=lstm", "--num-envs=6", "--minibatches=4"],
    "sebulba recurrent envs do not split into minibatches": ["--arch=sebulba", "--network=gru", "--num-envs=6",
                                                             "--minibatches=4"],
}


def _launch(args, cwd=None, timeout=120):
    return subprocess.run([PYTHON, LAUNCHER, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


# These go through the real launcher in a fresh process; the rest call the same
# `main()` in this process (the launcher is a two-line wrapper around it), which
# keeps the suite fast.
THROUGH_THE_LAUNCHER = {"mistyped flag", "unknown env", "envs do not split over devices",
                        "eval of a missing run"}


@pytest.mark.parametrize("name", BAD_INVOCATIONS)
def test_bad_input_is_one_line_exit_2_and_changes_nothing(name, tmp_path, capsys):
    args = BAD_INVOCATIONS[name]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    previous = run_dir / "metrics.jsonl"
    previous.write_text('{"env_steps": 1}\n')
    before = {p: p.read_bytes() for p in run_dir.iterdir()}
    if args[0] == "eval":
        args = [*args, f"--run-dir={run_dir}"] if not any("--run-dir" in a for a in args) else args
    else:
        args = [*args, f"--run-dir={run_dir}"]
    if name in THROUGH_THE_LAUNCHER:
        result = _launch(args)
        code, stderr = result.returncode, result.stderr
    else:
        from podracer.command import main

        code = main(args)
        stderr = capsys.readouterr().err
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: ") and "Traceback" not in stderr
    assert {p: p.read_bytes() for p in run_dir.iterdir()} == before


def test_unwritable_run_dir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    result = _launch([f"--run-dir={blocker}/run", "--total-steps=1000"])
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "--run-dir" in result.stderr
    assert blocker.read_text() == "not a directory"


def test_help_documents_the_flags():
    result = _launch(["--help"])
    assert result.returncode == 0
    for flag in ("--arch", "--algo", "--env", "--seed", "--total-steps", "--run-dir", "--num-envs",
                 "--rollout-len", "--epochs", "--minibatches", "--lr", "--clip-eps", "--gamma"):
        assert flag in result.stdout


def test_short_run_writes_metrics_and_summary(tmp_path):
    import json

    run_dir = tmp_path / "run"
    result = _launch(["--env=Pendulum-v1", "--total-steps=20000", f"--run-dir={run_dir}",
                      "--updates-per-call=2"])
    assert result.returncode == 0, result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["env"] == "Pendulum-v1" and summary["env_steps"] >= 20000
    assert summary["episode_return_mean"] < 0  # Pendulum's rewards are costs
    assert "summary" in result.stdout and "steps/s" in result.stdout


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """One short, real run with a checkpoint, shared by the tests below."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    result = _launch(["--total-steps=150000", f"--run-dir={run_dir}"])
    assert result.returncode == 0, result.stderr
    return run_dir


def _snapshot(run_dir):
    return {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}


@pytest.mark.parametrize("args, named", [
    (["--lr=0.01"], "--lr"),
    (["--env=Acrobot-v1"], "--env"),
    (["--seed=3", "--gamma=0.9"], "--gamma"),
])
def test_checkpoint_from_another_config(trained_run, args, named):
    before = _snapshot(trained_run)
    result = _launch(["--total-steps=150000", f"--run-dir={trained_run}", *args])
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and named in result.stderr
    assert _snapshot(trained_run) == before


def test_eval_and_load_policy(trained_run):
    import json

    import jax
    import numpy as np

    from podracer import load_policy
    from podracer.evaluate import gymnax_returns

    result = _launch(["eval", f"--run-dir={trained_run}", "--episodes=16"])
    assert result.returncode == 0, result.stderr
    scored = json.loads(result.stdout.strip().splitlines()[-1])
    assert scored["episodes"] == 16 and scored["episode_return_mean"] > 150
    act = load_policy(str(trained_run))
    trained = gymnax_returns(jax.jit(act), "CartPole-v1", 16)
    random_policy = gymnax_returns(lambda obs, key: jax.random.randint(key, obs.shape[:1], 0, 2),
                                   "CartPole-v1", 16)
    assert trained.mean() > 150 > 3 * random_policy.mean()
    # Pure: the same key gives the same actions.
    obs = np.zeros((5, 4), np.float32)
    key = jax.random.PRNGKey(1)
    np.testing.assert_array_equal(act(obs, key), act(obs, key))


def test_eval_and_load_policy_of_an_es_run(tmp_path):
    """An ARS V2 run's mean (whose policy reads normalised observations: load_policy must too)."""
    import json

    import jax
    import numpy as np

    from podracer import load_policy

    run_dir = tmp_path / "run"
    result = _launch(["--arch=anakin", "--algo=es", "--variant=ars_v2", "--population=32",
                      "--generations-per-call=4", "--eval-episodes=8", "--total-steps=512000",
                      f"--run-dir={run_dir}"])
    assert result.returncode == 0, result.stderr
    assert json.loads((run_dir / "summary.json").read_text())["mean_params_return"] >= 475

    result = _launch(["eval", f"--run-dir={run_dir}", "--episodes=16"])
    assert result.returncode == 0, result.stderr
    scored = json.loads(result.stdout.strip().splitlines()[-1])
    assert scored["episodes"] == 16 and scored["episode_return_mean"] >= 400  # random: about 22
    # An ES policy is deterministic: the key does not matter.
    act = load_policy(str(run_dir))
    obs = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    np.testing.assert_array_equal(act(obs, jax.random.PRNGKey(0)), act(obs, jax.random.PRNGKey(1)))
    assert len(np.unique(np.asarray(act(obs, jax.random.PRNGKey(0))))) == 2  # it looks at obs
