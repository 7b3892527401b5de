"""A population's host side, once for every Anakin pair: per-agent rows, aggregates, summary keys.

A pair reduces one call's metrics to one row per agent (the same keys a run of
one agent logs); `PopulationLog.row` turns them into the row the session logs:
the mean over agents under every usual key (so the progress line, the NaN
guard and the plots read it as before), the score's IQM and 95% stratified
bootstrap CI, and `agents`, the per-agent rows (TensorBoard gets one series
per agent from it). With `--pbt`, the per-agent rows hold each agent's settings
(`setting/NAME`) and a row whose call ranked the agents lists its exploit
events under `pbt` (`podracer.pbt`). `summary()` gives the summary's `agents`,
`iqm`, `iqm_ci` and `settings_ranked` (the final table's rows: settings as
each agent started), and `pbt` (every event and each agent's final settings).
"""

from __future__ import annotations

import math
from typing import Any

from podracer import population as pop

SETTING = "setting/"  # an agent row's key prefix for its settings under PBT


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class PopulationLog:
    """Tracks each agent's score (`score_key` of its rows) across a run's rows."""

    def __init__(self, members: list[pop.Agent], score_key: str = "episode_return_mean"):
        self.members = members
        self.score_key = score_key
        settings = [pop.setting_label(m.settings) for m in members]
        self.strata = [settings.index(label) for label in settings]
        self.last: list[float | None] = [None] * len(members)
        self.best: list[float | None] = [None] * len(members)
        self.settings: list[dict[str, float]] = [dict(m.settings) for m in members]  # as they are now
        self.events: list[dict] = []  # PBT's exploit events
        self.pbt = False

    def restore(self, rows: list[dict]) -> None:
        """Scores from the rows a resumed run keeps (`metrics.jsonl` up to its checkpoint)."""
        for row in rows:
            if isinstance(row.get("agents"), list):
                self._track(row["agents"], row.get("pbt") or [])

    def _track(self, agents: list[dict], events: list[dict]) -> None:
        self.events += events
        for i, agent in enumerate(agents):
            settings = {key[len(SETTING):]: value for key, value in agent.items() if key.startswith(SETTING)}
            if settings:
                self.pbt = True
                self.settings[i] = settings
            score = agent.get(self.score_key)
            if _number(score):
                self.last[i] = score
                self.best[i] = score if self.best[i] is None else max(self.best[i], score)

    def row(self, agents: list[dict], events: list[dict] = ()) -> dict[str, Any]:
        """The logged row: means over agents, the score's aggregate, the per-agent rows, PBT's events."""
        self._track(agents, list(events))
        row: dict[str, Any] = {}
        for key in agents[0]:
            if key.startswith(SETTING):  # each agent's own; a mean of settings means nothing
                continue
            values = [a[key] for a in agents if _number(a.get(key))]
            if isinstance(agents[0][key], bool):
                row[key] = all(a[key] for a in agents)
            elif key == "episodes":
                row[key] = int(sum(values))
            else:
                row[key] = sum(values) / len(values) if values else None
        stats = pop.aggregate([a.get(self.score_key) for a in agents], self.strata)
        row[f"{self.score_key}_iqm"] = stats["iqm"]
        row[f"{self.score_key}_iqm_ci"] = stats["iqm_ci"]
        row["agents"] = [{k: v for k, v in a.items() if k != "finite"} for a in agents]
        if events:
            row["pbt"] = list(events)
        return row

    def summary(self) -> dict[str, Any]:
        """`agents` (seed, settings, final and best score each), the aggregate and the ranking."""
        stats = pop.aggregate(self.last, self.strata)
        agents = [{"agent": m.index, "seed": m.seed, "settings": m.settings,
                   self.score_key: self.last[m.index], f"best_{self.score_key}": self.best[m.index]}
                  for m in self.members]
        return {"num_agents": len(self.members), "agents": agents,
                "iqm": stats["iqm"], "iqm_ci": stats["iqm_ci"], "agents_mean": stats["mean"],
                "score_key": self.score_key,
                "settings_ranked": pop.ranked_settings(self.members, self.last),
                **({"pbt": {"events": self.events, "final_settings": self.settings}} if self.pbt else {})}
