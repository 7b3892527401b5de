"""Plots of runs: `python -m podracer.plot RUN_DIR [RUN_DIR ...] [--out FILE.png]`.

Learning curves (mean return against env steps and against wall time) with
several runs overlaid; runs whose configs differ only in `--seed` are drawn as
one curve, their mean, with a band from the lowest to the highest seed. If a run
was profiled (`--profile`), a bar chart of its time breakdown is added.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import numpy as np

from podracer.errors import PodracerError


def read_curve(run_dir: str) -> dict[str, np.ndarray]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise PodracerError(f"{run_dir} has no metrics.jsonl; pass the --run-dir of a run")
    rows = []
    for line in open(path):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if row.get("episode_return_mean") is not None:
            rows.append(row)
    if not rows:
        raise PodracerError(f"{run_dir} has no finished episodes to plot yet")
    return {key: np.asarray([row.get(key, np.nan) for row in rows], float)
            for key in ("env_steps", "wall_s", "episode_return_mean")}


def _config(run_dir: str) -> dict[str, Any]:
    """The run's identity without its seed (from the latest checkpoint, else the summary)."""
    summary_path = os.path.join(run_dir, "summary.json")
    summary = json.load(open(summary_path)) if os.path.exists(summary_path) else {}
    try:
        from podracer.policy import run_config_of

        config = run_config_of(run_dir)
        config["run"] = {k: v for k, v in config["run"].items() if k not in ("seed", "run_dir")}
        config.pop("checkpoint", None)
        config.pop("distributed", None)
        return config
    except PodracerError:
        return {"label": os.path.basename(os.path.normpath(run_dir)),
                "arch": summary.get("arch"), "env": summary.get("env")}


def group_by_seed(run_dirs: list[str]) -> list[tuple[str, list[str]]]:
    """(label, run dirs) for each group of runs identical but for the seed."""
    groups: dict[str, list[str]] = {}
    labels: dict[str, str] = {}
    for run_dir in run_dirs:
        config = _config(run_dir)
        key = json.dumps(config, sort_keys=True, default=str)
        groups.setdefault(key, []).append(run_dir)
        run = config.get("run", config)
        labels[key] = " ".join(str(run.get(k)) for k in ("arch", "algo", "env") if run.get(k)) or run_dir
    return [(f"{labels[key]}: {os.path.basename(os.path.normpath(dirs[0]))}"
             f"{f' +{len(dirs) - 1} seeds' if len(dirs) > 1 else ''}", dirs)
            for key, dirs in groups.items()]


def _band(curves: list[dict[str, np.ndarray]], x_key: str):
    """Mean, min and max of the curves on a shared grid of `x_key`."""
    end = min(c[x_key][-1] for c in curves)
    start = max(c[x_key][0] for c in curves)
    grid = np.linspace(start, end, 100) if end > start else np.asarray([end])
    ys = np.stack([np.interp(grid, c[x_key], c["episode_return_mean"]) for c in curves])
    return grid, ys.mean(0), ys.min(0), ys.max(0)


def plot(run_dirs: list[str], out: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = group_by_seed(run_dirs)
    profiles = []
    for run_dir in run_dirs:
        path = os.path.join(run_dir, "summary.json")
        if os.path.exists(path) and json.load(open(path)).get("profile"):
            profiles.append((run_dir, json.load(open(path))["profile"]))
    panels = 2 + bool(profiles)
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5))
    for label, dirs in groups:
        curves = [read_curve(d) for d in dirs]
        for ax, x_key, x_label in ((axes[0], "env_steps", "environment steps"),
                                   (axes[1], "wall_s", "wall time (s)")):
            grid, mean, low, high = _band(curves, x_key)
            (line,) = ax.plot(grid, mean, label=label)
            if len(curves) > 1:
                ax.fill_between(grid, low, high, color=line.get_color(), alpha=0.25)
            ax.set_xlabel(x_label)
            ax.set_ylabel("mean episode return")
            ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    if profiles:
        run_dir, profile = profiles[0]
        rows = profile["operations"][::-1]  # barh draws bottom-up: keep the table's order
        # A row's share is of its own thread's time (`podracer.profile`): label each with it.
        names = [f"{row['thread']}: {row['operation']}" if "thread" in row else row["operation"]
                 for row in rows]
        axes[2].barh(names, [100 * row["share"] for row in rows])
        axes[2].tick_params(axis="y", labelsize=7)
        axes[2].set_xlabel("share of its thread's wall time (%)")
        axes[2].set_title(f"time breakdown: {os.path.basename(os.path.normpath(run_dir))}")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m podracer.plot", description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", help="run directories to plot")
    parser.add_argument("--out", default="podracer.png", help="the PNG to write (default: podracer.png)")
    args = parser.parse_args(argv)
    import logging

    logging.getLogger("absl").setLevel(logging.CRITICAL)  # orbax's notes on old checkpoints
    try:
        print(plot(args.run_dirs, args.out))
    except PodracerError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
