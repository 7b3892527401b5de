"""A scriptable Cloud TPU API on 127.0.0.1 for the provisioner tests.

It serves `google.cloud.tpu.v2.Tpu` and `google.longrunning.Operations` over
plaintext gRPC with generic handlers built from the real `tpu_v2` message
classes, so the tests drive the real `TpuClient` and its operation polling.

What the tests can script:
- the states a node walks through: each GetNode returns one, then moves on to
  the next; the last one stays (`node_states`);
- likewise the states of a queued resource (`queued_states`);
- what each worker publishes as the `podracer/state` guest attribute, one
  snapshot per GetGuestAttributes (`worker_states`);
- failures: `fail(method, code, times)` makes the next calls fail, and with
  `after_effect=True` the call takes effect before failing (a lost response);
- `create_error`: the create operation finishes with this error, leaving
  the node behind in CREATING;
- `on_call(method, fn, after_effect=False)`: run `fn()` when `method` is
  served, before it takes effect or (with `after_effect`) just after.

Every request is recorded in `requests` as `(method, message)`; a call to any
other method, of any service, is recorded as `(full method name, None)` and
answered UNIMPLEMENTED, so `requests == []` means the server saw no call at all.

With an `EmulatedPod` (tests/emulated_pod.py) attached, every node's workers boot
for real on this machine (at 127.0.0.1): their guest attributes are what they
published, and deleting the node stops them. A multislice queued resource
(`multislice_params`) has `node_count` nodes, booted together as one run's slices.
"""

from __future__ import annotations

import itertools
import time
import threading
from concurrent import futures
from dataclasses import dataclass, field
from typing import Callable

import grpc
from google.cloud import tpu_v2
from google.longrunning import operations_pb2
from google.protobuf import any_pb2, empty_pb2
from google.rpc import status_pb2

NodeState = tpu_v2.Node.State
QueuedState = tpu_v2.QueuedResourceState.State


@dataclass
class _Failure:
    code: grpc.StatusCode
    times: int
    message: str
    after_effect: bool


@dataclass
class _Operation:
    name: str
    is_done: Callable[[], bool]
    response: Callable[[], any_pb2.Any]
    error: status_pb2.Status | None = None


@dataclass
class _Slot:
    """A resource and the script of states it still has to walk through."""

    message: object
    script: list = field(default_factory=list)

    def advance(self) -> None:
        if self.script:
            self.set_state(self.script.pop(0))

    def set_state(self, state) -> None:
        if isinstance(self.message, tpu_v2.Node):
            self.message.state = state
        else:
            self.message.state.state = state


def _pack(message) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(type(message).pb(message) if hasattr(type(message), "pb") else message)
    return packed


