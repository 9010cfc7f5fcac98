"""Duplicate detection history: message ids seen within an entity's time window."""

from __future__ import annotations

from collections import OrderedDict


class DuplicateHistory:
    """Message ids remembered until ``window`` seconds after they were first sent."""

    def __init__(self, enabled: bool, window: float) -> None:
        self.enabled = enabled
        self.window = window
        self._seen: OrderedDict[str, float] = OrderedDict()

    def is_duplicate(self, message_id: str | None, now: float) -> bool:
        """True when ``message_id`` was sent within the window (never for messages without an id)."""
        if not self.enabled or message_id is None:
            return False
        self.prune(now)
        return message_id in self._seen

    def remember(self, message_id: str | None, now: float) -> None:
        """Record a message id that was accepted."""
        if self.enabled and message_id is not None:
            self._seen[message_id] = now + self.window

    def prune(self, now: float) -> None:
        """Forget ids whose window has passed (oldest first)."""
        while self._seen:
            first = next(iter(self._seen))
            if self._seen[first] > now:
                break
            del self._seen[first]
