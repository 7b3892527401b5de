"""The verbs: run (no verb), up, status, down, list.

`launch_on_slice` holds the one promise that matters most: a slice this
command created is deleted when the run ends, fails, or is interrupted, unless
the user asked to keep it.
"""

from __future__ import annotations

import dataclasses
import signal
import uuid

from podracer.errors import Interrupted, PodracerError
from podracer.provision import api_requests as requests
from podracer.provision.api import (
    ApiError,
    TpuApi,
    application_default_credentials,
    connect,
    is_loopback,
)
from podracer.provision.lifecycle import (
    RunFailed,
    Say,
    create_slice,
    delete_slice,
    new_launch_id,
    read_worker_states,
    wait_for_run,
    wait_until_ready,
)
from podracer.provision.report import (
    describe_node,
    describe_queued_resource,
    describe_worker_table,
    down_command,
    list_table,
    where_to_look,
)
from podracer.provision.source import DEFAULT_LAUNCHER, default_install_spec, read_launcher
from podracer.provision.spec import Command, SliceSpec, WorkerLayout
from podracer.provision.startup import make_startup_script

LAYOUT = WorkerLayout()


def execute(command: Command, say: Say) -> int:
    """Runs `command`; returns the exit status or raises `PodracerError` (or `Interrupted`)."""
    if command.dry_run:
        spec = _with_project(command.spec, _project_for_dry_run(command))
        return _dry_run(dataclasses.replace(command, spec=spec), say)
    api = _open_api(command)
    try:
        if command.verb == "list":
            return _list(api, say)
        if command.verb == "status":
            return _status(api, say)
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
    launch_id: str
    startup_script: str
    install_notes: tuple[str, ...]


def _plan(command: Command, spec: SliceSpec) -> _Plan:
    """Everything `run`/`up` will send, decided before anything is sent."""
    if command.install_spec:
        install_spec, notes = command.install_spec, []
    else:
        install_spec, notes = default_install_spec()
    launcher = read_launcher(command.launcher or DEFAULT_LAUNCHER)
    script = make_startup_script(install_spec, launcher, command.training_flags, LAYOUT)
    launch_id = new_launch_id()
    node = requests.make_node(spec, script, launch_id)
    if spec.queued:
        create = requests.create_queued_resource_request(
            spec, node, command.timing.ready_timeout, request_id=str(uuid.uuid4()))
    else:
        create = requests.create_node_request(spec, node)
    notes.insert(0, f"workers install: {install_spec}")
    if not spec.networking.external_ips:
        notes.append("workers get internal IPs only (--internal-ips: networkConfig."
                     "enableExternalIps is false): they reach PyPI and GitHub only through "
                     "Cloud NAT on their subnetwork")
    return _Plan(create, launch_id, script, tuple(notes))


def _run_or_up(api: TpuApi, command: Command, say: Say) -> int:
    plan = _plan(command, api.spec)
    for note in plan.install_notes:
        say(note)
    return launch_on_slice(api, plan.create_request, plan.launch_id, say,
                           wait_for_end=command.verb == "run", keep=command.keep)


def launch_on_slice(api: TpuApi, create_request, launch_id: str, say: Say, *,
                    wait_for_end: bool, keep: bool) -> int:
    """Creates the slice, waits for it, and (when `wait_for_end`) for the run on it.

    Deletes the slice afterwards when `wait_for_end`, and after any failure or
    Ctrl-C, unless `keep`.
    """
    spec = api.spec
    # From the moment the create is sent the slice may exist, even if the call is
    # interrupted before its answer comes back.
    might_exist = True
    say(f"creating TPU {spec.name} ({spec.shape}) in {spec.zone} ...")
    try:
        try:
            operation = create_slice(api, spec, create_request, launch_id)
        except ApiError as error:
            # A refused create made nothing, except one that kept failing with
            # UNAVAILABLE, which the server may have carried out.
            might_exist = error.maybe_applied
            raise
        node = wait_until_ready(api, spec, operation, say)
        for line in describe_node(node) + where_to_look(spec, LAYOUT):
            say(line)
        if not wait_for_end:
            say(f"TPU {spec.name} keeps running, and billing, until you run: {down_command(spec)}")
            return 0
        outcome = wait_for_run(api, spec, len(node.network_endpoints), say)
        if not outcome.succeeded:
            raise RunFailed(f"the run failed on TPU {spec.name}: {outcome.failure()}; "
                            f"see {LAYOUT.log_path} on the workers")
        say(f"the run finished on every worker of TPU {spec.name}")
    except (PodracerError, KeyboardInterrupt) as error:
        if not might_exist:
            raise
        raise _after_cleanup(api, spec, keep, say, error) from None
    if keep:
        say(f"kept TPU {spec.name} (--keep); delete it with: {down_command(spec)}")
        return 0
    _, failed = _delete_and_describe(api, spec, say)
    if failed:
        raise PodracerError(f"the run finished, but {failed}")
    return 0


