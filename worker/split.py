"""Split-on-failure: a failing N-event message becomes N single-event messages.

Each single gets a message id derived from its event id, so re-splitting after a crash (the
parent was not completed) produces identical messages that duplicate detection drops.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from shared.config import Config
from shared.ids import split_message_id
from shared.messages import OutgoingMessage, pack_batch, session_key
from shared.models import Batch

__all__ = ["PROP_SPLIT_FROM", "Splitter"]

PROP_SPLIT_FROM = "dbfanout-split-from"


class Splitter:
    """Sends the singles through ``send_all(queue, messages)`` (returns once all were accepted)."""

    def __init__(self, config: Config, send_all: Callable[[str, list[OutgoingMessage]], None]) -> None:
        self._config = config
        self._send_all = send_all

    def singles(self, batch: Batch, parent_message_id: str) -> list[OutgoingMessage]:
        poller = self._config.pollers[batch.poller]
        limit = poller.max_message_bytes
        singles: list[OutgoingMessage] = []
        for event in batch.events:
            (message,) = pack_batch(replace(batch, events=(event,)), limit, oversize=lambda e, _n: e)
            singles.append(
                replace(
                    message,
                    message_id=split_message_id(event.event_id),
                    # a session-enabled queue refuses a message without one; keep the key's order
                    session_id=session_key(poller.pk, event) if poller.sessions else None,
                    application_properties={**message.application_properties, PROP_SPLIT_FROM: parent_message_id},
                )
            )
        return singles

    def split(self, batch: Batch, *, parent_message_id: str, queue: str) -> None:
        self._send_all(queue, self.singles(batch, parent_message_id))
