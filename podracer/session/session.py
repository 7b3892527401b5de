"""One run's host sequence, written once for every (architecture, algorithm) pair.

A pair's driver supplies only what is its own (how its state is built, one
step or thread set, its extra metrics); the session does the rest:

    session = RunSession(configs)            # data and resume checks, the profiler
    ... build and compile (may refuse a setting: nothing written yet) ...
    state, meta = session.open(initial_state)   # run dir; restored if resuming
    session.start(total_steps, compile_s)    # logger (metrics, TensorBoard, W&B), profile window
    with session.training() as stop:         # signals: the loop saves, then stops
        ... session.log(row), session.check_finite(...), session.save(...) ...
    summary = session.finish(...)            # the dataset hook, summary.json, Interrupted

Every flag that concerns the host (`--run-dir`, `--checkpoint-every`,
`--wandb`, `--profile`, `--record-dataset`, `--init-from-dataset`) is
therefore handled here, once, for every pair. So is a `gs://` run directory:
checkpoints go there through orbax; the files that grow or that libraries
write locally (metrics, TensorBoard events, the profile trace, the summary) go
through `self.staging` (`podracer.storage`).
"""

from __future__ import annotations

import contextlib
import functools
import signal
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, NamedTuple

import jax

from podracer.errors import Interrupted, PodracerError
from podracer.protocol import parallel
from podracer.session.checkpoint import (Checkpointer, StopFlag, config_record,
                                        stop_on_signals)
from podracer.session.logger import RunLogger, start_wandb
from podracer.session.profile import make_profiler
from podracer.session.run_dir import agreed_checkpoint_steps, prepare_run_dir
from podracer import storage
from podracer.session import heartbeat, startup
from podracer.session.timing import Timings, as_metrics, format_breakdown

if TYPE_CHECKING:  # the command line's run spec, built above this layer
    from podracer.orchestrate.spec import RunSpec


def placed_for(program: Any, state: Any) -> Any:
    """`state` placed as the compiled `program` takes it: a restored or cloned state may not be.

    An array already placed so (any sharding equivalent to the program's) is
    left as it is.
    """
    (shardings,), _ = program.input_shardings

    def place(x, sharding):
        current = getattr(x, "sharding", None)
        if current is not None and current.is_equivalent_to(sharding, x.ndim):
            return x
        return jax.device_put(x, sharding)

    return jax.tree.map(place, state, shardings)


class DatasetHooks(NamedTuple):
    """What a run does with datasets, handed to the session from above.

    The orchestrator hands `podracer.data.train_hooks.HOOKS` to the runs it
    starts (`handing`), so that the session needs nothing of `podracer.data`.
    Each is called with the run's `data` section (`podracer.data.DataConfig`).
    """

    check: Callable[[Any, bool], None]  # (data, writes): before anything is built
    warm_start: Callable[..., tuple[Any, dict]]  # (train, data, spec, env_id, network, ppo_config, seed)
    record: Callable[..., dict]  # (data, arch, env_id, policy, seed) -> the summary's keys


_handed: DatasetHooks | None = None


@contextlib.contextmanager
def handing(hooks: DatasetHooks) -> Iterator[None]:
    """The runs opened inside the block use `hooks` for `--init-from-dataset` and `--record-dataset`."""
    global _handed
    previous, _handed = _handed, hooks
    try:
        yield
    finally:
        _handed = previous


def _dataset_hooks(data: Any) -> DatasetHooks | None:
    """The hooks handed in; a run asking for a dataset without them is refused in one line."""
    if _handed is None and data is not None and (data.record_dataset or data.init_from_dataset):
        raise PodracerError("--record-dataset and --init-from-dataset need a run started by "
                            "podracer.train or the command line, which hand the session its dataset hooks")
    return _handed


