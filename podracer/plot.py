"""Plots of runs: `python -m podracer.plot RUN_DIR [RUN_DIR ...] [--out FILE.png]`.

Run directories may be local or `gs://bucket/path`; the PNG is written locally.

Learning curves (return against env steps and against wall time) with several
runs overlaid; runs whose configs differ only in `--seed` are drawn as one
curve, their mean, with a band from the lowest to the highest seed. If a run
was profiled (`--profile`), a bar chart of its time breakdown is added.

Each run's headline curve (solid, with the band) is its key result: for PPO the
mean episode return (`episode_return_mean`), for evolution strategies the
return of the mean parameters (`mean_params_return`), with the population's
mean fitness (`episode_return_mean`) beside it, thin and dashed.

A population run (`--num-seeds`, `--sweep`) draws each agent thinly and the IQM
over agents with its 95% bootstrap CI band: one IQM and band per setting of a
finished sweep (its `summary.json` names each agent's setting), so that a
setting's curve is never averaged with another's. A population-based training
run (`--pbt`) draws the IQM over every agent (their settings change as they
train) and, in a panel per swept setting, its lineage: each agent's value over
the run, and each exploit event as a dotted line from the agent copied to the
agent that copied it, at the end of the call that ranked them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, NamedTuple

import numpy as np

from podracer.errors import PodracerError
from podracer import storage
from podracer.session.logger import read_rows


def _rows(run_dir: str) -> list[dict[str, Any]]:
    if not storage.exists(storage.join(run_dir, "metrics.jsonl")):
        raise PodracerError(f"{run_dir} has no metrics.jsonl; pass the directory of a run")
    return read_rows(run_dir)


def _summary(run_dir: str) -> dict[str, Any]:
    path = storage.join(run_dir, "summary.json")
    return json.loads(storage.read_text(path)) if storage.exists(path) else {}


def read_curve(run_dir: str, key: str = "episode_return_mean") -> dict[str, np.ndarray]:
    """`env_steps`, `wall_s` and `key` of the rows of the run's `metrics.jsonl` that have `key`."""
    rows = [row for row in _rows(run_dir) if row.get(key) is not None]
    if not rows:
        what = {"episode_return_mean": "finished episodes",
                "mean_params_return": "evaluations of the mean parameters"}.get(key, f"values of {key}")
        raise PodracerError(f"{run_dir} has no {what} to plot yet")
    return {name: np.asarray([row.get(name, np.nan) for row in rows], float)
            for name in ("env_steps", "wall_s", key)}


def is_es(run_dir: str) -> bool:
    """An evolution strategies run: its summary says so or, while it runs, its rows do."""
    summary = _summary(run_dir)
    if "algo" in summary:
        return summary["algo"] == "es"
    return any(row.get("mean_params_return") is not None for row in _rows(run_dir))


def _config(run_dir: str) -> dict[str, Any]:
    """The run's identity without its seed (from the latest checkpoint, else the summary)."""
    summary = _summary(run_dir)
    try:
        from podracer.policy import run_config_of

        config = run_config_of(run_dir)
        config["run"] = {k: v for k, v in config["run"].items() if k not in ("seed", "run_dir")}
        config.pop("checkpoint", None)
        config.pop("distributed", None)
        return config
    except PodracerError:
        return {"label": storage.name(run_dir),
                "arch": summary.get("arch"), "algo": summary.get("algo"), "env": summary.get("env")}


def _run_name(run_dir: str) -> str:
    """The run's own directory name: `runs/latest` is named for the run it links to."""
    return storage.name(run_dir if storage.is_remote(run_dir) else os.path.realpath(run_dir))


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
    return [(f"{labels[key]}: {_run_name(dirs[0])}"
             f"{f' +{len(dirs) - 1} seeds' if len(dirs) > 1 else ''}", dirs)
            for key, dirs in groups.items()]


class Curve(NamedTuple):
    """One line to draw: the metrics.jsonl key on the y axis and its legend entry."""

    y_key: str
    label: str


class Group(NamedTuple):
    """Runs identical but for the seed, and what to draw for them."""

    run_dirs: list[str]
    headline: Curve  # the runs' key result: solid, with the band over seeds
    companion: Curve | None  # context for the headline: thin and dashed, in its colour


def plan(run_dirs: list[str]) -> tuple[str, list[Group]]:
    """The y label and the curves to draw for each group of runs.

    PPO draws `episode_return_mean`, as "mean episode return" on the y axis.
    Evolution strategies draw `mean_params_return` as the headline, since the
    mean parameters are what the run trains and returns; the population's mean
    fitness (`episode_return_mean`, the return of perturbed parameters) is the
    companion. When the axes hold more than one kind of curve, the y label is
    the plain "episode return" and each legend entry says which curve it is, so
    that no curve sits under a label that names another.
    """
    runs = [(label, dirs, is_es(dirs[0])) for label, dirs in group_by_seed(run_dirs)]
    if not any(es for _, _, es in runs):
        return "mean episode return", [Group(dirs, Curve("episode_return_mean", label), None)
                                       for label, dirs, _ in runs]
    groups = []
    for label, dirs, es in runs:
        if es:
            groups.append(Group(dirs, Curve("mean_params_return", f"{label}: return of the mean parameters"),
                                Curve("episode_return_mean", f"{label}: population mean fitness")))
        else:
            groups.append(Group(dirs, Curve("episode_return_mean", f"{label}: mean episode return"), None))
    return "episode return", groups


