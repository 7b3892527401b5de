"""Test session set-up: eight CPU devices, before anything starts JAX's backend."""

import os
import sys
import tempfile

# One compilation cache for the whole session, inherited by every launcher
# subprocess: the many short runs of the same program compile it once.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="podracer-jax-cache-"))

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHER = os.path.join(REPO_ROOT, "launch", "tpu.py")
PYTHON = sys.executable
