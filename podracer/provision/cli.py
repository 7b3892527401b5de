"""`python launch/tpu.py [up|status|logs|attach|down|list] --tpu=NAME --zone=ZONE ... [training flags]`.

Verbs, as a gcloud user expects them:
- no verb: create the slice, run training on every worker, wait for the run to
  end, then delete the slice (unless --keep);
- `up`: create the slice and start training, then return; the slice keeps
  running until `down`;
- `status`: the slice's state and what each worker's run is doing;
- `logs NAME` (or `logs gs://BUCKET/RUN`): the workers' logs, from the run's
  bucket (`--worker=I` for one, `--follow` until the run ends);
- `attach NAME` (or `attach gs://BUCKET/RUN`): follow a run again, as the
  command that started it would have (`--detach`, or a launcher that was lost):
  to its end, restarts after preemption included, then delete the slice;
- `down`: delete the slice (and its queued resource);
- `list`: the slices in a zone.

A run on a slice lives in a bucket (`--bucket=gs://BUCKET`, or
`--run-dir=gs://BUCKET/PATH`): the code the workers install (a wheel of this
checkout and a lock of its dependencies), checkpoints, metrics, the summary and
the workers' logs. The slice's disks are deleted with it.

The provisioner's flags are the fixed set below; every other flag is a training
flag. Training flags, and everything after `--`, are checked here with the
trainer's own parser (`preflight`) before anything is created, then passed to
`python launch/tpu.py` on every worker.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import sys
from pathlib import Path

from podracer.errors import Interrupted, PodracerError
from podracer.provision import preflight, slices, validate
from podracer.provision.spec import (CLOUD_PLATFORM_SCOPE, TPU_VERSIONS, Command, SliceSpec,
                                     Timing, default_runtime_version)

VERBS = ("up", "status", "logs", "attach", "down", "list")


class _Parser(argparse.ArgumentParser):
    """Reports a bad flag as a one-line `PodracerError` instead of usage and exit."""

    def error(self, message: str):
        raise PodracerError(f"{message}; see `{self.prog} --help`")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be more than 0 seconds")
    return value


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a count (0, 1, 2, ...)")
    return int(text)


def _worker_index(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a worker number (0, 1, ...)")
    return int(text)


LAUNCHER = "python launch/tpu.py"


def _make_parser(verb: str, program: str = LAUNCHER) -> _Parser:
    """`program` is how the user called podracer (`podracer` or `python launch/tpu.py`)."""
    parser = _Parser(prog=program + (f" {verb}" if verb != "run" else ""), allow_abbrev=False,
                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    slice_flags = parser.add_argument_group("the slice")
    slice_flags.add_argument("--tpu", metavar="NAME", help="name of the TPU slice")
    slice_flags.add_argument("--zone", help="zone, e.g. us-central2-b")
    slice_flags.add_argument("--project", help="Google Cloud project (default: from ADC)")
    if verb in ("run", "up"):
        slice_flags.add_argument("--accelerator-type", metavar="TYPE",
                                 help="the slice by TensorCores, e.g. v4-32; or give "
                                      "--tpu-version and --topology")
        slice_flags.add_argument("--tpu-version", type=str.lower, choices=TPU_VERSIONS,
                                 help="TPU version of a slice given by --topology (gcloud's --type)")
        slice_flags.add_argument("--topology", metavar="AxBxC",
                                 help="chips along each axis, e.g. 2x2x4 (v4, v5p) or 4x4 (v5e, v6e)")
        slice_flags.add_argument("--runtime-version", metavar="IMAGE",
                                 help="TPU VM image (default: the one for the TPU generation)")
        tier = slice_flags.add_mutually_exclusive_group()
        tier.add_argument("--spot", action="store_true", help="spot capacity: cheaper, preemptible")
        tier.add_argument("--reserved", action="store_true", help="use the project's reservation")
        slice_flags.add_argument("--queued", action="store_true",
                                 help="create a queued resource that waits for capacity")
        slice_flags.add_argument("--num-slices", type=_count, default=1, metavar="N",
                                 help="multislice: N slices of this shape as one queued resource "
                                      "(needs --queued; nodes NAME-0 .. NAME-N-1), one run over "
                                      "all their hosts, its data parallelism across slices "
                                      "(default 1)")
        net = parser.add_argument_group("network and identity (as gcloud compute tpus tpu-vm create)")
        # gcloud calls it --network; here --network is the policy's (mlp, lstm, gru).
        net.add_argument("--vpc-network", dest="network",
                         help="VPC network (default: the project's `default`)")
        net.add_argument("--subnetwork", help="subnetwork of --vpc-network")
        net.add_argument("--internal-ips", action="store_true",
                         help="no external IPs on the workers; they then need Cloud NAT to reach "
                              "PyPI and GitHub (default: external IPs, as gcloud)")
        net.add_argument("--tags", action="append", metavar="TAG[,TAG...]",
                         help="network tags for firewall rules; repeatable")
        net.add_argument("--service-account", metavar="EMAIL",
                         help="service account the workers run as (default: Compute Engine's)")
        net.add_argument("--scopes", action="append", metavar="URL[,URL...]",
                         help=f"OAuth scopes of the service account (default: {CLOUD_PLATFORM_SCOPE})")
        run_flags = parser.add_argument_group("the run")
        run_flags.add_argument("--keep", action="store_true",
                               help="never delete the slice, not even after a failure")
        run_flags.add_argument("--max-restarts", type=_count, default=0, metavar="N",
                               help="when the slice is preempted or lost, create it again up to "
                                    "N times; the workers resume from the run's last checkpoint "
                                    "in the bucket (and start training again together up to N "
                                    "times if it fails, e.g. after a worker rebooted) (default 0)")
        run_flags.add_argument("--detach", action="store_true",
                               help="return once the run has started; follow it again with "
                                    "`attach NAME`; its workers delete the slice when it ends")
        run_flags.add_argument("--bucket", metavar="gs://BUCKET[/PREFIX]",
                               help="where the run lives: its staged code, checkpoints, metrics, "
                                    "summary and the workers' logs, in PREFIX/runs/NAME (or give "
                                    "--run-dir=gs://BUCKET/PATH)")
        run_flags.add_argument("--launcher", type=Path, metavar="PATH",
                               help="launcher file the workers run (default: launch/tpu.py)")
    else:
        parser.add_argument("--queued", action="store_true", help=argparse.SUPPRESS)
    if verb == "logs":
        logs = parser.add_argument_group("logs")
        logs.add_argument("--worker", type=_worker_index, metavar="I",
                          help="one worker's log (default: every worker's, each line marked)")
        logs.add_argument("--follow", action="store_true",
                          help="keep printing as the logs grow, until the workers end")
    api_flags = parser.add_argument_group("the API")
    api_flags.add_argument("--dry-run", action="store_true",
                           help="print the API requests (JSON) and startup script; call nothing")
    api_flags.add_argument("--api-endpoint", metavar="HOST:PORT",
                           help="Cloud TPU API endpoint; a loopback one is spoken to in "
                                "plaintext with anonymous credentials")
    api_flags.add_argument("--poll-interval", type=_seconds, default=Timing.poll_interval,
                           metavar="SECONDS")
    api_flags.add_argument("--ready-timeout", type=_seconds, default=Timing.ready_timeout,
                           metavar="SECONDS", help="give up if the slice is not ready by then")
    api_flags.add_argument("--max-run-time", type=_seconds, default=Timing.run_timeout,
                           metavar="SECONDS", help="stop the run (it saves a checkpoint) and delete "
                                                   "the slice once it has gone this long, counted "
                                                   "from the slice being ready: time queued for "
                                                   "capacity does not count (default 86400); the "
                                                   "workers keep this deadline too")
    api_flags.add_argument("--repair-timeout", type=_seconds, default=Timing.repair_timeout,
                           metavar="SECONDS", help="a slice not READY (REPAIRING) this long mid-run "
                                                   "is lost: restarted, or deleted (default 1800)")
    api_flags.add_argument("--retry-deadline", type=_seconds, default=Timing.retry_deadline,
                           metavar="SECONDS", help="how long to retry an unavailable API")
    return parser


def _split_verb(argv: list[str]) -> tuple[str, list[str]]:
    if argv and argv[0] in VERBS:
        return argv[0], argv[1:]
    return "run", argv


def provisioner_flags(verb: str = "run") -> list[str]:
    """The provisioner's own flags for `verb`: a fixed set; every other flag is a training flag."""
    return [option for action in _make_parser(verb)._actions
            for option in action.option_strings if option.startswith("--")]


