"""Checkpoints with orbax: periodic async saves, a save on SIGTERM/SIGINT, resume.

A run directory holds `checkpoints/<env_steps>/` written by orbax's
`CheckpointManager`: the whole state pytree (train state, every RNG key, the
environment state, normalisers) and a JSON item with the run's config. Orbax
writes each checkpoint into a temporary directory and renames it when complete
(on Cloud Storage, which cannot rename, it writes `commit_success.txt` last),
so a process killed mid-save leaves the previous checkpoint untouched; only
complete checkpoints count (`checkpoint_steps`). The run directory may be a
local path or `gs://bucket/path`: orbax and tensorstore write either.

Resuming is automatic: a run directory that already has a checkpoint continues
from its latest one, provided the config matches (only the settings listed in
`RESUMABLE_CHANGES` may differ). To start over, use another `--run-dir`. On
several processes, process 0 names that checkpoint and every process restores
it (`podracer.session.run_dir.agreed_checkpoint_steps`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import time
from typing import Any, Iterator

import jax

from podracer.bounds import NON_NEGATIVE, POSITIVE, bounded, check_bounds
from podracer.errors import PodracerError
from podracer import storage
from podracer.session import signals

CHECKPOINT_DIR = "checkpoints"

# Settings that may change between a run and its resumption: how long to run,
# where and how often to save, where compiled programs are cached, how to log,
# the device count (results are the same on any device count up to float
# rounding), how processes find each other (a free port, each process's own
# index) and which host threads or devices act and learn.
RESUMABLE_CHANGES = {
    ("run", "total_steps"), ("run", "run_dir"), ("run", "cpu_devices"), ("run", "compile_cache"),
    ("checkpoint", "checkpoint_every"), ("checkpoint", "keep_checkpoints"), ("checkpoint", "stop_timeout_s"),
    ("data", "record_dataset"), ("data", "record_episodes"), ("data", "record_deterministic"),
    ("logging", "wandb"), ("logging", "wandb_project"),
    ("distributed", "num_processes"), ("distributed", "coordinator"), ("distributed", "process_id"),
    ("distributed", "distributed"), ("distributed", "join_timeout_s"),
    ("sebulba", "actor_devices"), ("sebulba", "learner_devices"), ("sebulba", "env_threads"),
    ("sebulba", "log_every"),
}


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """When to save; where is always RUN_DIR/checkpoints."""

    checkpoint_every: int = bounded(100_000, NON_NEGATIVE)
    """Save every this many env steps (rounded up to whole host calls); 0: only at the end and on SIGTERM/SIGINT."""
    keep_checkpoints: int = bounded(3, POSITIVE)
    """Checkpoints to keep; older ones are deleted once a newer one is complete."""
    stop_timeout_s: float = bounded(30.0, POSITIVE)
    """After SIGTERM or Ctrl-C, seconds the run may take to save and write its results; past them (a save blocked on a disk or bucket that does not answer) it ends at once, the last complete checkpoint kept."""

    def __post_init__(self):
        check_bounds(self)


def config_record(sections: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Config sections (`RunSpec.recorded()`) as plain JSON (tuples become lists), keyed by section."""
    return {section: {k: list(v) if isinstance(v, tuple) else v
                      for k, v in dataclasses.asdict(cfg).items()}
            for section, cfg in sections.items()}


# Settings added after checkpoints were already being written: an older checkpoint
# that lacks one was made with this value.
ADDED_SETTINGS = {("network", "network"): "mlp",
                  **{("population", name): value for name, value in (
                      ("num_samples", 0), ("pbt", False), ("pbt_interval", 20), ("pbt_fraction", 0.25),
                      ("pbt_perturb", 1.25), ("pbt_resample", 0.25))}}


def config_differences(saved: dict, current: dict) -> list[str]:
    """`--flag` names whose values differ in ways a resumed run cannot absorb.

    Another architecture or algorithm is said alone: the two pairs read other
    sections, so listing every setting either one has would bury what differs.
    """
    pair = [f"--{name} ({saved.get('run', {}).get(name)!r} saved, {current.get('run', {}).get(name)!r} now)"
            for name in ("arch", "algo")
            if "run" in saved and "run" in current and saved["run"].get(name) != current["run"].get(name)]
    if pair:
        return pair
    differing = []
    for section in sorted(set(saved) | set(current)):
        old, new = saved.get(section, {}), current.get(section, {})
        for name in sorted(set(old) | set(new)):
            if name not in old and (section, name) in ADDED_SETTINGS:
                old = {**old, name: ADDED_SETTINGS[(section, name)]}
            if (section, name) not in RESUMABLE_CHANGES and old.get(name) != new.get(name):
                differing.append(f"--{name.replace('_', '-')} ({old.get(name)!r} saved, {new.get(name)!r} now)")
    return differing


def check_resumable(run_dir: str, step: int, config: CheckpointConfig, record: dict[str, Any]) -> None:
    """Refuses to resume `run_dir` from its checkpoint `step` if that was made with another config.

    Called before anything is built, so a wrong flag fails in a second, not after
    a compilation.
    """
    probe = Checkpointer(run_dir, config, record, create=False)
    try:
        probe.check_config(probe.read_meta(step))
    finally:
        probe.close()


