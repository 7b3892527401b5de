"""Every way a Sebulba run ends stops all of its threads, with the right exit status.

The wall-time bound is a generous deadline, not a measurement: a loaded machine may
take seconds to start or end a process. A thread that does not stop is caught by
what the run says instead: the main thread waits `JOIN_DEADLINE_S` (8 s) for the
others, then reports them "still busy", which the tests refuse.
"""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import jax
import pytest

from conftest import LAUNCHER, PYTHON, REPO_ROOT
from podracer.config import NetworkConfig, OptimConfig, RunConfig
from podracer.orchestrate.spec import RunSpec
from podracer.ppo import PPOConfig
from podracer.sebulba.config import SebulbaConfig
from podracer.sebulba import train as sebulba_train
from podracer.sebulba.envs import EnvPoolEnvs

STOP_WITHIN_S = 60.0
LONG_RUN = ["--arch=sebulba", "--algo=ppo", "--env=CartPole-v1", "--total-steps=100000000",
            "--num-envs=8", "--rollout-len=16"]


def _start(args, run_dir, env=None):
    return subprocess.Popen(args + [f"--run-dir={run_dir}"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT, env=env)


def _wait_for_training(process, run_dir, timeout=120.0):
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"exited early ({process.returncode}): {process.stderr.read()}")
        if metrics.exists() and metrics.read_text().count("\n") >= 2:
            return
        time.sleep(0.2)
    process.kill()
    pytest.fail("training did not start")


def _exit_within(process, seconds=STOP_WITHIN_S):
    start = time.monotonic()
    try:
        process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail(f"still running {seconds} s later")
    return process.returncode, time.monotonic() - start, process.stderr.read()


@pytest.mark.parametrize("sig, status, message", [(signal.SIGINT, 130, "stopped by signal 2"),
                                                  (signal.SIGTERM, 143, "stopped by signal 15")])
def test_signal_stops_a_training_run(sig, status, message, tmp_path):
    process = _start([PYTHON, LAUNCHER, *LONG_RUN], tmp_path)
    _wait_for_training(process, tmp_path)
    process.send_signal(sig)
    code, _, stderr = _exit_within(process)
    assert code == status, stderr
    assert message in stderr and "Traceback" not in stderr and "still busy" not in stderr


# Runs the launcher's entry point with one part of Sebulba made to fail mid-run.
FAULT_SCRIPT = textwrap.dedent("""
    import sys, time
    from podracer.sebulba import train
    from podracer.orchestrate.cli import main

    where = sys.argv[1]
    if where == "actor":
        class Failing(train.EnvPoolEnvs):
            calls = 0
            def recv(self):
                Failing.calls += 1
                if Failing.calls == 300:
                    print(f"FAULT {time.time()}", file=sys.stderr, flush=True)
                    raise RuntimeError("actor exploded")
                return super().recv()
        train.EnvPoolEnvs = Failing
    else:
        real = train.run_learner
        def failing_learner(learning, state):
            calls = []
            def step(*a):
                calls.append(1)
                if len(calls) == 4:
                    print(f"FAULT {time.time()}", file=sys.stderr, flush=True)
                    raise RuntimeError("learner exploded")
                return learning.step_fn(*a)
            return real(learning._replace(step_fn=step), state)
        train.run_learner = failing_learner
    sys.exit(main(sys.argv[2:]))
""")


@pytest.mark.parametrize("where", ["actor", "learner"])
def test_failure_in_a_thread_ends_the_process_with_an_error(where, tmp_path):
    process = _start([PYTHON, "-c", FAULT_SCRIPT, where, *LONG_RUN], tmp_path)
    code, _, stderr = _exit_within(process, seconds=120)
    fault_time = float(stderr.split("FAULT ")[1].split()[0])
    assert time.time() - fault_time < STOP_WITHIN_S + 1
    assert code not in (0, None), stderr
    assert f"{where} exploded" in stderr and f"raised in the {where} thread" in stderr
    assert "still busy" not in stderr  # every other thread stopped within the join deadline


def _sebulba_threads():
    return [t for t in threading.enumerate() if t.name.startswith("sebulba-") and t.is_alive()]


def test_actor_failure_in_process_stops_every_thread(tmp_path, monkeypatch):
    class Failing(EnvPoolEnvs):
        def recv(self):
            if getattr(self, "calls", 0) == 200:
                raise RuntimeError("environment exploded")
            self.calls = getattr(self, "calls", 0) + 1
            return super().recv()

    monkeypatch.setattr(sebulba_train, "EnvPoolEnvs", Failing)
    run = RunConfig(arch="sebulba", total_steps=10**8, run_dir=str(tmp_path))
    config = SebulbaConfig(num_envs=12, rollout_len=16, actor_threads=2)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="environment exploded"):
        sebulba_train.train_ppo(RunSpec(run=run, agent=PPOConfig(), sebulba=config,
                                        optimizer=OptimConfig(), network=NetworkConfig()),
                                devices=jax.devices()[:4])
    assert time.monotonic() - start < 60
    assert _sebulba_threads() == []
