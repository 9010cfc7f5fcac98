"""One section type per source kind: the keys it owns, the keys it fixes, and its own checks.

A poller's table is read in two halves: the keys every poller has (:mod:`shared.config.parse`)
and its kind's section. A section rejects the keys of other kinds, fills in what its source
fixes (a log source's cursor is its log position) and reads its own keys. A new source kind is
a new section here and one entry in :data:`SECTIONS`.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Mapping
from typing import Any, ClassVar

from shared.config.fields import Reader
from shared.config.poller import OnLostPosition, Snapshot
from shared.errors import ConfigError

__all__ = [
    "KIND_KEYS",
    "LOG_POSITION_KINDS",
    "SECTIONS",
    "KeysetSection",
    "MysqlBinlogSection",
    "OutboxSection",
    "PgLogicalSection",
    "Section",
]

#: Keys that only mean something to a keyset (table/query) poller.
KEYSET_KEYS = ("query", "cursor", "pk", "soft_delete_column", "xid_column", "filter", "null_cursor", "cursor_timezone")
_SNAPSHOT_KEYS = ("snapshot", "snapshot_chunk_size", "signal_table")
_SLOT_NAME = re.compile(r"^[a-z0-9_]{1,63}$")
_SIGNAL_TABLE = re.compile(r"^([a-z_][a-z0-9_]{0,62}\.)?[a-z_][a-z0-9_]{0,62}$")


class Section:
    """The keyset section (the default kind): a table or query read in cursor order."""

    kind: ClassVar[str] = "keyset"
    #: The kind-specific keys (see :data:`KIND_KEYS`) this kind accepts.
    keys: ClassVar[tuple[str, ...]] = ()

    def normalize(self, name: str, raw: Mapping[str, Any], prefix: str) -> Mapping[str, Any]:
        """``raw`` with the keys this kind fixes filled in, after rejecting the keys of other kinds."""
        for key in KIND_KEYS:
            if key in raw and key not in self.keys:
                owners = " / ".join(repr(s.kind) for s in SECTIONS.values() if key in s.keys)
                raise ConfigError(f"{prefix}.{key}", f"applies to kind = {owners} only{_WHY.get(key, '')}")
        return raw

    def values(self, name: str, r: Reader) -> dict[str, Any]:
        """The :class:`~shared.config.PollerConfig` fields this kind reads from its own keys."""
        return {}


KeysetSection = Section


class OutboxSection(Section):
    """An outbox table the application writes (shared.outbox): its order and event key are its own."""

    kind = "outbox"
    keys = ("outbox_retention_seconds",)

    def normalize(self, name: str, raw: Mapping[str, Any], prefix: str) -> Mapping[str, Any]:
        given = [k for k in KEYSET_KEYS if k in raw]
        if given:
            raise ConfigError(
                f"{prefix}.{given[0]}",
                'does not apply to kind = "outbox" (the outbox table fixes the order and the event key)',
                hint='keep table = "<outbox table>" and remove the keyset keys',
            )
        raw = super().normalize(name, raw, prefix)
        if raw.get("table") is None:
            raise ConfigError(
                f"{prefix}.table", 'kind = "outbox" needs the outbox table', hint='table = "dbfanout_outbox"'
            )
        return {**raw, "cursor": "id", "pk": ["id"]}

    def values(self, name: str, r: Reader) -> dict[str, Any]:
        # Rows are deleted this long after a landed checkpoint covered them (None: never pruned).
        return {"outbox_retention_seconds": r.number("outbox_retention_seconds", 0.0)}


class _LogSection(Section):
    """A source that reads a log: it names tables, the log orders the changes, snapshots run beside it."""

    log: ClassVar[str] = ""
    example: ClassVar[str] = ""

    def normalize(self, name: str, raw: Mapping[str, Any], prefix: str) -> Mapping[str, Any]:
        given = [k for k in KEYSET_KEYS if k in raw and k != "pk"]
        if given:
            raise ConfigError(
                f"{prefix}.{given[0]}",
                f'does not apply to kind = "{self.kind}" ({self.log} gives every change in commit order)',
                hint=f'keep tables = ["{self.example}", ...] (pk is optional: each table\'s primary key)',
            )
        raw = super().normalize(name, raw, prefix)
        table, tables = raw.get("table"), raw.get("tables")
        if (table is None) == (tables is None):
            raise ConfigError(f"{prefix}.tables", f'kind = "{self.kind}" needs exactly one of table or tables')
        tables = [table] if tables is None else tables
        if not isinstance(tables, list) or not tables or not all(isinstance(t, str) and t for t in tables):
            raise ConfigError(f"{prefix}.tables", "must be a list of table names", hint=f'tables = ["{self.example}"]')
        return {**raw, "table": tables[0], "tables": tables, "settle_seconds": 0.0}

    def values(self, name: str, r: Reader) -> dict[str, Any]:
        chunk_size = r.integer("snapshot_chunk_size", 0, 1_000_000)
        snapshot: Snapshot = r.choice("snapshot", Snapshot)
        return {"tables": tuple(r.raw["tables"]), "snapshot": snapshot, "snapshot_chunk_size": chunk_size}


class PgLogicalSection(_LogSection):
    """PostgreSQL logical decoding: a replication slot and a publication over the tables."""

    kind = "pg_logical"
    keys = ("tables", "slot", "publication", *_SNAPSHOT_KEYS, "on_lost_position")
    log, example = "the replication slot", "public.orders"

    def normalize(self, name: str, raw: Mapping[str, Any], prefix: str) -> Mapping[str, Any]:
        out = {**super().normalize(name, raw, prefix), "cursor": "commit_lsn"}
        default = "dbfanout_" + name.lower().replace("-", "_")
        for key in ("slot", "publication"):
            out[key] = value = raw.get(key, default)
            if not isinstance(value, str) or not _SLOT_NAME.match(value):
                raise ConfigError(
                    f"{prefix}.{key}", f"must be lower-case letters, digits and _ (up to 63), got {value!r}"
                )
        return out

    def values(self, name: str, r: Reader) -> dict[str, Any]:
        on_lost: OnLostPosition = r.choice("on_lost_position", OnLostPosition)
        return {
            **super().values(name, r),
            "slot": r.raw["slot"],
            "publication": r.raw["publication"],
            "signal_table": _signal_table(r),
            "on_lost_position": on_lost,
        }


class MysqlBinlogSection(_LogSection):
    """MySQL / MariaDB binlog: a replica connection with its own server id."""

    kind = "mysql_binlog"
    keys = ("tables", *_SNAPSHOT_KEYS, "server_id")
    log, example = "the binlog", "shop.orders"

    def normalize(self, name: str, raw: Mapping[str, Any], prefix: str) -> Mapping[str, Any]:
        out = {**super().normalize(name, raw, prefix), "cursor": "binlog_position"}
        bad = [t for t in out["tables"] if t.count(".") > 1]
        if bad:
            raise ConfigError(f"{prefix}.tables", f"{bad[0]!r}: name a table as database.table (or table)")
        return out

    def values(self, name: str, r: Reader) -> dict[str, Any]:
        return {**super().values(name, r), "signal_table": _signal_table(r), "server_id": _server_id(name, r)}


def _server_id(name: str, r: Reader) -> int:
    """A mysql_binlog poller's replica server id: ``server_id``, else one derived from its name
    (stable across restarts, in 1e9..2e9 where hand-picked server ids rarely are)."""
    if "server_id" in r.raw:
        return int(r.integer("server_id", 1, 4_294_967_295))
    return 1_000_000_000 + zlib.crc32(name.encode()) % 1_000_000_000


def _signal_table(r: Reader) -> str:
    """The snapshot signal table, schema-qualified (it is written into SQL: plain names only)."""
    value = r.text("signal_table")
    if not _SIGNAL_TABLE.match(value):
        raise r.error(
            "signal_table",
            f"must be [schema.]table in lower-case letters, digits and _ (got {value!r})",
            hint='signal_table = "public.dbfanout_signal"',
        )
    return value if "." in value else f"public.{value}"


SECTIONS: dict[str, Section] = {
    s.kind: s for s in (Section(), OutboxSection(), PgLogicalSection(), MysqlBinlogSection())
}
#: Every key some kind owns: a poller of another kind that sets it is told which kind it applies to.
KIND_KEYS = tuple(dict.fromkeys(k for s in SECTIONS.values() for k in s.keys))
#: Kinds whose source reads a log that can lose the changes after a checkpoint (``on_lost_position``).
LOG_POSITION_KINDS = tuple(s.kind for s in SECTIONS.values() if "on_lost_position" in s.keys)
_WHY = {"on_lost_position": " (a source that reads the table itself has no log position to lose)"}
