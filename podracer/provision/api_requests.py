"""The Cloud TPU API requests the provisioner sends, built by pure functions.

Building every request here, apart from sending it, is what lets `--dry-run`
print exactly what a real run would send.
"""

from __future__ import annotations

import json
import uuid

from google.cloud import tpu_v2
from google.protobuf import duration_pb2

from podracer.provision.spec import SliceSpec

STARTUP_SCRIPT_KEY = "startup-script"
# Labels on every slice podracer creates. `podracer-launch` tells our own slice
# apart from a stranger's of the same name when a create is retried.
MANAGED_BY_LABEL = ("managed-by", "podracer")
LAUNCH_ID_LABEL = "podracer-launch"
GUEST_ATTRIBUTES_QUERY = "podracer/"
# Node metadata naming the run's directory in its bucket: `status`, `logs` and
# `attach` find the run from the slice's name.
RUN_DIR_KEY = "podracer-run-dir"


# `--tpu-version` values as the API's AcceleratorConfig.Type names them.
_ACCELERATOR_TYPES = {"v5litepod": "V5LITE_POD"}


def accelerator_config(spec: SliceSpec) -> tpu_v2.AcceleratorConfig:
    name = _ACCELERATOR_TYPES.get(spec.tpu_version, spec.tpu_version.upper())
    return tpu_v2.AcceleratorConfig(type_=tpu_v2.AcceleratorConfig.Type[name],
                                    topology=spec.topology)


def network_config(spec: SliceSpec) -> tpu_v2.NetworkConfig:
    """Always sent. `enable_external_ips` is a plain bool: left out, it reads false (no
    external IPs), whereas gcloud sends true unless --internal-ips; we do as gcloud."""
    networking = spec.networking
    return tpu_v2.NetworkConfig(network=networking.network, subnetwork=networking.subnetwork,
                                enable_external_ips=networking.external_ips)


def make_node(spec: SliceSpec, startup_script: str, launch_id: str, run_dir: str) -> tpu_v2.Node:
    """The node to create: shape, image, tier, network, identity, and the startup script."""
    node = tpu_v2.Node(
        runtime_version=spec.runtime_version,
        network_config=network_config(spec),
        tags=list(spec.networking.tags),
        metadata={
            STARTUP_SCRIPT_KEY: startup_script,
            # Workers report their progress as guest attributes.
            "enable-guest-attributes": "TRUE",
            RUN_DIR_KEY: run_dir,
        },
        labels={MANAGED_BY_LABEL[0]: MANAGED_BY_LABEL[1], LAUNCH_ID_LABEL: launch_id},
    )
    if spec.topology:
        node.accelerator_config = accelerator_config(spec)
    else:
        node.accelerator_type = spec.accelerator_type
    if spec.identity.service_account or spec.identity.scopes:
        node.service_account = tpu_v2.ServiceAccount(
            email=spec.identity.service_account, scope=list(spec.identity.scopes))
    # A queued resource carries its tier itself (see `create_queued_resource_request`).
    if not spec.queued and (spec.spot or spec.reserved):
        node.scheduling_config = tpu_v2.SchedulingConfig(spot=spec.spot, reserved=spec.reserved)
    return node


def create_node_request(spec: SliceSpec, node: tpu_v2.Node) -> tpu_v2.CreateNodeRequest:
    return tpu_v2.CreateNodeRequest(parent=spec.parent, node_id=spec.name, node=node)


