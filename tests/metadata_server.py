"""A local GCE metadata server for the worker tests: the part a TPU VM's worker reads.

    with MetadataServer({"agent-worker-number": "0",
                         "worker-network-endpoints": "unknown:unknown:127.0.0.1"}) as mds:
        env = {"GCE_METADATA_HOST": mds.host}   # google-auth's variable
        ...                                       # the worker PUTs its state
        assert mds.guest_attributes["podracer/state"] == "running"

A real HTTP server on 127.0.0.1 (a thread), under `/computeMetadata/v1/`:

- `instance/attributes/KEY`: the attributes given at start; 404 for any other
  key, as the real server answers. `attributes` is the live dict: change it
  while the server runs.
- `instance/guest-attributes/NAMESPACE/KEY`: PUT stores the body (text), GET
  reads it back (404 until set). `guest_attributes` is the live dict, keyed
  `"NAMESPACE/KEY"` (the name the Cloud TPU API's GetGuestAttributes reports).
- `instance/service-accounts/default/token`: `{"access_token", "expires_in",
  "token_type"}`; also `.../default/email` and `.../default/?recursive=true`,
  which google-auth's Compute Engine credentials read before the token.

Like the real server, it refuses a request without `Metadata-Flavor: Google`
(403) and marks every answer with that header. Clients reach it through the
variables they document: `GCE_METADATA_HOST` (google-auth, and the worker
program), `GCE_METADATA_IP` (jax's Cloud TPU cluster detection).

The TPU VM format of `worker-network-endpoints` is one `NAME:ID:IP` triple per
worker, comma-separated, in worker order, for example
`unknown:unknown:10.0.0.2,unknown:unknown:10.0.0.3`; jax
(`jax._src.clusters.cloud_tpu_cluster`) takes the third field as the address,
and also accepts bare host names. `worker_endpoints(["10.0.0.2", ...])` writes it.

Every request is recorded in `requests` as a `MetadataRequest`; `fail(path,
times, status)` makes the next requests for a path fail (a flaky server).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

PREFIX = "/computeMetadata/v1/"
ATTRIBUTES = "instance/attributes/"
GUEST_ATTRIBUTES = "instance/guest-attributes/"
SERVICE_ACCOUNT = "instance/service-accounts/default/"


def worker_endpoints(addresses: list[str]) -> str:
    """`worker-network-endpoints` as a TPU VM's metadata holds it, worker 0 first."""
    return ",".join(f"unknown:unknown:{address}" for address in addresses)


@dataclass(frozen=True)
class MetadataRequest:
    method: str
    path: str  # below /computeMetadata/v1/, without the query
    query: dict[str, list[str]]
    flavor: bool  # sent `Metadata-Flavor: Google`
    status: int  # what the server answered
    body: str = ""  # a PUT's body


