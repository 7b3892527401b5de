"""The meaningful range of each numeric setting, declared once, next to its field.

    gamma: float = bounded(0.99, UNIT)  # with its docstring below, as every field

    def __post_init__(self):
        check_bounds(self)

`check_bounds` refuses a value outside its range with one line naming the flag,
the range and the value; the command line shows the range in `--help`. It is
also where every number of every config is refused when the program cannot
use it, bounded or not: a float that is NaN or infinite (no setting here has a
meaning for either), an integer past what a 64-bit integer holds. Checks
that relate several fields (a population that splits over devices) stay in the
config's own `__post_init__` or where the sizes are derived.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple


class Bound(NamedTuple):
    """low <= value <= high (`low_open`: low < value); None leaves that side open."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False

    def holds(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or value <= self.high

    def describe(self) -> str:
        if self.low is not None and self.high is not None:
            return f"in {'(' if self.low_open else '['}{_number(self.low)}, {_number(self.high)}]"
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {_number(self.low)}"
        return f"<= {_number(self.high)}"


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


POSITIVE = Bound(0, low_open=True)
NON_NEGATIVE = Bound(0)
UNIT = Bound(0, 1)  # discounts, lambdas, fractions
# JAX keys hold 32 bits of a seed (without jax_enable_x64): 5 and 2**32 + 5 would be one run.
SEED = Bound(0, 2**32 - 1)
INT64_MAX = 2**63 - 1


def bounded(default: Any, bound: Bound) -> Any:
    """A dataclass field whose value (each element, for a tuple) must lie in `bound`."""
    return dataclasses.field(default=default, metadata={"bound": bound})


def bound_of(field: dataclasses.Field) -> Bound | None:
    return field.metadata.get("bound")


def check_bounds(config: Any) -> None:
    """Raise ValueError for the first field of `config` outside its declared range, or any
    number the program cannot use (`check_number`)."""
    for field in dataclasses.fields(config):
        bound = bound_of(field)
        value = getattr(config, field.name)
        values = value if isinstance(value, tuple) else (value,)
        flag = "--" + field.name.replace("_", "-")
        for element in values:
            if bound is not None and not bound.holds(element):
                raise ValueError(f"{flag} must be {bound.describe()}, got {_shown(value)}")
            check_number(flag, element, value)


def check_number(flag: str, element: Any, value: Any = None) -> None:
    """Refuse a NaN or infinite float, or an integer beyond 64 bits, given as `flag`."""
    shown = _shown(element if value is None else value)
    if isinstance(element, float) and not math.isfinite(element):
        raise ValueError(f"{flag} must be a finite number, got {shown}")
    if isinstance(element, int) and not isinstance(element, bool) and abs(element) > INT64_MAX:
        raise ValueError(f"{flag} must be at most {INT64_MAX:,} in size (a 64-bit integer), got {shown}")


def _shown(value: Any) -> str:
    return " ".join(map(str, value)) if isinstance(value, tuple) else str(value)
