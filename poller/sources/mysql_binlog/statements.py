"""Statements in a row-based binlog, and events the reader passes or refuses.

A ``binlog_format = ROW`` server still writes some things as statements (query events): DDL,
``TRUNCATE`` (no rows: :func:`truncated_table`), XA control (xa.py). A *DML* statement in the
binlog means a session wrote with ``binlog_format = STATEMENT`` or ``MIXED`` (``SET SESSION
binlog_format``): its changes have no rows to deliver, so one that names a polled table is an
error (:func:`dml_error`), never a skip.
"""

from __future__ import annotations

import re
from typing import Any

from pymysqlreplication.event import (
    BeginLoadQueryEvent,
    FormatDescriptionEvent,
    IntvarEvent,
    MariadbAnnotateRowsEvent,
    MariadbBinLogCheckPointEvent,
    MariadbGtidListEvent,
    MariadbStartEncryptionEvent,
    PreviousGtidsEvent,
    RandEvent,
    RowsQueryLogEvent,
    StopEvent,
    UserVarEvent,
)
from pymysqlreplication.row_event import TableMapEvent

from shared.errors import SourceError

__all__ = ["PASSED", "dml_error", "load_statement", "schema_of", "truncated_table"]

#: Events the library decodes that carry no change of their own: read past. (A statement's
#: context — user variables, RAND seeds, auto-increment values, a LOAD DATA file's bytes — only
#: precedes a statement, judged by itself.) Any other event the reader does not handle is unknown.
PASSED = (
    FormatDescriptionEvent, TableMapEvent, MariadbAnnotateRowsEvent, RowsQueryLogEvent, MariadbGtidListEvent,
    MariadbBinLogCheckPointEvent, MariadbStartEncryptionEvent, PreviousGtidsEvent, StopEvent, RandEvent,
    UserVarEvent, IntvarEvent, BeginLoadQueryEvent,
)  # fmt: skip

_NAME = r"(?:`[^`]+`|\w+)"
_TRUNCATE = re.compile(rf"^TRUNCATE\s+(?:TABLE\s+)?({_NAME}(?:\s*\.\s*{_NAME})?)", re.IGNORECASE)
_DML = re.compile(r"^(?:/\*.*?\*/\s*)*(INSERT|UPDATE|DELETE|REPLACE|LOAD)\b", re.IGNORECASE | re.DOTALL)


def schema_of(event: Any) -> str:
    """A query event's default database (the statement's unqualified names are in it)."""
    schema = event.schema
    return schema.decode() if isinstance(schema, bytes) else str(schema or "")


def load_statement(body: bytes) -> tuple[str, str]:
    """``(schema, statement)`` of an Execute_load_query event's body (statement-format ``LOAD
    DATA``; the library does not decode its text): a query event's post-header (13 bytes) and
    the file id, offsets and duplicate handling (13), the status variables, the database and its
    NUL, then the statement."""
    db_len, status_len = body[8], int.from_bytes(body[11:13], "little")
    at = 26 + status_len
    schema = body[at : at + db_len].decode(errors="replace")
    return schema, body[at + db_len + 1 :].decode(errors="replace")


def truncated_table(query: str, schema: str) -> str | None:
    """``schema.table`` of a ``TRUNCATE [TABLE] name`` statement, else None."""
    match = _TRUNCATE.match(query.strip())
    if match is None:
        return None
    name = re.sub(r"[`\s]", "", match.group(1))
    return name if "." in name else f"{schema}.{name}"


def dml_error(query: str, schema: str, tables: frozenset[str], where: str) -> SourceError | None:
    """The error of a statement-format INSERT/UPDATE/DELETE/REPLACE/LOAD that names a polled
    table (its changes are not in the binlog as rows), else None."""
    if _DML.match(query.strip()) is None:
        return None
    for table in sorted(tables):
        db, _, name = table.partition(".")
        qualified = rf"`?{re.escape(db)}`?\s*\.\s*`?{re.escape(name)}`?(?![\w$`])"
        bare = rf"(?<![\w$.`])`?{re.escape(name)}`?(?![\w$`.])"
        if re.search(qualified, query, re.IGNORECASE) or (db == schema and re.search(bare, query, re.IGNORECASE)):
            return SourceError(
                f"the binlog at {where} holds a statement-format change of {table} (no rows to deliver): "
                f"{query[:120]!r}",
                hint="a session wrote with binlog_format = STATEMENT or MIXED: every writer of the poller's tables "
                "must use ROW (do not SET SESSION binlog_format). The checkpoint stays before it; to go on, "
                "`dbfanout checkpoint reset` the poller (it resumes at the binlog's end) and reload the table with "
                "`dbfanout snapshot`",
            )
    return None
