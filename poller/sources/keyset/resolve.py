"""A keyset source resolved: its table (reflected) or query, as the FROM clause and the expressions
the keyset compares (:class:`Resolved`), with the configured columns checked against it.

Resolved once per source, and again after a migration (:mod:`poller.sources.keyset.table_shape`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from poller.sources.keyset.plan import index_gap, sqlite_declared_kind
from poller.sources.keyset.table_shape import RUNBOOK, TableShape, key_change
from shared.config import PollerConfig
from shared.errors import ConfigError
from shared.logs import get_logger, ids
from shared.settings import redact_url

__all__ = ["RAW_CURSOR", "ROLES", "Resolved", "needed", "resolve"]

log = get_logger("poller.source")

#: SQLite: the compared (raw) cursor, selected beside the row's columns under this name.
RAW_CURSOR = "__dbfanout_cursor"
_SUBQUERY = "dbfanout_src"
#: A needed column's setting -> how an error names its role.
ROLES = {"cursor": "cursor", "pk": "pk", "soft_delete_column": "soft-delete", "xid_column": "xid"}


@dataclass(frozen=True, slots=True)
class Resolved:
    """The source as a FROM clause, with the expressions the keyset compares."""

    from_: sa.FromClause
    cursor: sa.ColumnElement[Any]  # as compared (raw text on SQLite)
    pk: tuple[sa.ColumnElement[Any], ...]
    columns: tuple[sa.ColumnElement[Any], ...]  # what a page selects (``*``)
    raw_extra: bool  # SQLite: the compared cursor is also selected, raw, as RAW_CURSOR
    sqlite_declared: str | None
    filter: sa.ColumnElement[bool] | None
    shape: TableShape | None  # table mode: the columns as reflected (None: a query's are its own)
    index_warning: str | None = None  # table mode: why fetches cannot seek an index


def needed(config: PollerConfig) -> list[tuple[str, str]]:
    """The columns the source needs, as ``(setting, column)``: the cursor and key columns first."""
    cfg = config
    columns = [("cursor", cfg.cursor)] + [("pk", c) for c in cfg.pk]
    columns += [(k, v) for k, v in (("soft_delete_column", cfg.soft_delete_column),
                                    ("xid_column", cfg.xid_column)) if v]  # fmt: skip
    return columns


def resolve(conn: sa.Connection, config: PollerConfig, *, changed: bool = False) -> Resolved:
    """The configured table (reflected; ``changed``: again, after a migration) or query."""
    return _resolve_table(conn, config, changed) if config.table else _resolve_query(conn, config)


def _check_columns(config: PollerConfig, present: list[str], where: str, *, changed: bool = False) -> None:
    """Each needed column is in ``present``: else a ConfigError, or SchemaChangeError when ``changed``
    (a migration renamed or dropped it under a running poller)."""
    for key, name in needed(config):
        if name in present:
            continue
        if changed:
            raise key_change(config.name, str(config.table), ROLES[key], name, "renamed or dropped")
        near = [p for p in present if p.lower() == name.lower()]
        hint = f"did you mean {near[0]!r}? (names are case-sensitive)" if near else None
        migrated = f"; if a migration renamed or dropped it: {RUNBOOK}" if config.table else ""
        raise ConfigError(
            f"pollers.{config.name}.{key}",
            f"column {name!r} is not in {where} (it has: {', '.join(present)}){migrated}",
            hint=hint,
        )


def _resolve_table(conn: sa.Connection, config: PollerConfig, changed: bool = False) -> Resolved:
    assert config.table is not None
    schema, _, name = config.table.rpartition(".")
    try:
        with warnings.catch_warnings():  # unknown types (xid8, ...) reflect as NullType: values pass raw
            warnings.filterwarnings("ignore", "Did not recognize type", sa.exc.SAWarning)
            table = sa.Table(name, sa.MetaData(), schema=schema or None, autoload_with=conn)
    except sa.exc.NoSuchTableError:
        raise ConfigError(
            f"pollers.{config.name}.table", f"table {config.table!r} does not exist in {redact_url(config.source_url)}"
        ) from None
    _check_columns(config, [c.name for c in table.columns], f"table {config.table!r}", changed=changed)
    index_warning = index_gap(conn, table, list(dict.fromkeys([config.cursor, *config.pk])))
    if index_warning:
        log.warning(index_warning, extra=ids(poller=config.name))
    column = table.c[config.cursor]
    sqlite = conn.dialect.name == "sqlite"
    # On SQLite the cursor is compared, ordered and checkpointed as the raw stored value.
    cursor = sa.type_coerce(column, sa.String()) if sqlite else column
    return Resolved(
        from_=table,
        cursor=cursor,
        pk=tuple(table.c[p] for p in config.pk),
        columns=(sa.literal_column("*"),),  # the table's columns at each read: a migration shows at once
        raw_extra=sqlite,
        sqlite_declared=sqlite_declared_kind(column.type) if sqlite else None,
        filter=_filter(config),
        shape=TableShape.of(table),
        index_warning=index_warning,
    )


def _resolve_query(conn: sa.Connection, config: PollerConfig) -> Resolved:
    assert config.query is not None
    names = [n for _, n in needed(config)]
    sub = sa.text(config.query).columns(*(sa.column(n) for n in dict.fromkeys(names))).subquery(_SUBQUERY)
    probe: sa.Select[Any] = sa.select(sa.literal_column("*")).select_from(sub).limit(0)
    present = list(conn.execute(probe).keys())
    _check_columns(config, present, "the query's output")
    return Resolved(
        from_=sub,
        cursor=sub.c[config.cursor],
        pk=tuple(sub.c[p] for p in config.pk),
        columns=(sa.literal_column("*"),),
        raw_extra=False,
        sqlite_declared=None,
        filter=_filter(config),
        shape=None,
    )


def _filter(config: PollerConfig) -> sa.ColumnElement[bool] | None:
    return sa.text(f"({config.filter})") if config.filter else None  # type: ignore[return-value]
