"""A pg_logical poller's publication and slot DDL: what must be published, and the repairs.

Why its own module: ``dbfanout validate --fix`` and the tests build the same statements, and each
one quotes every name from config by PostgreSQL's rules (a table named ``public.Orders`` in
``tables`` is ``"public"."Orders"``, never the ``public.orders`` an unquoted name folds to; a
config value never becomes SQL).

What a publication must hold:

* every table of the poller and the snapshot signal table (explicitly, or ``FOR ALL TABLES``);
* ``publish`` with ``truncate``: PostgreSQL sends a TRUNCATE only to publications that ask for it,
  and the poller must see one to say so (it logs a WARNING, counts it, records it in the state);
* ``publish_via_partition_root = true`` (PostgreSQL 13+): the changes of a partitioned table's
  partitions arrive under the partitioned table's name, the one in ``tables``. Older servers
  cannot publish a partitioned table at all (``validate`` says so; name the partitions instead).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from shared.config import PollerConfig

__all__ = [
    "PUBLISH",
    "VIA_ROOT_SINCE",
    "PublicationState",
    "create_publication_sql",
    "create_slot_sql",
    "missing_tables",
    "partitioned_tables",
    "publication_repairs",
    "qualified",
    "quote_ident",
    "quote_literal",
    "quote_table",
    "read_publication",
    "server_version",
]

#: What every poller's publication publishes (``truncate`` included: see the module docstring).
PUBLISH = "insert, update, delete, truncate"
#: The first server version (``server_version_num``) with ``publish_via_partition_root``.
VIA_ROOT_SINCE = 130000

_PREPARER = postgresql.dialect().identifier_preparer  # type: ignore[no-untyped-call]

# Members named explicitly (a partitioned table is one, whatever pg_publication_tables lists),
# and whatever the publication covers otherwise (FOR ALL TABLES, FOR TABLES IN SCHEMA).
_MEMBERS = sa.text(
    "SELECT n.nspname || '.' || c.relname FROM pg_publication p JOIN pg_publication_rel r ON r.prpubid = p.oid"
    " JOIN pg_class c ON c.oid = r.prrelid JOIN pg_namespace n ON n.oid = c.relnamespace WHERE p.pubname = :pub"
    " UNION SELECT schemaname || '.' || tablename FROM pg_publication_tables WHERE pubname = :pub"
)
_FLAGS = sa.text("SELECT to_jsonb(p) FROM pg_publication p WHERE pubname = :pub")  # pubviaroot: 13+ only
_RELKIND = sa.text("SELECT relkind FROM pg_class WHERE oid = to_regclass(:table)")


def quote_ident(name: str) -> str:
    """One identifier, always quoted (``Orders`` → ``"Orders"``; a quote inside is doubled)."""
    return _PREPARER.quote_identifier(name)


def quote_table(name: str) -> str:
    """A config table name (``schema.table`` or ``table``, each part as the catalog spells it), quoted."""
    return ".".join(quote_ident(part) for part in name.split("."))


def quote_literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def qualified(table: str) -> str:
    """``orders`` → ``public.orders`` (how the catalog and the log name a table)."""
    return table if "." in table else f"public.{table}"


def server_version(conn: sa.Connection) -> int:
    return int(conn.execute(sa.text("SHOW server_version_num")).scalar_one())


def _options(version: int) -> str:
    via_root = ", publish_via_partition_root = true" if version >= VIA_ROOT_SINCE else ""
    return f"publish = {quote_literal(PUBLISH)}{via_root}"


def create_publication_sql(config: PollerConfig, version: int = VIA_ROOT_SINCE) -> str:
    """``CREATE PUBLICATION`` for the poller's tables and its signal table (``version``: the server's)."""
    assert config.publication is not None
    tables = ", ".join(quote_table(t) for t in (*config.tables, config.signal_table))
    return f"CREATE PUBLICATION {quote_ident(config.publication)} FOR TABLE {tables} WITH ({_options(version)})"


def create_slot_sql(config: PollerConfig) -> str:
    assert config.slot is not None
    return f"SELECT pg_create_logical_replication_slot({quote_literal(config.slot)}, 'pgoutput')"


@dataclass(frozen=True, slots=True)
class PublicationState:
    """A publication as the catalog shows it."""

    members: frozenset[str]  # schema.table, as the catalog spells them
    every_kind: bool  # inserts, updates, deletes and truncates are published
    via_root: bool | None  # None: the server has no publish_via_partition_root (before 13)


def read_publication(conn: sa.Connection, publication: str) -> PublicationState | None:
    flags: dict[str, Any] | None = conn.execute(_FLAGS, {"pub": publication}).scalar()
    if flags is None:
        return None
    members = frozenset(conn.execute(_MEMBERS, {"pub": publication}).scalars())
    via_root = flags.get("pubviaroot")
    every_kind = all(flags.get(k) for k in ("pubinsert", "pubupdate", "pubdelete", "pubtruncate"))
    return PublicationState(members, every_kind, None if via_root is None else bool(via_root))


def partitioned_tables(conn: sa.Connection, tables: Sequence[str]) -> list[str]:
    """The partitioned tables (``relkind = 'p'``) among ``tables``."""
    return [t for t in tables if conn.execute(_RELKIND, {"table": quote_table(t)}).scalar() == "p"]


def publication_repairs(config: PollerConfig, state: PublicationState, partitioned: Sequence[str]) -> list[str]:
    """The statements that make an existing publication what the poller needs (empty: nothing to do)."""
    assert config.publication is not None
    pub = quote_ident(config.publication)
    missing = missing_tables(config, state)
    out = []
    if missing:
        out.append(f"ALTER PUBLICATION {pub} ADD TABLE {', '.join(quote_table(t) for t in missing)}")
    if not state.every_kind:  # SET replaces the list: every kind the poller reads, truncate included
        out.append(f"ALTER PUBLICATION {pub} SET (publish = {quote_literal(PUBLISH)})")
    if partitioned and state.via_root is False:
        out.append(f"ALTER PUBLICATION {pub} SET (publish_via_partition_root = true)")
    return out


def missing_tables(config: PollerConfig, state: PublicationState) -> list[str]:
    """The poller's tables (and signal table) the publication does not cover."""
    return [t for t in (*config.tables, config.signal_table) if qualified(t) not in state.members]
