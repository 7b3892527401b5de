"""Talking to the Cloud TPU API: connection, credentials, retries, and errors.

Every call goes through `TpuApi.send`, which retries UNAVAILABLE and
DEADLINE_EXCEEDED with bounded backoff and turns every other failure into a
one-line `ApiError` that says what to do. Credentials are handed to the
client library and never formatted into a message.
"""

from __future__ import annotations

import ipaddress
import re
import time

import google.auth
import grpc
from google.api_core import exceptions as api_exceptions
from google.api_core import retry as api_retry
from google.auth import exceptions as auth_exceptions
from google.auth.credentials import AnonymousCredentials
from google.cloud import tpu_v2
from google.cloud.tpu_v2.services.tpu.transports import TpuGrpcTransport

from podracer.errors import PodracerError
from podracer.provision.spec import CLOUD_PLATFORM_SCOPE, SliceSpec, Timing

LOGIN_COMMAND = "gcloud auth application-default login"
_TRANSIENT = (api_exceptions.ServiceUnavailable, api_exceptions.DeadlineExceeded)


class ApiError(PodracerError):
    """A failed TPU API call, explained in one line; `cause` is the library's error."""

    def __init__(self, message: str, cause: Exception | None = None):
        super().__init__(message)
        self.cause = cause

    @property
    def not_found(self) -> bool:
        return isinstance(self.cause, api_exceptions.NotFound)

    @property
    def already_exists(self) -> bool:
        return isinstance(self.cause, api_exceptions.AlreadyExists)

    @property
    def transient(self) -> bool:
        """An outage, not an answer: the API unreachable, or a token that could not be refreshed."""
        return isinstance(self.cause, (api_exceptions.RetryError, *_TRANSIENT,
                                       auth_exceptions.GoogleAuthError))

    @property
    def maybe_applied(self) -> bool:
        """True when the server may have acted although the call failed (lost responses)."""
        return isinstance(self.cause, (api_exceptions.RetryError, *_TRANSIENT))


def is_loopback(endpoint: str) -> bool:
    """True for `127.0.0.1:PORT`, `localhost:PORT` and `[::1]:PORT`."""
    host = endpoint.rsplit(":", 1)[0].strip("[]") if ":" in endpoint else endpoint
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def application_default_credentials():
    """(credentials, project or None) from Application Default Credentials."""
    try:
        return google.auth.default(scopes=[CLOUD_PLATFORM_SCOPE])
    except auth_exceptions.DefaultCredentialsError:
        raise PodracerError(
            f"no Google Cloud credentials found; run `{LOGIN_COMMAND}` "
            "(or point GOOGLE_APPLICATION_CREDENTIALS at a service-account key file)"
        ) from None


def connect(endpoint: str | None, credentials=None) -> tpu_v2.TpuClient:
    """A `TpuClient`: plaintext and anonymous for a loopback endpoint, else over TLS.

    A loopback endpoint is an emulator or a test server, which has no TLS and
    no use for a token; anything else gets the caller's credentials.
    """
    if endpoint and is_loopback(endpoint):
        transport = TpuGrpcTransport(
            host=endpoint,
            credentials=AnonymousCredentials(),
            channel=lambda host, **_: grpc.insecure_channel(host),
        )
        return tpu_v2.TpuClient(transport=transport)
    options = {"api_endpoint": endpoint} if endpoint else None
    return tpu_v2.TpuClient(credentials=credentials, client_options=options, transport="grpc")


def _one_line(text: object, limit: int = 300) -> str:
    line = " ".join(str(text).split())
    # Whatever the server echoes back, never show something shaped like a token.
    line = re.sub(r"ya29\.[\w.-]+", "[redacted]", line)
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _api_message(error: Exception) -> str:
    message = getattr(error, "message", None) or str(error)
    return _one_line(message)


