"""What to provision, how long to wait, and where things live on a worker.

Frozen dataclasses filled in by the CLI; everything below the CLI takes them as
arguments and never reads flags or the environment.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# Software images per TPU generation. A v4 slice needs the v4 image, a v5e slice
# the v5 lite image, and so on; the wrong one fails late, at boot.
_RUNTIME_BY_GENERATION = {
    "v2": "tpu-ubuntu2204-base",
    "v3": "tpu-ubuntu2204-base",
    "v4": "tpu-ubuntu2204-base",
    "v5litepod": "v2-alpha-tpuv5-lite",
    "v5p": "v2-alpha-tpuv5",
    "v6e": "v2-alpha-tpuv6e",
}


TPU_VERSIONS = tuple(_RUNTIME_BY_GENERATION)
# What the workers' service account may call when --scopes is not given: every
# Cloud API, which IAM roles then narrow down (the API's own default for an
# empty scope list is the same).
CLOUD_PLATFORM_SCOPE = "https://www.googleapis.com/auth/cloud-platform"


def default_runtime_version(accelerator: str) -> str | None:
    """The TPU VM image for `v4-32` or for a TPU version such as `v4`; None if unknown."""
    generation = accelerator.rsplit("-", 1)[0].lower()
    return _RUNTIME_BY_GENERATION.get(generation)


@dataclass(frozen=True)
class Networking:
    """The workers' network (the node's NetworkConfig) and firewall tags.

    Empty names leave the choice to the API: the project's `default` network.
    Without external IPs a worker reaches the internet (PyPI, GitHub) only
    through Cloud NAT, and Google APIs only with Private Google Access.
    """

    network: str = ""
    subnetwork: str = ""
    external_ips: bool = True
    tags: tuple[str, ...] = ()


@dataclass(frozen=True)
class Identity:
    """Whom the workers act as: a service account ("" for Compute Engine's default) and its scopes.

    No scopes means nothing is sent, and the API's defaults apply.
    """

    service_account: str = ""
    scopes: tuple[str, ...] = ()


@dataclass(frozen=True)
class SliceSpec:
    """One TPU slice: where it is, what it is, how it is billed, networked, and whom it acts as.

    Its shape is `accelerator_type` (`v4-32`), or a TPU version and a chip
    topology (`v4`, `2x2x4`): exactly one of the two.

    `num_slices` > 1 is a multislice: that many slices of this shape, created
    together as one queued resource named `name`, whose nodes the API names
    `name-0`, `name-1`, ... (its `node_id_prefix`).
    """

    project: str
    zone: str
    name: str
    accelerator_type: str = ""
    runtime_version: str = ""
    spot: bool = False
    reserved: bool = False
    queued: bool = False
    tpu_version: str = ""
    topology: str = ""
    networking: Networking = Networking()
    identity: Identity = Identity()
    num_slices: int = 1

    @property
    def shape(self) -> str:
        """`v4-32`, or `v4 2x2x4`: the slice's shape as the user gave it (`2 x v4-32`: multislice)."""
        shape = self.accelerator_type or f"{self.tpu_version} {self.topology}".strip()
        return f"{self.num_slices} x {shape}" if self.num_slices > 1 else shape

    @property
    def node_ids(self) -> tuple[str, ...]:
        """The nodes: the slice itself, or a multislice's `name-0`, `name-1`, ..., slice by slice."""
        if self.num_slices == 1:
            return (self.name,)
        return tuple(f"{self.name}-{index}" for index in range(self.num_slices))

    def node_path_of(self, node_id: str) -> str:
        return f"{self.parent}/nodes/{node_id}"

    @property
    def parent(self) -> str:
        return f"projects/{self.project}/locations/{self.zone}"

    @property
    def node_path(self) -> str:
        return self.node_path_of(self.name)

    @property
    def queued_resource_path(self) -> str:
        return f"{self.parent}/queuedResources/{self.name}"


@dataclass(frozen=True)
class Timing:
    """Every wait is bounded; these are the bounds, in seconds.

    `retry_deadline` bounds the retries of one call that keeps failing with
    UNAVAILABLE or DEADLINE_EXCEEDED; `call_timeout` bounds a single attempt.
    """

    poll_interval: float = 10.0
    ready_timeout: float = 3600.0
    run_timeout: float = 24 * 3600.0
    delete_timeout: float = 900.0
    retry_deadline: float = 120.0
    call_timeout: float = 60.0
    # A slice REPAIRING (or otherwise not READY) mid-run this long is lost.
    repair_timeout: float = 1800.0

    @property
    def retry_initial_delay(self) -> float:
        # Tied to the poll interval so a fast-polling caller also retries fast.
        return min(1.0, self.poll_interval)

    @property
    def retry_max_delay(self) -> float:
        return 32 * self.retry_initial_delay


@dataclass(frozen=True)
class Command:
    """One parsed invocation of the provisioner; `verb` is "run" when none was given."""

    verb: str
    spec: SliceSpec
    timing: Timing
    training_flags: tuple[str, ...] = ()
    keep: bool = False
    dry_run: bool = False
    api_endpoint: str | None = None
    bucket: str | None = None
    launcher: Path | None = None
    run_dir: str | None = None  # `logs gs://BUCKET/PATH`: a run read without the API
    worker: int | None = None  # `logs --worker=I`; None: every worker
    follow: bool = False  # `logs --follow`
    max_restarts: int = 0  # re-create a preempted or lost slice this many times
    detach: bool = False  # leave once the run has started; `attach NAME` follows it again
