"""A refusing broker is a state: back off, say so once, say when it ends.

When the broker refuses a send for now — the queue is full (QuotaExceeded), the namespace
throttles (ServerBusy), or it cannot be reached — the sink raises
:class:`~shared.errors.BrokerRefusingError`. The tick then keeps its checkpoint (nothing was
accepted past it) and hands the refusal to the poller's :class:`SinkRefusals`, which:

* schedules the next attempt after an exponentially growing, jittered delay
  (:class:`BackoffSchedule`: 1 s, 2 s, 4 s ... up to 30 s, each drawn from its upper half);
  a timer tick inside that window returns at once — no lease request, no source read, no
  storage write — and a lingering tick waits the window out when it ends before the linger does;
* logs the condition once at WARNING (later refusals at DEBUG) and, when a tick ends whose
  sends were accepted again, one INFO line with how long it lasted, the sends refused meanwhile
  and the rows accepted since it began (they had waited);
* sets the gauge ``dbfanout.sink_refusing`` (1 while it lasts, 0 again at the end) and counts
  every refused send in ``dbfanout.sends_refused`` (with its ``reason``);
* persists the state once per refusal, at its start: the state blob's ``checkpoint.metadata``
  gets ``sink_refusing`` (since, reason, error) in one CAS write that keeps the position. The
  next accepted page's commit replaces the metadata, which ends it. ``dbfanout status`` reads it
  there, and a new process (another Functions instance) that loads it adopts it: it does not
  warn again, and it reports the end with the refusal's whole duration.

The backoff itself lives in process memory (per poller runtime): a new process tries once at
its first tick, then backs off on its own; a process that finds the lease held elsewhere
forgets its refusal (the holder reports it).

The tick meets it as its sink: :class:`RefusalBackoff` wraps the poller's sink, counts what the
broker accepted, and is asked, once each, whether a send may be tried (before any request), what
the lease's state says, what a refusal changes and that the tick ended.
"""

from __future__ import annotations

import datetime as dt
import random
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from poller.ports import Sink
from shared.errors import BrokerRefusingError, RefusalReason
from shared.logs import get_logger, ids
from shared.models import Batch, Checkpoint
from shared.scrub import scrub
from shared.telemetry import metrics

__all__ = ["METADATA_KEY", "BackoffSchedule", "RefusalBackoff", "SinkRefusals", "refusal_from_metadata"]

log = get_logger("poller.backoff")
tick_log = get_logger("poller.tick")  # the tick's lines, as they were before the sink was wrapped

#: The key of the refusal in the state blob's ``checkpoint.metadata`` (read by ``dbfanout status``).
METADATA_KEY = "sink_refusing"

_REASONS: tuple[RefusalReason, ...] = ("queue_full", "throttled", "unreachable")
_WORDS: dict[str, str] = {
    "queue_full": "the queue is full",
    "throttled": "the broker throttles (server busy)",
    "unreachable": "the broker is unreachable",
}


@dataclass(frozen=True, slots=True)
class BackoffSchedule:
    """Exponential backoff with "equal jitter": attempt ``n`` (1-based) waits a delay drawn
    uniformly from the upper half of ``min(cap, base * factor**(n-1))``.

    The lower half is left out so the delay still grows (a full-jitter delay can be ~0 and
    retry at once); the jitter keeps many pollers of one namespace from retrying in step.
    """

    base: float = 1.0
    cap: float = 30.0
    factor: float = 2.0

    def nominal(self, attempt: int) -> float:
        """The delay's upper bound after ``attempt`` refused sends in a row."""
        if attempt < 1:
            return 0.0
        exponent = min(attempt - 1, 64)  # no float overflow on a refusal that lasts for days
        return float(min(self.cap, self.base * self.factor**exponent))

    def delay(self, attempt: int, rng: random.Random) -> float:
        """The wait before the next attempt, after ``attempt`` refused sends in a row."""
        nominal = self.nominal(attempt)
        return nominal / 2 + rng.random() * nominal / 2


@dataclass(frozen=True, slots=True)
class _Refusal:
    since: dt.datetime
    reason: RefusalReason
    error: str
    attempts: int
    retry_at: float  # on the monotonic clock


def refusal_from_metadata(metadata: Mapping[str, Any]) -> dict[str, Any] | None:
    """The persisted refusal in a checkpoint's metadata (``since``, ``reason``, ``error``), or None."""
    value = metadata.get(METADATA_KEY)
    if not isinstance(value, Mapping) or value.get("reason") not in _REASONS:
        return None
    return dict(value)


