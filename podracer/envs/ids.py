"""Which library runs an environment id, so that each architecture can refuse the other's by name.

Anakin runs gymnax ids as they are and JAX suites as `SUITE:ID`
(`podracer.envs.suites`); Sebulba runs envpool ids and Gymnasium vector
environments (`podracer.sebulba.envs`).
"""

from __future__ import annotations

import importlib.util
import sys
import types
from typing import NamedTuple


class Suite(NamedTuple):
    module: str  # the adapter, in this package
    library: str  # what it imports
    extra: str  # the pyproject extra that installs it
    example: str  # an --env value


SUITES: dict[str, Suite] = {
    "brax": Suite("brax_env", "brax", "brax", "brax:inverted_pendulum"),
    "jumanji": Suite("jumanji_env", "jumanji", "jumanji", "jumanji:Snake-v1"),
    "craftax": Suite("craftax_env", "craftax", "craftax", "craftax:Craftax-Classic-Symbolic-v1"),
    "navix": Suite("navix_env", "navix", "navix", "navix:Navix-Empty-5x5-v0"),
}

HELP = ("gymnax ids as they are (CartPole-v1); JAX suites as SUITE:ID: "
        + ", ".join(suite.example for suite in SUITES.values()))


def is_suite_id(env_id: str) -> bool:
    return env_id.partition(":")[0] in SUITES


def is_envpool_id(env_id: str) -> bool:
    """Whether Sebulba could run `env_id` (asked only to explain a refusal)."""
    try:
        import envpool
    except ImportError:
        return False
    return env_id in envpool.list_all_envs()


# Imported by gymnax at import time for its `render` methods only; loaded on first use.
_RENDERING_MODULES = ("seaborn", "matplotlib.pyplot")


def import_gymnax():
    """gymnax, without importing its plotting libraries until something draws.

    gymnax imports matplotlib's pyplot and seaborn (and through it pandas and
    scipy) when it is imported, only for its environments' `render` methods:
    about 1.2 of the 1.4 s its import takes (imports run on one core, so no
    machine hides it; 4-5 s of 5.5 on a busy one). Those two modules
    are put in `sys.modules` as stand-ins that import the real module at the
    first attribute asked of them, so rendering still works.
    """
    if "gymnax" not in sys.modules:
        for name in _RENDERING_MODULES:
            if name not in sys.modules:
                _OnFirstUse.install(name)
    import gymnax

    return gymnax


class _OnFirstUse(types.ModuleType):
    """A module that imports the real one at the first attribute it lacks, then forwards to it.

    (`importlib.util.LazyLoader` would load at once on Python 3.11: the import
    system reads every module's `__spec__`, which for it counts as a use.)
    """

    @classmethod
    def install(cls, name: str) -> None:
        try:
            spec = importlib.util.find_spec(name)  # imports a parent package (matplotlib) for real
        except ImportError:
            return
        if spec is None:
            return  # not installed: gymnax's own import says so
        module = cls(name)
        module.__spec__, module.__loader__, module.__file__ = spec, spec.loader, spec.origin
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)

    def __getattr__(self, attr: str):
        if sys.modules.get(self.__name__) is self:
            del sys.modules[self.__name__]
        real = importlib.import_module(self.__name__)
        self.__dict__.update(real.__dict__)
        return getattr(real, attr)


def gymnax_ids() -> list[str]:
    return list(import_gymnax().registered_envs)
