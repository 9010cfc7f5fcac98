"""The refusal backoff as a sink decorator: a refusing broker's state wraps the sink it refuses.

:class:`RefusalBackoff` is a :class:`~poller.ports.Sink` around another one. Its ``send`` counts
what the broker accepted; the tick asks it, once each, whether a send may be tried
(:meth:`RefusalBackoff.backoff_over`, before any request), what the lease's state says
(:meth:`RefusalBackoff.lease_taken`), what a refusal changes (:meth:`RefusalBackoff.refused`)
and that the tick ended (:meth:`RefusalBackoff.tick_ended`). The state itself (schedule, the
log-once lines, the gauge, what is persisted) is :class:`~poller.tick.backoff.SinkRefusals`'.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from poller.ports import Sink
from poller.tick.backoff import METADATA_KEY, SinkRefusals
from shared.errors import BrokerRefusingError
from shared.logs import get_logger, ids
from shared.models import Batch, Checkpoint

__all__ = ["RefusalBackoff"]

log = get_logger("poller.tick")  # the tick's logger: the lines are the tick's, as before the decorator


class RefusalBackoff:
    """A sink that backs off while the broker refuses sends (one poller's, across its ticks)."""

    def __init__(self, sink: Sink, refusals: SinkRefusals, *, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.inner = sink
        self.refusals = refusals
        self._monotonic = monotonic

    def send(self, batch: Batch) -> None:
        """Send through the wrapped sink; a :class:`BrokerRefusingError` propagates to the tick,
        which lands what was accepted before it and then calls :meth:`refused`."""
        self.inner.send(batch)
        self.refusals.accepted(len(batch.events))

    def close(self) -> None:
        self.inner.close()

    def backoff_over(self, until: float | None, stop: threading.Event) -> bool:
        """Whether a send may be tried now: no backoff, or its window ended (a lingering tick,
        ``until`` its end, waits for the window when it ends first; ``stop`` cuts the wait)."""
        wait = self.refusals.wait_seconds()
        if wait <= 0:
            return True
        if until is None or self._monotonic() + wait >= until:
            keys = ids(poller=self.refusals.poller, retry_in_seconds=round(wait, 1))
            log.debug("the broker refuses sends; backing off", extra=keys)
            return False
        return not stop.wait(wait)

    def lease_taken(self, checkpoint: Checkpoint | None) -> None:
        """The tick's lease outcome: the loaded checkpoint (a persisted refusal is adopted), or
        None when another instance holds the lease (it sends, and backs off, for the poller now)."""
        if checkpoint is None:
            self.refusals.forget()
        else:
            self.refusals.adopt(checkpoint.metadata)

    def refused(self, error: BrokerRefusingError, checkpoint: Checkpoint) -> Checkpoint | None:
        """Back off; a refusal that starts here returns ``checkpoint`` marked with it (same
        position), for the tick to write to the state blob once (``dbfanout status``, other
        processes). None while a refusal goes on."""
        if not self.refusals.refused(error):
            return None
        return Checkpoint(
            position=checkpoint.position,
            last_successful_batch_id=checkpoint.last_successful_batch_id,
            updated_at=checkpoint.updated_at,
            metadata={**checkpoint.metadata, METADATA_KEY: self.refusals.metadata()},
        )

    def tick_ended(self, *, caught_up: bool) -> None:
        """A tick ended without a refusal: one whose sends were accepted ends the refusal."""
        self.refusals.tick_ended(caught_up=caught_up)
