"""XA transactions in the binlog: their rows are delivered at ``XA COMMIT``, never after ``XA ROLLBACK``.

MariaDB 10.5+ (and MySQL) write an XA transaction's rows when it is *prepared* (``XA START`` …
``XA END``, ``XA PREPARE``) and its outcome later, as a transaction of its own (``XA COMMIT`` or
``XA ROLLBACK``), with any number of other transactions between. A prepared XA transaction still
holds its rows' locks until its outcome, so no transaction between the two touches those rows:
delivering its rows at the prepare's place in the binlog (once the commit is seen) keeps every
key's changes in commit order, and keeps positions increasing.

So while a prepared transaction with rows of the poller's tables has no outcome yet, every later
change is *held* (:class:`XaHold`) and the reader's position stays before the prepare: a page ends
there, a checkpoint cannot pass it, and a stream opened at the checkpoint reads the prepare again.
When every held prepare has its outcome, the held changes are released in binlog order, the
rolled-back transactions' left out. ``XA COMMIT … ONE PHASE`` (no prepare) commits at once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

__all__ = ["XaHold", "xa_statement"]

_XA = re.compile(
    r"^XA\s+(START|BEGIN|END|COMMIT|ROLLBACK)\s+(.*?)(\s+ONE\s+PHASE)?\s*;?\s*$", re.IGNORECASE | re.DOTALL
)


def xa_statement(query: str) -> tuple[str, str, bool] | None:
    """``(verb, xid, one phase)`` of an XA statement (verb upper case; the xid as the binlog writes
    it, e.g. ``X'61',X'',1``), or None for any other statement."""
    match = _XA.match(query.strip())
    if match is None:
        return None
    verb = match.group(1).upper()
    return ("START" if verb == "BEGIN" else verb), _xid(match.group(2)), match.group(3) is not None


def _xid(text: str) -> str:
    return re.sub(r"\s+", "", text)


@dataclass(slots=True)
class _Held:
    xid: str | None  # None: an ordinary transaction's changes, held behind a prepare
    changes: list[Any]
    committed: bool | None = None  # an XA transaction's outcome once seen


@dataclass(slots=True)
class XaHold:
    """Changes held back, in binlog order, behind prepared XA transactions with no outcome yet."""

    _queue: list[_Held] = field(default_factory=list)

    @property
    def holding(self) -> bool:
        return bool(self._queue)

    def prepared(self, xid: str, changes: list[Any]) -> None:
        self._queue.append(_Held(xid, changes))

    def add(self, changes: list[Any]) -> None:
        if changes:
            self._queue.append(_Held(None, changes))

    def resolve(self, xid: str, committed: bool) -> list[Any] | None:
        """The outcome of ``xid``: the changes now released (in order), or None while some other
        prepare still waits (or ``xid`` was not held: its rows were delivered, or were none of ours)."""
        held = next((h for h in self._queue if h.xid == xid and h.committed is None), None)
        if held is None:
            return None
        held.committed = committed
        if any(h.xid is not None and h.committed is None for h in self._queue):
            return None
        out = [c for h in self._queue if h.xid is None or h.committed for c in h.changes]
        self._queue.clear()
        return out
