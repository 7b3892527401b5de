"""The verbs: run (no verb), up, status, logs, down, list.

`launch_on_slice` holds the one promise that matters most: a slice this
command created is deleted when the run ends, fails, or is interrupted, unless
the user asked to keep it.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import tempfile
import uuid
from pathlib import Path

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
from podracer.provision import logs, staging
from podracer.provision.report import (
    describe_node,
    describe_queued_resource,
    describe_summary,
    describe_worker_table,
    down_command,
    list_table,
    logs_command,
    where_to_look,
)
from podracer.provision.spec import Command, SliceSpec
from podracer.provision.startup import make_startup_script, worker_config
from podracer.session import storage


def execute(command: Command, say: Say) -> int:
    """Runs `command`; returns the exit status or raises `PodracerError` (or `Interrupted`)."""
    if command.verb == "logs" and command.run_dir:
        return logs.show(command.run_dir, command.worker, command.follow, say,
                         command.timing.poll_interval)
    if command.dry_run:
        spec = _with_project(command.spec, _project_for_dry_run(command))
        return _dry_run(dataclasses.replace(command, spec=spec), say)
    api = _open_api(command)
    try:
        if command.verb == "list":
            return _list(api, say)
        if command.verb == "status":
            return _status(api, say)
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
    launch_id: str
    startup_script: str
    run_dir: str
    staged: staging.Staged
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
    staged = staging.prepare(run_dir, command.launcher or staging.DEFAULT_LAUNCHER, build_dir,
                             staging.worker_extras(command.training_flags))
    config = worker_config(run_dir, staged.code_dir, staged.names,
                           _without_run_dir(command.training_flags), staging.UV_VERSION,
                           staging.python_version())
    script = make_startup_script(config)
    launch_id = new_launch_id()
    node = requests.make_node(spec, script, launch_id, run_dir)
    if spec.queued:
        create = requests.create_queued_resource_request(
            spec, node, command.timing.ready_timeout, request_id=str(uuid.uuid4()))
    else:
        create = requests.create_node_request(spec, node)
    notes = [f"run directory: {run_dir}",
             f"workers install {staged.wheel.name} and the {staging.LOCK_NAME} beside it "
             f"(uv {staging.UV_VERSION}, Python {staging.python_version()}), staged in "
             f"{staged.code_dir}"]
    if not spec.networking.external_ips:
        notes.append("workers get internal IPs only (--internal-ips: networkConfig."
                     "enableExternalIps is false): they reach PyPI (uv, jax[tpu] and the "
                     "locked packages) only through Cloud NAT, and the bucket only with "
                     "Private Google Access, on their subnetwork")
    return _Plan(create, launch_id, script, run_dir, staged, tuple(notes))


def _run_or_up(api: TpuApi, command: Command, say: Say) -> int:
    with tempfile.TemporaryDirectory(prefix="podracer-stage-") as build_dir:
        plan = _plan(command, api.spec, Path(build_dir))
        for note in plan.notes:
            say(note)
        # The bucket is proved writable and the code staged before a slice is paid for.
        storage.probe_writable(plan.run_dir)
        plan.staged.upload()
    say(f"staged the code in {plan.staged.code_dir}")
    return launch_on_slice(api, plan.create_request, plan.launch_id, plan.run_dir, say,
                           wait_for_end=command.verb == "run", keep=command.keep)


def launch_on_slice(api: TpuApi, create_request, launch_id: str, run_dir: str, say: Say, *,
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
        for line in describe_node(node) + where_to_look(spec, run_dir):
            say(line)
        if not wait_for_end:
            say(f"TPU {spec.name} keeps running, and billing, until you run: {down_command(spec)}")
            return 0
        outcome = wait_for_run(api, spec, len(node.network_endpoints), say)
        if not outcome.succeeded:
            worker = outcome.first_failed()
            raise RunFailed(f"the run failed on TPU {spec.name}: {outcome.failure()}; its log: "
                            f"{logs.log_path(run_dir, worker)} ({logs_command(spec, worker)})")
        say(f"the run finished on every worker of TPU {spec.name}")
        _say_results(run_dir, spec, say)
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


def _say_results(run_dir: str, spec: SliceSpec, say: Say) -> None:
    """The run's result, read back from its bucket, and where everything is."""
    summary_path = storage.join(run_dir, "summary.json")
    try:
        summary = json.loads(storage.read_text(summary_path)) if storage.exists(summary_path) else None
    except (OSError, ValueError) as error:
        say(f"cannot read {summary_path} ({type(error).__name__}); the run's files are in {run_dir}")
        return
    if summary is None:
        say(f"no summary.json in {run_dir}; see the workers' logs: {logs_command(spec)}")
        return
    for line in [f"results in {run_dir}:", *describe_summary(summary),
                 f"  plot:  python -m podracer.plot {run_dir}",
                 f"  logs:  {logs_command(spec)} (or: python launch/tpu.py logs {run_dir})"]:
        say(line)


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
    run_dir = node.metadata.get(requests.RUN_DIR_KEY, "")
    for line in describe_worker_table(node, states) + (where_to_look(spec, run_dir) if run_dir else []):
        say(line)
    return 0


def _run_dir_of(api: TpuApi) -> str:
    """The run directory of the slice `api.spec` names, from the node's metadata."""
    spec = api.spec
    node = api.send_or_none(requests.get_node_request(spec), f"reading TPU {spec.name}")
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
    script, notes, staged = None, (), []
    if command.verb == "list":
        sent = [requests.list_nodes_request(spec), requests.list_queued_resources_request(spec)]
    elif command.verb == "status":
        sent = [requests.get_node_request(spec), requests.get_queued_resource_request(spec),
                requests.guest_attributes_request(spec)]
    elif command.verb == "logs":
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
        sent.append(requests.get_node_request(spec))
        if command.verb == "run":
            sent.append(requests.guest_attributes_request(spec))
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
