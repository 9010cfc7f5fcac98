"""What ``dbfanout init`` learns from a table: its key, a usable cursor, the index the keyset
query needs, a soft-delete column, and whether the server's log makes a log source possible.

Everything is read through SQLAlchemy's inspector and fixed catalogue queries; the only SQL
built from input is the suggested ``CREATE INDEX``, whose identifiers are quoted by the
dialect's own preparer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

__all__ = ["TableShape", "inspect_table", "split_table_name"]

# Column names that usually hold "last changed", best first (an integer version counts too).
CURSOR_NAMES = (
    "updated_at", "modified_at", "last_modified", "last_updated", "changed_at", "updated_on",
    "modified_on", "updated", "modified", "row_version", "rowversion", "version",
)  # fmt: skip
SOFT_DELETE_NAMES = ("deleted_at", "removed_at", "archived_at")
LOG_KIND = {"postgresql": "pg_logical", "mysql": "mysql_binlog", "mariadb": "mysql_binlog"}


@dataclass(frozen=True, slots=True)
class TableShape:
    """The facts ``dbfanout init`` writes the poller from (see :func:`inspect_table`)."""

    dialect: str
    table: str  # as the config names it (schema-qualified when given so)
    pk: tuple[str, ...]
    cursor: str | None
    cursor_reason: str
    index_sql: str | None  # the CREATE INDEX the keyset query needs; None when one exists
    soft_delete: str | None
    log_kind: str | None  # "pg_logical" / "mysql_binlog" when the server's log allows it
    log_detail: str
    columns: tuple[tuple[str, str], ...] = field(default=())  # (name, type) for the handler stub
    cursor_naive: bool = False  # a timestamp without a time zone: the config must say which zone


def split_table_name(table: str) -> tuple[str | None, str]:
    """``schema.table`` -> (schema, table); a bare name has no schema."""
    schema, dot, name = table.rpartition(".")
    return (schema or None, name) if dot else (None, table)


def inspect_table(engine: sa.Engine, table: str) -> TableShape:
    """Read ``table``'s shape; ``LookupError`` when it does not exist (the message lists what does)."""
    schema, name = split_table_name(table)
    inspector = sa.inspect(engine)
    if not inspector.has_table(name, schema=schema):
        known = sorted(inspector.get_table_names(schema=schema))[:20]
        raise LookupError(f"table {table!r} not found (tables here: {', '.join(known) or 'none'})")
    columns = inspector.get_columns(name, schema=schema)
    pk = tuple(inspector.get_pk_constraint(name, schema=schema).get("constrained_columns") or ())
    cursor, reason = _pick_cursor(columns, pk)
    indexes = inspector.get_indexes(name, schema=schema)
    needed = [cursor, *pk] if cursor else []
    has_index = any(list(ix.get("column_names") or [])[: len(needed)] == needed for ix in indexes)
    index_sql = None if not needed or has_index else _create_index_sql(engine.dialect, schema, name, needed)
    log_kind, log_detail = _log_source(engine)
    return TableShape(
        dialect=engine.dialect.name,
        table=table,
        pk=pk,
        cursor=cursor,
        cursor_reason=reason,
        index_sql=index_sql,
        soft_delete=_pick_soft_delete(columns),
        log_kind=log_kind,
        log_detail=log_detail,
        columns=tuple((str(c["name"]), str(c["type"])) for c in columns),
        cursor_naive=_naive_datetime(columns, cursor),
    )


def _is_cursor_type(column: dict[str, Any]) -> bool:
    kind = column["type"]
    return isinstance(kind, sa.DateTime | sa.Integer) or type(kind).__name__.upper() in {"TIMESTAMP", "DATETIME"}


def _pick_cursor(columns: list[Any], pk: tuple[str, ...]) -> tuple[str | None, str]:
    by_name = {str(c["name"]).lower(): c for c in columns}
    for candidate in CURSOR_NAMES:
        column = by_name.get(candidate)
        if column is not None and _is_cursor_type(column) and column["name"] not in pk:
            nullable = " (nullable: rows without a value are skipped; make it NOT NULL)" if column["nullable"] else ""
            return str(column["name"]), f"{column['type']} named like a last-change column{nullable}"
    return None, (
        "no column named like updated_at/version with a timestamp or integer type: add one that every "
        "write sets (docs/cursors.md), or use a log source"
    )


def _naive_datetime(columns: list[Any], cursor: str | None) -> bool:
    kind = next((c["type"] for c in columns if c["name"] == cursor), None)
    return isinstance(kind, sa.DateTime) and not kind.timezone


def _pick_soft_delete(columns: list[Any]) -> str | None:
    for column in columns:
        if str(column["name"]).lower() in SOFT_DELETE_NAMES and column["nullable"]:
            return str(column["name"])
    return None


def _create_index_sql(dialect: sa.Dialect, schema: str | None, name: str, columns: list[str]) -> str:
    quote = dialect.identifier_preparer.quote
    target = f"{quote(schema)}.{quote(name)}" if schema else quote(name)
    index = quote(f"ix_{name}_dbfanout"[:60])  # the name `dbfanout validate` suggests
    return f"CREATE INDEX {index} ON {target} ({', '.join(quote(c) for c in columns)})"


def _log_source(engine: sa.Engine) -> tuple[str | None, str]:
    """Whether the server's log can feed a log source, and why (not)."""
    kind = LOG_KIND.get(engine.dialect.name)
    if kind is None:
        return None, f"{engine.dialect.name} has no log source in dbfanout: keyset polling"
    try:
        with engine.connect() as conn:
            if kind == "pg_logical":
                level = str(conn.exec_driver_sql("SHOW wal_level").scalar_one())
                if level == "logical":
                    return kind, "wal_level = logical"
                return None, f"wal_level = {level} (logical decoding needs wal_level = logical and a restart)"
            row = conn.exec_driver_sql("SELECT @@log_bin, @@binlog_format, @@binlog_row_image").one()
    except sa.exc.DBAPIError as exc:
        return None, f"could not read the server's log settings ({type(exc.orig).__name__})"
    log_bin, fmt, image = (str(v) for v in row)
    if log_bin in ("1", "ON") and fmt.upper() == "ROW" and image.upper() == "FULL":
        return kind, "log_bin on, binlog_format = ROW, binlog_row_image = FULL"
    return None, f"log_bin = {log_bin}, binlog_format = {fmt}, binlog_row_image = {image} (needs on, ROW, FULL)"
