"""Operator time arguments: ``--since T`` (ISO time or an age such as ``2h``) and durations (``7d``)."""

from __future__ import annotations

import datetime as dt
import re

__all__ = ["parse_duration", "parse_since"]

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$", re.IGNORECASE)
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> dt.timedelta:
    """``90s``, ``15m``, ``2h``, ``7d``, ``1w`` → a timedelta. Raises ValueError saying the format."""
    match = _DURATION.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a duration; use a number and a unit: 90s, 15m, 2h, 7d, 1w")
    return dt.timedelta(seconds=float(match.group(1)) * _UNITS[match.group(2).lower()])


def parse_since(text: str, now: dt.datetime | None = None) -> dt.datetime:
    """An ISO time (with an offset, or ``Z``; a naive one is taken as UTC) or an age (``2h`` = 2 hours ago)."""
    now = now or dt.datetime.now(dt.UTC)
    if _DURATION.match(text):
        return now - parse_duration(text)
    try:
        value = dt.datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"{text!r} is neither an ISO time (2026-04-07T01:00:00Z) nor an age (2h, 7d)") from None
    return value if value.tzinfo is not None else value.replace(tzinfo=dt.UTC)