class SinkRefusals:
    """One poller's refusal state in this process (thread-safe; one tick at a time uses it).

    The tick calls :meth:`refused` when a send is refused, :meth:`accepted` after each accepted
    send and :meth:`tick_ended` when it ends without a refusal: the refusal ends there, once a
    send was accepted (a tick whose sends are accepted and then refused again — a queue that
    drains slowly — continues the refusal, with its backoff started over, and warns no more).
    """

    def __init__(
        self,
        poller: str,
        schedule: BackoffSchedule | None = None,
        *,
        rng: random.Random | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC),
    ) -> None:
        self.poller = poller
        self.schedule = schedule or BackoffSchedule()
        self._rng = rng or random.Random()
        self._monotonic = monotonic
        self._clock = clock
        self._lock = threading.Lock()
        self._refusal: _Refusal | None = None
        self._adopted: dict[str, Any] | None = None  # persisted by an earlier process, not yet resolved
        self._rows = 0  # rows accepted since the refusal started (they had waited)
        self._progressed = False  # a send was accepted since the last refusal
        self._refused_sends = 0  # sends refused since the refusal started

    @property
    def refusing(self) -> bool:
        """Whether a refusal (this process's, or one adopted from the state blob) is going on."""
        with self._lock:
            return self._refusal is not None or self._adopted is not None

    def wait_seconds(self) -> float:
        """How long until the next send may be tried (0: now)."""
        with self._lock:
            if self._refusal is None:
                return 0.0
            return max(0.0, self._refusal.retry_at - self._monotonic())

    def adopt(self, metadata: Mapping[str, Any]) -> None:
        """A loaded checkpoint's persisted refusal (another process announced it): not warned again."""
        persisted = refusal_from_metadata(metadata)
        with self._lock:
            if self._refusal is None and persisted is not None:
                self._adopted = persisted

    def refused(self, error: BrokerRefusingError) -> bool:
        """Record a refused send and schedule the next attempt. True when this starts the
        refusal here (the caller persists it, once), False while it goes on."""
        metrics.sends_refused.add(1, {"poller": self.poller, "reason": error.reason})
        text = scrub(str(error))
        with self._lock:
            current, adopted = self._refusal, self._adopted
            attempts = 1 if current is None or self._progressed else current.attempts + 1
            wait = self.schedule.delay(attempts, self._rng)
            since = current.since if current else _since(adopted) or self._clock()
            self._refusal = _Refusal(since, error.reason, text, attempts, self._monotonic() + wait)
            self._adopted, self._progressed = None, False
            self._refused_sends += 1
        metrics.sink_refusing.record(1, {"poller": self.poller})
        keys = ids(poller=self.poller, reason=error.reason, attempts=attempts, retry_in_seconds=round(wait, 1))
        started = current is None and adopted is None
        if started:
            log.warning(
                "the broker refuses sends (%s); backing off, the checkpoint holds and nothing is lost: %s",
                _WORDS[error.reason],
                text,
                extra=keys,
            )
        else:
            log.debug("the broker still refuses sends (%s)", _WORDS[error.reason], extra=keys)
        return started

    def accepted(self, rows: int) -> None:
        """A send of ``rows`` rows was accepted."""
        with self._lock:
            if self._refusal is not None or self._adopted is not None:
                self._rows += rows
                self._progressed = True

    def tick_ended(self, caught_up: bool) -> None:
        """A tick ended without a refusal: one that had sends accepted ends the refusal (one INFO
        line: how long it lasted, the sends refused meanwhile, the rows that had waited)."""
        with self._lock:
            current, adopted = self._refusal, self._adopted
            if not self._progressed or (current is None and adopted is None):
                return
            since = current.since if current else _since(adopted) or self._clock()
            reason = current.reason if current else str(adopted["reason"] if adopted else "")
            refused, rows = self._refused_sends, self._rows
            self._refusal, self._adopted, self._rows, self._progressed = None, None, 0, False
            self._refused_sends = 0
        seconds = max(0.0, (self._clock() - since).total_seconds())
        metrics.sink_refusing.record(0, {"poller": self.poller})
        log.info(
            "the broker accepts sends again after %.1f s (%s); %d rows that had waited were sent%s",
            seconds,
            _WORDS.get(reason, reason),
            rows,
            "" if caught_up else ", more follow",
            extra=ids(
                poller=self.poller, reason=reason, refused_seconds=round(seconds, 1), refused_sends=refused, rows=rows
            ),
        )

    def forget(self) -> None:
        """Another instance holds the lease now: this process sends nothing for the poller, so its
        refusal (and gauge) ends here without a line; the holder keeps its own (or adopts the
        persisted one)."""
        with self._lock:
            known = self._refusal is not None or self._adopted is not None
            self._refusal, self._adopted, self._rows, self._progressed = None, None, 0, False
            self._refused_sends = 0
        if known:
            metrics.sink_refusing.record(0, {"poller": self.poller})
            log.debug("another instance holds the lease; its sends are its own", extra=ids(poller=self.poller))

    def metadata(self) -> dict[str, Any]:
        """The refusal as persisted in ``checkpoint.metadata[METADATA_KEY]`` (empty when none)."""
        with self._lock:
            refusal = self._refusal
        if refusal is None:
            return {}
        return {"since": refusal.since.isoformat(), "reason": refusal.reason, "error": refusal.error[:500]}


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
            tick_log.debug("the broker refuses sends; backing off", extra=keys)
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


def _since(persisted: Mapping[str, Any] | None) -> dt.datetime | None:
    text = persisted.get("since") if persisted else None
    if not isinstance(text, str):
        return None
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError:
        return None
    return when if when.tzinfo else when.replace(tzinfo=dt.UTC)