def _band(curves: list[dict[str, np.ndarray]], x_key: str, y_key: str):
    """Mean, min and max of the curves on a shared grid of `x_key`."""
    end = min(c[x_key][-1] for c in curves)
    start = max(c[x_key][0] for c in curves)
    grid = np.linspace(start, end, 100) if end > start else np.asarray([end])
    ys = np.stack([np.interp(grid, c[x_key], c[y_key]) for c in curves])
    return grid, ys.mean(0), ys.min(0), ys.max(0)


def _settings(run_dir: str, num_agents: int) -> list[tuple[str | None, list[int]]]:
    """(setting, its agents) of a sweep whose summary names them; else (None, every agent)."""
    from podracer import population

    by_setting: dict[str, list[int]] = {}
    if _summary(run_dir).get("pbt"):  # agents change settings as they train: one group
        return [(None, list(range(num_agents)))]
    for agent in _summary(run_dir).get("agents") or []:
        by_setting.setdefault(population.setting_label(agent["settings"]), []).append(agent["agent"])
    if len(by_setting) < 2 or sorted(sum(by_setting.values(), [])) != list(range(num_agents)):
        return [(None, list(range(num_agents)))]
    return list(by_setting.items())


def read_population(run_dir: str, key: str) -> list[dict[str, Any]]:
    """A population run's curves, one dict per setting (`_settings`): its `setting` (None: every
    agent), `agents` [A, rows] of `key` (NaN where none), their `iqm`, its CI `low` and `high`."""
    from podracer import population

    rows = [row for row in _rows(run_dir) if isinstance(row.get("agents"), list)]
    value = lambda v: np.nan if v is None else v
    scores = np.asarray([[value(a.get(key)) for a in row["agents"]] for row in rows], float).T
    x = {"env_steps": np.asarray([row["env_steps"] for row in rows], float),
         "wall_s": np.asarray([row.get("wall_s", np.nan) for row in rows], float)}
    groups = []
    for setting, agents in _settings(run_dir, len(scores)):
        if setting is None:  # the rows' own aggregate, over every agent
            stats = [{"iqm": row.get(f"{key}_iqm"), "iqm_ci": row.get(f"{key}_iqm_ci")} for row in rows]
        else:
            stats = [population.aggregate([None if np.isnan(v) else v for v in column], [0] * len(agents))
                     for column in scores[agents].T]
        ci = [s["iqm_ci"] or [None, None] for s in stats]
        groups.append({**x, "setting": setting, "agents": scores[agents],
                       "iqm": np.asarray([value(s["iqm"]) for s in stats], float),
                       "low": np.asarray([value(c[0]) for c in ci], float),
                       "high": np.asarray([value(c[1]) for c in ci], float)})
    return groups


def _population(axes, run_dir: str, headline: Curve, y_label: str) -> None:
    """Each agent of a population thinly, and the IQM over agents with its 95% bootstrap CI band
    (per setting of a sweep)."""
    for curves in read_population(run_dir, headline.y_key):
        setting = f" {curves['setting']}" if curves["setting"] else ""
        label = f"{headline.label}:{setting} IQM of {len(curves['agents'])} agents, 95% CI"
        color = None
        for ax, x_key, x_label in ((axes[0], "env_steps", "environment steps"),
                                   (axes[1], "wall_s", "wall time (s)")):
            x = curves[x_key]
            (line,) = ax.plot(x, curves["iqm"], linewidth=2, color=color, label=label)
            color = line.get_color()  # the setting's colour on both axes
            ax.fill_between(x, curves["low"], curves["high"], color=color, alpha=0.25)
            for agent in curves["agents"]:
                ax.plot(x, agent, color=color, linewidth=0.5, alpha=0.4)
            ax.set_xlabel(x_label)
            ax.set_ylabel(y_label)
            ax.grid(alpha=0.3)


def read_lineage(run_dir: str) -> dict[str, Any] | None:
    """A PBT run's lineage, None for another run: `env_steps` [rows], `settings` (name -> each agent's
    value [A, rows]) and `events` (every exploit event of its rows, with its `env_steps`)."""
    from podracer.session.population import SETTING

    rows = [row for row in _rows(run_dir) if isinstance(row.get("agents"), list)]
    names = [key[len(SETTING):] for key in (rows[0]["agents"][0] if rows else {}) if key.startswith(SETTING)]
    if not names:
        return None
    return {"env_steps": np.asarray([row["env_steps"] for row in rows], float),
            "settings": {name: np.asarray([[a[SETTING + name] for a in row["agents"]] for row in rows]).T
                         for name in names},
            "events": [{**event, "env_steps": row["env_steps"]} for row in rows for event in row.get("pbt") or ()]}


