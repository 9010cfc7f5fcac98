"""Claim-check for rows too large for one message (``oversize_policy = "claim-check"``).

The poller stores the whole event in a blob and sends a small reference event instead; the
worker swaps the reference for the stored event before calling the handler, so handlers never
see the difference. Claims live in the state storage account, in the state container
(``[app] state_container``, default ``db-state``) under ``claims/<app>/<poller>/<event id>.json``.
The blob name is the event id, so a re-send overwrites identical content.

dbfanout never deletes a claim: a redelivery, a split single or a DLQ replay may need it long
after the first message completed. The state account's lifecycle rule (``infra/modules/
storage.bicep``, ``claimRetentionDays``) deletes claims older than the dead-letter retention you
need; a message whose claim is gone fails with :class:`~shared.errors.EnvelopeError` and is
dead-lettered, never handled with a partial row.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from azure.core.exceptions import AzureError, ResourceNotFoundError
from azure.storage.blob import ContainerClient

from shared.codec import decode_event, dumps, encode_event, loads
from shared.config import Config
from shared.errors import ConfigError, EnqueueError, EnvelopeError
from shared.models import RowChange
from shared.settings import storage_connection

__all__ = ["CLAIM_KEY", "CLAIM_PREFIX", "ClaimCheck", "is_claim", "open_claim_check", "state_container"]

#: The only key of a reference event's ``after``; documented in the envelope JSON Schema.
CLAIM_KEY = "$dbfanout_claim_check"
#: Where claims live in the state container (the infra lifecycle rule filters on it).
CLAIM_PREFIX = "claims"

MISSING_HINT = (
    "the claim blob was deleted (the state account's lifecycle rule, claimRetentionDays, expired it, or by hand): "
    "the row cannot be recovered from this message; touch the row in the source so the poller sends it again, "
    "then purge the message from the dead-letter queue"
)


def is_claim(event: RowChange) -> bool:
    """Whether ``event`` is a reference to a stored event rather than the event itself."""
    after = event.after
    if type(after) is dict:  # a decoded event: no abstract-class check (this runs once per event)
        return CLAIM_KEY in after
    return isinstance(after, Mapping) and CLAIM_KEY in after


class ClaimCheck:
    """Stores oversize events (poller side) and fetches them back (worker side)."""

    def __init__(self, container: ContainerClient, prefix: str = CLAIM_PREFIX) -> None:
        self._container = container
        self._prefix = prefix

    def blob_name(self, event: RowChange) -> str:
        return f"{self._prefix}/{event.poller}/{event.event_id}.json"

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
        if not is_claim(event):
            return event
        claim = (event.after or {})[CLAIM_KEY]
        name = claim["blob"]
        where = f"claim-check blob {claim.get('container')}/{name} of event {event.event_id} (poller {event.poller})"
        if claim.get("container") != self._container.container_name:
            raise EnvelopeError(f"{where} is not in this app's state container {self._container.container_name}")
        try:
            stored = loads(self._container.download_blob(name).readall())
        except ResourceNotFoundError as exc:
            raise EnvelopeError(f"{where} is missing", hint=MISSING_HINT) from exc
        except AzureError as exc:
            # Retryable: raising fails the message, which is redelivered (or dead-lettered, never lost).
            raise EnvelopeError(f"{where} cannot be read: {type(exc).__name__}") from exc
        full = decode_event(stored, event.poller)
        if full.event_id != event.event_id:
            raise EnvelopeError(f"{where} holds event {full.event_id}, not {event.event_id}")
        # The epoch is the envelope's (the stored event never had one): keep the reference's.
        return replace(full, epoch=event.epoch) if event.epoch else full


def open_claim_check(config: Config) -> ClaimCheck:
    """The app's claim store: the state container of the state storage account (no I/O yet)."""
    return ClaimCheck(state_container(config), prefix=f"{CLAIM_PREFIX}/{config.app.name}")


def state_container(config: Config) -> ContainerClient:
    """The state container of the state storage account (no I/O yet): claims and failure records."""
    app = config.app
    conn = storage_connection(config.settings, app.state_connection)
    if conn.connection_string:
        try:
            container = ContainerClient.from_connection_string(conn.connection_string, app.state_container)
        except ValueError as exc:  # the message never repeats the string: it holds the account key
            raise ConfigError(f"settings.{app.state_connection}", "not a valid storage connection string") from exc
    elif conn.blob_service_uri:
        from azure.identity import DefaultAzureCredential

        credential = DefaultAzureCredential(managed_identity_client_id=conn.client_id)
        container = ContainerClient(conn.blob_service_uri, app.state_container, credential=credential)
    else:
        raise ConfigError(f"settings.{app.state_connection}", "needs a connection string or a blob service URI")
    return container