def _delete_and_describe(api: TpuApi, spec: SliceSpec, say: Say) -> tuple[str, str | None]:
    """Deletes the slice: (what happened, or None) and (what went wrong, or None)."""
    try:
        deleted = delete_slice(api, spec, say)
    except (PodracerError, KeyboardInterrupt) as error:
        reason = "interrupted" if isinstance(error, KeyboardInterrupt) else error
        return "", (f"deleting TPU {spec.name} failed too ({reason}); delete it with: "
                    f"{down_command(spec)}")
    return (f"TPU {spec.name} deleted" if deleted else "no TPU was left behind"), None


def _after_cleanup(api: TpuApi, spec: SliceSpec, keep: bool, say: Say,
                   error: BaseException) -> PodracerError | Interrupted:
    """Deletes the slice after `error` (unless `keep`); the error to report, one line.

    A Ctrl-C is reported as `Interrupted` by SIGINT (exit status 130), as a
    training run stopped by a signal is.
    """
    if keep:
        outcome = f"TPU {spec.name} kept (--keep); delete it with: {down_command(spec)}"
    else:
        done, failed = _delete_and_describe(api, spec, say)
        outcome = failed or done
    if isinstance(error, KeyboardInterrupt):
        return Interrupted(signal.SIGINT, f"interrupted; {outcome}")
    reported = PodracerError(f"{error}; {outcome}")
    reported.exit_code = error.exit_code
    return reported


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
    if node is None:
        return 0
    for line in describe_node(node):
        say(line)
    states = read_worker_states(api, spec, len(node.network_endpoints))
    for line in describe_worker_table(node, states) + where_to_look(spec, LAYOUT):
        say(line)
    return 0


def _no_such_slice(spec: SliceSpec) -> PodracerError:
    return PodracerError(f"no TPU named {spec.name} in {spec.zone} (project {spec.project}); "
                         f"see `python launch/tpu.py list --zone={spec.zone}`")


def _down(api: TpuApi, say: Say) -> int:
    """Deletes the node, or its queued resource (and so the node) if it came from one."""
    spec = api.spec
    node = api.send_or_none(requests.get_node_request(spec), f"reading TPU {spec.name}")
    if node is not None:
        queued = bool(node.queued_resource)
    else:
        resource = api.send_or_none(requests.get_queued_resource_request(spec),
                                    f"reading queued resource {spec.name}")
        if resource is None:
            raise _no_such_slice(spec)
        queued = True
    delete_slice(api, dataclasses.replace(spec, queued=queued), say)
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
    script, notes = None, ()
    if command.verb == "list":
        sent = [requests.list_nodes_request(spec), requests.list_queued_resources_request(spec)]
    elif command.verb == "status":
        sent = [requests.get_node_request(spec), requests.get_queued_resource_request(spec),
                requests.guest_attributes_request(spec)]
    elif command.verb == "down":
        sent = [requests.get_node_request(spec), requests.delete_request(spec)]
    else:
        plan = _plan(command, spec)
        script, notes = plan.startup_script, plan.install_notes
        sent = [plan.create_request]
        if spec.queued:
            sent.append(requests.get_queued_resource_request(spec))
        sent.append(requests.get_node_request(spec))
        if command.verb == "run":
            sent.append(requests.guest_attributes_request(spec))
            if not command.keep:
                sent.append(requests.delete_request(spec))
    say(requests.describe_requests(sent))
    for note in notes:
        say(f"# {note}")
    if script is not None:
        say(f"# startup script (node metadata {requests.STARTUP_SCRIPT_KEY!r}, run on every worker):")
        say(script.rstrip("\n"))
    return 0
