"""Provisioner flag values checked on this machine, before any API call.

Only what needs no API call: the shapes of names, tags, topologies, scopes and
e-mail addresses. Whether a network or a service account exists is the API's
to say. Every mistake is one line naming the flag and an example of a good
value (`PodracerError`, exit status 2).
"""

from __future__ import annotations

import re
from typing import Iterable

from podracer.errors import PodracerError
from podracer.provision.spec import CLOUD_PLATFORM_SCOPE, Identity, Networking

# An RFC 1035 label, 1-63 characters: TPU names, network names, network tags.
NAME = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")
ZONE = re.compile(r"[a-z0-9-]+")
PROJECT = re.compile(r"[a-z0-9.:-]+")
ACCELERATOR_TYPE = re.compile(r"v[0-9][a-z0-9]*-[1-9][0-9]*")
TOPOLOGY = re.compile(r"[1-9][0-9]*(x[1-9][0-9]*){1,2}")
# Chips are laid out in 3 dimensions on v4 and v5p (AxBxC), in 2 on the others (AxB).
TOPOLOGY_DIMENSIONS = {"v2": 2, "v3": 2, "v4": 3, "v5litepod": 2, "v5p": 3, "v6e": 2}
SERVICE_ACCOUNT = re.compile(r"[a-z0-9][a-z0-9._-]*@[a-z0-9-]+(\.[a-z0-9-]+)+")
SCOPE = re.compile(r"https://www\.googleapis\.com/auth/[a-z0-9._/-]+")
_COMPUTE_URL = r"(https://www\.googleapis\.com/compute/v1/)?projects/[a-z0-9.:-]+"
# A network of another project (a Shared VPC) is named by its path.
_NETWORK_PATH = re.compile(_COMPUTE_URL + r"/global/networks/(?P<name>[^/]*)")
_SUBNETWORK_PATH = re.compile(_COMPUTE_URL + r"/regions/[a-z0-9-]+/subnetworks/(?P<name>[^/]*)")
# OAuth scopes under which the workers' service account can write Cloud Storage
# (https://cloud.google.com/storage/docs/oauth-scopes); any other list leaves the
# workers unable to write the run's checkpoints, metrics and logs, whatever IAM grants.
STORAGE_WRITE_SCOPES = (CLOUD_PLATFORM_SCOPE,
                        "https://www.googleapis.com/auth/devstorage.read_write",
                        "https://www.googleapis.com/auth/devstorage.full_control")


def check(pattern: re.Pattern, value: str, flag: str, example: str) -> None:
    if not pattern.fullmatch(value):
        raise PodracerError(f"{flag}={value!r} is not valid; use something like {flag}={example}")


def split_list(values: Iterable[str] | None) -> tuple[str, ...]:
    """`--tags=a,b --tags=c` as ("a", "b", "c"): comma lists, repeatable, each once, in order."""
    items = [item.strip() for value in values or () for item in value.split(",")]
    return tuple(dict.fromkeys(items))


def shape(accelerator_type: str | None, tpu_version: str | None,
          topology: str | None) -> tuple[str, str, str]:
    """(accelerator type, TPU version, topology): one of the two ways to say what slice."""
    example = "--accelerator-type=v4-32, or --tpu-version=v4 --topology=2x2x4"
    if accelerator_type and (tpu_version or topology):
        raise PodracerError(f"--accelerator-type and --tpu-version/--topology both give the "
                            f"slice's shape; pass one: {example}")
    if accelerator_type:
        accelerator_type = accelerator_type.lower()
        check(ACCELERATOR_TYPE, accelerator_type, "--accelerator-type", "v4-32")
        return accelerator_type, "", ""
    if not (tpu_version and topology):
        missing = "--topology" if tpu_version else "--tpu-version"
        raise PodracerError(f"{missing} is missing: the slice's shape is {example}")
    topology = topology.lower()
    dimensions = TOPOLOGY_DIMENSIONS[tpu_version]
    example_topology = "2x2x4" if dimensions == 3 else "4x4"
    check(TOPOLOGY, topology, "--topology", example_topology)
    if topology.count("x") + 1 != dimensions:
        raise PodracerError(f"--topology={topology} has {topology.count('x') + 1} dimensions; "
                            f"{tpu_version} chips are laid out in {dimensions} "
                            f"(e.g. --topology={example_topology})")
    return "", tpu_version, topology


def _check_network(value: str, flag: str, path: re.Pattern, example_path: str) -> None:
    match = path.fullmatch(value)
    name = match.group("name") if match else value
    if not NAME.fullmatch(name):
        raise PodracerError(
            f"{flag}={value!r} is not valid; give a name (lowercase letters, digits, hyphens, "
            f"e.g. {flag}=my-network) or a path such as {flag}={example_path}")


def networking(network: str | None, subnetwork: str | None, internal_ips: bool,
               tags: Iterable[str] | None) -> Networking:
    if network:
        _check_network(network, "--vpc-network", _NETWORK_PATH,
                       "projects/host-project/global/networks/my-network")
    if subnetwork:
        _check_network(subnetwork, "--subnetwork", _SUBNETWORK_PATH,
                       "projects/host-project/regions/us-central2/subnetworks/my-subnet")
    tag_list = split_list(tags)
    for tag in tag_list:
        if not NAME.fullmatch(tag):
            raise PodracerError(
                f"--tags: {tag!r} is not a valid network tag (1-63 lowercase letters, digits, "
                "hyphens, starting with a letter); e.g. --tags=podracer,allow-ssh")
    return Networking(network=network or "", subnetwork=subnetwork or "",
                      external_ips=not internal_ips, tags=tag_list)


def identity(service_account: str | None, scopes: Iterable[str] | None) -> Identity:
    """The workers' service account, and its scopes (cloud-platform unless given)."""
    if service_account is not None:
        check(SERVICE_ACCOUNT, service_account, "--service-account",
              "trainer@my-project.iam.gserviceaccount.com")
    scope_list = split_list(scopes)
    for scope in scope_list:
        if not SCOPE.fullmatch(scope):
            raise PodracerError(f"--scopes: {scope!r} is not an OAuth scope URL; e.g. "
                                f"--scopes={CLOUD_PLATFORM_SCOPE}")
    if scope_list and not set(scope_list) & set(STORAGE_WRITE_SCOPES):
        raise PodracerError(
            f"--scopes={','.join(scope_list)} do not let the workers write the run's bucket "
            f"(checkpoints, metrics, logs); add {STORAGE_WRITE_SCOPES[1]} (or {CLOUD_PLATFORM_SCOPE})")
    if service_account is None and not scope_list:
        return Identity()
    return Identity(service_account=service_account or "",
                    scopes=scope_list or (CLOUD_PLATFORM_SCOPE,))
