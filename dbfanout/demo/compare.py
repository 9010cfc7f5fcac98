"""The demo's verdict: does the target hold exactly the source's latest state?

Pure comparison (:func:`compare`) plus the two readers that feed it. A source row is *live*
when its soft-delete column is empty. The target must hold every live row, column for column
(values normalized by the codec the events travel in), and nothing else; and its per-key
version table must show, for every source row, the source's latest version and whether it
is deleted - so deletions are checked as strictly as upserts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from shared.codec import decode_value, encode_value, loads

__all__ = ["Comparison", "TargetState", "compare", "normalize", "read_source", "read_target"]

SAMPLE = 10  # ids listed per kind of mismatch (counts are always complete)
Row = Mapping[str, Any]


def normalize(row: Row) -> dict[str, Any]:
    """A row as the events carry it: every value through the codec's JSON encoding."""
    return {str(k): encode_value(v)[0] for k, v in row.items()}


@dataclass(frozen=True, slots=True)
class TargetState:
    """What the handler left: live rows, and the version (cursor, deleted) it applied per key."""

    rows: Mapping[int, Row]
    versions: Mapping[int, tuple[Any, bool]]
    processed_events: int = 0
    duplicates: int = 0


@dataclass(frozen=True, slots=True)
class Comparison:
    """Counts and the ids that differ, by kind."""

    source_rows: int
    live_rows: int
    deleted_rows: int
    target_rows: int
    missing: tuple[int, ...]  # live in the source, absent from the target
    different: tuple[int, ...]  # in both, but the target's columns are not the latest
    resurrected: tuple[int, ...]  # deleted in the source, still in the target
    unknown: tuple[int, ...]  # in the target, never in the source
    versions_behind: tuple[int, ...]  # applied version or deleted flag is not the source's latest
    # Keys the target's version table marks deleted: with hard deletes (nothing left in the source
    # to compare), the deletes that reached the handler as deletes.
    deletes_applied: int = 0

    @property
    def ok(self) -> bool:
        """An exact match: nothing missing, different, resurrected, unknown or behind."""
        return not (self.missing or self.different or self.resurrected or self.unknown or self.versions_behind)

    def to_json(self) -> dict[str, Any]:
        mismatches = {
            kind: {"count": len(ids), "ids": list(ids[:SAMPLE])}
            for kind, ids in (
                ("missing", self.missing),
                ("different", self.different),
                ("resurrected", self.resurrected),
                ("unknown", self.unknown),
                ("versions_behind", self.versions_behind),
            )
        }
        return {
            "exact_match": self.ok,
            "source_rows": self.source_rows,
            "live_rows": self.live_rows,
            "deleted_rows": self.deleted_rows,
            "target_rows": self.target_rows,
            "deletes_applied": self.deletes_applied,
            "mismatches": mismatches,
        }


def compare(
    source: Mapping[int, Row],
    target: TargetState,
    *,
    cursor: str = "version",
    soft_delete: str = "deleted_at",
) -> Comparison:
    """Compare every source row (live or deleted) with what the target holds for its key."""
    live = {k: r for k, r in source.items() if r.get(soft_delete) is None}
    deleted = set(source) - set(live)
    missing = sorted(k for k in live if k not in target.rows)
    different = sorted(k for k, r in live.items() if k in target.rows and normalize(r) != dict(target.rows[k]))
    resurrected = sorted(k for k in deleted if k in target.rows)
    unknown = sorted(k for k in target.rows if k not in source)
    behind = sorted(
        k for k, r in source.items() if target.versions.get(k) != (r.get(cursor), r.get(soft_delete) is not None)
    )
    return Comparison(
        source_rows=len(source),
        live_rows=len(live),
        deleted_rows=len(deleted),
        target_rows=len(target.rows),
        missing=tuple(missing),
        different=tuple(different),
        resurrected=tuple(resurrected),
        unknown=tuple(unknown),
        versions_behind=tuple(behind),
        deletes_applied=sum(1 for _, gone in target.versions.values() if gone),
    )


def read_source(engine: sa.Engine, table: str = "orders", pk: str = "id") -> dict[int, dict[str, Any]]:
    """Every source row by id, live and soft-deleted."""
    with engine.connect() as conn:
        rows = conn.execute(sa.text(f"SELECT * FROM {table}")).mappings().all()
    return {int(r[pk]): dict(r) for r in rows}


def _table_exists(conn: sa.Connection, name: str) -> bool:
    found = conn.execute(sa.text("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = :n"), {"n": name})
    return found.first() is not None


def _count(conn: sa.Connection, table: str) -> int:
    if not _table_exists(conn, table):
        return 0
    return int(conn.execute(sa.text(f"SELECT count(*) FROM {table}")).scalar_one())


def _decode_version(text: str) -> Any:
    # The example handler stores a cursor as {"v": [[value, tag], ...], "tuple": bool}.
    doc = loads(text)
    values = tuple(decode_value(v, t) for v, t in doc["v"])
    return values if doc["tuple"] else values[0]


def read_target(engine: sa.Engine, poller: str = "orders", pk: str = "id") -> TargetState:
    """The example handler's tables (empty until its first message created them)."""
    with engine.connect() as conn:
        if not _table_exists(conn, "dbfanout_example_target"):
            return TargetState(rows={}, versions={})
        where = {"p": poller}
        rows = conn.execute(sa.text("SELECT pk, row FROM dbfanout_example_target WHERE poller = :p"), where).all()
        versions = conn.execute(
            sa.text("SELECT pk, cursor, deleted FROM dbfanout_example_versions WHERE poller = :p"), where
        ).all()
        processed = _count(conn, "dbfanout_processed_events")
        duplicates = _count(conn, "dbfanout_example_duplicates")
    return TargetState(
        rows={int(loads(k)[pk]): loads(row) for k, row in rows},
        versions={int(loads(k)[pk]): (_decode_version(c), bool(d)) for k, c, d in versions},
        processed_events=processed,
        duplicates=duplicates,
    )