def parse_command(argv: list[str], program: str = LAUNCHER) -> Command:
    """Turns argv (without the program name) into a `Command`; raises `PodracerError`."""
    verb, rest = _split_verb(list(argv))
    after_dashes: list[str] = []
    if "--" in rest:
        split = rest.index("--")
        rest, after_dashes = rest[:split], rest[split + 1:]
    args, unknown = _make_parser(verb, program).parse_known_args(rest)
    if verb in ("status", "logs", "attach", "down") and args.tpu is None and unknown and not unknown[0].startswith("-"):
        args.tpu = unknown.pop(0)  # `status NAME`, as with gcloud
    run_dir = None
    if verb in ("logs", "attach") and args.tpu and args.tpu.startswith("gs://"):
        run_dir, args.tpu = args.tpu.rstrip("/"), None  # a run read from its bucket alone
    training_flags = tuple(unknown + after_dashes)
    if verb not in ("run", "up") and training_flags:
        first = training_flags[0]
        hint = preflight.suggestion(first, provisioner_flags(verb)) if first.startswith("--") else ""
        raise PodracerError(f"unexpected argument {first!r} for `{verb}`{hint} "
                            f"(see `{program} {verb} --help`)")

    required = {} if run_dir else {"--zone": args.zone}
    if verb != "list" and not run_dir:
        required["--tpu"] = args.tpu
    if verb in ("run", "up"):
        shape_given = args.accelerator_type or args.tpu_version or args.topology
        required["--accelerator-type (or --tpu-version with --topology)"] = shape_given
    missing = [flag for flag, value in required.items() if not value]
    if missing:
        raise PodracerError(f"`{verb}` needs {', '.join(missing)}; e.g. --tpu=my-slice "
                            "--zone=us-central2-b --accelerator-type=v4-32")
    if args.zone is not None:
        validate.check(validate.ZONE, args.zone, "--zone", "us-central2-b")
    if args.tpu is not None:
        validate.check(validate.NAME, args.tpu, "--tpu",
                       "my-slice (lowercase letters, digits, hyphens)")
    if args.project is not None:
        validate.check(validate.PROJECT, args.project, "--project", "my-project")
    spec = SliceSpec(project=args.project or "", zone=args.zone or "", name=args.tpu or "",
                     queued=args.queued)
    if verb in ("run", "up"):
        spec = _creation(spec, args)
    timing = Timing(poll_interval=args.poll_interval, ready_timeout=args.ready_timeout,
                    run_timeout=args.max_run_time, retry_deadline=args.retry_deadline,
                    call_timeout=min(Timing.call_timeout, args.retry_deadline),
                    repair_timeout=args.repair_timeout)
    return Command(
        verb=verb,
        spec=spec,
        timing=timing,
        training_flags=training_flags,
        keep=getattr(args, "keep", False),
        dry_run=args.dry_run,
        api_endpoint=args.api_endpoint,
        bucket=getattr(args, "bucket", None),
        launcher=getattr(args, "launcher", None),
        run_dir=run_dir,
        worker=getattr(args, "worker", None),
        follow=getattr(args, "follow", False),
        max_restarts=getattr(args, "max_restarts", 0),
        detach=getattr(args, "detach", False),
    )


