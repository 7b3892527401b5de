"""Sampled sweeps: `--sweep lr=loguniform:1e-4:1e-2 --num-samples=N` draws N settings instead of a grid.

A `--sweep` value is either a list (`V1,V2,...`) or a distribution:
`uniform:LOW:HIGH`, `loguniform:LOW:HIGH` (uniform in log space, LOW > 0) or
`choice:A,B,C`. With `--num-samples=N` every sweep is drawn from (a list as a
choice among its values), N settings, in numpy from `--seed`: the same command
draws the same settings. Population-based training resamples a setting from
the same space (`podracer.pbt`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from podracer.errors import PodracerError

KINDS = ("uniform", "loguniform", "choice")


class Space(NamedTuple):
    """What one swept setting's values are drawn from: `choice` among `values` (`list`: a plain
    list, which a grid crosses), or `uniform` or `loguniform` between `values[0]` and `values[1]`."""

    kind: str
    values: tuple[float, ...]

    def draw(self, rng: np.random.Generator) -> float:
        if self.kind in ("list", "choice"):
            return self.values[int(rng.integers(len(self.values)))]
        low, high = self.values
        if self.kind == "uniform":
            return float(rng.uniform(low, high))
        return float(math.exp(rng.uniform(math.log(low), math.log(high))))


def split_kind(flag: str, text: str) -> tuple[str | None, str]:
    """(`uniform`, `loguniform`, `choice` or None for a plain list, the rest of the value)."""
    kind, sep, rest = text.partition(":")
    kind = kind.strip()
    if not sep:
        return None, text
    if kind not in KINDS:
        raise PodracerError(f"--sweep {flag}: {kind!r} is not a distribution; use V1,V2,... or "
                            f"uniform:LOW:HIGH, loguniform:LOW:HIGH, choice:A,B,C")
    return kind, rest


def space_of(flag: str, kind: str | None, values: list[float]) -> Space:
    """A parsed `--sweep` value's space, its distribution checked: one-line errors."""
    if kind in (None, "choice"):
        return Space(kind or "list", tuple(values))
    if len(values) != 2:
        raise PodracerError(f"--sweep {flag}={kind}:LOW:HIGH takes two numbers, got {len(values)}")
    low, high = values
    if low >= high:
        raise PodracerError(f"--sweep {flag}={kind}:{low:g}:{high:g} needs LOW < HIGH; swap or widen them")
    if kind == "loguniform" and low <= 0:
        raise PodracerError(f"--sweep {flag}=loguniform:{low:g}:{high:g} needs LOW > 0 (it draws in log "
                            f"space); raise LOW or use uniform:")
    return Space(kind, (low, high))


def draw_settings(spaces: dict[str, Space], num_samples: int, seed: int) -> list[dict[str, float]]:
    """`num_samples` settings, each sweep drawn in turn from its space, from `seed` (reproducible)."""
    rng = np.random.default_rng(seed)
    return [{name: space.draw(rng) for name, space in spaces.items()} for _ in range(num_samples)]
