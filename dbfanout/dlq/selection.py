"""Which dead-lettered messages a command acts on, and the receive scan that finds them.

Shared by ``replay`` and ``purge`` of a Service Bus dead-letter queue; the storage-queue quarantine
(:mod:`dbfanout.dlq.poison`) uses the same :class:`Selection`.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from azure.servicebus import ServiceBusReceivedMessage, ServiceBusReceiver
from azure.servicebus.exceptions import ServiceBusError

from dbfanout.ops.bus import MessageView
from shared.logs import get_logger
from shared.servicebus import bus_errors

__all__ = ["Progress", "Selection", "each_selected", "release"]

log = get_logger("cli.replay")

RECEIVE_BATCH = 10  # small: every received message holds a lock until it is settled
RECEIVE_WAIT_SECONDS = 2.0

#: ``(done, total)`` after each message acted on.
Progress = Callable[[int, int], None]


@dataclass(frozen=True, slots=True)
class Selection:
    """Which dead-lettered messages to act on. ``everything`` must be explicit (``--all``)."""

    everything: bool = False
    sequences: frozenset[int] = frozenset()
    reason: str | None = None
    since: dt.datetime | None = None

    @property
    def empty(self) -> bool:
        return not (self.everything or self.sequences or self.reason or self.since)

    def matches(self, view: MessageView) -> bool:
        """Every given filter must hold (``--all`` alone matches everything)."""
        if self.sequences and view.sequence_number not in self.sequences:
            return False
        if self.reason is not None and (view.reason or "") != self.reason:
            return False
        return not (self.since is not None and (view.enqueued_time is None or view.enqueued_time < self.since))


def each_selected(
    receiver: ServiceBusReceiver,
    pending: set[int],
    act: Callable[[ServiceBusReceivedMessage], bool],
    progress: Progress | None = None,
) -> None:
    """Receive until every pending sequence number was acted on or the DLQ has nothing more to give.

    ``act`` settles one selected message and returns False to stop. Messages that are not
    selected keep their lock while the scan goes on (so the receiver moves past them) and are
    abandoned at the end. What stays in ``pending`` was not found (gone, or locked elsewhere).
    """
    total, held, going = len(pending), [], True
    try:
        while pending and going:
            with bus_errors("receive", receiver.entity_path):
                batch = receiver.receive_messages(max_message_count=RECEIVE_BATCH, max_wait_time=RECEIVE_WAIT_SECONDS)
            if not batch:
                break
            for message in batch:
                seq = int(message.sequence_number or 0)
                if seq not in pending or not going:
                    held.append(message)
                    continue
                going = act(message)
                pending.discard(seq)
                if progress is not None:
                    progress(total - len(pending), total)
    finally:
        release(receiver, held)


def release(receiver: ServiceBusReceiver, messages: Iterable[ServiceBusReceivedMessage]) -> None:
    """Give locks back (best effort: an expired lock frees the message anyway)."""
    for message in messages:
        try:
            receiver.abandon_message(message)
        except (ServiceBusError, OSError):
            log.debug("abandon failed; the lock will lapse", exc_info=True)
