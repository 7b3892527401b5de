"""A local Cloud Storage for the tests: gcp-storage-emulator (from PyPI), in memory.

    python tests/gcs_emulator.py PORT     # serves http://127.0.0.1:PORT until killed

Clients reach it through the variables they document (`STORAGE_EMULATOR_HOST`
for google-cloud-storage and gcsfs, `TENSORSTORE_GCS_HTTP_URL` for
tensorstore); podracer does not know it is there.

One fix makes the emulator answer media downloads as Cloud Storage does, which
tensorstore (so orbax's OCDBT checkpoints) relies on: the object's generation in
`x-goog-generation`, and the read preconditions `ifGenerationMatch` (412 when
it differs) and `ifGenerationNotMatch` (304 when it is the same). The emulator
(2026.7.19) sends no generation and ignores both, so a checkpoint whose
manifest tensorstore re-reads after writing it fails with "Malformed
StorageGeneration".
"""

from __future__ import annotations

import sys
import time
from http import HTTPStatus

from gcp_storage_emulator import server
from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects


def _with_generation(download):
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


def serve(port: int) -> None:
    original = objects.download
    patched = _with_generation(original)
    objects.download = patched  # `objects.get` with alt=media calls it by name
    server.HANDLERS = tuple(
        (regex, {method: patched if fn is original else fn for method, fn in handlers.items()})
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