def checkpoint_dir(run_dir: str) -> str:
    path = storage.join(run_dir, CHECKPOINT_DIR)
    return path if storage.is_remote(path) else os.path.abspath(path)


def checkpoint_steps(run_dir: str) -> list[int]:
    """Env steps of the run's complete checkpoints, oldest first (orbax's own test of complete)."""
    path = checkpoint_dir(run_dir)
    if not storage.isdir(path):
        return []
    import orbax.checkpoint as ocp

    return sorted(ocp.path.step.checkpoint_steps(path))


def has_checkpoint(run_dir: str) -> bool:
    return bool(checkpoint_steps(run_dir))


class Checkpointer:
    """Saves and restores one run's state; steps are env steps."""

    def __init__(self, run_dir: str, config: CheckpointConfig, record: dict[str, Any],
                 create: bool = True):
        import orbax.checkpoint as ocp

        self._ocp = ocp
        # What the (arch, algo) pair reads: a setting it ignores never blocks a resume.
        self.record = record  # `config_record` of the sections the run reads
        options = ocp.CheckpointManagerOptions(
            max_to_keep=config.keep_checkpoints, enable_async_checkpointing=True, create=create,
            # A save cut short (a kill, a full disk) leaves a temporary directory; this run holds the
            # run directory alone (`podracer.session.lock`), so any it finds are such leftovers.
            cleanup_tmp_directories=create)
        self.manager = ocp.CheckpointManager(checkpoint_dir(run_dir), options=options,
                                             item_names=("state", "meta"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, env_steps: int, state: Any, meta: dict[str, Any]) -> None:
        """Start an asynchronous save; returns once the arrays are copied off the devices."""
        ocp = self._ocp
        meta = {**meta, "env_steps": env_steps, "config": self.record}
        self.manager.save(env_steps, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)

    def read_meta(self, step: int | None = None) -> dict[str, Any]:
        step = self.latest_step() if step is None else step
        ocp = self._ocp
        try:
            return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        except Exception as err:  # orbax raises many types for a damaged directory
            raise PodracerError(
                f"checkpoint {step} in {checkpoint_dir_of(self)} is unreadable ({type(err).__name__}); "
                f"delete that step's directory to fall back to an older one, or use a new --run-dir"
            ) from None

    def check_config(self, meta: dict[str, Any]) -> None:
        differing = config_differences(meta.get("config", {}), self.record)
        if differing:
            raise PodracerError(
                f"the checkpoint in {checkpoint_dir_of(self)} was made with another config: "
                f"{', '.join(differing)}; rerun with the saved values or use a new --run-dir")

    def restore(self, like: Any, step: int | None = None) -> tuple[Any, dict[str, Any]]:
        """Restore the state into the shapes, dtypes and shardings of `like`."""
        ocp = self._ocp
        step = self.latest_step() if step is None else step
        meta = self.read_meta(step)
        self.check_config(meta)
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like)
        try:
            state = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract))).state
        except Exception as err:
            raise PodracerError(
                f"checkpoint {step} in {checkpoint_dir_of(self)} does not fit this run "
                f"({type(err).__name__}); use the --run-dir it was made for, or a new one") from None
        return state, meta

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


def restore_on_host(state_dir: str) -> Any:
    """A checkpoint's `state` item as plain nested containers of arrays on one device.

    Works whatever the topology it was saved from (8 devices, 2 processes, a pod
    slice): every array is restored whole onto this process's first device.
    """
    import orbax.checkpoint as ocp

    storage.check(state_dir)
    checkpointer = ocp.StandardCheckpointer()
    tree = checkpointer.metadata(state_dir).item_metadata
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), tree)
    return checkpointer.restore(state_dir, target)


def checkpoint_dir_of(checkpointer: Checkpointer) -> str:
    return str(checkpointer.manager.directory)


class StopFlag:
    """Set by SIGTERM/SIGINT; the training loop polls it between host calls."""

    def __init__(self):
        self.signal: int | None = None
        self.received_at = 0.0

    def __bool__(self) -> bool:
        return self.signal is not None


# A signal that repeats within this many seconds is the same request delivered
# twice: a terminal's Ctrl-C (or a scheduler) signals the whole process group,
# and the local spawner forwards what it receives to the same processes.
REPEAT_WINDOW_S = 1.0


@contextlib.contextmanager
def stop_on_signals() -> Iterator[StopFlag]:
    """Turn SIGTERM and SIGINT into a flag for the duration of the block.

    The loop finishes the call in flight, saves, and exits with 128 + signal:
    preemption (SIGTERM) and Ctrl-C both keep every step learned so far. A
    second signal, once `REPEAT_WINDOW_S` has passed, raises KeyboardInterrupt.
    """
    flag = StopFlag()
    signals.training_started()  # from here a signal saves before stopping

    def handler(signum, _frame):
        if flag.signal is not None:
            if time.monotonic() - flag.received_at < REPEAT_WINDOW_S:
                return
            raise KeyboardInterrupt  # a second signal: stop waiting politely
        flag.signal, flag.received_at = signum, time.monotonic()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield flag
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
