"""The learner: any agent's `learn` under `jit(shard_map)` over the learner devices only."""

from __future__ import annotations

import math
import queue
import threading
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, PartitionSpec as P

from podracer.agent import all_finite
from podracer.protocol import parallel
from podracer.sebulba.actor import Acting, Shipment, trajectory_shapes
from podracer.sebulba.control import Control
from podracer.sebulba.params import ParamsStore
from podracer.session.timing import Timings

_ACROSS_ACTORS = P(parallel.DATA_AXIS)  # bootstrap data and carries: [N, ...] leaves split along N


def make_learn_step(learn: Callable, mesh: Mesh, check_vma: bool = True,
                    learned_state: Callable[[Any], Any] = lambda state: state) -> Callable:
    """Jitted `step(state, batches, bootstraps, key, carries) -> (state, metrics)` of an agent's `learn`.

    `learn` is `Agent.learn` of an agent made with `axis_names=(parallel.DATA_AXIS,)`.
    `batches` is a tuple with one prepared time-major batch per actor thread,
    each split along its batch axis over `mesh` (`parallel.time_major_sharded`),
    `bootstraps` and `carries` the matching tuples of [N, ...] data
    (`parallel.sharded`; a feed-forward agent's carries are `()`). Every learner
    device joins its shards of all of them into one local batch and runs
    `learn`, which averages over the mesh. `state` is replicated over the mesh.
    The metrics include `params_finite` (1.0 when every floating-point leaf of
    `learned_state(new state)` is finite) for the NaN guard. `check_vma` and
    `learned_state` are the agent's (`Agent.check_vma`, `Agent.learned_state`).
    """
    join = lambda axis, parts: jax.tree.map(lambda *p: jnp.concatenate(p, axis=axis), *parts)

    def step(state, batches, bootstraps, key, carries):
        state, metrics = learn(state, join(1, batches), join(0, bootstraps), key, join(0, carries))
        finite = all_finite(learned_state(state))
        return state, {**metrics, "params_finite": finite.astype(jnp.float32)}

    specs = (P(), parallel.TIME_MAJOR_SPEC, _ACROSS_ACTORS, P(), _ACROSS_ACTORS)
    return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=specs, out_specs=(P(), P()), check_vma=check_vma))


def make_learner_step(apply_fn: Callable, optimizer: optax.GradientTransformation, config: Any, mesh: Mesh,
                      make_update: Callable | None = None) -> Callable:
    """`make_learn_step` of an update of `podracer.ppo.make_update`'s kind (PPO's by default): a user's
    own update on Sebulba's learner, `step(state, batches, bootstrap_values, key) -> (state, metrics)`."""
    if make_update is None:
        from podracer.ppo import make_update
    update = make_update(apply_fn, optimizer, config, axis_names=(parallel.DATA_AXIS,))
    step = make_learn_step(lambda state, batch, bootstrap, key, _carry: update(state, batch, bootstrap, key),
                           mesh)
    return lambda state, batches, bootstraps, key: step(state, batches, bootstraps, key, ((),) * len(batches))


def shipment_shapes(agent: Any, acting: Acting, acting_state: Any, rollout_len: int, num_envs: int,
                    mesh: Mesh, processes: int = 1) -> tuple[Any, Any, Any]:
    """Abstract (batch, bootstrap, carry) of one shipment: an actor thread's `num_envs` columns from each of
    `processes` processes, placed on `mesh` as the actors place them: for compiling the learner ahead."""
    trajectory = trajectory_shapes(acting, rollout_len, num_envs)
    # `prepare` is given what `Agent.for_rollout` makes of the acting state.
    batch, bootstrap = jax.eval_shape(agent.prepare, acting.rollout_state, trajectory)
    place = lambda tree, sharding, axis: jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((*x.shape[:axis], x.shape[axis] * processes, *x.shape[axis + 1:]),
                                       x.dtype, sharding=sharding), tree)
    by_column = parallel.sharded(mesh)
    return (place(batch, parallel.time_major_sharded(mesh), 1), place(bootstrap, by_column, 0),
            place(trajectory.next_carry, by_column, 0))


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
    `acting_state(state)` is what is published to the actors (`Agent.acting_state`).
    An agent whose updates differ in size (ES: its generations' episodes) says
    when to save (`save_due(updates_done)`, in place of `save_every`) and when to
    stop (`finished()`, after an update, before `num_updates`).
    """

    step_fn: Callable  # compiled `make_learn_step`
    sources: Sequence[queue.Queue]  # one per actor thread, in actor order
    store: ParamsStore
    num_updates: int
    key: jax.Array  # update u uses fold_in(key, u)
    control: Control
    timings: Timings
    on_update: Callable[[int, list[Shipment], dict], None]
    acting_state: Callable[[Any], Any] = lambda state: state
    first_update: int = 0
    save: Callable[[int, Any], None] | None = None
    save_every: int = 0
    interrupted: Callable[[], bool] = lambda: False
    guard: Callable[[bool, int], None] = lambda finite, update: None
    save_due: Callable[[int], bool] | None = None
    finished: Callable[[], bool] = lambda: False


def run_learner(learning: Learning, state: Any) -> Any:
    """Take one shipment from each actor queue, learn, publish; until `num_updates` updates.

    The update key of update u is `fold_in(key, u)`, so a run's updates do not
    depend on timing, and a resumed run (`first_update` > 0) continues the
    sequence. `on_update(u, shipments, metrics)` sees each update's inputs
    and host-side metrics. Returns the last state: early if `interrupted()`
    (a signal: saved first) or if `control.stop` is set (a failure elsewhere:
    nothing is saved).

    On several processes every learner runs this loop, and each update is one
    program over all their devices: so every update starts by deciding
    together whether to stop (`parallel.any_process`), and all of them stop,
    and save, after the same update.
    """
    (step_fn, sources, store, num_updates, key, control, timings, on_update, acting_state, first_update,
     save, save_every, interrupted, guard, save_due, finished) = learning
    if save_due is None:
        save_due = lambda done: bool(save_every) and done % save_every == 0
    saved = done = first_update
    for update in range(first_update, num_updates):
        shipments = take_one_each(sources, control, timings, interrupted)
        if control.stop.is_set():
            return state
        if parallel.any_process(interrupted()):
            break
        with timings.measure("learner_update"):
            state, metrics = step_fn(state, tuple(s.batch for s in shipments),
                                     tuple(s.bootstrap for s in shipments), jax.random.fold_in(key, update),
                                     tuple(s.carry for s in shipments))
            metrics = {name: float(value) for name, value in parallel.to_host(metrics).items()}
        finite = metrics.pop("params_finite", 1.0) == 1.0
        guard(finite and all(math.isfinite(v) for v in metrics.values()), update + 1)
        with timings.measure("params_to_actors"):
            store.publish(acting_state(state), update + 1)
        on_update(update, shipments, metrics)
        done = update + 1
        if save is not None and save_due(done):
            save(done, state)
            saved = done
        if finished():
            break
    if save is not None and done > saved:
        save(done, state)
    return state
