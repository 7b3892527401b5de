"""JAX environment suites for Anakin, named `--env=SUITE:ID`; gymnax ids stay bare.

Each suite is an optional extra (`pip install -e ".[brax]"`); naming a suite
whose library is missing is a one-line error that says which extra to install.
Every adapter follows the Anakin protocol of `podracer.envs.jax_envs` (auto-reset,
termination and truncation apart, episode statistics) through
`podracer.envs.suites.base.SuiteEnv`.
"""

from __future__ import annotations

import contextlib
import importlib
import io

from podracer.envs.ids import SUITES
from podracer.errors import PodracerError


def make_suite_env(env_id: str):
    """The Anakin environment for `SUITE:ID`."""
    suite_name, _, name = env_id.partition(":")
    suite = SUITES[suite_name]
    try:
        # brax's import of MuJoCo prints on stdout that its optional GPU backend
        # (warp) is missing; a run's output is the first thing a user reads.
        with contextlib.redirect_stdout(io.StringIO()):
            importlib.import_module(suite.library)
    except ImportError:
        raise PodracerError(f"--env={env_id} needs {suite.library}: pip install -e \".[{suite.extra}]\" "
                            f"(or pip install 'podracer-rl[{suite.extra}]')") from None
    module = importlib.import_module(f"podracer.envs.suites.{suite.module}")
    return module.make(env_id, name)