class FakeTpuService:
    """State and behaviour of the fake API; thread-safe."""

    def __init__(self, workers: int = 4):
        self.workers = workers
        self.node_states: list = [NodeState.CREATING, NodeState.READY]
        self.queued_states: list = [QueuedState.WAITING_FOR_RESOURCES, QueuedState.PROVISIONING,
                                    QueuedState.ACTIVE]
        self.worker_states: list[list[str]] = [["installing"] * workers, ["running"] * workers,
                                               ["exit=0"] * workers]
        self.create_error: tuple[grpc.StatusCode, str] | None = None
        # Answer GetGuestAttributes in reverse, leaving out workers that published nothing.
        self.guest_attributes_unordered = False
        self.nodes: dict[str, _Slot] = {}
        self.queued: dict[str, _Slot] = {}
        self.requests: list[tuple[str, object]] = []
        self._operations: dict[str, _Operation] = {}
        self._failures: dict[str, list[_Failure]] = {}
        self._hooks: dict[str, Callable[[], None]] = {}
        self._guest_calls = 0
        self._outage_until, self._outage_code = 0.0, grpc.StatusCode.UNAVAILABLE
        self.pod = None  # set by an EmulatedPod, which boots the nodes' workers
        self._ids = itertools.count(1)
        self._lock = threading.RLock()

    # -- scripting -------------------------------------------------------

    def fail(self, method: str, code: grpc.StatusCode, times: int = 1,
             message: str = "injected failure", after_effect: bool = False) -> None:
        self._failures.setdefault(method, []).append(
            _Failure(code, times, message, after_effect))

    def outage(self, seconds: float, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> None:
        """Every call, of every method, fails with `code` for the next `seconds`."""
        with self._lock:
            self._outage_until = time.monotonic() + seconds
            self._outage_code = code

    def on_call(self, method: str, hook: Callable[[], None], after_effect: bool = False) -> None:
        self._hooks[method] = (hook, after_effect)

    def methods_called(self) -> list[str]:
        with self._lock:
            return [method for method, _ in self.requests]

    def requests_of(self, method: str) -> list:
        with self._lock:
            return [message for name, message in self.requests if name == method]

    # -- plumbing --------------------------------------------------------

    def _serve(self, method: str, handler, request, context):
        with self._lock:
            self.requests.append((method, request))
            hook, hook_after_effect = self._hooks.get(method, (None, False))
            failure = self._take_failure(method)
            down = time.monotonic() < self._outage_until
        if down:
            context.abort(self._outage_code, "the service is unavailable (an outage)")
        if hook is not None and not hook_after_effect:
            hook()
        if failure is not None and not failure.after_effect:
            context.abort(failure.code, failure.message)
        with self._lock:
            response = handler(request, context)
        if hook is not None and hook_after_effect:
            hook()
        if failure is not None:
            context.abort(failure.code, failure.message)
        return response

    def _take_failure(self, method: str) -> _Failure | None:
        queue = self._failures.get(method)
        if not queue:
            return None
        failure = queue[0]
        failure.times -= 1
        if failure.times <= 0:
            queue.pop(0)
        return failure

    def _new_operation(self, parent: str, is_done, response, error=None):
        name = f"{parent}/operations/operation-{next(self._ids)}"
        self._operations[name] = _Operation(name, is_done, response, error)
        return self._operation_message(self._operations[name])

    def _operation_message(self, operation: _Operation) -> operations_pb2.Operation:
        message = operations_pb2.Operation(
            name=operation.name,
            metadata=_pack(tpu_v2.OperationMetadata(verb="create")),
        )
        if operation.error is not None:
            message.done = True
            message.error.CopyFrom(operation.error)
        elif operation.is_done():
            message.done = True
            message.response.CopyFrom(operation.response())
        return message

    def _parent_of(self, name: str) -> str:
        return name.rsplit("/", 2)[0]

    def _new_node(self, name: str, node, queued_resource: str = "") -> _Slot:
        node = tpu_v2.Node(node)
        node.name = name
        node.queued_resource = queued_resource
        node.network_endpoints = [
            tpu_v2.NetworkEndpoint(
                ip_address="127.0.0.1" if self.pod else f"10.0.0.{index + 2}", port=8470)
            for index in range(self.workers)
        ]
        slot = _Slot(node, list(self.node_states))
        slot.advance()
        return slot

    def _delete_nodes(self, names: list[str], then: Callable[[], None]) -> Callable[[], bool]:
        """Removes the nodes (emulated ones once their workers stop), then `then()`; done yet?"""
        if self.pod is not None:
            return self.pod.delete_nodes(names, then)
        for name in names:
            del self.nodes[name]
        then()
        return lambda: True

    def _abort_not_found(self, context, name: str):
        context.abort(grpc.StatusCode.NOT_FOUND, f'Resource "{name}" was not found')

    # -- google.cloud.tpu.v2.Tpu ----------------------------------------

    def CreateNode(self, request, context):
        name = f"{request.parent}/nodes/{request.node_id}"
        if name in self.nodes:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, f"{name} already exists")
        self.nodes[name] = slot = self._new_node(name, request.node)
        if self.create_error is not None:
            # As with a real stockout, the node is left behind, half made.
            slot.script = []
            code, message = self.create_error
            error = status_pb2.Status(code=code.value[0], message=message)
            return self._new_operation(request.parent, lambda: True, None, error)
        if self.pod is not None:
            self.pod.boot(slot.message)
        return self._new_operation(
            request.parent,
            lambda: slot.message.state != NodeState.CREATING,
            lambda: _pack(slot.message),
        )

    def GetNode(self, request, context):
        slot = self.nodes.get(request.name)
        if slot is None:
            self._abort_not_found(context, request.name)
        node = tpu_v2.Node(slot.message)
        slot.advance()
        return node

    def ListNodes(self, request, context):
        nodes = [tpu_v2.Node(slot.message) for name, slot in sorted(self.nodes.items())
                 if name.startswith(request.parent + "/")]
        return tpu_v2.ListNodesResponse(nodes=nodes)

    def DeleteNode(self, request, context):
        if request.name not in self.nodes:
            self._abort_not_found(context, request.name)
        done = self._delete_nodes([request.name], lambda: None)
        return self._new_operation(
            self._parent_of(request.name), done, lambda: _pack(empty_pb2.Empty()))

    def GetGuestAttributes(self, request, context):
        if request.name not in self.nodes:
            self._abort_not_found(context, request.name)
        if self.pod is not None and self.pod.runs(request.name):
            published = self.pod.guest_attributes(request.name)
        else:  # scripted workers publish their number before their first state, as real ones
            snapshot = self.worker_states[min(self._guest_calls, len(self.worker_states) - 1)]
            self._guest_calls += 1
            published = [{} if value is None else {"podracer/worker": str(index), "podracer/state": value}
                         for index, value in enumerate(snapshot)]
        if self.guest_attributes_unordered:  # the API names no worker and promises no order
            published = [values for values in reversed(published) if values]
        attributes = []
        for values in published:
            items = [tpu_v2.GuestAttributesEntry(namespace=path.split("/")[0], key=path.split("/")[1],
                                                 value=value)
                     for path, value in sorted(values.items()) if path.startswith(request.query_path)]
            attributes.append(tpu_v2.GuestAttributes(
                query_path=request.query_path,
                query_value=tpu_v2.GuestAttributesValue(items=items)))
        return tpu_v2.GetGuestAttributesResponse(guest_attributes=attributes)

    def CreateQueuedResource(self, request, context):
        name = f"{request.parent}/queuedResources/{request.queued_resource_id}"
        if name in self.queued:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, f"{name} already exists")
        resource = tpu_v2.QueuedResource(request.queued_resource)
        resource.name = name
        slot = _Slot(resource, list(self.queued_states))
        slot.advance()
        self.queued[name] = slot
        return self._new_operation(
            request.parent, lambda: True, lambda: _pack(slot.message))

    def GetQueuedResource(self, request, context):
        slot = self.queued.get(request.name)
        if slot is None:
            self._abort_not_found(context, request.name)
        resource = slot.message
        if resource.state.state == QueuedState.FAILED and not resource.state.failed_data.error.message:
            resource.state.failed_data.error = status_pb2.Status(
                code=8, message="no capacity for the requested accelerator")
        if resource.state.state == QueuedState.ACTIVE:
            self._materialize_nodes(request.name, resource)
        returned = tpu_v2.QueuedResource(resource)
        slot.advance()
        return returned

    def _materialize_nodes(self, queued_resource: str, resource) -> None:
        """An ACTIVE queued resource has its nodes, READY, then on along `node_states`: a
        node spec's `node_id`, or a multislice's `node_count` nodes `PREFIX-0`, `PREFIX-1`,
        ... (the prefix defaults to the queued resource's id)."""
        for spec in resource.tpu.node_spec:
            multislice = spec.multislice_params
            node_ids = ([f"{multislice.node_id_prefix or queued_resource.rsplit('/', 1)[-1]}-{index}"
                         for index in range(multislice.node_count)] if multislice.node_count
                        else [spec.node_id])
            booted = []
            for node_id in node_ids:
                node_name = f"{spec.parent}/nodes/{node_id}"
                if node_name in self.nodes:
                    continue
                slot = self._new_node(node_name, spec.node, queued_resource)
                slot.message.multislice_node = len(node_ids) > 1
                slot.set_state(NodeState.READY)
                slot.script = [state for state in self.node_states
                               if state not in (NodeState.CREATING, NodeState.READY)]
                self.nodes[node_name] = slot
                booted.append(slot.message)
            if self.pod is not None and booted:
                self.pod.boot(*booted)

    def ListQueuedResources(self, request, context):
        resources = [tpu_v2.QueuedResource(slot.message)
                     for name, slot in sorted(self.queued.items())
                     if name.startswith(request.parent + "/")]
        return tpu_v2.ListQueuedResourcesResponse(queued_resources=resources)

    def DeleteQueuedResource(self, request, context):
        if request.name not in self.queued:
            self._abort_not_found(context, request.name)
        nodes = [name for name, slot in self.nodes.items()
                 if slot.message.queued_resource == request.name]
        if nodes and not request.force:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          "queued resource still has nodes; delete them or use force")
        self.queued[request.name].script = []
        self.queued[request.name].set_state(QueuedState.DELETING)
        done = self._delete_nodes(nodes, lambda: self.queued.pop(request.name, None))
        return self._new_operation(
            self._parent_of(request.name), done, lambda: _pack(empty_pb2.Empty()))

    # -- google.longrunning.Operations ----------------------------------

    def GetOperation(self, request, context):
        operation = self._operations.get(request.name)
        if operation is None:
            self._abort_not_found(context, request.name)
        return self._operation_message(operation)


