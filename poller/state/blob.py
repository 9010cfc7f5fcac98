"""StateStore on Azure Blob Storage: one JSON blob per poller holds checkpoint and lease (seed 002).

Every mutation is exactly one conditional upload (STYLE R1): If-None-Match ``*`` to create,
If-Match on the snapshot's ETag otherwise, and no SDK retries (a retried conditional write
whose first attempt landed would come back 412 and look like a lost lease). Loads may retry a
little. SDK errors are mapped once, in :func:`blob_errors` (R2).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any, TypedDict, Unpack
from urllib.parse import urlsplit

import requests
from azure.core import MatchConditions
from azure.core.exceptions import (
    AzureError,
    HttpResponseError,
    ResourceExistsError,
    ResourceModifiedError,
    ResourceNotFoundError,
    ServiceResponseError,
)
from azure.core.pipeline.transport import RequestsTransport
from azure.identity import DefaultAzureCredential
from azure.storage.blob import BlobClient, BlobServiceClient, ContainerClient, ContentSettings, LinearRetry

from poller.lease.protocol import Clock, utcnow
from poller.ports import Snapshot
from poller.state.store import ConditionalStateStore, WriteOp
from shared.codec import decode_state, encode_state
from shared.errors import (
    CommitAmbiguousError,
    CommitError,
    ConfigError,
    DbFanoutError,
    LostLeaseError,
    StateError,
    StateUnavailableError,
)
from shared.models import StateDoc
from shared.settings import StorageConnection, redact_url

__all__ = [
    "DEFAULT_CONTAINER",
    "BlobStateStore",
    "LeaseTiming",
    "blob_errors",
    "blob_service_client",
    "open_state_store",
    "state_blob_name",
]

DEFAULT_CONTAINER = "db-state"
DEFAULT_REQUEST_TIMEOUT = 10.0
DEFAULT_READ_RETRIES = 1

#: Operations that write with If-Match / If-None-Match: a 404/409/412 means the lease moved.
_CAS_OPS = frozenset({"acquire", "heartbeat", "commit", "release", "replace"})
#: Commit answers that may come after the write landed (timeouts on the service side).
_AMBIGUOUS_STATUS = frozenset({408, 500, 504})
#: Client errors that say "try again" (auth may be a token or RBAC propagation delay).
_TRANSIENT_4XX = frozenset({401, 403, 408, 429})


def state_blob_name(app_name: str, poller_name: str) -> str:
    """``state/{app_name}/{poller_name}.json`` (seed 002 §3)."""
    return f"state/{app_name}/{poller_name}.json"


def _describe(exc: BaseException) -> str:
    """A one-line account of an SDK error, with any key or SAS signature redacted."""
    status = getattr(exc, "status_code", None)
    code = getattr(exc, "error_code", None)
    code = getattr(code, "value", code)
    first = (str(exc).strip().splitlines() or [""])[0][:200]
    parts = [type(exc).__name__, f"status={status}" if status else "", f"code={code}" if code else "", first]
    return redact_url(" ".join(p for p in parts if p))


@contextmanager
def blob_errors(op: str, window: str | None = None) -> Iterator[None]:
    """Map azure-storage-blob errors to dbfanout errors, ``from`` the SDK error (STYLE R2).

    * 412 / 409 / 404 on a conditional write: the blob moved under us -> LostLeaseError (W4)
    * commit without an answer (read timeout, dropped connection, 408/500/504): it may have
      landed -> CommitAmbiguousError (W5); any other commit failure -> CommitError (W1, or ``window``)
    * anything else (unreachable, connect timeout, auth, throttling, 5xx, missing container) ->
      StateUnavailableError (retryable); a request the service rejects as invalid (other 4xx) -> StateError

    Messages carry the SDK error's type, status, code and first line, with secrets redacted.
    """
    try:
        yield
    except AzureError as exc:
        raise _mapped(op, window, exc) from exc


def _mapped(op: str, window: str | None, exc: AzureError) -> DbFanoutError:
    what = _describe(exc)
    status = getattr(exc, "status_code", None)
    if isinstance(exc, ResourceNotFoundError) and getattr(exc, "error_code", None) == "ContainerNotFound":
        return StateUnavailableError(
            f"{op}: the state container does not exist ({what})",
            hint="create the state container (open_state_store does) or fix the container name",
        )
    conflict = isinstance(exc, ResourceModifiedError | ResourceExistsError | ResourceNotFoundError)
    if op in _CAS_OPS and (conflict or status in (409, 412)):
        return LostLeaseError(f"{op}: the state blob changed since it was read; the lease moved ({what})", window="W4")
    if op == "commit":
        if isinstance(exc, ServiceResponseError) or status in _AMBIGUOUS_STATUS:
            # The request went out and no definite answer came back: it may have landed.
            return CommitAmbiguousError(f"commit: the write may have landed ({what})", window="W5")
        return CommitError(f"commit failed; nothing was written ({what})", window=window or "W1")
    if (
        isinstance(exc, HttpResponseError)
        and status is not None
        and 400 <= status < 500
        and status not in _TRANSIENT_4XX
    ):
        return StateError(f"{op}: state storage rejected the request ({what})")
    landed = " (the write may have landed)" if op in _CAS_OPS and isinstance(exc, ServiceResponseError) else ""
    return StateUnavailableError(f"{op}: state storage unreachable or refused the request{landed} ({what})")


class BlobStateStore(ConditionalStateStore):
    """The StateStore port on one blob: ``state/{app_name}/{poller_name}.json`` in a container."""

    def __init__(
        self,
        container_client: ContainerClient,
        app_name: str,
        poller_name: str,
        *,
        clock: Clock = utcnow,
        skew_margin: dt.timedelta | None = None,
        request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
    ) -> None:
        super().__init__(poller_name, clock=clock, skew_margin=skew_margin)
        self.app_name = app_name
        self.blob_name = state_blob_name(app_name, poller_name)
        self._container = container_client
        self._blob = container_client.get_blob_client(self.blob_name)
        self._read_opts: dict[str, Any] = {"connection_timeout": request_timeout, "read_timeout": request_timeout}
        # One request per mutation: never let the SDK resend a conditional write.
        self._write_opts: dict[str, Any] = {**self._read_opts, "retry_total": 0}

    def __repr__(self) -> str:
        return f"BlobStateStore({self._blob.container_name}/{self.blob_name})"

    @property
    def container_client(self) -> ContainerClient:
        return self._container

    @property
    def blob_client(self) -> BlobClient:
        return self._blob

    def load(self) -> Snapshot | None:
        with blob_errors("load"):
            try:
                downloader = self._blob.download_blob(**self._read_opts)
            except ResourceNotFoundError:
                return None  # first run (a missing container shows up on the create)
            data = downloader.readall()
            etag = downloader.properties.etag
        return Snapshot(decode_state(data), etag)  # StateFormatError propagates: never overwrite it

    def put(self, op: WriteOp, doc: StateDoc, etag: str | None) -> Snapshot:
        """The one conditional upload: create (If-None-Match: *) or CAS (If-Match: etag)."""
        data = encode_state(doc)
        if etag is None:
            condition: dict[str, Any] = {"match_condition": MatchConditions.IfMissing}  # If-None-Match: *
        else:
            condition = {"etag": etag, "match_condition": MatchConditions.IfNotModified}
        with blob_errors(op):
            result = self._blob.upload_blob(
                data,
                overwrite=True,  # the condition above decides; overwrite=False would add its own
                content_settings=ContentSettings(content_type="application/json"),
                **condition,
                **self._write_opts,
            )
        return Snapshot(doc, str(result["etag"]))


# --------------------------------------------------------------------------------------------
# Factory


class _EnvOnceSession(requests.Session):
    """A requests session that reads the proxy and CA-bundle environment once per endpoint.

    requests re-reads them on every request (``merge_environment_settings``: every variable of
    the environment, twice), about a third of the CPU of a checkpoint write; the environment of
    a running app does not change, so the answer is kept per scheme, host and arguments.
    """

    def __init__(self) -> None:
        super().__init__()
        self._env_settings: dict[tuple[Any, ...], dict[str, Any]] = {}

    def merge_environment_settings(self, url: str, proxies: Any, stream: Any, verify: Any, cert: Any) -> dict[str, Any]:
        parts = urlsplit(url)
        key = (parts.scheme, parts.netloc, tuple(sorted((proxies or {}).items())), stream, verify, cert)
        if key not in self._env_settings:
            self._env_settings[key] = super().merge_environment_settings(url, proxies, stream, verify, cert)
        return dict(self._env_settings[key])


def blob_service_client(
    conn: StorageConnection,
    *,
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
    retry_total: int = DEFAULT_READ_RETRIES,
) -> BlobServiceClient:
    """A client from a connection string, or from ``blob_service_uri`` and a managed identity.

    Timeouts and retries are short so a stalled storage account cannot hang a tick for minutes.
    """
    options: dict[str, Any] = {
        "connection_timeout": request_timeout,
        "read_timeout": request_timeout,
        "retry_policy": LinearRetry(backoff=1, random_jitter_range=1, retry_total=retry_total),
        "transport": RequestsTransport(session=_EnvOnceSession(), session_owner=True),
    }
    if conn.connection_string:
        try:
            return BlobServiceClient.from_connection_string(conn.connection_string, **options)
        except ValueError as exc:  # the message never repeats the string: it holds the account key
            raise ConfigError("storage connection", "not a valid storage connection string") from exc
    if conn.blob_service_uri:
        credential = DefaultAzureCredential(managed_identity_client_id=conn.client_id)
        return BlobServiceClient(conn.blob_service_uri, credential=credential, **options)
    raise ConfigError("storage connection", "needs a connection string or a blob service URI")


class LeaseTiming(TypedDict, total=False):
    """The lease-timing keywords of :class:`BlobStateStore` that :func:`open_state_store` passes on."""

    clock: Clock
    skew_margin: dt.timedelta | None


def open_state_store(
    conn: StorageConnection,
    container: str,
    app_name: str,
    poller_name: str,
    *,
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
    retry_total: int = DEFAULT_READ_RETRIES,
    ensure_container: bool = True,
    **lease_timing: Unpack[LeaseTiming],
) -> BlobStateStore:
    """Build the client and the store; create the container when missing (an existing one is fine).

    ``clock`` and ``skew_margin`` go to :class:`BlobStateStore` as they are.
    Raises StateUnavailableError when the container cannot be created (storage down, no RBAC).
    """
    service = blob_service_client(conn, request_timeout=request_timeout, retry_total=retry_total)
    container_client = service.get_container_client(container)
    if ensure_container:
        with blob_errors("create-container"), suppress(ResourceExistsError):
            container_client.create_container(connection_timeout=request_timeout, read_timeout=request_timeout)
    return BlobStateStore(container_client, app_name, poller_name, request_timeout=request_timeout, **lease_timing)
