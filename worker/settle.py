"""What to do with a message after the handler ran: a pure decision (STYLE R10)."""

from __future__ import annotations

import enum

__all__ = ["Settle", "decide"]


class Settle(enum.Enum):
    COMPLETE = "complete"  # success: the host completes the message
    SPLIT = "split"  # re-enqueue each event alone, then let the parent complete
    RAISE = "raise"  # fail the invocation: the host abandons; DLQ after MaxDeliveryCount


def decide(ok: bool, n_events: int, delivery_count: int, split_after: int) -> Settle:
    """``delivery_count`` is the Functions host's: 1 on the first delivery."""
    if ok:
        return Settle.COMPLETE
    if n_events > 1 and delivery_count >= split_after:
        return Settle.SPLIT
    return Settle.RAISE