_TPU_METHODS = {
    "CreateNode": (tpu_v2.CreateNodeRequest, operations_pb2.Operation),
    "GetNode": (tpu_v2.GetNodeRequest, tpu_v2.Node),
    "ListNodes": (tpu_v2.ListNodesRequest, tpu_v2.ListNodesResponse),
    "DeleteNode": (tpu_v2.DeleteNodeRequest, operations_pb2.Operation),
    "GetGuestAttributes": (tpu_v2.GetGuestAttributesRequest, tpu_v2.GetGuestAttributesResponse),
    "CreateQueuedResource": (tpu_v2.CreateQueuedResourceRequest, operations_pb2.Operation),
    "GetQueuedResource": (tpu_v2.GetQueuedResourceRequest, tpu_v2.QueuedResource),
    "ListQueuedResources": (tpu_v2.ListQueuedResourcesRequest, tpu_v2.ListQueuedResourcesResponse),
    "DeleteQueuedResource": (tpu_v2.DeleteQueuedResourceRequest, operations_pb2.Operation),
}


def _serializer(message_class):
    return getattr(message_class, "serialize", None) or message_class.SerializeToString  # proto-plus or not


def _deserializer(message_class):
    return getattr(message_class, "deserialize", None) or message_class.FromString


def _handlers(service: FakeTpuService, methods: dict) -> dict:
    def bind(name):
        handler = getattr(service, name)
        return lambda request, context: service._serve(name, handler, request, context)

    return {
        name: grpc.unary_unary_rpc_method_handler(
            bind(name),
            request_deserializer=_deserializer(request_class),
            response_serializer=_serializer(response_class),
        )
        for name, (request_class, response_class) in methods.items()
    }


class _RecordEveryOtherCall(grpc.GenericRpcHandler):
    """Last in line: records a call no other handler serves (the server then answers UNIMPLEMENTED)."""

    def __init__(self, service: FakeTpuService):
        self._service = service

    def service(self, handler_call_details):
        with self._service._lock:
            self._service.requests.append((handler_call_details.method, None))
        return None


class TpuServer:
    """Serves a `FakeTpuService` on 127.0.0.1 at a free port."""

    def __init__(self, service: FakeTpuService):
        self.service = service
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        self._server.add_generic_rpc_handlers((
            grpc.method_handlers_generic_handler(
                "google.cloud.tpu.v2.Tpu", _handlers(service, _TPU_METHODS)),
            grpc.method_handlers_generic_handler(
                "google.longrunning.Operations",
                _handlers(service, {"GetOperation": (
                    operations_pb2.GetOperationRequest, operations_pb2.Operation)})),
            _RecordEveryOtherCall(service),
        ))
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"127.0.0.1:{self.port}"

    def __enter__(self) -> "TpuServer":
        self._server.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.stop(grace=None).wait(timeout=5)
