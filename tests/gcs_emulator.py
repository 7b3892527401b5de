"""A local Cloud Storage for the tests: gcp-storage-emulator (from PyPI), in memory.

    python tests/gcs_emulator.py PORT     # serves http://127.0.0.1:PORT until killed

    with running_emulator(log_dir) as emulator:     # in a test: a fresh one on a free port
        emulator.url                                # http://127.0.0.1:PORT
        emulator.variables                          # the clients' variables, for a subprocess's env
        bucket = emulator.create_bucket("runs")     # a google.cloud.storage Bucket

Clients reach it through the variables they document (`STORAGE_EMULATOR_HOST`
for google-cloud-storage and gcsfs, `TENSORSTORE_GCS_HTTP_URL` for
tensorstore); podracer does not know it is there. tests/conftest.py's
fixtures `gcs_emulator` and `gcs_bucket` give a test module one emulator, with
the variables set in its environment.

Two fixes make the emulator answer as Cloud Storage does. Media downloads,
which tensorstore (so orbax's OCDBT checkpoints) relies on: the object's
generation in `x-goog-generation`, and the read preconditions
`ifGenerationMatch` (412 when it differs) and `ifGenerationNotMatch` (304 when
it is the same). The emulator (2026.7.19) sends no generation and ignores both,
so a checkpoint whose manifest tensorstore re-reads after writing it fails with
"Malformed StorageGeneration". Uploads and deletes: the write precondition
`ifGenerationMatch` (0: only if absent; 412 when it does not hold), which the
run directory's lease relies on and the emulator ignores.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from http import HTTPStatus
from pathlib import Path
from typing import Iterator, NamedTuple

START_TIMEOUT_S = 30
STALLED_CLIENT_S = 15


def emulator_variables(url: str) -> dict[str, str]:
    """The variables that point every client podracer uses at the emulator at `url`."""
    return {
        "STORAGE_EMULATOR_HOST": url,  # google-cloud-storage and gcsfs
        "TENSORSTORE_GCS_HTTP_URL": url,  # tensorstore, so orbax's arrays
        # fsspec's configuration from the environment: gcsfs's token="anon", no credential lookup.
        "FSSPEC_GCS_TOKEN": "anon",
        # gcsfs asks a bucket's layout of the Storage Control API (gRPC), which the emulator lacks.
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        # tensorstore's fixed test token: no credential files, no metadata server lookup.
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",
    }


class Emulator(NamedTuple):
    """A running emulator: where it listens and the variables its clients need."""

    url: str
    variables: dict[str, str]
    pid: int = 0  # its server process (a test may pause it, as an unresponsive bucket)

    def client(self):
        """A google-cloud-storage client of this emulator (whatever this process's environment says)."""
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        return storage.Client(project="emulator", credentials=AnonymousCredentials(),
                              client_options={"api_endpoint": self.url})

    def create_bucket(self, name: str):
        """Create bucket `name`; returns it (a google.cloud.storage Bucket)."""
        return self.client().create_bucket(name)



@contextlib.contextmanager
def running_emulator(log_dir: str | os.PathLike) -> Iterator[Emulator]:
    """A fresh, empty emulator on a free port for the block; its requests logged in `log_dir`."""
    from podracer.orchestrate.distributed import free_port   # the emulator's own process needs no podracer
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = Path(log_dir) / "requests.log"
    with open(log_path, "w") as log:  # a pipe left unread would fill
        server = subprocess.Popen([sys.executable, os.path.abspath(__file__), str(port)],
                                  stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_until_listening(log_path, server)
            yield Emulator(url, emulator_variables(url), server.pid)
        finally:
            server.kill()
            server.wait(timeout=30)


def _wait_until_listening(log_path: Path, server: subprocess.Popen) -> None:
    """Until `serve` says it listens (a port taken meanwhile by another program ends it instead)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while "serving on" not in log_path.read_text():
        if server.poll() is not None:
            raise RuntimeError(f"the emulator exited with status {server.returncode}; see {log_path}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the emulator did not start within {START_TIMEOUT_S} s; see {log_path}")
        time.sleep(0.1)


def _with_generation(download):
    from gcp_storage_emulator.exceptions import NotFound

    def handler(request, response, storage, *args, **kwargs):
        try:
            obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
        except NotFound:
            return download(request, response, storage, *args, **kwargs)
        generation = str(obj.get("generation") or "0")
        response["x-goog-generation"] = generation
        response["x-goog-metageneration"] = str(obj.get("metageneration") or "1")
        match = request.query.get("ifGenerationMatch")
        not_match = request.query.get("ifGenerationNotMatch")
        if match and match[0] != generation:
            response.status = HTTPStatus.PRECONDITION_FAILED
            return None
        if not_match and not_match[0] == generation:
            response.status = HTTPStatus.NOT_MODIFIED
            return None
        return download(request, response, storage, *args, **kwargs)

    return handler


def _generation_of(storage, bucket: str, name: str | None) -> str:
    """An object's generation, "0" when there is none (Cloud Storage's meaning of 0 in preconditions)."""
    from gcp_storage_emulator.exceptions import NotFound

    if not name:
        return "0"
    try:
        return str(storage.get_file_obj(bucket, name).get("generation") or "0")
    except NotFound:
        return "0"


def _with_write_precondition(handler, name_of):
    """`handler` that first checks an upload's or delete's `ifGenerationMatch` (412 when it fails)."""

    def checked(request, response, storage, *args, **kwargs):
        match = request.query.get("ifGenerationMatch")
        if match:
            current = _generation_of(storage, request.params["bucket_name"], name_of(request))
            if match[0] != current:
                response.status = HTTPStatus.PRECONDITION_FAILED
                return None
        return handler(request, response, storage, *args, **kwargs)

    return checked


def _upload_name(request) -> str | None:
    if "name" in request.query:
        return request.query["name"][0]
    data = request.data
    meta = data.get("meta") if isinstance(data, dict) else None
    return (meta or {}).get("name") or (data.get("name") if isinstance(data, dict) else None)


def serve(port: int) -> None:
    from gcp_storage_emulator import server
    from gcp_storage_emulator.handlers import objects

    # The emulator answers one request at a time. A client frozen mid-request (a test
    # pauses a worker with SIGSTOP) would hold it for everyone; as a real server
    # does, a connection silent this long is dropped.
    server.RequestHandler.timeout = STALLED_CLIENT_S
    replaced = {
        objects.download: _with_generation(objects.download),
        objects.insert: _with_write_precondition(objects.insert, _upload_name),
        objects.delete: _with_write_precondition(objects.delete, lambda request: request.params["object_id"]),
    }
    objects.download = replaced[objects.download]  # `objects.get` with alt=media calls it by name
    server.HANDLERS = tuple(
        (regex, {method: replaced.get(fn, fn) for method, fn in handlers.items()})
        for regex, handlers in server.HANDLERS)
    emulator = server.create_server("127.0.0.1", port, in_memory=True)
    emulator.start()
    print(f"serving on 127.0.0.1:{port}", flush=True)
    try:
        while True:
            time.sleep(3600)
    finally:
        emulator.stop()


if __name__ == "__main__":
    serve(int(sys.argv[1]))
