"""Which decoded changes a pg_logical poller keeps, and what it must never drop in silence.

Why its own module: the slot sends whatever the publication holds, and two kinds of change have
no row for the stream: a change of a relation the poller does not know (a partition published
under its own name, a table someone added to the publication by hand) and a TRUNCATE (issue 42).
Neither is dropped without a word:

* a change of an unknown relation: a WARNING naming it (once per relation and process) and the
  counter ``dbfanout.pg_logical.unknown_relation_changes`` (attribute ``relation``);
* a TRUNCATE of one of the poller's tables: a WARNING naming the tables, the counter
  ``dbfanout.truncates`` (attribute ``table``), and a note the checkpoint past it
  records (``checkpoint.metadata["source"]["truncate"]``: tables, LSN, commit time, count), which
  ``dbfanout status`` shows. The checkpoint never moves past a TRUNCATE without that note: the
  page that could let it (or the slot) pass carries it, and a page with no row gets an
  ``advance`` to the TRUNCATE's position so the tick writes it.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from poller.ports import Page
from poller.snapshot.requests import signal_of
from poller.sources.pg_logical.pgoutput import Change, Relation
from shared.config import PollerConfig
from shared.models import Lsn, Position, SnapshotState
from shared.telemetry import metrics

__all__ = ["TRUNCATE_NOTE", "Relations", "Truncate", "listed", "record_truncates"]

#: The key of the last TRUNCATE in ``checkpoint.metadata["source"]``.
TRUNCATE_NOTE = "truncate"

Key = tuple[int, int]

# What a relation's changes are to the poller (Relations.wanted).
_LISTED, _SIGNAL, _UNKNOWN = "listed", "signal", "unknown"


@dataclass(frozen=True, slots=True)
class Truncate:
    """A TRUNCATE of some of the poller's tables, as the slot sent it."""

    key: Key
    tables: tuple[str, ...]
    committed_at: dt.datetime


class Relations:
    """The source's filter over decoded changes (see the module docstring)."""

    def __init__(self, config: PollerConfig, warn_once: Callable[..., None]) -> None:
        self._config = config
        self._warn_once = warn_once
        self._truncates: dict[Key, Truncate] = {}  # seen, not yet behind a landed checkpoint
        self._counted: Key = (-1, -1)  # the last unknown relation's change counted (re-peeks read it again)
        self._verdicts: dict[tuple[str, str], str] = {}  # (schema, name) -> _LISTED, _SIGNAL or _UNKNOWN

    def wanted(self, change: Change) -> bool:
        """Whether the stream gets ``change`` (its tables', and the signal rows of this poller)."""
        if change.kind == "truncate":
            self._truncated(change)
            return False
        rel = change.relation
        where = (rel.schema, rel.name)
        verdict = self._verdicts.get(where)
        if verdict is None:  # once per relation: the same name always gets the same verdict
            verdict = self._verdicts[where] = (
                _SIGNAL if rel.qualified == self._config.signal_table
                else _LISTED if listed(rel, self._config.tables) else _UNKNOWN
            )  # fmt: skip
        if verdict is _LISTED:
            return True
        if verdict is _SIGNAL:  # ours only: other pollers share the table
            return signal_of(change.new, self._config.name) is not None
        name = rel.qualified
        self._warn_once(
            f"unknown-{name}",
            "a change of %s arrived from the slot, which is not in tables: it is not delivered (a partition "
            "published under its own name? see 'Partitioned tables' in docs/operations.md)",
            name,
        )
        if change.key > self._counted:
            self._counted = change.key
            metrics.unknown_relation_changes.add(1, {"poller": self._config.name, "relation": name})
        return False

    def _truncated(self, change: Change) -> None:
        ours = tuple(r.qualified for r in change.truncated if listed(r, self._config.tables))
        if not ours or change.key in self._truncates:
            return
        self._truncates[change.key] = Truncate(change.key, ours, change.commit_time)
        self._warn_once(
            f"truncate-{change.key}",
            "TRUNCATE of %s at %s: the poller delivers no event for it (its targets keep the truncated rows); "
            "see 'TRUNCATE' in docs/operations.md",
            ", ".join(ours),
            change.commit_lsn,
        )
        for table in ours:
            metrics.truncates.add(1, {"poller": self._config.name, "table": table})

    def attach(self, page: Page, after_key: Key | None, state: SnapshotState | None, read_to_end: bool) -> None:
        """Give ``page`` the note of every TRUNCATE after ``after_key``; a page with no row an
        ``advance`` to the last one when the read went past it (so the tick writes the note),
        with ``state``, the snapshot state the fetch began with (a page with no row left it as is)."""
        pending = tuple(t for k, t in sorted(self._truncates.items()) if after_key is None or k > after_key)
        if not pending:
            return
        page.notes = record_truncates(pending)
        if not len(page) and page.advance is None and read_to_end:
            lsn, seq = pending[-1].key
            page.advance = Position(Lsn(lsn), {"seq": seq}, state)

    def landed(self, key: Key | None) -> None:
        """A checkpoint at ``key`` landed: the TRUNCATEs up to it are recorded."""
        if key is not None:
            self._truncates = {k: t for k, t in self._truncates.items() if k > key}


def record_truncates(truncates: Sequence[Truncate]) -> Callable[[Mapping[str, Any]], Mapping[str, Any]]:
    """How a page updates the checkpoint's source notes: the last TRUNCATE, and how many were
    recorded (one read again, at or before the recorded one, is not counted twice)."""

    def update(notes: Mapping[str, Any]) -> Mapping[str, Any]:
        last = notes.get(TRUNCATE_NOTE) or {}
        recorded = tuple(last.get("key") or (-1, -1))
        new = [t for t in truncates if t.key > recorded]
        if not new:
            return notes
        t = new[-1]
        note = {
            "tables": list(t.tables),
            "lsn": str(Lsn(t.key[0])),
            "key": list(t.key),
            "committed_at": t.committed_at.isoformat(),
            "count": int(last.get("count") or 0) + len(new),
        }
        return {**notes, TRUNCATE_NOTE: note}

    return update


def listed(rel: Relation, tables: Sequence[str]) -> bool:
    return any(t == rel.qualified or (t == rel.name and rel.schema == "public") for t in tables)
