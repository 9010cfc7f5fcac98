"""Claim-check for rows too large for one message (``oversize_policy = "claim-check"``).

The poller stores the whole event in a blob and sends a small reference event instead; the
worker swaps the reference for the stored event before calling the handler, so handlers never
see the difference. The blob name is the event id, so a re-send overwrites identical content.
Claim blobs are not deleted by dbfanout (a redelivery or DLQ replay may need them): give the
container a lifecycle rule that deletes blobs older than the DLQ retention you need.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from azure.core.exceptions import AzureError
from azure.storage.blob import ContainerClient

from shared.codec import decode_event, dumps, encode_event, loads
from shared.errors import EnqueueError, EnvelopeError
from shared.models import RowChange

__all__ = ["CLAIM_KEY", "ClaimCheck"]

#: The only key of a reference event's ``after``; documented in the envelope JSON Schema.
CLAIM_KEY = "$dbfanout_claim_check"


class ClaimCheck:
    def __init__(self, container: ContainerClient) -> None:
        self._container = container

    def blob_name(self, event: RowChange) -> str:
        return f"claims/{event.poller}/{event.event_id}.json"

    def offload(self, event: RowChange, size: int) -> RowChange:
        """Store the event; return the reference event that travels instead (poller side)."""
        name = self.blob_name(event)
        try:
            self._container.upload_blob(name, dumps(encode_event(event)), overwrite=True)
        except AzureError as exc:
            raise EnqueueError(f"poller {event.poller}: cannot store claim-check blob {name}: {exc}") from exc
        reference: dict[str, Any] = {
            CLAIM_KEY: {"container": self._container.container_name, "blob": name, "bytes": size}
        }
        return replace(event, after=reference)

    def resolve(self, event: RowChange) -> RowChange:
        """Swap a reference event for the stored one (worker side); other events pass through."""
        if not event.after or CLAIM_KEY not in event.after:
            return event
        name = event.after[CLAIM_KEY]["blob"]
        try:
            stored = loads(self._container.download_blob(name).readall())
        except AzureError as exc:
            # Retryable: raising fails the message, which is redelivered (or dead-lettered, never lost).
            raise EnvelopeError(f"claim-check blob {name} of event {event.event_id} cannot be read: {exc}") from exc
        full = decode_event(stored, event.poller)
        if full.event_id != event.event_id:
            raise EnvelopeError(f"claim-check blob {name} holds event {full.event_id}, not {event.event_id}")
        return full
