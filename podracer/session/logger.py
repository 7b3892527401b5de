"""Run outputs: `metrics.jsonl` per log interval, `summary.json` at the end, a progress line.

Keys every architecture and algorithm writes (stable; later additions only add):
`env_steps`, `sps`, `episode_return_mean`; the summary adds `wall_s`. Evolution
strategies add `mean_params_return` (shown on the progress line) and `generations`.

For a `gs://` run directory, `metrics.jsonl` and the TensorBoard events are
written locally (`storage.Staging`) and copied to the bucket at the first row,
then at most every `SYNC_INTERVAL_S`, before every checkpoint (`sync()`) and
at the end: the bucket's rows always cover its latest checkpoint.

The progress line reads

    steps     100,352/500,000 (20%)      23,456 steps/s  return    21.50  elapsed 0:00:04  eta 0:00:17

with `return -` until the first episode ends and `eta -:--:--` while unknown.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, BinaryIO, TextIO

from podracer.errors import PodracerError
from podracer import storage
from podracer.session import writers

# The clock the logger reads; a module attribute so that tests can drive it.
clock = time.perf_counter

# On a terminal the line rewrites itself in place, at most this often.
TERMINAL_INTERVAL_S = 0.1

METRICS = "metrics.jsonl"
TENSORBOARD = "tensorboard"
SUMMARY = "summary.json"
# A gs:// run directory gets the growing files at most this often between
# checkpoints: each copy is a whole-object upload, made on the logging thread.
SYNC_INTERVAL_S = 10.0


def read_rows(run_dir: str) -> list[dict[str, Any]]:
    """The rows of a run directory's `metrics.jsonl` (local or gs://), a line cut short by a kill left out."""
    rows = []
    path = storage.join(run_dir, METRICS)
    for line in storage.read_text(path).splitlines() if storage.exists(path) else ():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def start_wandb(logging_config: Any, run: Any, record: dict[str, Any]) -> Any:
    """A Weights & Biases run when `--wandb` asks for one (`logging_config`, the run's `LogConfig`),
    else None; `record` (the run's settings, `config_record`) is its config."""
    if not logging_config.wandb:
        return None
    try:
        import wandb
    except ImportError:
        raise PodracerError("--wandb needs the wandb package; pip install wandb, or drop --wandb") from None
    # W&B keeps its files in a local directory: RUN_DIR/wandb for a local run
    # directory; for a gs:// one, W&B's own default (./wandb, or $WANDB_DIR).
    return wandb.init(project=logging_config.wandb_project,
                      dir=None if storage.is_remote(run.run_dir) else run.run_dir,
                      name=storage.name(run.run_dir),
                      config=record)


def format_duration(seconds: float | None) -> str:
    """`h:mm:ss` (hours unbounded: 31 hours is `31:12:40`); `-:--:--` when unknown."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "-:--:--"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def _format_return(value: float | None) -> str:
    # Before the first episode ends there is no return yet: say so, not `nan`.
    if value is None or not math.isfinite(value):
        return f"{'-':>8}"
    return f"{value:>8.2f}"


def progress_line(env_steps: int, total_steps: int, sps: float, episode_return: float | None,
                  elapsed_s: float, mean_params_return: float | None = None) -> str:
    """One progress line from the numbers; the ETA is what is left at `sps`."""
    # Rounded down, so a run shows 100% only when it is done.
    percent = min(100, 100 * env_steps // total_steps) if total_steps > 0 else 100
    eta = max(total_steps - env_steps, 0) / sps if sps and sps > 0 else None
    line = (f"steps {env_steps:>11,}/{total_steps:,} ({percent}%)  {sps or 0.0:>10,.0f} steps/s  "
            f"return {_format_return(episode_return)}")
    if mean_params_return is not None:  # evolution strategies: the return of the mean parameters
        line += f"  mean params {_format_return(mean_params_return)}"
    return line + f"  elapsed {format_duration(elapsed_s)}  eta {format_duration(eta)}"


# Cloud clients tensorboardX imports, where installed, for event files at s3:// and
# gs:// paths. podracer writes its events to a local directory (a gs:// run
# directory gets them by copy, `storage.Staging`), and their imports took 0.2 s
# of a run's start-up on a quiet machine, 1 s on a busy one.
_TENSORBOARDX_UNUSED = ("boto3", "google.cloud.storage")


def summary_writer_class() -> type:
    """tensorboardX's `SummaryWriter`, imported without the cloud clients it would not use here."""
    if "tensorboardX" not in sys.modules:
        hidden = [name for name in _TENSORBOARDX_UNUSED if name not in sys.modules]
        for name in hidden:
            sys.modules[name] = None  # an import of it raises ImportError, which tensorboardX expects
        try:
            import tensorboardX  # noqa: F401
        finally:
            for name in hidden:
                if name in sys.modules and sys.modules[name] is None:
                    del sys.modules[name]
    from tensorboardX import SummaryWriter

    return SummaryWriter


