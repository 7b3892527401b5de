"""Several processes on loopback joined by jax.distributed, exactly as on a pod slice."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
from podracer.session.checkpoint import restore_on_host
import pytest

from conftest import LAUNCHER, PYTHON
from podracer.orchestrate.distributed import free_port

# 4 calls of 2 updates of 8 environments x 16 steps; a checkpoint after every call.
SMALL = ["--num-envs=8", "--rollout-len=16", "--updates-per-call=2", "--total-steps=1024",
         "--seed=3", "--checkpoint-every=256"]
TWO = ["--num-processes=2", "--cpu-devices=2"]


def _env(tmp_path):
    return dict(os.environ)  # with the session's compilation cache (conftest)


def _steps(run_dir):
    path = run_dir / "checkpoints"
    return sorted(int(n) for n in os.listdir(path) if n.isdigit()) if path.exists() else []


def _final(run_dir):
    return restore_on_host(str(run_dir / "checkpoints" / str(_steps(run_dir)[-1]) / "state"))


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """One uninterrupted run of 2 processes x 2 devices: (run_dir, its stdout)."""
    run_dir = tmp_path_factory.mktemp("two") / "run"
    result = subprocess.run([PYTHON, LAUNCHER, *SMALL, *TWO, f"--run-dir={run_dir}"],
                            capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-2000:]
    return run_dir, result.stdout


def test_two_processes_agree_and_match_one_process(two_processes, tmp_path):
    import jax

    two, stdout = two_processes
    one = tmp_path / "one"
    summary = json.loads((two / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["devices"] == 4 and summary["updates"] == 8
    prints = summary["params_fingerprints"]
    assert len(prints) == 2 and prints[0] == prints[1]  # bitwise the same on both processes
    # Only process 0 writes the run files: one summary printed, metrics rows not doubled.
    assert stdout.count("summary\n") == 1
    rows = (two / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["env_steps"] for r in rows] == [256 * k for k in range(1, 5)]

    result = subprocess.run([PYTHON, LAUNCHER, *SMALL, "--cpu-devices=4", f"--run-dir={one}"],
                            capture_output=True, text=True, timeout=400, env=_env(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    a, b = _final(two), _final(one)
    for x, y in zip(jax.tree.leaves(a["train"]["params"]), jax.tree.leaves(b["train"]["params"])):
        np.testing.assert_allclose(x, y, rtol=1e-3, atol=1e-4)
    # The environments (sharded over both processes' devices) are in the same states.
    np.testing.assert_allclose(a["obs"], b["obs"], rtol=1e-4, atol=1e-5)


def test_two_processes_save_on_sigterm_and_resume_to_the_same_parameters(tmp_path):
    """orbax's multi-host path: both processes save together, and restore what they saved.

    The stopped run has no end in sight (10^9 steps), so the signal lands mid-run
    however fast the machine; the resumed run and an unstopped reference then end
    two calls after the save. A constant learning rate keeps the three runs' updates
    the same whatever their totals.
    """
    run_dir = tmp_path / "run"
    args = [PYTHON, LAUNCHER, *SMALL, *TWO, "--no-anneal-lr"]
    proc = subprocess.Popen([*args, "--total-steps=1000000000", f"--run-dir={run_dir}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not _steps(run_dir):
        assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)  # to the launcher, which forwards it to both processes
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-2000:]
    saved = _steps(run_dir)[-1]
    total = saved + 512

    result = subprocess.run([*args, f"--total-steps={total}", f"--run-dir={run_dir}"],
                            capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from_env_steps"] == saved and summary["updates"] == total // 128
    unstopped = tmp_path / "unstopped"
    result = subprocess.run([*args, f"--total-steps={total}", f"--run-dir={unstopped}"],
                            capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-2000:]
    reference = json.loads((unstopped / "summary.json").read_text())
    assert summary["params_fingerprints"] == reference["params_fingerprints"]


# 6 updates of 16 environments x 16 steps; actors wait for each update, so a seed fixes the run.
SEBULBA = ["--arch=sebulba", "--num-envs=16", "--rollout-len=16", "--total-steps=1536", "--synchronous",
           "--seed=5"]


def test_sebulba_learner_spans_both_processes(tmp_path):
    """Each process's actor fills its half of every global batch; both learners update in lockstep."""
    import dataclasses

    import jax

    from podracer.orchestrate.cli import parse_configs
    from podracer.sebulba import train_ppo

    two = tmp_path / "two"
    result = subprocess.run([PYTHON, LAUNCHER, *SEBULBA, *TWO, f"--run-dir={two}"],
                            capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((two / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["updates"] == 6
    # Each process: device 0 acts, device 1 learns; the learner mesh has both learners.
    assert (summary["actor_devices"], summary["learner_devices"], summary["actor_threads"]) == (2, 2, 2)
    prints = summary["params_fingerprints"]
    assert len(prints) == 2 and prints[0] == prints[1]
    assert result.stdout.count("summary\n") == 1

    # One process acting with two threads (numbered, seeded and keyed as the two
    # processes' threads are) and learning on one device sees the same global
    # batch: process 0's columns, then process 1's. (PPO shuffles each column
    # with a key from its global index, so another column order would differ.)
    configs = parse_configs([*SEBULBA, f"--run-dir={tmp_path / 'one'}"])
    sebulba = dataclasses.replace(configs.sebulba, actor_devices=(0,), learner_devices=(1,),
                                  actor_threads=2)
    _, state = train_ppo(configs.replace(sebulba=sebulba), devices=jax.devices()[:2])
    across = jax.tree.leaves(_final(two)["train"]["params"])
    within = jax.tree.leaves(jax.device_get(state.params))
    assert len(across) == len(within) > 0
    for x, y in zip(across, within):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5)


# Generations of 16 members on CartPole; each process acts on device 0 and learns on device 1.
SEBULBA_ES = ["--arch=sebulba", "--algo=es", "--population=16", "--total-steps=8000", "--seed=4",
              "--checkpoint-every=2500"]


def test_sebulba_es_population_spans_both_processes_and_matches_one_process(tmp_path):
    """Each process's actor evaluates half the members; one fitness vector, one tell, one mean."""
    import dataclasses

    import jax

    from podracer.orchestrate.cli import parse_configs
    from podracer.sebulba.train_es import train_es

    two = tmp_path / "two"
    result = subprocess.run([PYTHON, LAUNCHER, *SEBULBA_ES, *TWO, f"--run-dir={two}"],
                            capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((two / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["env_steps"] >= 8000
    # Over every process, as Sebulba PPO counts them: each acts on one device and learns on one.
    assert (summary["actor_devices"], summary["learner_devices"], summary["actor_threads"]) == (2, 2, 2)
    prints = summary["params_fingerprints"]
    assert len(prints) == 2 and prints[0] == prints[1]
    assert result.stdout.count("summary\n") == 1
    saves = _steps(two)  # one after each multiple of 2,500 env steps is passed, and the last
    assert len(saves) >= 3 and saves[-1] == summary["env_steps"]

    # One process whose two actor threads are numbered (members, env seeds) as
    # the two processes' threads are evaluates the same episodes and tells the same.
    configs = parse_configs([*SEBULBA_ES, f"--run-dir={tmp_path / 'one'}"])
    configs = configs.replace(sebulba=dataclasses.replace(configs.sebulba, actor_devices=(0,),
                                                          learner_devices=(1,), actor_threads=2))
    one_summary, (state, _) = train_es(configs, devices=jax.devices()[:2])
    assert one_summary["generations"] == summary["generations"]
    across = _final(two)["strategy"]["mean"]
    np.testing.assert_allclose(across, np.asarray(state.mean), rtol=1e-5, atol=1e-6)
    first = restore_on_host(str(two / "checkpoints" / str(saves[0]) / "state"))["strategy"]["mean"]
    assert np.abs(across - first).max() > 1e-3  # the mean moved after the first save


# 3 calls of 2 generations of 16 members, 100-step episodes.
ES = ["--algo=es", "--population=16", "--horizon=100", "--generations-per-call=2",
      "--total-steps=9600", "--seed=2", "--checkpoint-every=3200"]


def test_es_population_spans_both_processes_and_matches_one_process(tmp_path):
    two, one = tmp_path / "two", tmp_path / "one"
    result = subprocess.run([PYTHON, LAUNCHER, *ES, *TWO, f"--run-dir={two}"],
                            capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((two / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["devices"] == 4 and summary["generations"] == 6
    prints = summary["params_fingerprints"]
    assert len(prints) == 2 and prints[0] == prints[1]

    # 1 process x 4 devices, in this process (the launcher's code path below its CLI).
    import jax

    from podracer.anakin.train_es import train_es
    from podracer.orchestrate.cli import parse_configs

    _, runner = train_es(parse_configs([*ES, f"--run-dir={one}"]), devices=jax.devices()[:4])
    a = _final(two)["train"]["strategy"]["mean"]
    np.testing.assert_allclose(a, np.asarray(runner.train.strategy.mean), rtol=1e-5, atol=1e-6)
    # The generations after the first call moved the mean: the runs agree on something.
    first = restore_on_host(str(two / "checkpoints" / "3200" / "state"))["train"]["strategy"]["mean"]
    assert np.abs(a - first).max() > 1e-3


def test_population_agents_split_over_both_processes_match_one_process(tmp_path):
    """4 agents (2 seeds x 2 learning rates), one per device of 2 processes x 2 devices."""
    import jax

    population = [*SMALL, "--num-seeds=2", "--sweep", "lr=0,1e-3", "--checkpoint-every=512"]
    two, one = tmp_path / "two", tmp_path / "one"
    result = subprocess.run([PYTHON, LAUNCHER, *population, *TWO, f"--run-dir={two}"],
                            capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((two / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["devices"] == 4
    prints = summary["params_fingerprints"]
    assert len(prints) == 2 and prints[0] == prints[1]
    assert [(a["agent"], a["seed"], a["settings"]) for a in summary["agents"]] == [
        (0, 3, {"lr": 0.0}), (1, 4, {"lr": 0.0}), (2, 3, {"lr": 1e-3}), (3, 4, {"lr": 1e-3})]
    assert all(a["episode_return_mean"] is not None for a in summary["agents"])

    result = subprocess.run([PYTHON, LAUNCHER, *population, "--cpu-devices=4", f"--run-dir={one}"],
                            capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-2000:]
    a, b = _final(two), _final(one)
    for x, y in zip(jax.tree.leaves(a["train"]["params"]), jax.tree.leaves(b["train"]["params"])):
        assert x.shape[0] == 4  # every agent, gathered from both processes
        np.testing.assert_allclose(x, y, rtol=1e-3, atol=1e-4)
    # The learning-rate-0 agents held their parameters, the others moved: each device trained its own.
    first = restore_on_host(str(two / "checkpoints" / "512" / "state"))["train"]["params"]
    moved = [max(float(np.abs(x[i] - y[i]).max()) for x, y in
                 zip(jax.tree.leaves(a["train"]["params"]), jax.tree.leaves(first))) for i in range(4)]
    assert moved[0] == moved[1] == 0 and min(moved[2:]) > 1e-4, moved


def _children(pid):
    import psutil

    return psutil.Process(pid).children()


def test_killing_one_process_stops_the_run(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([PYTHON, LAUNCHER, "--num-envs=8", "--rollout-len=16",
                             "--updates-per-call=1", "--total-steps=10000000",
                             "--num-processes=2", "--cpu-devices=2", f"--run-dir={run_dir}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=_env(tmp_path))
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and metrics.stat().st_size > 0):
        assert time.monotonic() < deadline and proc.poll() is None, "the run never started"
        time.sleep(0.2)
    children = _children(proc.pid)
    assert len(children) == 2
    children[1].kill()  # process 1 dies mid-run
    killed = time.monotonic()
    _, stderr = proc.communicate(timeout=90)
    assert time.monotonic() - killed < 60
    assert proc.returncode != 0
    assert "process 1 of 2 exited with status 9 (killed by signal SIGKILL)" in stderr
    assert not children[0].is_running() or children[0].status() == "zombie"


def test_a_joined_process_exits_when_its_peer_dies(tmp_path):
    """Without the local orchestrator (separate hosts), jax.distributed's heartbeat ends the survivor."""
    coordinator = f"127.0.0.1:{free_port()}"
    run_dir = tmp_path / "run"
    args = ["--num-envs=8", "--rollout-len=16", "--updates-per-call=1", "--total-steps=10000000",
            "--num-processes=2", "--cpu-devices=2", f"--coordinator={coordinator}",
            f"--run-dir={run_dir}"]
    procs = [subprocess.Popen([PYTHON, LAUNCHER, *args, f"--process-id={i}"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              env=_env(tmp_path)) for i in range(2)]
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and metrics.stat().st_size > 0):
        assert time.monotonic() < deadline, "the run never started"
        time.sleep(0.2)
    procs[1].kill()
    killed = time.monotonic()
    _, stderr = procs[0].communicate(timeout=90)
    procs[1].wait()
    assert time.monotonic() - killed < 60
    assert procs[0].returncode != 0
    # Whichever notices first: jax.distributed's heartbeat, or gloo's transport in the
    # middle of a collective the dead peer was part of (more likely on a busy machine).
    assert any(sign in stderr for sign in ("another task died", "unhealthy", "gloo")), stderr[-2000:]