def _closing_loggers_on_failure(method: Callable) -> Callable:
    """`method`, which closes the session's loggers when it fails (`RunSession._close_loggers`)."""
    @functools.wraps(method)
    def wrapped(self: "RunSession", *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except BaseException:
            self._close_loggers()
            raise

    return wrapped


class RunSession:
    """The host side of one run: run directory, checkpoints, logging, profile, signals, summary."""

    def __init__(self, spec: RunSpec):
        # The sections the host side reads, and the record of every setting the run reads
        # (kept in each checkpoint, which a resume must match, and in summary.json).
        self.run, self.data, self.checkpoint, self.logging = spec.run, spec.data, spec.checkpoint, spec.logging
        self.record = config_record(spec.recorded())
        self.datasets = _dataset_hooks(self.data)
        self.startup = startup.take()  # since the process (or the `podracer.train` call) started
        self.main_process = parallel.is_main_process()
        # Everything that needs no compilation is checked before anything is built. A
        # checkpoint made with another config is refused by `open` (the command line
        # refuses it before anything is built: `podracer.orchestrate.cli`).
        storage.check(self.run.run_dir)
        if self.datasets is not None and self.data is not None:
            self.datasets.check(self.data, self.main_process)
        # The checkpoint to resume from, as process 0 sees it: every process restores that one.
        self.resume_steps = agreed_checkpoint_steps(self.run.run_dir)
        self.resuming = self.resume_steps is not None
        # Where this process writes the files a gs:// run directory gets by copy.
        self.staging = storage.Staging(self.run.run_dir)
        self.profiler = make_profiler(
            self.logging, self.staging.local if self.logging.profile else self.run.run_dir)
        self.timings: Timings = self.profiler or Timings()
        self.checkpointer: Checkpointer | None = None  # made when first needed (`_checkpointer`)
        self.logger: RunLogger | None = None
        self.resumed_from: int | None = None  # env steps of the checkpoint resumed from
        self.last_saved: int | None = None  # env steps of the last checkpoint written or found
        self.stop: StopFlag | None = None
        self.compile_s = self.train_s = 0.0
        self.profile: dict | None = None
        self.cloned: dict[str, Any] = {}  # the warm start's summary keys
        self._train_start = 0.0

    def measure(self, name: str):
        """Time a block under `name` (the profiler's table, or the plain time breakdown)."""
        return self.timings.measure(name)

    # -- before training

    def open(self, initial: Any) -> tuple[Any, dict[str, Any]]:
        """Create the run directory; returns the state to start from.

        A resumed run gets its latest checkpoint (process 0's latest, on every
        process), restored into `initial`'s shapes and shardings, with the
        checkpoint's meta; a new run `initial` and an empty meta.
        """
        prepare_run_dir(self.run.run_dir)
        if not self.resuming:
            return initial, {}
        state, meta = self._checkpointer().restore(initial, step=self.resume_steps)
        self.resumed_from = self.last_saved = int(meta["env_steps"])
        return state, meta

    def compiled_init_and_step(self, init: Any, init_args: tuple, step: Any | None) -> tuple[Any, Any]:
        """A run's `init` compiled for `init_args`, and its `step` (None: none) for the shapes
        and dtypes of the state `init` returns; give `step` a state placed by `placed_for`."""
        lowered = init.trace(*init_args).lower()
        state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=x.weak_type),
                             lowered.out_info)
        return lowered.compile(), None if step is None else step.lower(state).compile()

    def _checkpointer(self) -> Checkpointer:
        """The run's checkpointer, made when first needed: by a new run at its first save."""
        if self.checkpointer is None:
            self.checkpointer = Checkpointer(self.run.run_dir, self.checkpoint, self.record)
        return self.checkpointer

    def warm_start(self, train: Any, spec: Any, network: Any, ppo_config: Any) -> Any:
        """`--init-from-dataset`: a new run's PPO train state cloned from the dataset.

        A resumed run continues from its checkpoint, never from the dataset.
        """
        if self.resuming or self.data is None or not self.data.init_from_dataset:
            return train
        train, self.cloned = self.datasets.warm_start(train, self.data, spec, self.run.env, network,
                                                      ppo_config, self.run.seed)
        return train

    @_closing_loggers_on_failure
    def start(self, total_steps: int, compile_s: float) -> RunLogger:
        """Training begins: metrics, TensorBoard and W&B open, the profile window starts."""
        self.compile_s = compile_s
        heartbeat.end()  # the command line's "compiling ..." line ends before "compiled in"
        self.logger = RunLogger(self.run.run_dir, total_steps, enabled=self.main_process,
                                resume_steps=self.resumed_from or 0, staging=self.staging,
                                wandb_run=start_wandb(self.logging, self.run, self.record) if self.main_process else None)
        self.logger.compiled(compile_s)
        if self.profiler:
            self.profiler.start()
        self.startup.training_starts()  # the first step is dispatched next
        self._train_start = time.perf_counter()
        return self.logger

    def elapsed(self) -> float:
        """Seconds of training so far."""
        return time.perf_counter() - self._train_start

    def population_log(self, members: list, score_key: str = "episode_return_mean"):
        """The host side of a population (`podracer.session.population`), its scores restored on a resume."""
        from podracer.session.logger import read_rows
        from podracer.session.population import PopulationLog

        log = PopulationLog(members, score_key)
        if self.resuming and self.main_process:
            rows = read_rows(self.run.run_dir)
            log.restore([r for r in rows if r.get("env_steps", 0) <= (self.resumed_from or 0)])
        return log

    def population_summary(self, log) -> dict[str, Any]:
        """The summary keys of a population: its agents, aggregate and ranking."""
        return log.summary()

    # -- during training

    @contextlib.contextmanager
    def training(self, profile_note: str | None = None) -> Iterator[StopFlag]:
        """SIGINT/SIGTERM set the flag it yields; the loop saves, then stops.

        The training clock and the profile window end when the block does (not
        after the last save has reached the disk); whatever ended the block, a
        save already started is completed, never left half-written.
        """
        try:
            with stop_on_signals() as stop:
                self.stop = stop
                yield stop
            self.train_s = self.elapsed()
            self.profile = self._publish_trace(self.profiler.stop(profile_note)) if self.profiler else None
        except BaseException:
            if self.logger is not None:  # a failed run's rows so far still reach a gs:// run directory
                with contextlib.suppress(Exception):
                    self.logger.sync()
            self._close_loggers()
            self.staging.close()
            raise
        finally:
            if self.checkpointer is not None:
                self.checkpointer.wait()
                self.checkpointer.close()

    def _close_loggers(self) -> None:
        """Close the failed run's metrics file, TensorBoard writer and W&B run now: left
        to the interpreter's exit, their clean-up ends the run with a traceback on
        Python 3.12 and later, which refuse new threads then."""
        if self.logger is not None:
            with contextlib.suppress(Exception):  # the failure that got here is the one to report
                self.logger.close(failed=True)

    def _publish_trace(self, report: dict[str, Any]) -> dict[str, Any]:
        """Copy the trace to a gs:// run directory; the report then names it there."""
        self.staging.sync(("profile",))
        return {**report, "trace_dir": self.staging.published(report["trace_dir"]),
                "trace_file": self.staging.published(report["trace_file"])}

    def log(self, row: dict[str, Any]) -> None:
        self.logger.log(row)

    def save(self, env_steps: int, state: Any, meta: dict[str, Any]) -> None:
        """Start an asynchronous checkpoint of `state` at `env_steps`.

        The rows logged so far reach a gs:// run directory first, so that its
        `metrics.jsonl` always covers its latest checkpoint.
        """
        with self.measure("checkpoint"):
            if self.logger is not None:
                self.logger.sync()
            self._checkpointer().save(env_steps, state, meta)
        self.last_saved = env_steps

    def check_finite(self, finite: bool, where: str, env_steps: int, fix: str) -> None:
        """The NaN guard: stop before a non-finite state is published or saved.

        `where` names the step (`update 12`, `generation 3`); `fix` says what
        to change (`lower --lr or --max-grad-norm`).
        """
        if finite:
            return
        kept = ("nothing was saved yet" if self.last_saved is None else
                f"the last good checkpoint (env step {self.last_saved:,}) is kept")
        raise PodracerError(f"non-finite loss or parameters at {where} (env step {env_steps:,}); "
                            f"stopped, {kept}; {fix}")

    # -- after training

    @_closing_loggers_on_failure
    def finish(self, *, env_steps: int, new_steps: int, episode_return_mean: float | None,
               fingerprint_of: Any, devices: dict[str, int], extra: dict[str, Any],
               stopped: bool, policy: Callable[[], Any] | None = None,
               breakdown: bool = False) -> dict[str, Any]:
        """Write `summary.json` (its common keys mean the same for every pair) and return it.

        `breakdown` adds the time per
        operation (keys and a printed table) for pairs whose threads measure it.
        `devices` counts over every process; `fingerprint_of` is the parameter
        tree every process must hold alike; `policy()` gives the trained policy
        (`podracer.acting.Policy`), which `--record-dataset` records on process 0
        when training was not stopped early.
        Raises `Interrupted` (after writing the summary) when a signal stopped
        the run.
        """
        import jax

        recorded = {}
        if (self.data is not None and self.data.record_dataset and policy is not None and not stopped
                and self.main_process):
            recorded = self.datasets.record(self.data, self.run.arch, self.run.env, policy(), self.run.seed)
        totals = self.timings.totals()
        summary = self.logger.summary({
            "arch": self.run.arch, "algo": self.run.algo, "env": self.run.env,
            "env_steps": env_steps,
            "sps": new_steps / self.train_s if new_steps and self.train_s > 0 else None,
            "episode_return_mean": episode_return_mean,
            **extra,
            # A population's aggregate throughput: every agent's steps.
            **({"population_sps": new_steps * extra["num_agents"] / self.train_s}
               if "num_agents" in extra and new_steps and self.train_s > 0 else {}),
            **self.cloned,
            **devices,
            "processes": jax.process_count(),
            "compile_s": self.compile_s,
            **self.startup.summary(),  # time_to_first_step_s, compile_cache
            "train_s": self.train_s,
            "resumed_from_env_steps": self.resumed_from,
            # Every process must hold the same parameters; one hash per process proves it.
            "params_fingerprints": parallel.process_fingerprints(fingerprint_of),
            **recorded,
            # Sebulba's thread-seconds per operation; Anakin's host waits on the device
            # inside them, so there only a profile (`--profile`) breaks its time down.
            **(as_metrics(totals) if breakdown else {}),
            # From the same start as `time_to_first_step_s` (the process's, or the
            # `podracer.train` call's), so that start-up is part of the wall time.
            "wall_s": time.time() - self.startup.started,
            **({"profile": self.profile} if self.profile else {}),
            "config": self.record,
        })
        self.staging.close()
        if breakdown and self.logger.enabled and not self.profiler:  # a profile prints its own table
            self.logger.stream.write(format_breakdown(totals, self.train_s))
            self.logger.stream.flush()
        if stopped:
            signum = (self.stop.signal if self.stop else None) or signal.SIGTERM  # maybe another process's
            saved = (f"checkpoint saved; resume with --run-dir={self.run.run_dir}"
                     if self.last_saved is not None else "nothing was saved yet")
            raise Interrupted(signum, f"stopped by signal {signum} at env step {env_steps:,}; {saved}")
        return summary

