"""The Azure Storage Queue adapter both sides use (``transport = "storage-queue"``).

Differences from Service Bus that the pipeline handles here and in the docs:

* **No duplicate detection.** A batch re-sent after a failed commit (W1) is delivered twice;
  handlers must deduplicate on ``event_id`` (the processed-events helper does).
* **64 KiB per message**, and the Functions queue trigger expects **base64** text by default, so
  a message body is at most 48 KiB before encoding; larger rows need the claim-check policy.
* **Visibility timeouts instead of locks**, ``dequeue_count`` instead of a delivery count, and the
  poison queue ``<queue>-poison`` instead of a dead-letter queue.
"""

from __future__ import annotations

import base64
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from typing import Any

from azure.core.exceptions import (
    AzureError,
    HttpResponseError,
    ResourceExistsError,
    ResourceNotFoundError,
    ServiceRequestError,
    ServiceResponseError,
)
from azure.storage.queue import QueueClient, QueueServiceClient

from shared.errors import BrokerRefusingError, EnqueueError
from shared.messages import OutgoingMessage
from shared.settings import StorageConnection

__all__ = [
    "MAX_BODY_BYTES",
    "StorageQueueSender",
    "decode_queue_text",
    "encode_queue_text",
    "poison_queue_name",
    "queue_errors",
    "queue_service_client",
]

#: 64 KiB of base64 text carries 48 KiB of body.
MAX_BODY_BYTES = 48 * 1024


def poison_queue_name(queue: str) -> str:
    """Where the Functions host moves a message after ``maxDequeueCount`` failed attempts."""
    return f"{queue}-poison"


def encode_queue_text(body: bytes) -> str:
    return base64.b64encode(body).decode("ascii")


def decode_queue_text(text: str | bytes) -> bytes:
    raw = text.encode("ascii") if isinstance(text, str) else text
    return base64.b64decode(raw, validate=True)


def queue_service_client(conn: StorageConnection, **kwargs: Any) -> QueueServiceClient:
    """From a connection string, or from ``NAME__queueServiceUri`` and a managed identity."""
    if conn.connection_string:
        return QueueServiceClient.from_connection_string(conn.connection_string, **kwargs)
    if not conn.queue_service_uri:
        raise EnqueueError(
            "the storage connection has no queue endpoint",
            hint="set <connection>__queueServiceUri (e.g. https://ACCOUNT.queue.core.windows.net)",
        )
    from azure.identity import DefaultAzureCredential

    credential = DefaultAzureCredential(managed_identity_client_id=conn.client_id)
    return QueueServiceClient(conn.queue_service_uri, credential=credential, **kwargs)


@contextmanager
def queue_errors(op: str, queue: str) -> Iterator[None]:
    """Map storage SDK errors to EnqueueError, ``from`` the original (messages hold no keys).

    The service throttling (503 ServerBusy, 500 OperationTimedOut) or unreachable (no
    connection, a reset, a timeout) raises :class:`BrokerRefusingError`: the poller backs off.
    """
    try:
        yield
    except ResourceNotFoundError as exc:
        raise EnqueueError(f"{op}: storage queue {queue} does not exist", hint="create it (infra/ does)") from exc
    except (ServiceRequestError, ServiceResponseError) as exc:
        message = f"{op} to storage queue {queue} failed: the storage account is unreachable: {type(exc).__name__}"
        raise BrokerRefusingError(message, "unreachable") from exc
    except HttpResponseError as exc:
        code = getattr(exc, "error_code", None)
        if exc.status_code in (500, 503) and code in ("ServerBusy", "OperationTimedOut"):
            message = f"{op} to storage queue {queue} refused: the account is busy ({code})"
            raise BrokerRefusingError(message, "throttled") from exc
        raise EnqueueError(f"{op} to storage queue {queue} failed: {type(exc).__name__}") from exc
    except AzureError as exc:
        raise EnqueueError(f"{op} to storage queue {queue} failed: {type(exc).__name__}") from exc


class StorageQueueSender:
    """Sends messages one by one (Storage Queues have no batch send); returns once all were stored."""

    def __init__(self, queue: QueueClient, *, create: bool = False) -> None:
        self._queue = queue
        self.queue = queue.queue_name
        self._lock = threading.Lock()
        if create:
            with suppress(ResourceExistsError):
                queue.create_queue()

    def send_all(self, messages: Sequence[OutgoingMessage]) -> None:
        with self._lock, queue_errors("send", self.queue):
            for message in messages:
                if len(message.body) > MAX_BODY_BYTES:
                    raise EnqueueError(
                        f"message {message.message_id} is {len(message.body)} bytes; the limit is 48 KiB"
                    )
                self._queue.send_message(encode_queue_text(message.body))

    def close(self) -> None:
        self._queue.close()
