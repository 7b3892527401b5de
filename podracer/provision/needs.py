"""What a run needs on every worker besides podracer: the extras its flags use, and a py: env's module.

The workers install only what was staged (`podracer.provision.staging`): the
wheel, the lock of the distributions it needs, the launcher. A flag that needs
an optional extra (an Anakin suite, datasets, W&B) would pass the preflight on
a machine that has the extra and then fail on every worker; so would a
`py:MODULE:FUNCTION` environment whose module exists only here.
"""

from __future__ import annotations

import importlib.metadata as metadata
import re
from pathlib import Path
from typing import Sequence

from podracer.errors import PodracerError
from podracer.provision.staging import WORKER_EXTRAS, lock

# Anakin's JAX environment suites (`--env=SUITE:ID`), each an extra of its own name.
SUITE_EXTRAS = ("brax", "jumanji", "craftax", "navix")


def worker_extras(training_flags: Sequence[str]) -> tuple[str, ...]:
    """The extras the workers need for these flags, as the trainer will read them.

    gcs always (the run directory is in a bucket); an Anakin suite's for
    `--env=SUITE:ID` (brax, jumanji, craftax, navix); data for `--record-dataset`
    or `--init-from-dataset`; wandb for `--wandb`. (video is `eval`'s alone:
    no training flag draws frames.)
    """
    from podracer.orchestrate.parse import parse

    configs = parse(list(training_flags)).configs
    extras = list(WORKER_EXTRAS)
    env = configs.run.env
    if env.split(":", 1)[0] in SUITE_EXTRAS and ":" in env:
        extras.append(env.split(":", 1)[0])
    if configs.data.record_dataset or configs.data.init_from_dataset:
        extras.append("data")
    if configs.logging.wandb:
        extras.append("wandb")
    return tuple(extras)


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def env_module_files(env_id: str, root: Path, extras: Sequence[str]) -> dict[str, Path]:
    """The files of a `py:MODULE:FUNCTION` environment's module that the workers need.

    MODULE's top-level module (`my_sims.py`) or package (`my_sims/`, every .py
    file in it) in the working directory `root`, by their names relative to it:
    staged beside the launcher, whose folder is the first entry of the
    workers' `sys.path`. A module that a distribution of the lock for `extras`
    installs needs nothing staged; any other is refused in one line. Other
    ids: nothing.
    """
    if not env_id.startswith("py:"):
        return {}
    top = env_id[len("py:"):].partition(":")[0].split(".")[0]
    package = root / top
    if (package / "__init__.py").is_file():
        return {path.relative_to(root).as_posix(): path for path in sorted(package.rglob("*.py"))
                if "__pycache__" not in path.parts}
    if (root / f"{top}.py").is_file():
        return {f"{top}.py": root / f"{top}.py"}
    locked = {_normal(line.split("==")[0].split("[")[0]) for line in lock(extras)}
    if any(_normal(name) in locked for name in metadata.packages_distributions().get(top, ())):
        return {}
    raise PodracerError(f"--env={env_id}: the workers import {top} from files staged from the "
                        f"working directory, and {root} has no {top}.py or {top}/__init__.py; "
                        f"run from the folder that holds it")
