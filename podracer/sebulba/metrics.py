"""Sebulba's log rows: learner metrics, episodes, policy lag and the time breakdown per interval."""

from __future__ import annotations

import time

import numpy as np

from podracer.session.logger import RunLogger
from podracer.sebulba.actor import Shipment
from podracer.session.timing import Timings, as_metrics


class IntervalLog:
    """Called after every update; writes one metrics.jsonl row every `log_every` updates.

    Policy lag of a trajectory = updates applied to the learner's parameters
    since the parameters that acted (0: on-policy). Rows carry the lag's mean
    and max over the interval, the newest policy version seen, and the
    cumulative time breakdown. A run resumed after `first_update` updates counts
    on from there; its steps/s count only the updates made since.
    """

    def __init__(self, logger: RunLogger, timings: Timings, log_every: int, steps_per_update: int,
                 num_updates: int, first_update: int = 0):
        self.logger, self.timings = logger, timings
        self.log_every, self.steps_per_update, self.num_updates = log_every, steps_per_update, num_updates
        self.first_update = first_update
        self.start = time.perf_counter()
        self.last_return = None
        self.lags: list[int] = []  # every trajectory's lag, over the run
        self.updates = first_update
        self.newest_version = first_update
        self.dropped = self.resets = 0
        self._reset_interval()

    def _reset_interval(self):
        self.metrics: list[dict] = []
        self.returns: list[np.ndarray] = []
        self.lengths: list[np.ndarray] = []
        self.interval_lags: list[int] = []

    def __call__(self, update: int, trajectories: list[Shipment], metrics: dict) -> None:
        with self.timings.measure("logging"):
            self._record(update, trajectories, metrics)

    def _record(self, update: int, trajectories: list[Shipment], metrics: dict) -> None:
        # Update u (from 0) changes parameters that have had u updates.
        lags = [update - t.policy_version for t in trajectories]
        self.lags += lags
        self.interval_lags += lags
        self.newest_version = max(t.policy_version for t in trajectories)
        self.updates = update + 1
        self.metrics.append(metrics)
        self.returns += [t.episode_returns for t in trajectories]
        self.lengths += [t.episode_lengths for t in trajectories]
        self.dropped += sum(t.dropped_steps for t in trajectories)
        self.resets += sum(t.reset_steps for t in trajectories)
        if self.updates % self.log_every and self.updates < self.num_updates:
            return
        returns, lengths = np.concatenate(self.returns), np.concatenate(self.lengths)
        env_steps = self.updates * self.steps_per_update
        row = {name: float(np.mean([m[name] for m in self.metrics])) for name in self.metrics[0]}
        row.update(
            env_steps=env_steps,
            sps=(self.updates - self.first_update) * self.steps_per_update / (time.perf_counter() - self.start),
            episode_return_mean=float(returns.mean()) if returns.size else None,
            episode_length_mean=float(lengths.mean()) if lengths.size else None,
            episodes=int(returns.size),
            policy_lag_mean=float(np.mean(self.interval_lags)),
            policy_lag_max=int(np.max(self.interval_lags)),
            policy_version=self.newest_version,
            updates=self.updates,
            **as_metrics(self.timings.totals()))
        if returns.size:
            self.last_return = row["episode_return_mean"]
        self.logger.log(row)
        self._reset_interval()

    def run_summary(self) -> dict:
        """Run-wide lag and skipped-step counts, for the summary."""
        return {
            "policy_lag_mean": float(np.mean(self.lags)) if self.lags else None,
            "policy_lag_max": int(np.max(self.lags)) if self.lags else None,
            "dropped_steps": self.dropped,
            "reset_steps": self.resets,
        }
