"""What the provisioner prints: pure functions from API messages to text."""

from __future__ import annotations

import shlex
from collections import Counter

from google.cloud import tpu_v2

from podracer.provision.spec import SliceSpec
from podracer.provision.startup import WorkerState


def describe_workers(states: list[WorkerState]) -> str:
    """`3 running, 1 exited 0`: workers counted by state, in order of first appearance."""
    counts = Counter(state.describe() for state in states)
    return ", ".join(f"{count} {state}" for state, count in counts.items())


def _flags(spec: SliceSpec) -> str:
    return (f"--zone={shlex.quote(spec.zone)} --project={shlex.quote(spec.project)}")


def logs_command(spec: SliceSpec, worker: int | None = None, follow: bool = False) -> str:
    return " ".join(["python launch/tpu.py logs", shlex.quote(spec.name), _flags(spec)]
                    + ([f"--worker={worker}"] if worker is not None else [])
                    + (["--follow"] if follow else []))


def where_to_look(spec: SliceSpec, run_dir: str) -> list[str]:
    """Where the run's results and logs are (all in its bucket), and the commands that read them."""
    return [
        f"run directory: {run_dir} (checkpoints, metrics, summary, TensorBoard events)",
        f"worker logs:   {run_dir}/logs/worker-I.log, copied as they grow",
        f"follow them:   {logs_command(spec, worker=0, follow=True)}",
    ]


def describe_summary(summary: dict) -> list[str]:
    """The run's result from its `summary.json`, in a line or two."""
    lines = []
    steps, sps = summary.get("env_steps"), summary.get("sps")
    if isinstance(steps, int):
        speed = f" at {sps:,.0f} env steps/s" if isinstance(sps, (int, float)) else ""
        lines.append(f"  {summary.get('arch')} {summary.get('algo')} on {summary.get('env')}: "
                     f"{steps:,} env steps{speed} over {summary.get('processes', 1)} processes")
    if isinstance(summary.get("episode_return_mean"), (int, float)):
        lines.append(f"  episode return (mean of the last interval): "
                     f"{summary['episode_return_mean']:.2f}")
    return lines


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
        # Shown by its nodes once it has them (a multislice's are NAME-0, NAME-1, ...).
        if (specs and specs[0].node_id in node_names
                or any(node.queued_resource == resource.name for node in nodes)):
            continue
        accelerator = node_shape(specs[0].node) if specs else "-"
        slices = specs[0].multislice_params.node_count if specs else 0
        accelerator = f"{slices} x {accelerator}" if slices > 1 else accelerator
        rows.append((name, accelerator, resource.state.state.name, "-", "yes"))
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
            for row in rows]