def _lineage(axes, run_dir: str, lineage: dict[str, Any]) -> None:
    """One panel per swept setting: each agent's value over the run, and each exploit event."""
    x = lineage["env_steps"]
    for ax, (name, values) in zip(axes, lineage["settings"].items()):
        colors = [ax.step(x, agent, where="post", linewidth=1)[0].get_color() for agent in values]
        for event in lineage["events"]:  # at the step of its call: from the donor's value to the new one
            column = int(np.searchsorted(x, event["env_steps"]))
            copied = values[event["from"], max(column - 1, 0)]
            ax.plot([x[column]] * 2, [copied, values[event["to"], column]], linestyle=":", marker=".",
                    markevery=[0], color=colors[event["to"]], linewidth=1)
        if np.all(values > 0) and values.max() > 10 * values.min():
            ax.set_yscale("log")
        ax.set_xlabel("environment steps")
        ax.set_ylabel(name.replace("_", "-"))
        ax.set_title(f"PBT lineage of {len(values)} agents: {_run_name(run_dir)}", fontsize=9)
        ax.grid(alpha=0.3)


def figure(run_dirs: list[str]):
    """The plot as a matplotlib `Figure` (not registered with pyplot, so nothing to close)."""
    from matplotlib.figure import Figure

    y_label, groups = plan(run_dirs)
    profiles = [(run_dir, _summary(run_dir)["profile"]) for run_dir in run_dirs
                if _summary(run_dir).get("profile")]
    lineages = [(run_dir, lineage) for run_dir in run_dirs if (lineage := read_lineage(run_dir))]
    panels = 2 + bool(profiles) + sum(len(lineage["settings"]) for _, lineage in lineages)
    fig = Figure(figsize=(6 * panels, 4.5))
    axes = fig.subplots(1, panels)
    first = 2 + bool(profiles)
    for run_dir, lineage in lineages:
        _lineage(axes[first:], run_dir, lineage)
        first += len(lineage["settings"])
    for group in groups:
        if any(isinstance(row.get("agents"), list) for row in _rows(group.run_dirs[0])):
            for run_dir in group.run_dirs:
                _population(axes, run_dir, group.headline, y_label)
            continue
        headline = [read_curve(d, group.headline.y_key) for d in group.run_dirs]
        companion = [read_curve(d, group.companion.y_key) for d in group.run_dirs] if group.companion else []
        for ax, x_key, x_label in ((axes[0], "env_steps", "environment steps"),
                                   (axes[1], "wall_s", "wall time (s)")):
            grid, mean, low, high = _band(headline, x_key, group.headline.y_key)
            (line,) = ax.plot(grid, mean, label=group.headline.label)
            if len(headline) > 1:
                ax.fill_between(grid, low, high, color=line.get_color(), alpha=0.25)
            if companion:
                grid, mean, _, _ = _band(companion, x_key, group.companion.y_key)
                ax.plot(grid, mean, label=group.companion.label, color=line.get_color(),
                        linestyle="--", linewidth=1, alpha=0.7)
            ax.set_xlabel(x_label)
            ax.set_ylabel(y_label)
            ax.grid(alpha=0.3)
    # Below the curves, never on them: a population's labels (setting, IQM, CI) are long
    # enough that the best place inside the panel still covered its curves and left axis.
    axes[0].legend(fontsize=8, loc="upper left", bbox_to_anchor=(0, -0.14))
    if profiles:
        run_dir, profile = profiles[0]
        rows = profile["operations"][::-1]  # barh draws bottom-up: keep the table's order
        # A row's share is of its own thread's time (`podracer.session.profile`): label each with it.
        names = [f"{row['thread']}: {row['operation']}" if "thread" in row else row["operation"]
                 for row in rows]
        axes[2].barh(names, [100 * row["share"] for row in rows])
        axes[2].tick_params(axis="y", labelsize=7)
        axes[2].set_xlabel("share of its thread's wall time (%)")
        axes[2].set_title(f"time breakdown: {_run_name(run_dir)}")
    fig.tight_layout()
    return fig


def plot(run_dirs: list[str], out: str) -> str:
    """Write the plot of `run_dirs` to the PNG `out`; returns `out`."""
    figure(run_dirs).savefig(out, dpi=100)
    return out


def main(argv: list[str] | None = None, prog: str = "python -m podracer.plot") -> int:
    """`python -m podracer.plot RUN_DIR ...`, also the verb `podracer plot RUN_DIR ...` (`prog`)."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
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
