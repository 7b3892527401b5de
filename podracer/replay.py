"""A replay buffer kept in an agent's state: flashbax's item buffer, the same on every device.

An off-policy agent (DQN, SAC) keeps its buffer in the state the architecture
carries, checkpoints and resumes (`podracer.agent`): `learn` adds the
rollout it is given, then samples from the buffer. Under `shard_map` each
device steps only its slice of the environments, so a rollout is first
gathered over the mesh axes (`gather_rollout`): every device adds the same
global rows, in environment order, and its buffer stays replicated like the
parameters. A minibatch is then drawn with the replicated key (the same rows
everywhere) and each device computes the gradient of its share of it
(`device_share`), averaged with `pmean`: the update of one device on the whole
minibatch, split, so 1 and 8 devices train the same agent.

flashbax (InstaDeep) is used as it is: its item buffer is a pytree of arrays
with pure `add` and `sample`, which is what a jitted, vmapped, checkpointed
state needs.
"""

from __future__ import annotations

from typing import Any, Sequence

import flashbax
import jax
import jax.numpy as jnp

from podracer.errors import PodracerError
from podracer.protocol import parallel


def capacity_problem(capacity: int, batch_size: int, min_size: int) -> str | None:
    """Why a buffer of `capacity` could never serve a batch of `batch_size` after `min_size` transitions, or None."""
    if capacity < batch_size:
        return (f"--buffer-size={capacity} is smaller than one batch (--batch-size={batch_size}); "
                f"raise --buffer-size or lower --batch-size")
    if min_size > capacity:
        return (f"--learning-starts={min_size} transitions never fit in --buffer-size={capacity}; "
                f"lower --learning-starts or raise --buffer-size")
    return None


def make_buffer(capacity: int, batch_size: int, min_size: int):
    """flashbax's uniform item buffer of `capacity` transitions, sampling `batch_size` once `min_size` are in.

    Refuses, in one line, a buffer that could never fill a batch (`capacity_problem`).
    """
    problem = capacity_problem(capacity, batch_size, min_size)
    if problem:
        raise PodracerError(problem)
    return flashbax.make_item_buffer(max_length=capacity, min_length=max(min_size, batch_size),
                                     sample_batch_size=batch_size, add_batches=True)


def gather_rollout(rows: Any, axis_names: Sequence[str]) -> Any:
    """Time-major rows [T, B_local, ...] of this device as the global [T * B, ...] items, in environment order."""
    if axis_names:
        # Typed as the same on every device (it is): the buffer it fills is replicated state.
        rows = jax.tree.map(lambda x: jax.lax.all_gather(x, tuple(axis_names), axis=1, tiled=True,
                                                         to="invarying"), rows)
    return jax.tree.map(lambda x: x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:]), rows)


def device_share(batch: Any, axis_names: Sequence[str]) -> Any:
    """This device's contiguous share [N / D, ...] of a replicated batch [N, ...] (all of it on one device)."""
    if not axis_names:
        return batch
    num_devices = jax.lax.psum(1, tuple(axis_names))
    index = parallel.axis_offset(1, axis_names)

    def share(x):
        size = x.shape[0] // num_devices
        return jax.lax.dynamic_slice_in_dim(x, index * size, size)

    return jax.tree.map(share, batch)


def share_problem(batch_size: int, num_devices: int) -> str | None:
    """Why a minibatch of `batch_size` cannot be split over `num_devices`, or None."""
    if batch_size % num_devices:
        return (f"--batch-size={batch_size} does not split over {num_devices} devices; "
                f"make it a multiple of {num_devices}")
    return None


def ready(buffer, state) -> jax.Array:
    """Whether the buffer holds enough transitions to learn from (a traced bool)."""
    return jnp.asarray(buffer.can_sample(state))
