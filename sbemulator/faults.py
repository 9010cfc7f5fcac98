"""Fault injection, so other test suites can exercise failure paths over the real protocol."""

from __future__ import annotations

import threading

from sbemulator.errors import BrokerError


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

    def reject_next_sends(
        self,
        n: int = 1,
        condition: str = "com.microsoft:server-busy",
        description: str = "injected fault: the emulator refuses this send",
    ) -> None:
        """Refuse the next ``n`` sends (single or batch transfers) with ``condition``.

        ``com.microsoft:server-busy`` surfaces as ServiceBusServerBusyError (the SDK retries it
        unless ``retry_total=0``); ``amqp:resource-limit-exceeded`` as ServiceBusQuotaExceededError.
        """
        with self._lock:
            self._reject_sends.extend([(condition, description)] * n)

    def clear(self) -> None:
        """Forget all pending faults."""
        with self._lock:
            self._reject_sends.clear()

    def take_send_fault(self) -> InjectedFault | None:
        """The next injected send refusal, if any (consumes it)."""
        with self._lock:
            if not self._reject_sends:
                return None
            condition, description = self._reject_sends.pop(0)
        return InjectedFault(condition, description)
