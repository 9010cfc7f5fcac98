"""Closing what a long-lived runtime built: each part it keeps by name, then forgetting them."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any, Protocol, TypeVar

__all__ = ["Closable", "close_and_clear"]


class Closable(Protocol):
    """Anything with a ``close()`` (senders, runtimes, clients)."""

    def close(self) -> None: ...


_Part = TypeVar("_Part", bound=Closable)


def close_and_clear(parts: MutableMapping[Any, _Part]) -> None:
    """Close every part, then forget them all, so the next use builds fresh ones."""
    for part in parts.values():
        part.close()
    parts.clear()