def _creation(spec: SliceSpec, args: argparse.Namespace) -> SliceSpec:
    """What `run` and `up` create: shape, image, tier, network and identity, all checked."""
    accelerator_type, tpu_version, topology = validate.shape(
        args.accelerator_type, args.tpu_version, args.topology)
    runtime_version = args.runtime_version or default_runtime_version(
        accelerator_type or tpu_version)
    if not runtime_version:
        raise PodracerError(f"no default image for --accelerator-type={accelerator_type}; "
                            "pass --runtime-version (`gcloud compute tpus versions list`)")
    _check_num_slices(args.num_slices, args.queued, accelerator_type or tpu_version)
    return dataclasses.replace(
        spec, accelerator_type=accelerator_type, tpu_version=tpu_version, topology=topology,
        runtime_version=runtime_version, spot=args.spot, reserved=args.reserved,
        num_slices=args.num_slices,
        networking=validate.networking(args.network, args.subnetwork, args.internal_ips, args.tags),
        identity=validate.identity(args.service_account, args.scopes))


def _check_num_slices(num_slices: int, queued: bool, accelerator: str) -> None:
    if num_slices < 1:
        raise PodracerError(f"--num-slices={num_slices}: a run needs at least one slice; "
                            "leave it out for one, or e.g. --num-slices=2 --queued")
    if num_slices == 1:
        return
    if not queued:
        raise PodracerError(f"--num-slices={num_slices} needs --queued: the Cloud TPU API "
                            "creates several slices together only as one queued resource")
    version = accelerator.rsplit("-", 1)[0] if "-" in accelerator else accelerator
    if version in slices.GENERATIONS and version not in slices.MULTISLICE_VERSIONS:
        raise PodracerError(f"--num-slices={num_slices}: {version} has no multislice; use "
                            f"one of {', '.join(slices.MULTISLICE_VERSIONS)} (e.g. "
                            "--accelerator-type=v4-16)")


