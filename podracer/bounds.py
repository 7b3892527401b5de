"""The meaningful range of each numeric setting, declared once, next to its field.

    gamma: float = bounded(0.99, UNIT)  # with its docstring below, as every field

    def __post_init__(self):
        check_bounds(self)

`check_bounds` refuses a value outside its range with one line naming the flag,
the range and the value; the command line shows the range in `--help`. Checks
that relate several fields (a population that splits over devices) stay in the
config's own `__post_init__` or where the sizes are derived.
"""

from __future__ import annotations

import dataclasses
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
            return f"in [{self.low:g}, {self.high:g}]"
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        return f"<= {self.high:g}"


POSITIVE = Bound(0, low_open=True)
NON_NEGATIVE = Bound(0)
UNIT = Bound(0, 1)  # discounts, lambdas, fractions


def bounded(default: Any, bound: Bound) -> Any:
    """A dataclass field whose value (each element, for a tuple) must lie in `bound`."""
    return dataclasses.field(default=default, metadata={"bound": bound})


def bound_of(field: dataclasses.Field) -> Bound | None:
    return field.metadata.get("bound")


def check_bounds(config: Any) -> None:
    """Raise ValueError for the first field of `config` outside its declared range."""
    for field in dataclasses.fields(config):
        bound = bound_of(field)
        if bound is None:
            continue
        value = getattr(config, field.name)
        values = value if isinstance(value, tuple) else (value,)
        for element in values:
            if not bound.holds(element):
                flag = "--" + field.name.replace("_", "-")
                raise ValueError(f"{flag} must be {bound.describe()}, got {_shown(value)}")


def _shown(value: Any) -> str:
    return " ".join(map(str, value)) if isinstance(value, tuple) else str(value)
