"""The learner's latest acting state (`Agent.acting_state`), published to every actor device with a version number."""

from __future__ import annotations

import threading
from typing import Any, NamedTuple, Sequence

import jax

from podracer.protocol import parallel


class PublishedPolicy(NamedTuple):
    state: Any  # what acting reads, on one actor device
    version: int  # updates applied to it


class ParamsStore:
    """Holds one copy of the newest acting state per actor device; actors read, the learner publishes."""

    def __init__(self, devices: Sequence[jax.Device]):
        self._devices = tuple(dict.fromkeys(devices))
        self._changed = threading.Condition()
        self._copies: dict[jax.Device, PublishedPolicy] = {}
        self._version = -1

    def publish(self, state: Any, version: int) -> None:
        """Copy `state` (a pytree of arrays) to every actor device and make it the newest."""
        copies = {}
        # `state` may be replicated over other processes' devices too: copy this process's replica.
        local = parallel.local_replica(state)
        for device in self._devices:
            copies[device] = PublishedPolicy(jax.device_put(local, device), version)
        with self._changed:
            self._copies, self._version = copies, version
            self._changed.notify_all()

    def wait_for(self, version: int, device: jax.Device, stop: threading.Event,
                 poll_s: float = 0.05) -> PublishedPolicy | None:
        """The newest acting state on `device` once its version is at least `version`; None if stopped."""
        with self._changed:
            while self._version < version:
                if stop.is_set():
                    return None
                self._changed.wait(poll_s)
            return self._copies[device]
