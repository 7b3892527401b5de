"""Test session set-up: eight CPU devices, before anything starts JAX's backend."""

import os
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHER = os.path.join(REPO_ROOT, "launch", "tpu.py")
PYTHON = sys.executable
