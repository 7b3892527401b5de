"""Every way out of a run closes its loggers (metrics, TensorBoard, W&B) before it returns.

Left open, they are closed by their own clean-up at interpreter exit, which starts
threads: Python 3.12 and later refuse that, and the run ended with a traceback
after its one-line error. So a failed run's logger threads must be gone, and its
W&B run finished, by the time the failure leaves the session, on any Python.
"""

import threading
import time

import jax.numpy as jnp
import pytest

from podracer.config import LogConfig, RunConfig
from podracer.errors import PodracerError
from podracer.orchestrate.spec import RunSpec
from podracer.session.session import RunSession

ROW = {"env_steps": 8, "sps": 100.0, "episode_return_mean": 9.0}


@pytest.fixture
def session(tmp_path, monkeypatch):
    """A session whose loggers are open (metrics, TensorBoard, W&B offline), one row logged;
    and the threads that ran before its loggers opened."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    started = RunSession(RunSpec(run=RunConfig(run_dir=str(tmp_path / "run"), total_steps=64),
                                 logging=LogConfig(wandb=True)))
    started.open({"w": jnp.zeros(3)})
    before = set(threading.enumerate())
    started.start(64, 0.0)
    return started, before


def _logger_threads_left(before: set, timeout: float = 10.0) -> list[str]:
    """Threads started since `before` still running after `timeout` s. W&B's connection to
    its service process lasts as long as the process (its next run reuses it) and is not
    one run's; the orbax import is no logger."""
    deadline = time.monotonic() + timeout
    while True:
        left = [thread.name for thread in threading.enumerate()
                if thread not in before and thread.is_alive()
                and not thread.name.startswith("wandb-") and thread.name != "podracer-import-orbax"]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def _assert_closed(session, before) -> None:
    import wandb

    assert _logger_threads_left(before) == []  # TensorBoard's writer stopped
    assert wandb.run is None  # the W&B run finished
    assert session.logger._file.closed


def test_a_run_stopped_by_the_nan_guard_has_closed_its_loggers(session):
    session, before = session
    with pytest.raises(PodracerError, match="non-finite"):
        with session.training():
            session.log(ROW)
            session.check_finite(False, "update 1", 8, "lower --lr")
    _assert_closed(session, before)


def test_a_run_that_fails_while_writing_its_summary_has_closed_its_loggers(session):
    session, before = session
    with session.training():
        session.log(ROW)
    params = jnp.ones(3)
    params.delete()  # what a donated buffer is: its fingerprint cannot be read
    with pytest.raises(RuntimeError, match="deleted"):
        session.finish(env_steps=8, new_steps=8, episode_return_mean=9.0, fingerprint_of=params,
                       devices={"devices": 1}, extra={}, stopped=False)
    _assert_closed(session, before)
