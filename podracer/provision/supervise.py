"""A run on a slice, from its creation to its end: restarts, detach and attach.

The launch record, `RUN_DIR/launch.json` in the run's bucket, holds what it takes
to create the slice again (the create request), how the run is to be followed
(`--max-restarts`, `--keep`, the `--max-run-time` deadline) and the restarts made
so far. `attach NAME` reads it, so any machine with the credentials can take over
a run whose launcher was closed or lost.

The promises:

- a slice this command created is deleted when the run ends, fails, or is
  interrupted, unless the user asked to keep it (`--keep`, `up`, `--detach`);
- a slice that is training is never deleted because the API or the credentials
  were unavailable for a while: the launcher waits, retries and says so;
- a slice preempted or lost mid-run is deleted and created again, up to
  `--max-restarts` times; the workers resume from the run's last checkpoint in
  the bucket, so a restart costs at most one checkpoint interval of steps.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import time

from google.cloud import tpu_v2

from podracer.errors import Interrupted, PodracerError
from podracer.provision import api_requests as requests
from podracer.provision import logs
from podracer.provision.api import ApiError, TpuApi
from podracer.provision.lifecycle import (RunFailed, Say, SliceLost, create_slice, delete_slice,
                                          new_launch_id, wait_for_run, wait_until_ready)
from podracer.provision.report import (describe_node, describe_summary, down_command,
                                       logs_command, where_to_look)
from podracer.provision.spec import SliceSpec
from podracer import storage

LAUNCH_RECORD = "launch.json"


@dataclasses.dataclass
class Launch:
    """What `run`, `--detach` and `attach` need to follow a run, kept in its bucket."""

    run_dir: str
    create: tpu_v2.CreateNodeRequest | tpu_v2.CreateQueuedResourceRequest
    max_restarts: int = 0
    keep: bool = False
    max_run_time_s: float | None = None  # --max-run-time
    deadline_unix: float | None = None  # set when the first slice is READY: time queued does not count
    restarts: list[dict] = dataclasses.field(default_factory=list)

    @property
    def queued(self) -> bool:
        return isinstance(self.create, tpu_v2.CreateQueuedResourceRequest)

    @property
    def num_slices(self) -> int:
        return requests.num_slices_of(self.create.queued_resource) if self.queued else 1

    def save(self) -> None:
        kind = type(self.create)
        record = {"run_dir": self.run_dir, "create_kind": kind.__name__,
                  "create": json.loads(kind.to_json(self.create)),
                  "max_restarts": self.max_restarts, "keep": self.keep,
                  "max_run_time_s": self.max_run_time_s, "deadline_unix": self.deadline_unix,
                  "restarts": self.restarts}
        storage.write_text(storage.join(self.run_dir, LAUNCH_RECORD), json.dumps(record, indent=1))

    @classmethod
    def load(cls, run_dir: str) -> "Launch":
        path = storage.join(run_dir, LAUNCH_RECORD)
        if not storage.exists(path):
            raise PodracerError(f"{run_dir} has no {LAUNCH_RECORD}: it was not launched on a "
                                "slice by podracer (or by an older version); nothing to attach to")
        record = json.loads(storage.read_text(path))
        kind = getattr(tpu_v2, record["create_kind"])
        return cls(run_dir=record["run_dir"], create=kind.from_json(json.dumps(record["create"])),
                   max_restarts=record["max_restarts"], keep=record["keep"],
                   max_run_time_s=record.get("max_run_time_s"),
                   deadline_unix=record["deadline_unix"], restarts=record["restarts"])

    def fresh_create(self) -> tuple[object, str]:
        """The create request with a new launch id (and request id): one per slice created."""
        request = type(self.create)(self.create)
        node = request.queued_resource.tpu.node_spec[0].node if self.queued else request.node
        launch_id = new_launch_id()
        node.labels[requests.LAUNCH_ID_LABEL] = launch_id
        node.metadata[requests.LAUNCH_ID_LABEL] = launch_id  # the workers' barrier key
        if self.queued:
            request.request_id = requests.new_request_id()
        return request, launch_id

    def seconds_left(self) -> float | None:
        return None if self.deadline_unix is None else self.deadline_unix - time.time()


def follow(api: TpuApi, launch: Launch, say: Say, *, create: bool, wait_for_end: bool,
           detach: bool = False) -> int:
    """Creates the slice (when `create`), then follows the run on it to its end.

    Returns after the slice is ready when not `wait_for_end` (`up`) or when
    `detach`; otherwise deletes the slice at the end (unless `keep`), re-creating
    it after a preemption while restarts are left.
    """
    spec = api.spec
    while True:
        might_exist = True  # from the moment a create is sent, the slice may exist
        try:
            if create:
                request, launch_id = launch.fresh_create()
                say(f"creating TPU {spec.name} ({spec.shape}) in {spec.zone} ...")
                try:
                    operation = create_slice(api, spec, request, launch_id)
                except ApiError as error:
                    # A refused create made nothing, except one that kept failing with
                    # UNAVAILABLE, which the server may have carried out.
                    might_exist = error.maybe_applied
                    raise
                nodes = wait_until_ready(api, spec, operation, say)
                if launch.deadline_unix is None and launch.max_run_time_s:
                    launch.deadline_unix = time.time() + launch.max_run_time_s
                    launch.save()  # `attach` keeps the same deadline
                for line in ([line for node in nodes for line in describe_node(node)]
                             + where_to_look(spec, launch.run_dir)):
                    say(line)
                if not wait_for_end:
                    say(f"TPU {spec.name} keeps running, and billing, until you run: "
                        f"{down_command(spec)}")
                    return 0
                if detach:
                    for line in _detached(spec, launch):
                        say(line)
                    return 0
            else:
                nodes = _live_nodes(api, spec)
            # Every slice of a multislice has the same shape: as many workers each.
            outcome = wait_for_run(api, spec, len(nodes[0].network_endpoints), say,
                                   _deadline(launch))
            if not outcome.succeeded:
                worker = outcome.first_failed()
                raise RunFailed(f"the run failed on TPU {spec.name}: {outcome.failure()}; its "
                                f"log: {logs.log_path(launch.run_dir, worker)} "
                                f"({logs_command(spec, worker)})")
            say(f"the run finished on every worker of TPU {spec.name}")
            say_results(launch, spec, say)
        except SliceLost as lost:
            if logs.finished(launch.run_dir):  # its workers saw the end first, and deleted it
                say(f"the run finished on every worker, and TPU {spec.name} is gone ({lost})")
                say_results(launch, spec, say)
                return 0
            if len(launch.restarts) >= launch.max_restarts:
                raise _after_cleanup(api, spec, launch.keep, say, _no_restart_left(lost, launch)) from None
            _restart(api, spec, launch, lost, say)
            create = True
            continue
        except (PodracerError, KeyboardInterrupt) as error:
            if not might_exist:
                raise
            raise _after_cleanup(api, spec, launch.keep, say, error) from None
        if launch.keep:
            say(f"kept TPU {spec.name} (--keep); delete it with: {down_command(spec)}")
            return 0
        _, failed = _delete_and_describe(api, spec, say)
        if failed:
            raise PodracerError(f"the run finished, but {failed}")
        return 0


def _deadline(launch: Launch) -> float | None:
    left = launch.seconds_left()
    return None if left is None else time.monotonic() + left


def _live_nodes(api: TpuApi, spec: SliceSpec) -> list[tpu_v2.Node]:
    """The slices as they are now, for a launcher that attaches to them; lost if one is gone."""
    nodes = []
    for node_id in spec.node_ids:
        node = api.send_or_none(requests.get_node_request(spec, node_id), f"reading TPU {node_id}")
        if node is None:
            raise SliceLost(f"TPU {node_id} is gone")
        nodes.append(node)
    return nodes


def _restart(api: TpuApi, spec: SliceSpec, launch: Launch, lost: SliceLost, say: Say) -> None:
    """Deletes what is left of a lost slice and records the restart in the bucket."""
    launch.restarts.append({"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                            "reason": str(lost)})
    launch.save()
    say(f"{lost}; restart {len(launch.restarts)} of {launch.max_restarts}: deleting what is "
        f"left, then creating TPU {spec.name} again; the workers resume from the last "
        f"checkpoint in {launch.run_dir}")
    done, failed = _delete_and_describe(api, spec, say)
    if failed:
        raise PodracerError(f"{lost}; {failed}")


def _no_restart_left(lost: SliceLost, launch: Launch) -> RunFailed:
    made = f"after {len(launch.restarts)} restarts " if launch.restarts else ""
    return RunFailed(f"{lost} {made}(--max-restarts={launch.max_restarts}); resume it with the "
                     f"same command and --run-dir={launch.run_dir}")


def _detached(spec: SliceSpec, launch: Launch) -> list[str]:
    flags = f"--zone={spec.zone} --project={spec.project}"
    return [f"detached: TPU {spec.name} trains on, and bills, without this launcher",
            f"  follow it again: python launch/tpu.py attach {spec.name} {flags}",
            f"  its logs:        {logs_command(spec, worker=0, follow=True)}",
            f"  stop it:         {down_command(spec)}",
            "  when the run ends, its workers delete the slice"
            + (" (but not the slice: --keep)" if launch.keep else "")]


def say_results(launch: Launch, spec: SliceSpec, say: Say) -> None:
    """The run's result, read back from its bucket, the restarts it took, and where everything is.

    The restarts are also added to the run's `summary.json` (`slice_restarts`).
    """
    run_dir = launch.run_dir
    summary_path = storage.join(run_dir, "summary.json")
    try:
        summary = json.loads(storage.read_text(summary_path)) if storage.exists(summary_path) else None
    except (OSError, ValueError) as error:
        say(f"cannot read {summary_path} ({type(error).__name__}); the run's files are in {run_dir}")
        return
    if summary is None:
        say(f"no summary.json in {run_dir}; see the workers' logs: {logs_command(spec)}")
        return
    if launch.restarts and summary.get("slice_restarts") != launch.restarts:
        summary["slice_restarts"] = launch.restarts
        storage.write_text(summary_path, json.dumps(summary, indent=1))
    restarts = ([f"  restarts: {len(launch.restarts)} ("
                 + "; ".join(restart["reason"] for restart in launch.restarts) + ")"]
                if launch.restarts else [])
    for line in [f"results in {run_dir}:", *describe_summary(summary), *restarts,
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
