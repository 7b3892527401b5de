"""`python launch/tpu.py [up|status|down|list] --tpu=NAME --zone=ZONE ... [training flags]`.

Verbs, as a gcloud user expects them:
- no verb: create the slice, run training on every worker, wait for the run to
  end, then delete the slice (unless --keep);
- `up`: create the slice and start training, then return; the slice keeps
  running until `down`;
- `status`: the slice's state and what each worker's run is doing;
- `down`: delete the slice (and its queued resource);
- `list`: the slices in a zone.

Flags this module does not know are training flags; they, and everything after
`--`, are passed to `python launch/tpu.py` on every worker.
"""

from __future__ import annotations

import argparse
import re
import signal
import sys
from pathlib import Path

from podracer.errors import Interrupted, PodracerError
from podracer.provision.spec import Command, SliceSpec, Timing, default_runtime_version

VERBS = ("up", "status", "down", "list")
_NAME = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")
_ZONE = re.compile(r"[a-z0-9-]+")
_PROJECT = re.compile(r"[a-z0-9.:-]+")


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


def _make_parser(verb: str) -> _Parser:
    program = "python launch/tpu.py" + (f" {verb}" if verb != "run" else "")
    parser = _Parser(prog=program, allow_abbrev=False,
                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    slice_flags = parser.add_argument_group("the slice")
    slice_flags.add_argument("--tpu", metavar="NAME", help="name of the TPU slice")
    slice_flags.add_argument("--zone", help="zone, e.g. us-central2-b")
    slice_flags.add_argument("--project", help="Google Cloud project (default: from ADC)")
    if verb in ("run", "up"):
        slice_flags.add_argument("--accelerator-type", metavar="TYPE", help="e.g. v4-32")
        slice_flags.add_argument("--runtime-version", metavar="IMAGE",
                                 help="TPU VM image (default: the one for the TPU generation)")
        tier = slice_flags.add_mutually_exclusive_group()
        tier.add_argument("--spot", action="store_true", help="spot capacity: cheaper, preemptible")
        tier.add_argument("--reserved", action="store_true", help="use the project's reservation")
        slice_flags.add_argument("--queued", action="store_true",
                                 help="create a queued resource that waits for capacity")
        run_flags = parser.add_argument_group("the run")
        run_flags.add_argument("--keep", action="store_true",
                               help="never delete the slice, not even after a failure")
        run_flags.add_argument("--install-spec", metavar="REQUIREMENT",
                               help="pip requirement the workers install (default: this commit "
                                    "or version of podracer)")
        run_flags.add_argument("--launcher", type=Path, metavar="PATH",
                               help="launcher file the workers run (default: launch/tpu.py)")
    else:
        parser.add_argument("--queued", action="store_true", help=argparse.SUPPRESS)
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
    api_flags.add_argument("--run-timeout", type=_seconds, default=Timing.run_timeout,
                           metavar="SECONDS", help="give up (and delete) if the run goes longer")
    api_flags.add_argument("--retry-deadline", type=_seconds, default=Timing.retry_deadline,
                           metavar="SECONDS", help="how long to retry an unavailable API")
    return parser


def _split_verb(argv: list[str]) -> tuple[str, list[str]]:
    if argv and argv[0] in VERBS:
        return argv[0], argv[1:]
    return "run", argv


def _check(pattern: re.Pattern, value: str, flag: str, example: str) -> None:
    if not pattern.fullmatch(value):
        raise PodracerError(f"{flag}={value!r} is not valid; use something like {flag}={example}")


def parse_command(argv: list[str]) -> Command:
    """Turns argv (without the program name) into a `Command`; raises `PodracerError`."""
    verb, rest = _split_verb(list(argv))
    after_dashes: list[str] = []
    if "--" in rest:
        split = rest.index("--")
        rest, after_dashes = rest[:split], rest[split + 1:]
    args, unknown = _make_parser(verb).parse_known_args(rest)
    if verb in ("status", "down") and args.tpu is None and unknown and not unknown[0].startswith("-"):
        args.tpu = unknown.pop(0)  # `status NAME`, as with gcloud
    training_flags = tuple(unknown + after_dashes)
    if verb not in ("run", "up") and training_flags:
        raise PodracerError(f"unexpected argument {training_flags[0]!r} for `{verb}`; "
                            f"see `python launch/tpu.py {verb} --help`")

    required = {"--zone": args.zone}
    if verb != "list":
        required["--tpu"] = args.tpu
    if verb in ("run", "up"):
        required["--accelerator-type"] = args.accelerator_type
    missing = [flag for flag, value in required.items() if not value]
    if missing:
        raise PodracerError(f"`{verb}` needs {', '.join(missing)}; e.g. --tpu=my-slice "
                            "--zone=us-central2-b --accelerator-type=v4-32")
    _check(_ZONE, args.zone, "--zone", "us-central2-b")
    if args.tpu is not None:
        _check(_NAME, args.tpu, "--tpu", "my-slice (lowercase letters, digits, hyphens)")
    if args.project is not None:
        _check(_PROJECT, args.project, "--project", "my-project")

    runtime_version = ""
    if verb in ("run", "up"):
        runtime_version = args.runtime_version or default_runtime_version(args.accelerator_type)
        if not runtime_version:
            raise PodracerError(f"no default image for --accelerator-type={args.accelerator_type}; "
                                "pass --runtime-version (`gcloud compute tpus versions list`)")
    spec = SliceSpec(
        project=args.project or "",
        zone=args.zone,
        name=args.tpu or "",
        accelerator_type=getattr(args, "accelerator_type", "") or "",
        runtime_version=runtime_version,
        spot=getattr(args, "spot", False),
        reserved=getattr(args, "reserved", False),
        queued=args.queued,
    )
    timing = Timing(poll_interval=args.poll_interval, ready_timeout=args.ready_timeout,
                    run_timeout=args.run_timeout, retry_deadline=args.retry_deadline,
                    call_timeout=min(Timing.call_timeout, args.retry_deadline))
    return Command(
        verb=verb,
        spec=spec,
        timing=timing,
        training_flags=training_flags,
        keep=getattr(args, "keep", False),
        dry_run=args.dry_run,
        api_endpoint=args.api_endpoint,
        install_spec=getattr(args, "install_spec", None),
        launcher=getattr(args, "launcher", None),
    )


def main(argv: list[str]) -> int:
    """Runs one provisioner command; returns the exit status.

    0: done; 1: the run or the slice failed; 2: a problem with the command, the
    credentials or the API; 130: interrupted. Errors are one line on stderr.
    """

    def say(line: str) -> None:
        print(line, flush=True)

    try:
        command = parse_command(argv)
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
