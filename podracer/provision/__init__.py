"""The provisioner: TPU VM slices through the Cloud TPU API (`google.cloud.tpu_v2`).

`cli.main(argv)` runs the TPU verbs `podracer.command` hands it. The pieces it is
built from are importable on their own: flag values checked without the API
(`validate`), the training flags checked with the trainer's parser before a
slice is paid for (`preflight`), pure request builders (`api_requests`), the
startup script (`startup`), and the slice's life cycle (`lifecycle`).
"""

from podracer.provision.spec import (Identity, Networking, SliceSpec, Timing,
                                     default_runtime_version)
from podracer.provision.startup import WorkerState, make_startup_script, parse_worker_state

__all__ = [
    "Identity",
    "Networking",
    "SliceSpec",
    "Timing",
    "WorkerState",
    "default_runtime_version",
    "make_startup_script",
    "parse_worker_state",
]
