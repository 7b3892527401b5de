"""A slice's life: create it and wait until ready, watch the run, delete it.

Each wait polls at `Timing.poll_interval`, prints a line when the state it
watches changes, and gives up at its own deadline.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Callable

from google.cloud import tpu_v2

from podracer.errors import PodracerError
from podracer.provision import api_requests as requests
from podracer.provision.api import ApiError, TpuApi
from podracer.provision.report import describe_workers
from podracer.provision.spec import SliceSpec
from podracer.provision.startup import (
    GUEST_ATTRIBUTE_KEY,
    GUEST_ATTRIBUTE_NAMESPACE,
    WORKER_KEY,
    WorkerState,
    parse_worker_state,
)

Say = Callable[[str], None]
NodeState = tpu_v2.Node.State
QueuedState = tpu_v2.QueuedResourceState.State

# States a node never comes back from on its own: the slice, and the run on it, are gone.
LOST_NODE_STATES = {NodeState.PREEMPTED, NodeState.TERMINATED, NodeState.STOPPED,
                    NodeState.STOPPING, NodeState.DELETING, NodeState.HIDDEN}
LOST_QUEUED_STATES = {QueuedState.SUSPENDING, QueuedState.SUSPENDED, QueuedState.DELETING}


class RunFailed(PodracerError):
    """The slice or the run on it failed (preempted, a worker exited non-zero, time ran out).

    Not a mistake in the command, so the exit status is 1 rather than 2.
    """

    exit_code = 1


class SliceLost(RunFailed):
    """The slice went away under the run (preempted, deleted, unhealthy for good).

    The run's checkpoint is in its bucket: a new slice resumes it (`--max-restarts`).
    """


def new_launch_id() -> str:
    """Marks the slices one invocation creates (a label value: lowercase, digits)."""
    return uuid.uuid4().hex[:16]


class _Watch:
    """Prints `[  12s] what: STATE` when STATE changes; knows its deadline."""

    def __init__(self, say: Say, what: str, timeout: float, give_up: str,
                 start: float | None = None):
        self._say, self._what, self._timeout, self._give_up = say, what, timeout, give_up
        self._start = time.monotonic() if start is None else start
        self._last = None

    def show(self, state: str) -> None:
        if state != self._last:
            self._say(f"[{time.monotonic() - self._start:5.0f}s] {self._what}: {state}")
            self._last = state

    def check_deadline(self) -> None:
        if time.monotonic() - self._start > self._timeout:
            raise RunFailed(f"{self._give_up} after {self._timeout:g} s")


def create_slice(api: TpuApi, spec: SliceSpec, create_request, launch_id: str):
    """Sends the create request; returns its operation, or None if adopting our own slice.

    A create whose response was lost is retried by the client and then meets
    ALREADY_EXISTS. If the existing slice carries this launch's id, it is ours.
    """
    try:
        return api.send(create_request, f"creating TPU {spec.name}")
    except ApiError as error:
        if error.already_exists and _is_ours(api, spec, launch_id):
            return None
        raise


def _is_ours(api: TpuApi, spec: SliceSpec, launch_id: str) -> bool:
    if spec.queued:
        resource = api.send_or_none(requests.get_queued_resource_request(spec),
                                    f"reading queued resource {spec.name}")
        labels = resource.tpu.node_spec[0].node.labels if resource and resource.tpu.node_spec else {}
    else:
        found = api.send_or_none(requests.get_node_request(spec), f"reading TPU {spec.name}")
        labels = found.labels if found else {}
    return labels.get(requests.LAUNCH_ID_LABEL) == launch_id


def wait_until_ready(api: TpuApi, spec: SliceSpec, operation, say: Say) -> list[tpu_v2.Node]:
    """Waits for the slice (every slice of a multislice) to be READY, and for a queued
    resource to be ACTIVE first; returns the nodes, slice by slice.

    Every wait shares one deadline, `ready_timeout` from now.
    """
    timing, start = api.timing, time.monotonic()
    if spec.queued:
        if operation is not None:
            api.wait_operation(operation, f"queueing TPU {spec.name}", timing.ready_timeout)
        _wait_until_active(api, spec, say, start)
        operation = None
    nodes = []
    for node_id in spec.node_ids:
        watch = _Watch(say, f"TPU {node_id}", timing.ready_timeout,
                       f"TPU {node_id} was not ready", start)
        while True:
            if operation is not None and api.operation_done(operation, f"creating TPU {node_id}"):
                operation = None
            node = api.send_or_none(requests.get_node_request(spec, node_id),
                                    f"reading TPU {node_id}")
            state = node.state if node is not None else NodeState.CREATING
            watch.show(state.name)
            if state in LOST_NODE_STATES:
                raise SliceLost(f"TPU {node_id} was {state.name} before it was ready; "
                                "run again, or use --reserved or --queued for steadier capacity")
            if state == NodeState.READY and operation is None:
                nodes.append(node)
                break
            watch.check_deadline()
            time.sleep(timing.poll_interval)
    return nodes


def _wait_until_active(api: TpuApi, spec: SliceSpec, say: Say, start: float) -> None:
    watch = _Watch(say, f"queued resource {spec.name}", api.timing.ready_timeout,
                   f"queued resource {spec.name} was not provisioned", start)
    while True:
        resource = api.send(requests.get_queued_resource_request(spec),
                            f"reading queued resource {spec.name}")
        state = resource.state.state
        watch.show(state.name)
        if state == QueuedState.ACTIVE:
            return
        if state == QueuedState.FAILED:
            reason = " ".join(resource.state.failed_data.error.message.split()) or "no reason given"
            raise RunFailed(f"queued resource {spec.name} failed: {reason}; try another --zone "
                            "or accelerator type")
        if state in LOST_QUEUED_STATES:
            raise SliceLost(f"queued resource {spec.name} was {state.name} (preempted) "
                            "before it was ready; run again")
        watch.check_deadline()
        time.sleep(api.timing.poll_interval)


def read_worker_states(api: TpuApi, spec: SliceSpec, workers: int,
                       node_id: str = "") -> list[WorkerState]:
    """What each worker of the slice (or of the node `node_id`, one slice of a
    multislice) last published, by worker number; workers that have not reported are booting.

    The API answers one entry per worker without naming it, in no promised
    order, and may leave out a worker that has published nothing: each worker
    publishes its number (`podracer/worker`) before its first state, and its
    entry is read as that worker's. An entry without a number (a worker program
    older than this launcher) counts by its position.
    """
    node_id = node_id or spec.name
    response = api.send_or_none(requests.guest_attributes_request(spec, node_id),
                                f"reading the workers of TPU {node_id}")
    values: dict[int, str | None] = {}
    for position, attributes in enumerate(response.guest_attributes if response is not None else []):
        found = {entry.key: entry.value for entry in attributes.query_value.items
                 if entry.namespace == GUEST_ATTRIBUTE_NAMESPACE}
        number = found.get(WORKER_KEY, "")
        values[int(number) if number.isdigit() else position] = found.get(GUEST_ATTRIBUTE_KEY)
    return [parse_worker_state(values.get(index)) for index in range(workers)]


@dataclass(frozen=True)
class RunOutcome:
    workers: tuple[WorkerState, ...]

    @property
    def succeeded(self) -> bool:
        return all(worker.exit_code == 0 for worker in self.workers)

    def failure(self) -> str:
        failed = [f"worker {index} {worker.describe()}"
                  for index, worker in enumerate(self.workers) if worker.failed]
        return ", ".join(failed)

    def first_failed(self) -> int:
        """The first worker that failed (0 if none did)."""
        return next((index for index, worker in enumerate(self.workers) if worker.failed), 0)


def wait_for_run(api: TpuApi, spec: SliceSpec, workers: int, say: Say,
                 deadline: float | None = None) -> RunOutcome:
    """Waits until every worker (`workers` per slice) has exited, or one has failed.

    One failed worker ends the wait: the others are blocked in collectives with
    it and will not finish. Raises `SliceLost` when a slice is preempted,
    deleted, or not READY for longer than `repair_timeout` (REPAIRING comes back
    on its own): the slices of a multislice train as one run, so one slice lost
    loses it. Workers are numbered as the run's processes, slice by slice. An API that cannot be reached, or credentials that cannot be
    refreshed, never end the wait: the slice is training, and is left to; the
    wait goes on, saying so, until `deadline` (a `time.monotonic()` value).
    """
    timing = api.timing
    start = time.monotonic()
    deadline = start + timing.run_timeout if deadline is None else deadline
    watch = _Watch(say, "workers", deadline - start, "the run was still going", start)
    unhealthy_since = None
    outage_since = None
    while True:
        try:
            nodes, states = _read_slices(api, spec, workers)
        except ApiError as error:
            if not error.transient:
                raise
            if outage_since is None:
                outage_since = time.monotonic()
                say(f"cannot reach the Cloud TPU API ({error}); TPU {spec.name} is left "
                    "running and the run goes on; retrying")
            _check_deadline(watch, deadline)
            time.sleep(timing.poll_interval)
            continue
        if outage_since is not None:
            say(f"the Cloud TPU API answers again after {time.monotonic() - outage_since:.0f} s")
            outage_since = None
        for node_id, node in zip(spec.node_ids, nodes):
            if node is None:
                raise SliceLost(f"TPU {node_id} was deleted while the run was going")
            if node.state in LOST_NODE_STATES:
                raise SliceLost(f"TPU {node_id} was {node.state.name} during the run")
        unhealthy = [(node_id, node.state) for node_id, node in zip(spec.node_ids, nodes)
                     if node.state != NodeState.READY]
        if unhealthy:
            node_id, state = unhealthy[0]
            unhealthy_since = unhealthy_since or time.monotonic()
            watch.show(f"TPU {state.name}" if spec.num_slices == 1
                       else f"TPU {node_id} {state.name}")
            if time.monotonic() - unhealthy_since > timing.repair_timeout:
                raise SliceLost(f"TPU {node_id} stayed {state.name} for "
                                f"{timing.repair_timeout:g} s during the run")
        else:
            unhealthy_since = None
            watch.show(describe_workers(states))
            if any(state.failed for state in states) or all(state.finished for state in states):
                return RunOutcome(tuple(states))
        _check_deadline(watch, deadline)
        time.sleep(timing.poll_interval)


def _read_slices(api: TpuApi, spec: SliceSpec, workers: int):
    """(each slice's node or None, every worker's state, slice by slice)."""
    nodes, states = [], []
    for node_id in spec.node_ids:
        node = api.send_or_none(requests.get_node_request(spec, node_id), f"reading TPU {node_id}")
        nodes.append(node)
        if node is not None:
            states += read_worker_states(api, spec, max(workers, 1), node_id)
    return nodes, states


def _check_deadline(watch: _Watch, deadline: float) -> None:
    if time.monotonic() > deadline:
        watch.check_deadline()
        raise RunFailed("the run was still going at its --max-run-time")


def delete_slice(api: TpuApi, spec: SliceSpec, say: Say, queued_resource: str = "") -> bool:
    """Deletes the slice (with the queued resource it came from) and waits until it is gone.

    False if there was none to delete.
    """
    say(f"deleting TPU {spec.name} ...")
    operation = api.send_or_none(requests.delete_request(spec, queued_resource),
                                 f"deleting TPU {spec.name}")
    if operation is None:
        say(f"TPU {spec.name} does not exist; nothing to delete")
        return False
    api.wait_operation(operation, f"deleting TPU {spec.name}", api.timing.delete_timeout)
    say(f"deleted TPU {spec.name}")
    return True
