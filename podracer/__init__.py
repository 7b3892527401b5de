"""podracer: Anakin and Sebulba reinforcement learning on JAX.

Subpackages are imported on demand (`from podracer import ppo`) so that using
one algorithm never pulls in an environment library it does not need.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
