"""Run directories: a new one per run, `runs/latest` at the newest, resume and finished.

Without `--run-dir` a run gets a new directory named for what it is and when
(`runs/anakin-ppo-CartPole-v1-20261123-142501`), and `runs/latest` links to the
newest. A directory that holds a checkpoint resumes from it; one whose latest
checkpoint already covers `--total-steps` is finished and is left as it is.

`--run-dir` may also be `gs://bucket/path` (see `podracer.storage`):
resuming and the finished check work the same there; the new directory per
run and `runs/latest` are local conveniences, since a bucket's run directory
is always named.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
from typing import Iterator, NamedTuple

from podracer.errors import PodracerError
from podracer import storage

RUNS_ROOT = "runs"
LATEST = "latest"


def new_run_name(arch: str, algo: str, env: str, when: float, root: str = RUNS_ROOT) -> str:
    """`root/ARCH-ALGO-ENV-YYYYmmdd-HHMMSS`, with `-2`, `-3`, ... if that exists already."""
    env_part = re.sub(r"[^A-Za-z0-9._-]+", "_", env)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(when))
    base = os.path.join(root, f"{arch}-{algo}-{env_part}-{stamp}")
    path, suffix = base, 1
    while os.path.lexists(path):
        suffix += 1
        path = f"{base}-{suffix}"
    return path


def link_latest(run_dir: str) -> str | None:
    """Point `runs/latest` (beside `run_dir`) at it; returns the previous target, if any.

    A real directory named `latest` (an older run's) is never replaced; a
    `gs://` run directory gets no link.
    """
    if storage.is_remote(run_dir):
        return None
    parent, name = os.path.split(os.path.normpath(run_dir))
    latest = os.path.join(parent, LATEST)
    if os.path.exists(latest) and not os.path.islink(latest):
        return None
    previous = os.readlink(latest) if os.path.islink(latest) else None
    tmp = f"{latest}.{os.getpid()}.tmp"
    try:
        os.symlink(name, tmp)
        os.replace(tmp, latest)  # atomic: a reader sees the old link or the new one
    except OSError:  # a filesystem without symbolic links: the runs are still there
        if os.path.lexists(tmp):
            os.remove(tmp)
    return previous


def unlink_new_run(run_dir: str, previous_latest: str | None) -> None:
    """Remove a new run directory that nothing was written to, and restore `runs/latest`.

    Called when a new run fails before it wrote anything (a setting refused
    while building), so a mistake leaves no empty directory behind. (A `gs://`
    one never holds anything before training: there is nothing to remove.)
    """
    if storage.is_remote(run_dir):
        return
    if os.path.isdir(run_dir) and not os.listdir(run_dir):
        os.rmdir(run_dir)
    if os.path.lexists(run_dir):  # it holds what the run wrote: it stays the latest run
        return
    latest = os.path.join(os.path.dirname(os.path.normpath(run_dir)), LATEST)
    if os.path.islink(latest) and os.readlink(latest) == os.path.basename(os.path.normpath(run_dir)):
        os.remove(latest)
        if previous_latest:
            os.symlink(previous_latest, latest)


def prepare_run_dir(run_dir: str) -> str:
    """Create `run_dir` (and parents) or explain why it cannot be written (local or `gs://`)."""
    storage.probe_writable(run_dir)
    return run_dir


class RunDirState(NamedTuple):
    """What a run directory holds for a run asked to reach `total_steps`."""

    checkpoint_steps: int | None  # env steps of its latest checkpoint; None: no checkpoint
    total_steps: int

    @property
    def resumes(self) -> bool:
        return self.checkpoint_steps is not None and not self.finished

    @property
    def finished(self) -> bool:
        return self.checkpoint_steps is not None and self.checkpoint_steps >= self.total_steps


def latest_checkpoint_steps(run_dir: str) -> int | None:
    """Env steps of the newest complete checkpoint (orbax names each by its step)."""
    from podracer.session.checkpoint import checkpoint_steps

    steps = checkpoint_steps(run_dir)
    return steps[-1] if steps else None


def agreed_checkpoint_steps(run_dir: str) -> int | None:
    """Process 0's `latest_checkpoint_steps(run_dir)`, on every process.

    Process 0 alone looks and every process takes its answer, so all resume
    from the same checkpoint, or all start anew, even where another host's view
    of the directory differs (it lags behind, or a local path is another disk
    on each host).
    """
    from podracer.protocol import parallel

    mine = latest_checkpoint_steps(run_dir) if parallel.is_main_process() else None
    return parallel.from_main_process(mine)


def finished_message(run_dir: str, state: RunDirState) -> str:
    outputs = [name for name in ("summary.json", "metrics.jsonl", "tensorboard", "checkpoints")
               if storage.exists(storage.join(run_dir, name))]
    return (f"{run_dir} is a finished run ({state.checkpoint_steps:,} env steps of "
            f"--total-steps={state.total_steps:,}); nothing to do. Its results: "
            f"{', '.join(storage.join(run_dir, name) for name in outputs)}. "
            f"Pass a larger --total-steps to train it further, or leave out --run-dir for a new run.")


def finished_summary(run_dir: str) -> dict:
    """A finished run's `summary.json` ({} without one); one line if it cannot be read."""
    path = storage.join(run_dir, "summary.json")
    if not storage.exists(path):
        return {}
    try:
        summary = json.loads(storage.read_text(path))
        detail = None if isinstance(summary, dict) else "not a JSON object"
    except (ValueError, OSError) as err:  # cut short, edited, or not UTF-8
        detail = type(err).__name__
    if detail:
        raise PodracerError(f"{path} is damaged ({detail}); its checkpoints are untouched: delete "
                            f"{path} and evaluate the run with `eval --run-dir={run_dir}`, or pass a larger "
                            f"--total-steps to train further and write a new summary")
    return summary


@contextlib.contextmanager
def disk_full_is_one_line(run_dir: str) -> Iterator[None]:
    """A full disk (or quota) inside the block becomes one line that says which checkpoint is kept.

    An asynchronous save cut short leaves tensorstore completing writes for an
    event loop orbax has closed; each reports a traceback as an unraisable
    error. Those are held back while the block runs, shown if it ends otherwise,
    and dropped (then and from then on: the process is ending) after a full disk.
    """
    previous, held = sys.unraisablehook, []
    sys.unraisablehook = held.append
    full = False
    try:
        yield
    except PodracerError:
        raise
    except Exception as err:
        words = storage.disk_full(err)
        if words is None:
            raise
        full = True
        from podracer.session.checkpoint import checkpoint_steps

        kept = "nothing was saved yet"
        with contextlib.suppress(Exception):
            steps = checkpoint_steps(run_dir)  # complete ones only
            if steps:
                kept = f"the last complete checkpoint (env step {steps[-1]:,}) is kept"
        raise PodracerError(f"the disk holding --run-dir={run_dir} is full ({words}); stopped, {kept}; "
                            f"free space, then run the same command to resume") from None
    finally:
        sys.unraisablehook = (lambda unraisable: None) if full else previous
        if not full:
            for unraisable in held:
                previous(unraisable)
