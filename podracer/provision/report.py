"""What the provisioner prints: pure functions from API messages to text."""

from __future__ import annotations

import shlex
from collections import Counter

from google.cloud import tpu_v2

from podracer.provision.spec import SliceSpec, WorkerLayout
from podracer.provision.startup import WorkerState


def describe_workers(states: list[WorkerState]) -> str:
    """`3 running, 1 exited 0`: workers counted by state, in order of first appearance."""
    counts = Counter(state.describe() for state in states)
    return ", ".join(f"{count} {state}" for state, count in counts.items())


def _gcloud_ssh(spec: SliceSpec, remote_command: str) -> str:
    return " ".join([
        "gcloud compute tpus tpu-vm ssh", shlex.quote(spec.name),
        f"--zone={shlex.quote(spec.zone)}", f"--project={shlex.quote(spec.project)}",
        "--worker=all", f"--command={shlex.quote(remote_command)}",
    ])


def where_to_look(spec: SliceSpec, layout: WorkerLayout) -> list[str]:
    """Where the run directory and logs are, and the commands that read them."""
    return [
        f"run directory: {layout.run_dir} on every worker "
        "(relative paths in your training flags resolve there)",
        f"training log:  {layout.log_path} on every worker",
        f"follow it:     {_gcloud_ssh(spec, f'tail -n 50 -f {layout.log_path}')}",
    ]


def down_command(spec: SliceSpec) -> str:
    return " ".join([
        "python launch/tpu.py down", f"--tpu={shlex.quote(spec.name)}",
        f"--zone={shlex.quote(spec.zone)}", f"--project={shlex.quote(spec.project)}",
    ])


def node_shape(node: tpu_v2.Node) -> str:
    """`v4-32`, or `V4 2x2x4` for a node created from a TPU version and a topology."""
    config = node.accelerator_config
    if node.accelerator_type or not config.topology:
        return node.accelerator_type or "-"
    return f"{config.type_.name} {config.topology}"


def describe_node(node: tpu_v2.Node) -> list[str]:
    """The slice's state and its workers' addresses."""
    lines = [
        f"TPU {node.name.rsplit('/', 1)[-1]}: {node.state.name}"
        + (f" ({node.health.name})" if node.health else ""),
        f"  accelerator: {node_shape(node)}, image: {node.runtime_version}, "
        f"workers: {len(node.network_endpoints)}",
    ]
    network = node.network_config
    lines.append(f"  network: {network.network.rsplit('/', 1)[-1] or 'default'}, "
                 f"{'external' if network.enable_external_ips else 'internal'} IPs, service "
                 f"account: {node.service_account.email or 'Compute Engine default'}")
    if node.scheduling_config.spot:
        lines.append("  billing: spot (may be preempted)")
    elif node.scheduling_config.reserved:
        lines.append("  billing: reserved")
    if node.queued_resource:
        lines.append(f"  queued resource: {node.queued_resource.rsplit('/', 1)[-1]}")
    if node.health_description:
        lines.append(f"  health: {' '.join(node.health_description.split())}")
    return lines


def describe_worker_table(node: tpu_v2.Node, states: list[WorkerState]) -> list[str]:
    lines = ["  worker  address         podracer"]
    for index, state in enumerate(states):
        endpoints = node.network_endpoints
        address = endpoints[index].ip_address if index < len(endpoints) else "-"
        lines.append(f"  {index:<6}  {address:<14}  {state.describe()}")
    return lines


def describe_queued_resource(resource: tpu_v2.QueuedResource) -> str:
    name = resource.name.rsplit("/", 1)[-1]
    line = f"queued resource {name}: {resource.state.state.name}"
    if resource.state.state == tpu_v2.QueuedResourceState.State.FAILED:
        line += f" ({' '.join(resource.state.failed_data.error.message.split())})"
    return line


def list_table(nodes: list[tpu_v2.Node], queued: list[tpu_v2.QueuedResource]) -> list[str]:
    """Like `gcloud compute tpus tpu-vm list`, plus queued resources still waiting."""
    rows = [("NAME", "ACCELERATOR", "STATE", "RUNTIME", "QUEUED")]
    node_names = set()
    for node in nodes:
        name = node.name.rsplit("/", 1)[-1]
        node_names.add(name)
        queued_resource = "yes" if node.queued_resource else "-"
        rows.append((name, node_shape(node), node.state.name, node.runtime_version,
                     queued_resource))
    for resource in queued:
        name = resource.name.rsplit("/", 1)[-1]
        specs = resource.tpu.node_spec
        if specs and specs[0].node_id in node_names:
            continue
        accelerator = node_shape(specs[0].node) if specs else "-"
        rows.append((name, accelerator, resource.state.state.name, "-", "yes"))
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
            for row in rows]
