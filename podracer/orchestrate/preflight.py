"""What can be found wrong before compiling, found before compiling: the dataset paths, a batch too
large for memory.

`--record-dataset` and `--init-from-dataset` are checked here, before the run
directory is taken (`podracer.data.train_hooks.check_data_config`; the run
session checks them again for a run started from Python).

A batch larger than the devices can hold used to be found by XLA's allocator
after compilation, in a 50-line trace. The one array every rollout holds,
its observations ([rollout, environments, obs...] per agent), is a lower bound
on what a run needs; a run whose lower bound already exceeds the memory of its
devices is refused in one line that names the flag.
"""

from __future__ import annotations

import math
import os

import numpy as np

from podracer import population
from podracer.errors import PodracerError
from podracer.orchestrate.spec import RunSpec

GIB = 2**30


def check(configs: RunSpec, main_process: bool = True) -> None:
    """Refuse a run whose dataset paths are wrong or whose rollout cannot fit in memory (other
    settings are checked where they are built). `main_process`: this process records the dataset."""
    data = configs.data
    if data.record_dataset or data.init_from_dataset:
        from podracer.data.train_hooks import check_data_config

        check_data_config(data, writes=main_process)
    needed = rollout_bytes(configs)
    if needed is None:
        return
    available, where = device_memory()
    if needed > available:
        arch = configs.architecture
        raise PodracerError(
            f"--num-envs={arch.num_envs:,} with --rollout-len={arch.rollout_len:,} needs at least "
            f"{needed / GIB:,.1f} GiB for one rollout's observations, more than the {available / GIB:,.1f} "
            f"GiB of {where}; lower --num-envs")


def rollout_bytes(configs: RunSpec) -> int | None:
    """Bytes of one rollout's observations over every agent (None: not a rollout-based run)."""
    run = configs.run
    if run.algo == "es":
        return None
    if run.arch == "anakin":
        from podracer.envs.jax_envs import make_env

        spec = make_env(run.env).spec
    else:
        from podracer.sebulba.envs import env_spec

        spec = env_spec(run.env)
    arch = configs.architecture
    agents = len(population.agents(configs)) if run.arch == "anakin" else 1
    per_step = math.prod(spec.obs_shape) * np.dtype(spec.obs_dtype).itemsize
    return agents * arch.num_envs * arch.rollout_len * per_step


def device_memory() -> tuple[int, str]:
    """Memory of this process's devices in bytes (the host's for CPU devices), and what it is."""
    import jax

    devices = jax.local_devices()
    limits = [(device.memory_stats() or {}).get("bytes_limit") for device in devices]
    if all(limits):
        return sum(limits), f"{len(devices)} {devices[0].platform} device(s)"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's memory"
