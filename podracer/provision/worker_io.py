"""The TPU worker's two endpoints, with the standard library alone: the metadata server and Cloud Storage.

Part of the worker program (`podracer.provision.worker`), which the startup
script writes beside it on the VM. Endpoints are the clients' documented ones:
the metadata server at `GCE_METADATA_HOST` (google-auth's variable;
metadata.google.internal by default), Cloud Storage at `STORAGE_EMULATOR_HOST`
(google-cloud-storage's; https://storage.googleapis.com by default).
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request

GUEST_ATTRIBUTE = "podracer/state"
# The worker's own number, beside its state: the API lists the workers' guest
# attributes without saying whose each is, so the launcher reads it from here.
WORKER_ATTRIBUTE = "podracer/worker"
HTTP_TIMEOUT_S = 60
# A multislice's slices: where the Cloud TPU service tells each worker which slice it is
# on and who coordinates (its `tpu-env` metadata, as JAX's own TPU cluster detection
# reads it), and what libtpu's multislice (Megascale) runtime reads from the environment.
TPU_ENV = "instance/attributes/tpu-env"
MEGASCALE_COORDINATOR, MEGASCALE_NUM_SLICES = "MEGASCALE_COORDINATOR_ADDRESS", "MEGASCALE_NUM_SLICES"
MEGASCALE_SLICE_ID, MEGASCALE_PORT = "MEGASCALE_SLICE_ID", "MEGASCALE_PORT"
DEFAULT_MEGASCALE_PORT = "8080"


def _metadata_root() -> str:
    host = os.environ.get("GCE_METADATA_HOST", "metadata.google.internal")
    return f"http://{host}/computeMetadata/v1/"


def metadata(path: str, default: str | None = None, attempts: int = 8) -> str | None:
    """A metadata value (`instance/attributes/agent-worker-number`), or `default` if absent.

    Early in a boot the metadata server may not answer yet: connection errors and
    5xx answers are retried, 1, 2, 4 ... s apart (about 4 minutes in all).
    """
    request = urllib.request.Request(_metadata_root() + path, headers={"Metadata-Flavor": "Google"})
    for attempt in range(attempts):
        try:
            with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as answer:
                return answer.read().decode()
        except urllib.error.HTTPError as error:
            if error.code == 404:
                return default
            if error.code < 500 or attempt == attempts - 1:
                raise
        except (OSError, urllib.error.URLError):
            if attempt == attempts - 1:
                raise
        time.sleep(2 ** attempt)
    return default


def parse_tpu_env(text: str) -> dict:
    """`tpu-env` metadata (one `KEY: 'value'` a line) as a dict."""
    values = {}
    for line in text.splitlines():
        key, colon, value = line.partition(":")
        if colon:
            values[key.strip()] = value.strip().strip("'\"")
    return values


def megascale_environment(tpu_env: dict, num_slices: int) -> dict:
    """The multislice variables for training: coordinator, slice count, slice id, port.

    Raises ValueError (one line) where the slice's metadata does not make this
    worker one of `num_slices` slices.
    """
    missing = [key for key in (MEGASCALE_COORDINATOR, MEGASCALE_NUM_SLICES, MEGASCALE_SLICE_ID)
               if not tpu_env.get(key)]
    if missing:
        raise ValueError(f"the slice's tpu-env metadata has no {', '.join(missing)}: this node "
                         f"is not one slice of a multislice of {num_slices}")
    if tpu_env[MEGASCALE_NUM_SLICES] != str(num_slices):
        raise ValueError(f"the slice's tpu-env metadata says {tpu_env[MEGASCALE_NUM_SLICES]} "
                         f"slices, the launcher created {num_slices}")
    return {MEGASCALE_COORDINATOR: tpu_env[MEGASCALE_COORDINATOR],
            MEGASCALE_NUM_SLICES: str(num_slices), MEGASCALE_SLICE_ID: tpu_env[MEGASCALE_SLICE_ID],
            MEGASCALE_PORT: tpu_env.get(MEGASCALE_PORT) or DEFAULT_MEGASCALE_PORT}


def multislice(num_slices: int) -> tuple:
    """(the MEGASCALE_* variables, or {} for one slice; what is wrong, or "")."""
    if num_slices == 1:
        return {}, ""
    try:
        return megascale_environment(parse_tpu_env(metadata(TPU_ENV, "") or ""), num_slices), ""
    except ValueError as error:
        return {}, str(error)


def publish_state(value: str, attribute: str = GUEST_ATTRIBUTE) -> None:
    """Sets the guest attribute the launcher reads; a metadata hiccup must not stop the run."""
    request = urllib.request.Request(
        _metadata_root() + "instance/guest-attributes/" + attribute, data=value.encode(),
        method="PUT", headers={"Metadata-Flavor": "Google"})
    try:
        urllib.request.urlopen(request, timeout=10).close()
    except (OSError, urllib.error.URLError):
        pass


class Storage:
    """Cloud Storage's JSON API with the worker's service-account token."""

    def __init__(self):
        self.base = os.environ.get("STORAGE_EMULATOR_HOST", "https://storage.googleapis.com")
        if "://" not in self.base:
            self.base = "http://" + self.base
        self.base = self.base.rstrip("/")
        self._token, self._expires = "", 0.0

    def _authorization(self) -> dict:
        if time.monotonic() > self._expires:
            answer = json.loads(metadata("instance/service-accounts/default/token") or "{}")
            self._token = answer.get("access_token", "")
            self._expires = time.monotonic() + max(0, int(answer.get("expires_in", 0)) - 60)
        return {"Authorization": f"Bearer {self._token}"} if self._token else {}

    @staticmethod
    def split(url: str) -> tuple[str, str]:
        bucket, _, name = url[len("gs://"):].partition("/")
        return bucket, name

    def download(self, url: str, path: str) -> None:
        bucket, name = self.split(url)
        request = urllib.request.Request(
            f"{self.base}/storage/v1/b/{bucket}/o/{urllib.parse.quote(name, safe='')}?alt=media",
            headers=self._authorization())
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as answer, \
                open(path + ".part", "wb") as out:
            while True:
                chunk = answer.read(1 << 20)
                if not chunk:
                    break
                out.write(chunk)
        os.replace(path + ".part", path)

    def list(self, url_prefix: str) -> list:
        """The object names under `gs://BUCKET/PREFIX`, relative to it."""
        bucket, prefix = self.split(url_prefix)
        names, token = [], ""
        while True:
            query = {"prefix": prefix, "fields": "items(name),nextPageToken"}
            if token:
                query["pageToken"] = token
            request = urllib.request.Request(
                f"{self.base}/storage/v1/b/{bucket}/o?{urllib.parse.urlencode(query)}",
                headers=self._authorization())
            with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as answer:
                page = json.loads(answer.read().decode() or "{}")
            names += [item["name"][len(prefix):] for item in page.get("items", [])]
            token = page.get("nextPageToken", "")
            if not token:
                return names

    def upload(self, data: bytes, url: str) -> None:
        bucket, name = self.split(url)
        query = urllib.parse.urlencode({"uploadType": "media", "name": name})
        request = urllib.request.Request(
            f"{self.base}/upload/storage/v1/b/{bucket}/o?{query}", data=data, method="POST",
            headers={**self._authorization(), "Content-Type": "application/octet-stream"})
        urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S).close()


