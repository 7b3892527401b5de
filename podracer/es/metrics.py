"""ES metrics on the host: one call's or interval's stacked strategy metrics as one log row."""

from __future__ import annotations

import numpy as np

from podracer.protocol import parallel

# What the NaN guard tells a user whose ES run diverged.
ES_FIX = "lower --es-lr or --sigma"

def es_row(metrics) -> dict:
    """One call's ES metrics (stacked over its generations) as one log row, and whether all are finite."""
    metrics = parallel.to_host(metrics)
    finite = bool(np.all(metrics.pop("params_finite", True))) and all(
        np.all(np.isfinite(value)) for value in metrics.values())
    row = {"mean_params_return": float(metrics.pop("mean_params_return"))}
    row["episode_return_mean"] = float(np.mean(metrics["fitness_mean"]))
    row["episode_return_max"] = float(np.max(metrics.pop("fitness_max")))
    row["episode_return_min"] = float(np.min(metrics.pop("fitness_min")))
    row.update({key: float(np.mean(value)) for key, value in metrics.items()})
    row["finite"] = finite
    return row
