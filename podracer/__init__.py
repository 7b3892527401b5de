"""podracer: Anakin and Sebulba reinforcement learning on JAX.

Subpackages are imported on demand (`from podracer import ppo`) so that using
one algorithm never pulls in an environment library it does not need.
"""

from podracer.version import __version__

__all__ = ["__version__", "load_policy", "train"]


def train(**flags) -> dict:
    """Train with the launcher's flags as keywords (see `python launch/tpu.py --help`)."""
    from podracer.orchestrate.cli import train as _train

    return _train(**flags)


def load_policy(run_dir: str, deterministic: bool = False):
    """A pure `act(obs, key) -> actions` from a run directory's latest checkpoint."""
    from podracer.policy import load_policy as _load_policy

    return _load_policy(run_dir, deterministic)
