"""The learner's latest policy, published to every actor device with a version number."""

from __future__ import annotations

import threading
from typing import Any, NamedTuple, Sequence

import jax

from podracer.protocol import parallel
from podracer.types import TrainState


class PublishedPolicy(NamedTuple):
    params: Any  # on one actor device
    obs_stats: Any
    version: int  # updates applied to these parameters


class ParamsStore:
    """Holds one copy of the newest policy per actor device; actors read, the learner publishes."""

    def __init__(self, devices: Sequence[jax.Device]):
        self._devices = tuple(dict.fromkeys(devices))
        self._changed = threading.Condition()
        self._copies: dict[jax.Device, PublishedPolicy] = {}
        self._version = -1

    def publish(self, state: TrainState, version: int) -> None:
        """Copy `state`'s policy to every actor device and make it the newest."""
        copies = {}
        # `state` may be replicated over other processes' devices too: copy this process's replica.
        policy = parallel.local_replica((state.params, state.obs_stats))
        for device in self._devices:
            params, obs_stats = jax.device_put(policy, device)
            copies[device] = PublishedPolicy(params, obs_stats, version)
        with self._changed:
            self._copies, self._version = copies, version
            self._changed.notify_all()

    def wait_for(self, version: int, device: jax.Device, stop: threading.Event,
                 poll_s: float = 0.05) -> PublishedPolicy | None:
        """The newest policy on `device` once its version is at least `version`; None if stopped."""
        with self._changed:
            while self._version < version:
                if stop.is_set():
                    return None
                self._changed.wait(poll_s)
            return self._copies[device]
