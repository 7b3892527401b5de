"""What a TPU slice is made of: hosts, and the JAX devices on each.

The preflight checks a run's layout (Sebulba's actor and learner devices and
environment counts, Anakin's and a population's splits) against these numbers
before the slice is paid for; on a real slice the trainer would find the same
mistake only after the slice was created and every worker had installed.

From the Cloud TPU documentation (system architecture and the per-version
pages for v2/v3, v4, v5e, v5p and v6e):

| version | accelerator type counts | chips per host | one host up to | JAX devices per chip |
|---|---|---|---|---|
| v2, v3 | TensorCores, 2 per chip (v3-8: 4 chips) | 4 | 4 chips | 2 (one per TensorCore) |
| v4 | TensorCores, 2 per chip (v4-8: 4 chips) | 4 | 4 chips | 1 (megacore) |
| v5p | TensorCores, 2 per chip (v5p-8: 4 chips) | 4 | 4 chips | 1 (megacore) |
| v5e (`v5litepod`) | chips (v5litepod-8: 8 chips) | 4 | 8 chips (1x1, 2x2, 2x4) | 1 |
| v6e | chips (v6e-8: 8 chips) | 4 | 8 chips (1x1, 2x2, 2x4) | 1 |

So v4-32 is 16 chips on 4 hosts of 4 devices; v6e-8 and v5litepod-8 are one
host of 8 devices, v6e-16 is 4 hosts of 4. A topology (`--topology=2x2x4`)
counts chips. A version missing here (a newer one) is not checked; the API
says whether the slice exists.

Multislice (several slices of one shape joined over the data-centre network,
`--num-slices`) is for v4 and later (the Cloud TPU multislice documentation);
the run sees every host of every slice, one process each.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from podracer.errors import PodracerError


class Generation(NamedTuple):
    cores_per_chip: int  # TensorCores per chip: what v2-v4 and v5p accelerator types count
    devices_per_chip: int  # JAX devices per chip: 1 where a chip's cores act as one (megacore)
    chips_per_host: int  # on a slice of several hosts
    one_host_chips: tuple[int, ...]  # the chip counts a single host holds


GENERATIONS = {
    "v2": Generation(2, 2, 4, (4,)),
    "v3": Generation(2, 2, 4, (4,)),
    "v4": Generation(2, 1, 4, (4,)),
    "v5p": Generation(2, 1, 4, (4,)),
    "v5litepod": Generation(1, 1, 4, (1, 4, 8)),
    "v6e": Generation(1, 1, 4, (1, 4, 8)),
}


MULTISLICE_VERSIONS = ("v4", "v5p", "v5litepod", "v6e")


class SliceShape(NamedTuple):
    """A slice as the run sees it: `hosts` processes, each with `devices_per_host` local devices."""

    name: str  # `v6e-8`, or `v4 2x2x4`
    hosts: int
    devices_per_host: int

    @property
    def devices(self) -> int:
        return self.hosts * self.devices_per_host

    def describe(self) -> str:
        hosts = f"{self.hosts} host{'s' if self.hosts > 1 else ''}"
        return f"{self.name} ({hosts} of {self.devices_per_host} devices)"


def slice_shape(accelerator_type: str = "", tpu_version: str = "",
                topology: str = "") -> SliceShape | None:
    """Hosts and devices of `v4-32`, or of a version and topology (`v4`, `2x2x4`); None if unknown.

    Raises `PodracerError` for a count no slice of that version has.
    """
    if accelerator_type:
        version, count = accelerator_type.rsplit("-", 1)
        generation = GENERATIONS.get(version)
        if generation is None:
            return None
        chips, remainder = divmod(int(count), generation.cores_per_chip)
        name, flag = accelerator_type, f"--accelerator-type={accelerator_type}"
    else:
        generation = GENERATIONS.get(tpu_version)
        if generation is None:
            return None
        chips, remainder = math.prod(int(n) for n in topology.split("x")), 0
        name, flag = f"{tpu_version} {topology}", f"--topology={topology}"
        version = tpu_version
    smallest = min(generation.one_host_chips) * generation.cores_per_chip
    if remainder or not (chips in generation.one_host_chips
                         or (chips > max(generation.one_host_chips)
                             and chips % generation.chips_per_host == 0)):
        raise PodracerError(f"{flag} is not a {version} slice: it is one host of "
                            f"{', '.join(map(str, generation.one_host_chips))} chips or a multiple "
                            f"of {generation.chips_per_host} chips on several (e.g. "
                            f"--accelerator-type={version}-{smallest})")
    if chips in generation.one_host_chips:
        return SliceShape(name, 1, chips * generation.devices_per_chip)
    return SliceShape(name, chips // generation.chips_per_host,
                      generation.chips_per_host * generation.devices_per_chip)


def multislice(shape: SliceShape, num_slices: int) -> SliceShape:
    """What a run sees on `num_slices` slices of `shape`: the hosts of all of them."""
    if num_slices == 1:
        return shape
    return SliceShape(f"{num_slices} x {shape.name}", shape.hosts * num_slices,
                      shape.devices_per_host)