class MetadataServer:
    """The metadata server, started by `with` (or `start()`), stopped on exit."""

    def __init__(self, attributes: dict[str, str] | None = None, *,
                 access_token: str = "test-access-token", expires_in: int = 3599,
                 email: str = "worker@test-project.iam.gserviceaccount.com"):
        self.attributes: dict[str, str] = dict(attributes or {})
        self.guest_attributes: dict[str, str] = {}
        self.access_token = access_token
        self.expires_in = expires_in
        self.email = email
        self.requests: list[MetadataRequest] = []
        self._failures: dict[str, list[int]] = {}  # path -> [times left, status]
        self._lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle -----------------------------------------------------------

    def start(self) -> "MetadataServer":
        server = self

        class Handler(_Handler):
            metadata = server

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever,
                                        name="metadata-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._thread.join(timeout=10)
            self._httpd = None

    def __enter__(self) -> "MetadataServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def host(self) -> str:
        """`127.0.0.1:PORT`: the value for GCE_METADATA_HOST (and GCE_METADATA_IP)."""
        if self._httpd is None:
            raise RuntimeError("the metadata server is not running")
        return f"127.0.0.1:{self._httpd.server_address[1]}"

    @property
    def url(self) -> str:
        return f"http://{self.host}{PREFIX}"

    # -- scripting -----------------------------------------------------------

    def fail(self, path: str, times: int = 1, status: int = HTTPStatus.SERVICE_UNAVAILABLE) -> None:
        """Answer the next `times` requests for `path` (below /computeMetadata/v1/) with `status`."""
        with self._lock:
            self._failures[path] = [times, int(status)]

    def paths(self, method: str | None = None) -> list[str]:
        """The paths requested so far (those with the flavor header), optionally of one method."""
        with self._lock:
            return [r.path for r in self.requests if r.flavor and method in (None, r.method)]

    # -- serving (called from the handler's threads) -------------------------

    def _take_failure(self, path: str) -> int | None:
        with self._lock:
            failure = self._failures.get(path)
            if not failure or failure[0] <= 0:
                return None
            failure[0] -= 1
            return failure[1]

    def _record(self, request: MetadataRequest) -> None:
        with self._lock:
            self.requests.append(request)

    def _answer_get(self, path: str, query: dict[str, list[str]]) -> tuple[int, str, str]:
        """(status, content type, body) for a GET."""
        if path.startswith(ATTRIBUTES):
            value = self.attributes.get(path[len(ATTRIBUTES):])
            if value is None:
                return _not_found()
            return HTTPStatus.OK, "application/text", value
        if path.startswith(GUEST_ATTRIBUTES):
            value = self.guest_attributes.get(path[len(GUEST_ATTRIBUTES):])
            if value is None:
                return _not_found()
            return HTTPStatus.OK, "application/text", value
        if path == SERVICE_ACCOUNT + "token":
            token = {"access_token": self.access_token, "expires_in": self.expires_in,
                     "token_type": "Bearer"}
            return HTTPStatus.OK, "application/json", json.dumps(token)
        if path == SERVICE_ACCOUNT + "email":
            return HTTPStatus.OK, "application/text", self.email
        if path == SERVICE_ACCOUNT and query.get("recursive") == ["true"]:
            info = {"aliases": ["default"], "email": self.email,
                    "scopes": ["https://www.googleapis.com/auth/cloud-platform"]}
            return HTTPStatus.OK, "application/json", json.dumps(info)
        return _not_found()

    def _answer_put(self, path: str, body: str) -> tuple[int, str, str]:
        key = path[len(GUEST_ATTRIBUTES):] if path.startswith(GUEST_ATTRIBUTES) else ""
        namespace, _, name = key.partition("/")
        if not namespace or not name or "/" in name:
            return HTTPStatus.BAD_REQUEST, "text/plain", "guest attributes are NAMESPACE/KEY"
        self.guest_attributes[key] = body
        return HTTPStatus.OK, "text/plain", ""


def _not_found() -> tuple[int, str, str]:
    return HTTPStatus.NOT_FOUND, "text/html", "<html><body>Not Found</body></html>"


class _Handler(BaseHTTPRequestHandler):
    metadata: MetadataServer
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self._serve("GET")

    def do_PUT(self) -> None:
        self._serve("PUT")

    def _serve(self, method: str) -> None:
        url = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length).decode() if length else ""
        flavor = self.headers.get("Metadata-Flavor") == "Google"
        path = url.path[len(PREFIX):] if url.path.startswith(PREFIX) else url.path
        query = parse_qs(url.query)
        if not flavor:
            answer = (HTTPStatus.FORBIDDEN, "text/html",
                      "Missing required header: Metadata-Flavor: Google")
        elif not url.path.startswith(PREFIX):
            answer = _not_found()
        elif (status := self.metadata._take_failure(path)) is not None:
            answer = (status, "text/plain", f"injected failure {status}")
        elif method == "PUT":
            answer = self.metadata._answer_put(path, body)
        else:
            answer = self.metadata._answer_get(path, query)
        status, content_type, text = answer
        self.metadata._record(MetadataRequest(method, path, query, flavor, int(status), body))
        data = text.encode()
        self.send_response(status)
        self.send_header("Metadata-Flavor", "Google")
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args) -> None:  # keep the test output quiet
        pass
