"""The binlog server's side of a ``kind = "mysql_binlog"`` poller: where its binlog ends, and its errors."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import sqlalchemy as sa

from poller.sources.engines import db_errors
from shared.config import PollerConfig
from shared.errors import FetchError, SourceError

__all__ = ["binlog_end", "binlog_errors"]

_MYSQL_ERRORS_PURGED = (1236,)  # ER_MASTER_FATAL_ERROR_READING_BINLOG: the file or GTID is gone


def binlog_end(conn: sa.Connection, poller: str) -> tuple[str, int]:
    try:
        row = conn.execute(sa.text("SHOW MASTER STATUS")).first()
    except sa.exc.ProgrammingError:  # MySQL 8.4 renamed it
        row = conn.execute(sa.text("SHOW BINARY LOG STATUS")).first()
    if row is None:
        raise SourceError(
            f"poller {poller}: the server writes no binary log",
            hint="turn log_bin on (MariaDB: log_bin in the server's config; Azure Flexible Server: always on)",
        )
    return str(row[0]), int(row[1])


@contextmanager
def binlog_errors(context: str, config: PollerConfig) -> Iterator[None]:
    """SQLAlchemy's errors as :func:`poller.sources.engines.db_errors` maps them; the replication
    connection's (pymysql's own) as FetchError, or SourceError when the binlog is gone."""
    import pymysql

    with db_errors(context, config.source_url):
        try:
            yield
        except pymysql.err.OperationalError as exc:
            code = exc.args[0] if exc.args else None
            message = str(exc.args[1]) if len(exc.args) > 1 else str(exc)
            if code in _MYSQL_ERRORS_PURGED:
                raise SourceError(
                    f"{context}: the server cannot send the binlog from the checkpoint: {message}",
                    hint="the binlog at the checkpoint was purged (raise binlog_expire_logs_seconds), or the "
                    "GTID state is unknown to this server; `dbfanout checkpoint reset` the poller and reload "
                    "the tables' rows with `dbfanout snapshot`; see docs/operations.md",
                ) from exc
            raise FetchError(f"{context} failed: {message}") from exc
        except pymysql.err.MySQLError as exc:
            raise FetchError(f"{context} failed: {exc}") from exc
