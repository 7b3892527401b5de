"""The `podracer` command (`python launch/tpu.py`): one entry point, three kinds of verb.

- `up`, `status`, `logs`, `attach`, `down`, `list`, or any command with `--tpu`: the TPU
  provisioner (`podracer.provision.cli`), which gets a slice and runs the
  training flags on it;
- `eval`: a trained policy evaluated (`podracer.evaluate`);
- `plot`: a run's learning curves drawn (`podracer.plot`);
- anything else: a training run on this machine (`podracer.orchestrate.cli`).

It sits above all three, so that none of them imports another's command.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
from typing import Sequence


def is_provision(argv: Sequence[str]) -> bool:
    """A TPU verb (`up`, `attach`, ...), or a run on a slice (`--tpu`): the provisioner's."""
    from podracer.provision.cli import VERBS

    return bool(argv) and argv[0] in VERBS or any(
        arg == "--tpu" or arg.startswith("--tpu=") for arg in argv)


def program_name(argv0: str) -> str:
    """How the user called podracer: `podracer` (the console script) or `python launch/tpu.py`."""
    name = os.path.basename(argv0)
    return "podracer" if name in ("podracer", "podracer.exe") else "python launch/tpu.py"


def main(argv: Sequence[str] | None = None) -> int:
    """Exit status 0, or 2 with one line on stderr for a user error.

    Without `argv`, the process's own command line (a training run's start-up
    is then counted from the process's start), and the process ends when this
    returns: its last act is `gc.freeze()`, so that the interpreter's
    collections at exit skip the objects alive then (JAX's), all freed with the
    process anyway: 0.47 s of the 3.6 CPU-seconds of a short run with a warm
    compilation cache. Every file podracer wrote is closed by then.
    """
    status = _dispatch(sys.argv[1:] if argv is None else list(argv), argv)
    if argv is None:
        gc.freeze()
    return status


def _dispatch(given: list[str], argv: Sequence[str] | None) -> int:
    if is_provision(given):
        from podracer.provision.cli import main as provision_main

        return provision_main(given, program_name(sys.argv[0]) if argv is None else "python launch/tpu.py")
    if given[:1] == ["eval"]:
        from podracer.evaluate import main as evaluate_main
        from podracer.orchestrate.cli import exit_status

        logging.getLogger("absl").setLevel(logging.CRITICAL)
        return exit_status(lambda: evaluate_main(given[1:]))
    if given[:1] == ["plot"]:
        from podracer.orchestrate.cli import exit_status
        from podracer.plot import main as plot_main

        return exit_status(lambda: plot_main(given[1:], prog="podracer plot"))
    from podracer.orchestrate.cli import main as train_main

    return train_main(argv)
