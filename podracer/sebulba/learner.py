"""The learner: Anakin's pure update (PPO's or IMPALA's) under `jit(shard_map)` over the learner devices only."""

from __future__ import annotations

import math
import queue
import threading
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, PartitionSpec as P

from podracer.protocol import parallel
from podracer.ppo import PPOConfig
from podracer.ppo import make_update as ppo_make_update
from podracer.sebulba.actor import Trajectory
from podracer.sebulba.control import Control
from podracer.sebulba.params import ParamsStore
from podracer.session.timing import Timings
from podracer.types import TrainState, Transition


def make_learner_step(apply_fn: Callable, optimizer: optax.GradientTransformation,
                      ppo_config: PPOConfig, mesh: Mesh,
                      make_update: Callable = ppo_make_update) -> Callable:
    """Jitted `step(state, batches, bootstrap_values, key) -> (state, metrics)`.

    `batches` is a tuple with one time-major Transition per actor thread, each
    split along its batch axis over `mesh` (`parallel.time_major_sharded`), and
    `bootstrap_values` the matching tuple of [N] arrays (`parallel.sharded`).
    Every learner device joins its shards of all of them into one local batch
    and runs `make_update`'s update (PPO's by default; `podracer.vtrace.make_update`
    with an `ImpalaConfig`), which averages gradients over the mesh with
    `lax.pmean`. `state` is replicated over the mesh. The metrics include
    `params_finite` (1.0 when every new parameter is finite) for the NaN guard.
    """
    update = make_update(apply_fn, optimizer, ppo_config, axis_names=(parallel.DATA_AXIS,))

    def step(state: TrainState, batches: tuple[Transition, ...], bootstrap_values, key):
        batch = jax.tree.map(lambda *parts: jnp.concatenate(parts, axis=1), *batches)
        state, metrics = update(state, batch, jnp.concatenate(bootstrap_values), key)
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(state.params)]))
        return state, {**metrics, "params_finite": finite.astype(jnp.float32)}

    sharded = jax.shard_map(
        step, mesh=mesh,
        in_specs=(P(), parallel.TIME_MAJOR_SPEC, P(parallel.DATA_AXIS), P()),
        out_specs=(P(), P()))
    return jax.jit(sharded)


def trajectory_shapes(example: Transition, num_envs: int, mesh: Mesh) -> tuple[Transition, jax.ShapeDtypeStruct]:
    """Abstract (batch, bootstrap value) of one actor thread's trajectory, for ahead-of-time compiling.

    `example` is any Transition with the right per-row shapes ([T, ...] leaves).
    """
    batch_sharding = parallel.time_major_sharded(mesh)
    batch = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((x.shape[0], num_envs, *x.shape[1:]), x.dtype, sharding=batch_sharding),
        example)
    bootstrap = jax.ShapeDtypeStruct((num_envs,), jnp.float32, sharding=parallel.sharded(mesh))
    return batch, bootstrap


def get_until_stopped(source: queue.Queue, stop: threading.Event, poll_s: float = 0.05,
                      interrupted: Callable[[], bool] = lambda: False):
    """The next item of `source`, or None once `stop` is set or `interrupted()`."""
    while not stop.is_set() and not interrupted():
        try:
            return source.get(timeout=poll_s)
        except queue.Empty:
            continue
    return None


def take_one_each(sources: Sequence[queue.Queue], control: Control, timings: Timings,
                  interrupted: Callable[[], bool] = lambda: False) -> list | None:
    """One item from every actor queue, in actor order; None once stopped or `interrupted()`."""
    items = []
    for source in sources:
        with timings.measure("learner_queue_wait"):
            item = get_until_stopped(source, control.stop, interrupted=interrupted)
        if item is None:
            return None
        items.append(item)
    return items


class Learning(NamedTuple):
    """What a learner thread runs with: one record rather than a dozen arguments.

    `save(updates_done, state)` runs every `save_every` updates (0: never
    periodically) and when the learner ends or is interrupted, unless nothing
    changed since the last save. `guard(finite, update)` is the NaN guard (the
    run session's): it raises before a non-finite state is published or saved.
    """

    step_fn: Callable  # compiled `make_learner_step`
    sources: Sequence[queue.Queue]  # one per actor thread, in actor order
    store: ParamsStore
    num_updates: int
    key: jax.Array  # update u uses fold_in(key, u)
    control: Control
    timings: Timings
    on_update: Callable[[int, list[Trajectory], dict], None]
    first_update: int = 0
    save: Callable[[int, TrainState], None] | None = None
    save_every: int = 0
    interrupted: Callable[[], bool] = lambda: False
    guard: Callable[[bool, int], None] = lambda finite, update: None


def run_learner(learning: Learning, state: TrainState) -> TrainState:
    """Take one trajectory from each actor queue, update, publish; until `num_updates` updates.

    The update key of update u is `fold_in(key, u)`, so a run's updates do not
    depend on timing, and a resumed run (`first_update` > 0) continues the
    sequence. `on_update(u, trajectories, metrics)` sees each update's inputs
    and host-side metrics. Returns the last state: early if `interrupted()`
    (a signal: saved first) or if `control.stop` is set (a failure elsewhere:
    nothing is saved).

    On several processes every learner runs this loop, and each update is one
    program over all their devices: so every update starts by deciding
    together whether to stop (`parallel.any_process`), and all of them stop,
    and save, after the same update.
    """
    (step_fn, sources, store, num_updates, key, control, timings, on_update, first_update, save,
     save_every, interrupted, guard) = learning
    saved = done = first_update
    for update in range(first_update, num_updates):
        trajectories = take_one_each(sources, control, timings, interrupted)
        if control.stop.is_set():
            return state
        if parallel.any_process(interrupted()):
            break
        with timings.measure("learner_update"):
            state, metrics = step_fn(state, tuple(t.batch for t in trajectories),
                                     tuple(t.bootstrap_value for t in trajectories),
                                     jax.random.fold_in(key, update))
            metrics = {name: float(value) for name, value in parallel.to_host(metrics).items()}
        finite = metrics.pop("params_finite", 1.0) == 1.0
        guard(finite and all(math.isfinite(v) for v in metrics.values()), update + 1)
        with timings.measure("params_to_actors"):
            store.publish(state, update + 1)
        on_update(update, trajectories, metrics)
        done = update + 1
        if save is not None and save_every and done % save_every == 0:
            save(done, state)
            saved = done
    if save is not None and done > saved:
        save(done, state)
    return state