class RunLogger:
    """Appends metrics lines, prints progress, writes the summary.

    Every `log()` call writes its row to `metrics.jsonl`, TensorBoard and W&B.
    The progress line is rate-limited so that a long run stays readable: on a
    terminal it rewrites itself in place (at most every `TERMINAL_INTERVAL_S`);
    elsewhere (CI, log files, notebook cells) it prints one plain line at most
    every `min_interval_s`. The first row, the final row (`env_steps >=
    total_steps`) and the last row before `summary()` are always shown.

    Files go into `staging` (by default the run directory's own,
    `storage.Staging(run_dir)`), published to a `gs://` run directory by `sync()`.
    """

    def __init__(self, run_dir: str, total_steps: int, stream: TextIO | None = None,
                 enabled: bool = True, resume_steps: int = 0, wandb_run: Any = None,
                 min_interval_s: float = 5.0, staging: storage.Staging | None = None):
        self.run_dir = run_dir
        self._owns_staging = staging is None
        self.staging = staging or storage.Staging(run_dir)
        self._last_sync: float | None = None
        self.total_steps = total_steps
        self.stream = stream or sys.stdout
        self.enabled = enabled
        # `wall_s` in rows and the summary counts from here (compilation
        # included where the driver compiles after this), as it always has:
        # `podracer.plot` draws return against it, so moving it would shift
        # every run's wall-time curve. The progress line's `elapsed` counts
        # from `train_start` instead, which `compiled()` moves to the end of
        # compilation.
        self.start = clock()
        self.train_start = self.start
        self.interactive = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.min_interval_s = TERMINAL_INTERVAL_S if self.interactive else min_interval_s
        self.last_return = float("nan")
        self.rows = 0
        self._wandb = wandb_run
        self._last_printed: float | None = None  # when a progress line was last written
        self._unprinted: str | None = None  # the newest line held back by the rate limit
        self._width = 0  # of the line on screen, to blank what a shorter one leaves
        self._closed = False
        if enabled:
            self._file = self._open_metrics(resume_steps)
            # TensorBoard event files beside metrics.jsonl: `tensorboard --logdir RUN_DIR`.
            # A queue deep enough that rows logged before `log` notices a dead writer never block on it.
            writers.watch_event_writers()
            self._tensorboard = summary_writer_class()(self.staging.path(TENSORBOARD),
                                                       max_queue=writers.EVENT_QUEUE)

    def _open_metrics(self, resume_steps: int) -> BinaryIO:
        """A fresh file, or, when resuming, the run directory's rows up to the checkpoint, then append.

        Rows are appended whole (`writers.append_line`); a line cut short anyway (a
        file written before that, or another tool's) is dropped with a warning.
        """
        path = self.staging.path(METRICS)
        if not resume_steps:
            return open(path, "wb", buffering=0)
        kept, torn = [], 0
        published = storage.join(self.run_dir, METRICS)
        if storage.exists(published):
            for line in storage.read_text(published).splitlines(keepends=True):
                try:
                    row = json.loads(line)
                except ValueError:  # a line cut short by a kill
                    torn += 1
                    continue
                if row.get("env_steps", 0) <= resume_steps:
                    kept.append(line if line.endswith("\n") else line + "\n")
                    if row.get("episode_return_mean") is not None:
                        self.last_return = row["episode_return_mean"]
        if torn:
            print(f"warning: dropped {torn} line{'s' if torn > 1 else ''} of {published} cut short by an "
                  f"earlier stop; the rows up to the checkpoint at env step {resume_steps:,} are kept",
                  file=sys.stderr, flush=True)
        with open(path + ".tmp", "w") as f:
            f.writelines(kept)
        os.replace(path + ".tmp", path)
        return open(path, "ab", buffering=0)

    def elapsed(self) -> float:
        """Seconds since the logger was made: the `wall_s` of rows and the summary."""
        return clock() - self.start

    def compiled(self, seconds: float) -> None:
        """Say that compilation took `seconds` and training starts now.

        The progress line's `elapsed` counts from this call.
        """
        self.train_start = clock()
        if self.enabled:
            self._end_line()
            self.stream.write(f"compiled in {seconds:.1f} s; training\n")
            self.stream.flush()

    def log(self, metrics: dict[str, Any]) -> None:
        """Record one interval; must contain `env_steps`, `sps`, `episode_return_mean`."""
        metrics = {key: _jsonable(value) for key, value in metrics.items()}
        metrics.setdefault("wall_s", round(self.elapsed(), 3))
        if metrics.get("episode_return_mean") is not None:
            self.last_return = metrics["episode_return_mean"]
        self.rows += 1
        if not self.enabled:
            return
        writers.append_line(self._file, json.dumps(metrics) + "\n")
        writers.raise_writer_failure(self.staging.path(TENSORBOARD))
        scalars = {key: value for key, value in metrics.items()
                   if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "env_steps"}
        for key, value in scalars.items():
            self._tensorboard.add_scalar(f"podracer/{key}", value, metrics["env_steps"])
        for i, agent in enumerate(metrics.get("agents") or ()):  # a population: a series per agent
            for key, value in agent.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tensorboard.add_scalar(f"agent_{i}/{key}", value, metrics["env_steps"])
        if self._wandb is not None:
            self._wandb.log(scalars, step=metrics["env_steps"])
        if self.staging.remote and (self._last_sync is None or clock() - self._last_sync >= SYNC_INTERVAL_S):
            self.sync()
        self._progress(metrics)

    def sync(self) -> None:
        """Copy `metrics.jsonl` and the TensorBoard events, as they are now, to a `gs://` run directory.

        The session calls it before every checkpoint, so that the rows up to a
        checkpoint are in the bucket before the checkpoint is.
        """
        if not (self.enabled and self.staging.remote):
            return
        self._file.flush()
        self._tensorboard.flush()
        self.staging.sync((METRICS, TENSORBOARD))
        self._last_sync = clock()

    def close(self, failed: bool = False) -> None:
        """Close `metrics.jsonl`, the TensorBoard writer and the W&B run (marked failed if
        `failed`); a second call does nothing.

        Every way out of a run closes them: TensorBoard's and W&B's own clean-up at
        interpreter exit starts threads, which Python 3.12 and later refuse then
        (a traceback after the run's last line).
        """
        if not self.enabled or self._closed:
            return
        self._closed = True
        self._file.close()
        self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish(exit_code=1 if failed else None)

    def _progress(self, metrics: dict[str, Any]) -> None:
        now = clock()
        mean_params = None  # not evolution strategies: no `mean params` part
        if "mean_params_return" in metrics:  # None until the mean parameters are first evaluated
            mean_params = metrics["mean_params_return"] if metrics["mean_params_return"] is not None else math.nan
        # A run of whole generations (Sebulba ES) ends in the one that passes the total
        # asked for: its line's total is then what it trained, never "51,001/50,000".
        self.total_steps = max(self.total_steps, metrics["env_steps"])
        line = progress_line(metrics["env_steps"], self.total_steps, metrics["sps"], self.last_return,
                             now - self.train_start, mean_params)
        final = metrics["env_steps"] >= self.total_steps
        due = self._last_printed is None or now - self._last_printed >= self.min_interval_s
        if not (due or final):
            self._unprinted = line  # shown by a later row, or by summary()
            return
        self._last_printed = now
        self._write_line(line)

    def _write_line(self, line: str) -> None:
        self._unprinted = None
        if self.interactive:
            # Pad to the previous line's width: `\r` only moves the cursor, so a
            # shorter line would leave the old one's tail on screen.
            self.stream.write("\r" + line.ljust(self._width))
            self._width = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def _end_line(self) -> None:
        """Finish a terminal's in-place line, so the next output starts on its own."""
        if self._width:
            self.stream.write("\n")
            self._width = 0

    def summary(self, summary: dict[str, Any]) -> dict[str, Any]:
        """Write `summary.json` and print it; returns what was written."""
        summary = {key: _jsonable(value) for key, value in summary.items()}
        summary.setdefault("wall_s", round(self.elapsed(), 3))
        if self.enabled:
            if self._wandb is not None:
                self._wandb.summary.update({k: v for k, v in summary.items() if not isinstance(v, (list, dict))})
            self.close()
            storage.write_text(self.staging.path(SUMMARY), json.dumps(summary, indent=2))
            self.staging.sync((METRICS, TENSORBOARD, SUMMARY))  # the session publishes the trace
            if self._owns_staging:
                self.staging.close()
            if self._unprinted is not None:  # the last printed line is the final state
                self._write_line(self._unprinted)
            self._end_line()
            width = max(len(key) for key in summary)
            self.stream.write("summary\n" + "".join(
                f"  {key:<{width}}  {_format(value)}\n" for key, value in summary.items()
                if key not in ("profile", "config", "agents", "settings_ranked", "pbt")))
            if summary.get("settings_ranked"):
                from podracer.population import format_ranking

                self.stream.write(format_ranking(summary["settings_ranked"], summary["score_key"],
                                                 pbt="pbt" in summary))
            if summary.get("profile"):
                from podracer.session.profile import format_profile

                self.stream.write(format_profile(summary["profile"]))
            self.stream.flush()
        return summary


def _format(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 1e6 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)