def explain(error: Exception, spec: SliceSpec, doing: str, timing: Timing) -> ApiError:
    """One line that says what went wrong while `doing`, and what to do about it."""
    zone, name = spec.zone, spec.name
    if isinstance(error, api_exceptions.RetryError):
        cause = error.cause
        detail = _api_message(cause) if cause is not None else _one_line(error)
        return ApiError(
            f"the TPU API stayed unavailable for {timing.retry_deadline:g} s while {doing} "
            f"({detail}); try again later", error)
    if isinstance(error, auth_exceptions.GoogleAuthError):
        return ApiError(
            f"could not get an access token while {doing} ({type(error).__name__}); "
            f"run `{LOGIN_COMMAND}`", error)
    message = _api_message(error)
    if isinstance(error, api_exceptions.PermissionDenied):
        text = (f"permission denied while {doing} in project {spec.project}: {message}; "
                "check --project, that the Cloud TPU API is enabled, and that you have "
                "the TPU Admin role (roles/tpu.admin)")
        if spec.identity.service_account:
            text += (" and the Service Account User role (roles/iam.serviceAccountUser) "
                     f"on {spec.identity.service_account}")
    elif isinstance(error, api_exceptions.Unauthenticated):
        text = f"the credentials were rejected while {doing}: {message}; run `{LOGIN_COMMAND}`"
    elif isinstance(error, api_exceptions.ResourceExhausted):
        text = (f"no capacity or quota for {spec.shape or 'this TPU'} in {zone} "
                f"while {doing}: {message}; try another --zone, --spot, or --queued to "
                "wait for capacity")
    elif isinstance(error, api_exceptions.InvalidArgument):
        text = (f"the TPU API rejected the request while {doing}: {message}; check "
                "--accelerator-type (or --tpu-version and --topology), --runtime-version, "
                "--zone, and --vpc-network, --subnetwork, --service-account if given "
                f"(`gcloud compute tpus accelerator-types list --zone={zone}`)")
    elif isinstance(error, api_exceptions.NotFound):
        text = (f"not found while {doing}: {message}; check --tpu, --zone and --project "
                f"(`python launch/tpu.py list --zone={zone}`)")
    elif isinstance(error, api_exceptions.AlreadyExists):
        text = (f"a TPU named {name} already exists in {zone}; pick another --tpu, or "
                f"delete it with `python launch/tpu.py down --tpu={name} --zone={zone}`")
    elif isinstance(error, _TRANSIENT):
        text = f"the TPU API is unavailable while {doing}: {message}; try again later"
    elif isinstance(error, api_exceptions.GoogleAPICallError):
        code = getattr(error.code, "name", error.code)
        text = f"the TPU API failed while {doing}: {code}: {message}"
    else:
        text = f"the TPU API failed while {doing}: {type(error).__name__}: {message}"
    return ApiError(text, error)


def _method_name(request) -> str:
    """`create_node` for a `CreateNodeRequest`: the `TpuClient` method that sends it."""
    rpc = type(request).__name__.removesuffix("Request")
    return re.sub(r"(?<!^)(?=[A-Z])", "_", rpc).lower()


class TpuApi:
    """One slice's view of the API: send requests, wait on operations."""

    def __init__(self, client: tpu_v2.TpuClient, spec: SliceSpec, timing: Timing):
        self.client = client
        self.spec = spec
        self.timing = timing
        self._retry = api_retry.Retry(
            predicate=api_retry.if_exception_type(*_TRANSIENT),
            initial=timing.retry_initial_delay,
            maximum=timing.retry_max_delay,
            multiplier=2.0,
            timeout=timing.retry_deadline,
        )

    def send(self, request, doing: str):
        """Sends `request` with bounded retries; failures become one-line `ApiError`s."""
        method = getattr(self.client, _method_name(request))
        try:
            return method(request=request, retry=self._retry, timeout=self.timing.call_timeout)
        except (api_exceptions.GoogleAPIError, auth_exceptions.GoogleAuthError) as error:
            raise explain(error, self.spec, doing, self.timing) from None

    def send_or_none(self, request, doing: str):
        """Like `send`, but None when the resource does not exist."""
        try:
            return self.send(request, doing)
        except ApiError as error:
            if error.not_found:
                return None
            raise

    def operation_done(self, operation, doing: str) -> bool:
        """Polls a long-running operation once; raises its error if it failed."""
        try:
            if not operation.done(retry=self._retry):
                return False
        except (api_exceptions.GoogleAPIError, auth_exceptions.GoogleAuthError) as error:
            raise explain(error, self.spec, doing, self.timing) from None
        error = operation.exception()
        if error is not None:
            raise explain(error, self.spec, doing, self.timing)
        return True

    def wait_operation(self, operation, doing: str, timeout: float) -> None:
        """Polls until the operation finishes, at most `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while not self.operation_done(operation, doing):
            if time.monotonic() > deadline:
                raise PodracerError(
                    f"gave up after {timeout:g} s while {doing}; the operation "
                    f"{operation.operation.name} may still finish")
            time.sleep(self.timing.poll_interval)

    def close(self) -> None:
        self.client.transport.close()
