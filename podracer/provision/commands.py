"""The verbs: run (no verb), up, status, logs, down, list.

`launch_on_slice` holds the one promise that matters most: a slice this
command created is deleted when the run ends, fails, or is interrupted, unless
the user asked to keep it.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

from podracer.errors import PodracerError
from podracer.provision import api_requests as requests
from podracer.provision.api import (
    ApiError,
    TpuApi,
    application_default_credentials,
    connect,
    is_loopback,
)
from podracer.provision.lifecycle import Say, delete_slice, new_launch_id, read_worker_states
from podracer.provision.supervise import Launch, follow, say_results
from podracer.provision import logs, needs, staging
from podracer.provision.report import (
    describe_node,
    describe_queued_resource,
    describe_worker_table,
    list_table,
    where_to_look,
)
from podracer.provision.slices import multislice, slice_shape
from podracer.provision.spec import Command, SliceSpec
from podracer.provision.startup import make_startup_script, worker_config
from podracer import storage


def execute(command: Command, say: Say) -> int:
    """Runs `command`; returns the exit status or raises `PodracerError` (or `Interrupted`)."""
    if command.verb == "logs" and command.run_dir:
        return logs.show(command.run_dir, command.worker, command.follow, say,
                         command.timing.poll_interval)
    if command.verb == "attach" and command.run_dir:
        # The run's launch record names its slice.
        spec = _spec_of(Launch.load(command.run_dir), command.spec)
        command = dataclasses.replace(command, spec=spec)
    if command.dry_run:
        spec = _with_project(command.spec, _project_for_dry_run(command))
        return _dry_run(dataclasses.replace(command, spec=spec), say)
    api = _open_api(command)
    try:
        if command.verb == "list":
            return _list(api, say)
        if command.verb == "status":
            return _status(api, say)
        if command.verb == "attach":
            return _attach(api, command, say)
        if command.verb == "logs":
            run_dir = _run_dir_of(api)
            return logs.show(run_dir, command.worker, command.follow, say,
                             command.timing.poll_interval)
        if command.verb == "down":
            return _down(api, say)
        return _run_or_up(api, command, say)
    finally:
        api.close()


def _with_project(spec: SliceSpec, project: str) -> SliceSpec:
    return dataclasses.replace(spec, project=project)


def _missing_project() -> PodracerError:
    return PodracerError("no Google Cloud project: pass --project=PROJECT_ID "
                         "(or set GOOGLE_CLOUD_PROJECT)")


def _project_for_dry_run(command: Command) -> str:
    if command.spec.project:
        return command.spec.project
    if command.api_endpoint and is_loopback(command.api_endpoint):
        raise _missing_project()
    _, project = application_default_credentials()
    if not project:
        raise _missing_project()
    return project


def _open_api(command: Command) -> TpuApi:
    """A connected `TpuApi`; finds the credentials (and the project, if not given)."""
    project, credentials = command.spec.project, None
    if not (command.api_endpoint and is_loopback(command.api_endpoint)):
        credentials, default_project = application_default_credentials()
        project = project or default_project or ""
    if not project:
        raise _missing_project()
    client = connect(command.api_endpoint, credentials)
    return TpuApi(client, _with_project(command.spec, project), command.timing)


# -- run and up --------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Plan:
    create_request: object
    startup_script: str
    run_dir: str
    staged: staging.Staged
    launch: Launch
    notes: tuple[str, ...]


def _without_run_dir(flags) -> list[str]:
    """The training flags less `--run-dir` (the workers are given the run's own)."""
    kept, skip = [], False
    for flag in flags:
        if skip:
            skip = False
        elif flag == "--run-dir":
            skip = True
        elif not flag.startswith("--run-dir="):
            kept.append(flag)
    return kept


def _plan(command: Command, spec: SliceSpec, build_dir: Path) -> _Plan:
    """Everything `run`/`up` will stage and send, decided (and built) before anything is sent."""
    run_dir = staging.slice_run_dir(command.bucket, command.training_flags, spec.name)
    # A finished run's slice is deleted by whoever sees the end first: the launcher
    # following it, or its workers (with their service account), when it is not kept.
    self_delete = command.verb == "run" and not command.keep
    extras = needs.worker_extras(command.training_flags) + (("tpu",) if self_delete else ())
    modules = needs.env_module_files(_env_id(command.training_flags), Path.cwd(), extras)
    staged = staging.prepare(run_dir, command.launcher or staging.DEFAULT_LAUNCHER, build_dir,
                             extras, modules)
    config = worker_config(run_dir, staged.code_dir, staged.names,
                           _without_run_dir(command.training_flags), staging.UV_VERSION,
                           staging.python_version(), max_restarts=command.max_restarts,
                           max_run_time_s=command.timing.run_timeout,
                           delete_when_done=_slice_address(spec, command) if self_delete else None,
                           num_slices=spec.num_slices)
    script = make_startup_script(config)
    node = requests.make_node(spec, script, new_launch_id(), run_dir)
    if spec.queued:
        create = requests.create_queued_resource_request(
            spec, node, command.timing.ready_timeout, request_id=requests.new_request_id())
    else:
        create = requests.create_node_request(spec, node)
    launch = Launch(run_dir, create, max_restarts=command.max_restarts,
                    keep=command.keep or command.verb == "up",
                    max_run_time_s=command.timing.run_timeout)
    shape = slice_shape(spec.accelerator_type, spec.tpu_version, spec.topology)
    notes = [f"run directory: {run_dir}"]
    if shape is not None:
        notes.append(f"slice: {multislice(shape, spec.num_slices).describe()}, one process of "
                     f"the run per host; the run's layout was checked for it")
    if spec.num_slices > 1:
        notes.append(f"multislice: one queued resource {spec.name} of {spec.num_slices} slices "
                     f"({', '.join(spec.node_ids)}), joined over the data-centre network; the "
                     "processes are numbered slice by slice, worker 0 of slice 0 coordinates")
    notes += [
             f"workers install {staged.wheel.name} and the {staging.LOCK_NAME} beside it "
             f"(uv {staging.UV_VERSION}, Python {staging.python_version()}), staged in "
             f"{staged.code_dir}"]
    if not spec.networking.external_ips:
        notes.append("workers get internal IPs only (--internal-ips: networkConfig."
                     "enableExternalIps is false): they reach PyPI (uv, jax[tpu] and the "
                     "locked packages) only through Cloud NAT, and the bucket only with "
                     "Private Google Access, on their subnetwork")
    return _Plan(create, script, run_dir, staged, launch, tuple(notes))


def _env_id(training_flags) -> str:
    from podracer.orchestrate.parse import parse

    return parse(list(training_flags)).configs.run.env


def _slice_address(spec: SliceSpec, command: Command) -> dict:
    """How a worker names its own slice to delete it: `python launch/tpu.py down` flags."""
    return {"name": spec.name, "zone": spec.zone, "project": spec.project,
            "api_endpoint": command.api_endpoint or ""}


def _run_or_up(api: TpuApi, command: Command, say: Say) -> int:
    with tempfile.TemporaryDirectory(prefix="podracer-stage-") as build_dir:
        plan = _plan(command, api.spec, Path(build_dir))
        for note in plan.notes:
            say(note)
        # The bucket is proved writable and the code staged before a slice is paid for.
        storage.probe_writable(plan.run_dir)
        plan.staged.upload()
    say(f"staged the code in {plan.staged.code_dir}")
    plan.launch.save()
    return follow(api, plan.launch, say, create=True, wait_for_end=command.verb == "run",
                  detach=command.detach)


def _spec_of(launch: Launch, spec: SliceSpec) -> SliceSpec:
    """The slice a launch record creates: its project, zone and name."""
    create = launch.create
    parts = create.parent.split("/")  # projects/P/locations/Z
    name = create.queued_resource_id if launch.queued else create.node_id
    return dataclasses.replace(spec, project=parts[1], zone=parts[3], name=name,
                               queued=launch.queued, num_slices=launch.num_slices)


def _attach(api: TpuApi, command: Command, say: Say) -> int:
    """Follows a run again, from its launch record: to its end, restarts included."""
    launch = Launch.load(command.run_dir or _run_dir_of(api))
    spec = dataclasses.replace(api.spec, queued=launch.queued, num_slices=launch.num_slices)
    api = TpuApi(api.client, spec, api.timing)
    say(f"attached to the run in {launch.run_dir} on TPU {spec.name}"
        + (f" ({len(launch.restarts)} restarts so far)" if launch.restarts else ""))
    node = api.send_or_none(requests.get_node_request(spec, spec.node_ids[0]),
                            f"reading TPU {spec.node_ids[0]}")
    if node is None and logs.finished(launch.run_dir):
        say(f"the run has finished and TPU {spec.name} is gone")
        say_results(launch, spec, say)
        return 0
    return follow(api, launch, say, create=False, wait_for_end=True)


# -- status, down, list --------------------------------------------------------


def _status(api: TpuApi, say: Say) -> int:
    spec = api.spec
    node = api.send_or_none(requests.get_node_request(spec), f"reading TPU {spec.name}")
    resource = api.send_or_none(requests.get_queued_resource_request(spec),
                                f"reading queued resource {spec.name}")
    if node is None and resource is None:
        raise _no_such_slice(spec)
    if resource is not None:
        say(describe_queued_resource(resource))
    slices = [node] if node is not None else []
    if node is None and resource is not None and requests.num_slices_of(resource) > 1:
        # A multislice: its nodes are NAME-0, NAME-1, ..., once it is ACTIVE.
        spec = dataclasses.replace(spec, num_slices=requests.num_slices_of(resource))
        slices = [found for node_id in spec.node_ids if (found := api.send_or_none(
            requests.get_node_request(spec, node_id), f"reading TPU {node_id}")) is not None]
    run_dir = ""
    for node in slices:
        for line in describe_node(node):
            say(line)
        node_id = node.name.rsplit("/", 1)[-1]
        try:
            states = read_worker_states(api, spec, len(node.network_endpoints), node_id)
        except ApiError as error:  # the slice's state is worth showing without its workers'
            say(f"  workers: unknown ({error})")
            states = []
        for line in describe_worker_table(node, states) if states else []:
            say(line)
        run_dir = run_dir or node.metadata.get(requests.RUN_DIR_KEY, "")
    for line in where_to_look(spec, run_dir) if run_dir else []:
        say(line)
    return 0


def _run_dir_of(api: TpuApi) -> str:
    """The run directory of the slice `api.spec` names, from the node's metadata (a
    multislice's, from its queued resource's node spec)."""
    spec = api.spec
    node = api.send_or_none(requests.get_node_request(spec), f"reading TPU {spec.name}")
    if node is None:
        resource = api.send_or_none(requests.get_queued_resource_request(spec),
                                    f"reading queued resource {spec.name}")
        if resource is not None and requests.num_slices_of(resource) > 1:
            node = resource.tpu.node_spec[0].node
    run_dir = node.metadata.get(requests.RUN_DIR_KEY, "") if node is not None else ""
    if not run_dir:
        raise PodracerError(
            f"{_no_such_slice(spec) if node is None else f'TPU {spec.name} was not started by podracer'}"
            "; read a run's logs from its bucket with: python launch/tpu.py logs gs://BUCKET/PATH")
    return run_dir


def _no_such_slice(spec: SliceSpec) -> PodracerError:
    return PodracerError(f"no TPU named {spec.name} in {spec.zone} (project {spec.project}); "
                         f"see `python launch/tpu.py list --zone={spec.zone}`")


def _down(api: TpuApi, say: Say) -> int:
    """Deletes the node, or its queued resource (and so the node) if it came from one."""
    spec = api.spec
    node = api.send_or_none(requests.get_node_request(spec), f"reading TPU {spec.name}")
    if node is not None:
        # The node names the queued resource it came from, which may be named apart from it.
        delete_slice(api, spec, say, queued_resource=node.queued_resource)
        return 0
    resource = api.send_or_none(requests.get_queued_resource_request(spec),
                                f"reading queued resource {spec.name}")
    if resource is None:
        raise _no_such_slice(spec)
    delete_slice(api, dataclasses.replace(spec, queued=True), say)
    return 0


def _list(api: TpuApi, say: Say) -> int:
    spec = api.spec
    nodes = api.send(requests.list_nodes_request(spec), f"listing TPUs in {spec.zone}")
    queued = api.send(requests.list_queued_resources_request(spec),
                      f"listing queued resources in {spec.zone}")
    nodes, queued = list(nodes), list(queued)
    if not nodes and not queued:
        say(f"no TPUs in {spec.zone} (project {spec.project})")
        return 0
    for line in list_table(nodes, queued):
        say(line)
    return 0


# -- dry run -------------------------------------------------------------------


def _dry_run(command: Command, say: Say) -> int:
    """Prints the requests as JSON, then notes and the startup script as `#` lines; sends nothing.

    The JSON is what would be sent, so a field at its default (`false`, an
    empty string) is absent from it; the notes say what that leaves out.
    """
    spec = command.spec
    script, notes, staged = None, (), []
    if command.verb == "list":
        sent = [requests.list_nodes_request(spec), requests.list_queued_resources_request(spec)]
    elif command.verb == "status":
        sent = [requests.get_node_request(spec), requests.get_queued_resource_request(spec),
                requests.guest_attributes_request(spec)]
    elif command.verb in ("logs", "attach"):
        sent = [requests.get_node_request(spec)]
    elif command.verb == "down":
        sent = [requests.get_node_request(spec), requests.delete_request(spec)]
    else:
        with tempfile.TemporaryDirectory(prefix="podracer-stage-") as build_dir:
            plan = _plan(command, spec, Path(build_dir))
            staged = plan.staged.describe()
        script, notes = plan.startup_script, plan.notes
        sent = [plan.create_request]
        if spec.queued:
            sent.append(requests.get_queued_resource_request(spec))
        sent += [requests.get_node_request(spec, node_id) for node_id in spec.node_ids]
        if command.verb == "run":
            sent += [requests.guest_attributes_request(spec, node_id) for node_id in spec.node_ids]
            if not command.keep:
                sent.append(requests.delete_request(spec))
    say(requests.describe_requests(sent))
    for note in notes:
        say(f"# {note}")
    if staged:
        say("# staged before the slice is created (uploaded by a real run, not by --dry-run):")
        for line in staged:
            say(f"#   {line}")
    if script is not None:
        say(f"# startup script (node metadata {requests.STARTUP_SCRIPT_KEY!r}, run on every worker):")
        say(script.rstrip("\n"))
    return 0
