"""Fault injection, so other test suites can exercise failure paths over the real protocol.

An emulator-only knob (Service Bus has nothing like it): tests refuse sends on purpose, once
(:meth:`Faults.reject_next_sends`) or until told otherwise (:meth:`Faults.throttle`, a namespace
that throttles every send with ``com.microsoft:server-busy`` and Service Bus's own text).
:meth:`Faults.send_counts` says how many sends each entity accepted and refused, for any reason
(a full queue too): a test counts a client's attempts there.
"""

from __future__ import annotations

import threading
from collections import Counter

from sbemulator.errors import SERVER_BUSY_TEXT, BrokerError

SERVER_BUSY = "com.microsoft:server-busy"


class InjectedFault(BrokerError):
    """A refusal chosen by a test; carries the AMQP condition to send."""

    def __init__(self, condition: str, description: str) -> None:
        super().__init__(description)
        self.condition = condition


class Faults:
    """Thread-safe switches the AMQP layer consults. Obtain it as ``emulator.faults``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reject_sends: list[tuple[str, str]] = []
        self._throttled: set[str] | None = None  # entity names (lower case); empty: every entity
        self._accepted: Counter[str] = Counter()
        self._refused: Counter[str] = Counter()

    def reject_next_sends(
        self,
        n: int = 1,
        condition: str = SERVER_BUSY,
        description: str = SERVER_BUSY_TEXT,
    ) -> None:
        """Refuse the next ``n`` sends (single or batch transfers) with ``condition``.

        ``com.microsoft:server-busy`` surfaces as ServiceBusServerBusyError (the SDK retries it
        unless ``retry_total=0``); ``amqp:resource-limit-exceeded`` as ServiceBusQuotaExceededError.
        """
        with self._lock:
            self._reject_sends.extend([(condition, description)] * n)

    def throttle(self, *entities: str) -> None:
        """Refuse every send to ``entities`` (queues or topics; none: every entity) with
        ``com.microsoft:server-busy`` and Service Bus's throttling text, until :meth:`unthrottle`."""
        with self._lock:
            self._throttled = {e.lower() for e in entities}

    def unthrottle(self) -> None:
        """Accept sends again (after :meth:`throttle`)."""
        with self._lock:
            self._throttled = None

    def clear(self) -> None:
        """Forget all pending faults (and stop throttling)."""
        with self._lock:
            self._reject_sends.clear()
            self._throttled = None

    def take_send_fault(self, entity: str = "") -> InjectedFault | None:
        """The next injected send refusal for ``entity``, if any (consumes a one-off fault)."""
        with self._lock:
            if self._reject_sends:
                condition, description = self._reject_sends.pop(0)
                return InjectedFault(condition, description)
            throttled = self._throttled
        if throttled is not None and (not throttled or entity.lower() in throttled):
            return InjectedFault(SERVER_BUSY, SERVER_BUSY_TEXT)
        return None

    def count_send(self, entity: str, *, accepted: bool) -> None:
        """Count one transfer to ``entity`` (called by the AMQP layer)."""
        with self._lock:
            (self._accepted if accepted else self._refused)[entity.lower()] += 1

    def send_counts(self, entity: str) -> dict[str, int]:
        """``{"accepted": n, "refused": n}``: transfers (a batch is one) to a queue or topic so far."""
        key = entity.lower()
        with self._lock:
            return {"accepted": self._accepted[key], "refused": self._refused[key]}
