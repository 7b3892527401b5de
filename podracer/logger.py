"""Run outputs: `metrics.jsonl` per log interval, `summary.json` at the end, a progress line.

Keys every architecture and algorithm writes (stable; later additions only add):
`env_steps`, `sps`, `episode_return_mean`; the summary adds `wall_s`. Evolution
strategies add `mean_params_return` (shown on the progress line) and `generations`.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, TextIO

from podracer.errors import PodracerError


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def start_wandb(configs: dict[str, Any]) -> Any:
    """A Weights & Biases run when `--wandb` asks for one (process 0 only), else None."""
    import dataclasses

    logging_config = configs.get("logging")
    if logging_config is None or not logging_config.wandb:
        return None
    try:
        import wandb
    except ImportError:
        raise PodracerError("--wandb needs the wandb package; pip install wandb, or drop --wandb") from None
    run = configs["run"]
    return wandb.init(project=logging_config.wandb_project, dir=run.run_dir,
                      name=os.path.basename(os.path.abspath(run.run_dir)),
                      config={name: dataclasses.asdict(cfg) for name, cfg in configs.items()})


def prepare_run_dir(run_dir: str) -> str:
    """Create `run_dir` (and parents) or explain why it cannot be written."""
    try:
        os.makedirs(run_dir, exist_ok=True)
        probe = os.path.join(run_dir, ".write-test")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as err:
        raise PodracerError(f"cannot write to --run-dir={run_dir} ({err.strerror}); "
                            f"pass a directory you can write to") from None
    return run_dir


class RunLogger:
    """Appends metrics lines, prints progress, writes the summary.

    On a terminal the progress line rewrites itself; elsewhere (CI, log files)
    it prints one plain line per interval.
    """

    def __init__(self, run_dir: str, total_steps: int, stream: TextIO | None = None,
                 enabled: bool = True, resume_steps: int = 0, wandb_run: Any = None):
        self.run_dir = run_dir
        self.total_steps = total_steps
        self.stream = stream or sys.stdout
        self.enabled = enabled
        self.start = time.perf_counter()
        self.interactive = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.last_return = float("nan")
        self.rows = 0
        self._wandb = wandb_run
        if enabled:
            self._file = self._open_metrics(resume_steps)
            from tensorboardX import SummaryWriter

            # TensorBoard event files beside metrics.jsonl: `tensorboard --logdir RUN_DIR`.
            self._tensorboard = SummaryWriter(os.path.join(run_dir, "tensorboard"))

    def _open_metrics(self, resume_steps: int) -> TextIO:
        """A fresh file, or, when resuming, the rows up to the checkpoint, then append."""
        path = os.path.join(self.run_dir, "metrics.jsonl")
        if not resume_steps:
            return open(path, "w")
        kept = []
        if os.path.exists(path):
            for line in open(path):
                try:
                    row = json.loads(line)
                except ValueError:  # a line cut short by a kill
                    continue
                if row.get("env_steps", 0) <= resume_steps:
                    kept.append(line if line.endswith("\n") else line + "\n")
                    if row.get("episode_return_mean") is not None:
                        self.last_return = row["episode_return_mean"]
        with open(path + ".tmp", "w") as f:
            f.writelines(kept)
        os.replace(path + ".tmp", path)
        return open(path, "a")

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def log(self, metrics: dict[str, Any]) -> None:
        """Record one interval; must contain `env_steps`, `sps`, `episode_return_mean`."""
        metrics = {key: _jsonable(value) for key, value in metrics.items()}
        metrics.setdefault("wall_s", round(self.elapsed(), 3))
        if metrics.get("episode_return_mean") is not None:
            self.last_return = metrics["episode_return_mean"]
        self.rows += 1
        if not self.enabled:
            return
        self._file.write(json.dumps(metrics) + "\n")
        self._file.flush()
        scalars = {key: value for key, value in metrics.items()
                   if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "env_steps"}
        for key, value in scalars.items():
            self._tensorboard.add_scalar(f"podracer/{key}", value, metrics["env_steps"])
        if self._wandb is not None:
            self._wandb.log(scalars, step=metrics["env_steps"])
        self._progress(metrics)

    def _progress(self, metrics: dict[str, Any]) -> None:
        steps, sps = metrics["env_steps"], metrics["sps"] or 0.0
        eta = (self.total_steps - steps) / sps if sps else float("nan")
        line = (f"steps {steps:>11,}/{self.total_steps:,}  {sps:>10,.0f} steps/s  "
                f"return {self.last_return:>8.2f}  eta {eta:>6.1f}s")
        if metrics.get("mean_params_return") is not None:  # evolution strategies
            line += f"  mean params {metrics['mean_params_return']:>8.2f}"
        if self.interactive:
            self.stream.write("\r" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def summary(self, summary: dict[str, Any]) -> dict[str, Any]:
        """Write `summary.json` and print it; returns what was written."""
        summary = {key: _jsonable(value) for key, value in summary.items()}
        summary.setdefault("wall_s", round(self.elapsed(), 3))
        if self.enabled:
            self._file.close()
            self._tensorboard.close()
            if self._wandb is not None:
                self._wandb.summary.update({k: v for k, v in summary.items() if not isinstance(v, (list, dict))})
                self._wandb.finish()
            path = os.path.join(self.run_dir, "summary.json")
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(summary, f, indent=2)
            os.replace(tmp, path)
            if self.interactive:
                self.stream.write("\n")
            width = max(len(key) for key in summary)
            self.stream.write("summary\n" + "".join(
                f"  {key:<{width}}  {_format(value)}\n" for key, value in summary.items()
                if key != "profile"))
            if summary.get("profile"):
                from podracer.profile import format_profile

                self.stream.write(format_profile(summary["profile"]))
            self.stream.flush()
        return summary


def _format(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 1e6 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)
