"""Protocol layer: the only module that knows about meshes, axes and collectives.

Every architecture builds its device mesh here and names its axes with the
constants below, so a pure update written with `axis_names=(DATA_AXIS,)` works
unchanged under Anakin (all devices) and Sebulba (learner devices only).
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from podracer.errors import PodracerError

# Data parallelism: environments (Anakin), trajectories (Sebulba learner) and
# population members (ES) are split along this axis.
DATA_AXIS = "data"

# Time-major [T, B, ...] experience is split along B, its second dimension.
TIME_MAJOR_SPEC = P(None, DATA_AXIS)


def make_mesh(devices: Sequence[jax.Device] | None = None, axis: str = DATA_AXIS) -> Mesh:
    """A one-axis mesh over `devices` (default: every device of every process).

    Axes are `Auto` so the compiler is free to place intermediates; explicit
    placement happens through `shard_map` specs.
    """
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise PodracerError("no devices to build a mesh on; check --devices / the JAX platform")
    return Mesh(data_axis_order(devices), (axis,), axis_types=(AxisType.Auto,))


def data_axis_order(devices: Sequence[jax.Device]) -> np.ndarray:
    """`devices` in the order the data axis takes them.

    On several TPU slices joined over the data-centre network (multislice), slice
    by slice, each slice's devices in the order its own interconnect favours, as
    `create_hybrid_device_mesh` lays them out: a gradient average is then reduced
    within each slice first, and only one partial sum per slice crosses the
    slower network. Elsewhere (one slice, CPU and GPU devices, which have no
    `slice_index`), as given.
    """
    slices = {getattr(device, "slice_index", 0) for device in devices}
    if len(slices) == 1 or len(devices) % len(slices):
        return np.asarray(devices)
    try:
        return mesh_utils.create_hybrid_device_mesh((len(devices) // len(slices),),
                                                    (len(slices),), devices)
    except ValueError:
        # Not whole slices (Sebulba's learner devices on each host): they keep process
        # order, which is slice by slice too, as a multislice's processes are numbered.
        return np.asarray(devices)


def process_major(local_devices: Sequence[jax.Device]) -> list[jax.Device]:
    """The devices at the positions of `local_devices` on every process, process by process.

    Every process of a run is started with the same flags, so positions in
    `jax.local_devices()` (Sebulba's `--learner-devices`) name the same role on
    each host; a mesh over the result spans that role's devices of all
    processes. On one process, `local_devices` itself.
    """
    local = jax.local_devices()
    positions = [local.index(device) for device in local_devices]
    # `jax.local_devices()` is `jax.devices()` filtered to one process, in the same order.
    by_process = [[d for d in jax.devices() if d.process_index == p] for p in range(jax.process_count())]
    return [devices[i] for devices in by_process for i in positions]


def run_once_options(mesh: Mesh) -> dict[str, int] | None:
    """XLA options for a program that runs once (a run's initialisation) on `mesh`.

    On CPU: no LLVM optimisation, which halves its compilation (2.2 s to 0.9 s
    of CPU time for Anakin PPO's CartPole initialisation) and cannot pay for
    itself in one call. Other backends compile it as any program.
    """
    return {"xla_backend_optimization_level": 0} if mesh.devices.flat[0].platform == "cpu" else None


def training_options(mesh: Mesh, quick_compile: bool = True) -> dict[str, int] | None:
    """XLA options for Anakin's training programs on `mesh`.

    On CPU with `quick_compile`: LLVM's optimisation level 1 instead of its
    default. Programs that spend their time in library matrix products (YNNPACK)
    and short elementwise fusions ran as fast at level 1 (CartPole MLP with 1 and
    16 agents, brax inverted_pendulum, Breakout-MinAtar's CNN, all within noise),
    while compiling took a fifth to a third less (CartPole, 16 agents: 5.4 s to
    3.6 s). Not for ES (`Agent.quick_cpu_compile`): its members' batched
    matrix-vector products are XLA's own loops, which ran 12-30% slower at
    level 1. Other backends compile as usual.
    """
    quick = quick_compile and mesh.devices.flat[0].platform == "cpu"
    return {"xla_backend_optimization_level": 1} if quick else None


def replicated(mesh: Mesh) -> NamedSharding:
    """Sharding of an array that every device holds whole."""
    return NamedSharding(mesh, P())


def sharded(mesh: Mesh, axis: str = DATA_AXIS) -> NamedSharding:
    """Sharding of an array split along its leading dimension over `axis`."""
    return NamedSharding(mesh, P(axis))


def time_major_sharded(mesh: Mesh, axis: str = DATA_AXIS) -> NamedSharding:
    """Sharding of a time-major [T, B, ...] array split along its batch dimension B."""
    return NamedSharding(mesh, P(None, axis))


def split_evenly(total: int, parts: int, what: str, flag: str) -> int:
    """`total / parts`, or a one-line error telling the user how to fix `flag`."""
    if total <= 0:
        raise PodracerError(f"{flag} must be positive, got {total}")
    if total % parts:
        lower = max(parts, total - total % parts)
        raise PodracerError(
            f"{flag}={total} {what} do not split over {parts} devices; "
            f"use a multiple of {parts} (e.g. {flag}={lower})"
        )
    return total // parts


def pmean(tree, axis_names: Sequence[str]):
    """Mean over the named axes; identity when there are none (single device)."""
    if not axis_names:
        return tree
    return jax.lax.pmean(tree, tuple(axis_names))


def psum(tree, axis_names: Sequence[str]):
    """Sum over the named axes; identity when there are none."""
    if not axis_names:
        return tree
    return jax.lax.psum(tree, tuple(axis_names))


def axis_offset(local_size: int, axis_names: Sequence[str]):
    """Global index of this shard's first element along the data axes."""
    if not axis_names:
        return 0
    index = 0
    for name in axis_names:
        index = index * jax.lax.axis_size(name) + jax.lax.axis_index(name)
    return index * local_size


def vary(tree, axis_names: Sequence[str]):
    """Mark replicated values as per-device before differentiating through them.

    Inside `shard_map`, the gradient with respect to a replicated (axis-invariant)
    input is summed over the axis implicitly. Casting parameters to 'varying'
    first keeps each device's gradient its own, so an explicit `pmean` averages
    them: the same update on one device and on many.
    """
    if not axis_names:
        return tree

    def cast(x):
        missing = tuple(a for a in axis_names if a not in jax.typeof(x).manual_axis_type.varying)
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)


def all_gather(local: jax.Array, axis_names: Sequence[str]) -> jax.Array:
    """Concatenate every device's `[n, ...]` slice, in device order, on every device.

    The result is typed as the same on all devices (`to="invarying"`), so it can
    leave `shard_map` with a replicated spec; the identity without axes.
    """
    if not axis_names:
        return local
    return jax.lax.all_gather(local, tuple(axis_names), tiled=True, to="invarying")


def is_main_process() -> bool:
    """Process 0 logs and writes run files; every process computes."""
    return jax.process_index() == 0


def to_host(tree):
    """Bring a pytree of (possibly global, multi-process) arrays to host numpy.

    Replicated arrays are read from a local copy; arrays sharded over other
    processes' devices are gathered from every process.
    """
    from jax.experimental import multihost_utils

    def fetch(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return np.asarray(x)
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(fetch, tree)


def from_host(tree, sharding: NamedSharding):
    """Global arrays with `sharding` from host (numpy) arrays, or arrays on one of this process's devices.

    Along a dimension that `sharding` splits over several processes, each process
    passes its own part and the global array joins the parts in process order
    (the order of the mesh's devices); a dimension it does not split must be the
    same on every process. On one process, `jax.device_put`. (A `device_put`
    onto devices of several processes is not the same: it expects the whole
    array on every process.)
    """
    return jax.make_array_from_process_local_data(sharding, tree)


def local_replica(tree):
    """This process's copy of a replicated pytree, each leaf on one of its own devices.

    A replicated global array cannot be copied to a device as a whole (most of
    its copies belong to other processes); any local copy is the same value.
    """
    return jax.tree.map(lambda x: x.addressable_data(0) if isinstance(x, jax.Array) else x, tree)


def any_process(flag: bool) -> bool:
    """True on every process if `flag` is true on any: a decision all processes share.

    A signal reaches processes at slightly different times; deciding to stop
    together keeps their collectives in step.
    """
    if jax.process_count() == 1:
        return bool(flag)
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.asarray([flag], np.int32))))


def from_main_process(value: int | None) -> int | None:
    """Process 0's `value` (an int or None) on every process: one process decides for all.

    Every process calls it; only process 0's argument counts, so a fact that
    process 0 alone looks up (the others may pass None) is the same everywhere.
    """
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    # A flag byte (0: None), then the int64's bytes: without jax_enable_x64 an
    # int64 array would travel as int32.
    code = np.zeros(9, np.uint8)
    if value is not None:
        code[0], code[1:] = 1, np.frombuffer(np.int64(value).tobytes(), np.uint8)
    agreed = np.asarray(multihost_utils.broadcast_one_to_all(code))
    return int(np.frombuffer(agreed[1:].tobytes(), np.int64)[0]) if agreed[0] else None


def fingerprint(tree) -> str:
    """A hash of every byte of a (replicated) pytree, to compare across processes."""
    import hashlib

    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(to_host(tree)):
        digest.update(np.ascontiguousarray(leaf).tobytes())
    return digest.hexdigest()[:16]


def process_fingerprints(tree) -> list[str]:
    """Every process's `fingerprint(tree)`, in process order."""
    mine = fingerprint(tree)
    if jax.process_count() == 1:
        return [mine]
    from jax.experimental import multihost_utils

    codes = multihost_utils.process_allgather(np.frombuffer(bytes.fromhex(mine), np.uint8))
    return [bytes(row).hex() for row in np.asarray(codes).reshape(jax.process_count(), -1)]