def create_queued_resource_request(
    spec: SliceSpec, node: tpu_v2.Node, ready_timeout: float, request_id: str
) -> tpu_v2.CreateQueuedResourceRequest:
    """A queued resource that the API itself gives up on after `ready_timeout`.

    `request_id` makes a retried create idempotent on the server. A multislice
    (`spec.num_slices` > 1) is one node spec with `multislice_params` instead of
    a node id: the API creates that many nodes of it, named `NAME-0`, `NAME-1`, ...
    """
    NodeSpec = tpu_v2.QueuedResource.Tpu.NodeSpec
    if spec.num_slices > 1:
        node_spec = NodeSpec(parent=spec.parent, node=node, multislice_params=NodeSpec.MultisliceParams(
            node_count=spec.num_slices, node_id_prefix=spec.name))
    else:
        node_spec = NodeSpec(parent=spec.parent, node_id=spec.name, node=node)
    resource = tpu_v2.QueuedResource(
        tpu=tpu_v2.QueuedResource.Tpu(node_spec=[node_spec]),
        queueing_policy=tpu_v2.QueuedResource.QueueingPolicy(
            valid_until_duration=duration_pb2.Duration(seconds=int(ready_timeout))),
    )
    if spec.spot:
        resource.spot = tpu_v2.QueuedResource.Spot()
    if spec.reserved:
        # What gcloud sends (v2 API) for `queued-resources create --reserved` without a
        # --reservation-host-* flag: reservationName `projects/PROJECT/locations/ZONE/
        # reservations/-`, any reservation of the project in the zone (a host flag puts
        # another project, folder or organization in that form).
        resource.reservation_name = f"{spec.parent}/reservations/-"
    return tpu_v2.CreateQueuedResourceRequest(
        parent=spec.parent,
        queued_resource_id=spec.name,
        queued_resource=resource,
        request_id=request_id,
    )


def new_request_id() -> str:
    """Makes a retried create idempotent on the server; one per create."""
    return str(uuid.uuid4())


def num_slices_of(resource: tpu_v2.QueuedResource) -> int:
    """How many slices a queued resource holds: 1, or its multislice's node count."""
    specs = resource.tpu.node_spec
    return max(1, specs[0].multislice_params.node_count) if specs else 1


def get_node_request(spec: SliceSpec, node_id: str = "") -> tpu_v2.GetNodeRequest:
    """Reads the slice's node (or the node `node_id`, one slice of a multislice)."""
    return tpu_v2.GetNodeRequest(name=spec.node_path_of(node_id or spec.name))


def get_queued_resource_request(spec: SliceSpec) -> tpu_v2.GetQueuedResourceRequest:
    return tpu_v2.GetQueuedResourceRequest(name=spec.queued_resource_path)


def guest_attributes_request(spec: SliceSpec, node_id: str = "") -> tpu_v2.GetGuestAttributesRequest:
    return tpu_v2.GetGuestAttributesRequest(name=spec.node_path_of(node_id or spec.name),
                                            query_path=GUEST_ATTRIBUTES_QUERY)


def list_nodes_request(spec: SliceSpec) -> tpu_v2.ListNodesRequest:
    return tpu_v2.ListNodesRequest(parent=spec.parent)


def list_queued_resources_request(spec: SliceSpec) -> tpu_v2.ListQueuedResourcesRequest:
    return tpu_v2.ListQueuedResourcesRequest(parent=spec.parent)


def delete_node_request(spec: SliceSpec) -> tpu_v2.DeleteNodeRequest:
    return tpu_v2.DeleteNodeRequest(name=spec.node_path)


def delete_queued_resource_request(spec: SliceSpec, name: str = "") -> tpu_v2.DeleteQueuedResourceRequest:
    """Deletes the queued resource `name` (default: the one named as the slice).

    force: its node goes with it, so nothing billable is left behind.
    """
    return tpu_v2.DeleteQueuedResourceRequest(name=name or spec.queued_resource_path, force=True)


def delete_request(spec: SliceSpec, queued_resource: str = ""):
    """How to delete the slice `spec` describes: its node, or the queued resource it came
    from (`queued_resource`, the node's own `queued_resource` field, when known)."""
    if spec.queued or queued_resource:
        return delete_queued_resource_request(spec, queued_resource)
    return delete_node_request(spec)


def rpc_name(request) -> str:
    """`google.cloud.tpu.v2.Tpu/CreateNode` for a `CreateNodeRequest`."""
    return "google.cloud.tpu.v2.Tpu/" + type(request).__name__.removesuffix("Request")


def describe_requests(requests) -> str:
    """The requests as a JSON array of `{"rpc": ..., "request": ...}`, as sent.

    Fields left at their defaults are not sent, so they are not shown either.
    """
    described = [
        {"rpc": rpc_name(request), "request": json.loads(type(request).to_json(
            request, use_integers_for_enums=False, always_print_fields_with_no_presence=False))}
        for request in requests
    ]
    return json.dumps(described, indent=2)