def check_command(command: Command) -> None:
    """Everything that can be checked before a slice exists; the training flags above all."""
    if command.verb in ("run", "up"):
        preflight.check_training_flags(command.training_flags, provisioner_flags(command.verb))
        spec = command.spec
        shape = slices.slice_shape(spec.accelerator_type, spec.tpu_version, spec.topology)
        if shape is not None:  # a version the table does not know is left to the API
            preflight.check_layout(command.training_flags,
                                   slices.multislice(shape, spec.num_slices))
        from podracer.provision import staging

        staging.slice_run_dir(command.bucket, command.training_flags, command.spec.name)


def main(argv: list[str], program: str = LAUNCHER) -> int:
    """Runs one provisioner command; returns the exit status.

    `program` names the command in help and hints: `python launch/tpu.py` or `podracer`.

    0: done; 1: the run or the slice failed; 2: a problem with the command, the
    credentials or the API; 130: interrupted. Errors are one line on stderr.
    """

    def say(line: str) -> None:
        print(line, flush=True)

    # Library chatter (gcsfs's notes on how it reaches a bucket) would break the
    # one-line error contract; what a user must see, podracer says itself.
    logging.getLogger("gcsfs").setLevel(logging.ERROR)

    try:
        command = parse_command(argv, program)
        check_command(command)
        return _load_commands().execute(command, say)
    except (PodracerError, Interrupted) as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return error.exit_code
    except KeyboardInterrupt:
        stopped = Interrupted(signal.SIGINT, "interrupted")
        print(f"error: {stopped}", file=sys.stderr, flush=True)
        return stopped.exit_code
    except SystemExit as done:  # --help
        return done.code if isinstance(done.code, int) else 0


def _load_commands():
    """The verbs, imported only once a command has parsed.

    They need the Cloud TPU client libraries, an optional extra; without them a
    user should get one line saying how to install them, not a traceback.
    """
    try:
        from podracer.provision import commands
    except ImportError as error:
        if not (error.name or "").startswith(("google", "grpc", "proto")):
            raise
        raise PodracerError(f"the TPU provisioner needs {error.name}, which is missing; "
                            "install it with: pip install \"podracer-rl[tpu]\" (or pip install -e \".[tpu]\" in a checkout)") from None
    return commands


if __name__ == "__main__":  # what a worker runs to delete its own slice
    sys.exit(main(sys.argv[1:]))
