"""Test session set-up: eight CPU devices, before anything starts JAX's backend."""

import atexit
import os
import shutil
import sys
import tempfile

# One compilation cache per test process (each pytest-xdist worker its own),
# inherited by every launcher subprocess: the many short runs of one program
# compile it once, no process reads an entry that another test process is
# writing, and nothing reaches the user's own cache (~/.cache/podracer/jax).
# JAX's own variable points this process's direct calls of the drivers there too.
_CACHE = tempfile.mkdtemp(prefix="podracer-jax-cache-")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
os.environ["PODRACER_COMPILE_CACHE"] = os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHER = os.path.join(REPO_ROOT, "launch", "tpu.py")
PYTHON = sys.executable
