"""SQLAlchemy engines for source databases: one pooled engine per URL, reused across ticks.

A Functions worker process runs many timer ticks; opening a connection per tick would dominate
small batches. Engines are cached per URL in this module and disposed by :func:`dispose_engines`
(worker shutdown, tests).

Per dialect:

* every engine: ``pool_pre_ping`` (a dead pooled connection is replaced instead of failing the
  tick), connections recycled after 30 minutes (Azure load balancers drop idle TCP sessions);
* PostgreSQL / MariaDB: a 10 s connect timeout, so "database down" is a prompt, retryable
  :class:`~shared.errors.FetchError` instead of a tick that hangs until its lease lapses;
* MariaDB / MySQL: the session ``time_zone`` is set to UTC, so ``NOW()`` and ``TIMESTAMP`` columns
  are UTC (set ``cursor_timezone = "UTC"`` for them);
* SQLite: the driver's default pool (a file database is shared by the process).

Keyset reads (:class:`~poller.sources.keyset.source.SqlSource`) use an engine of their own per URL
(:func:`make_engine` with ``reads=True``, server databases only): an idle tick is one SELECT,
and with the defaults above it cost four round trips (pre-ping, BEGIN, the SELECT, ROLLBACK).
A read engine runs in autocommit (each statement its own snapshot, as each page already was: no
BEGIN, no ROLLBACK, no reset at check-in) and without pre-ping: the reader notices a dead
connection by its statement's own error and reads again once on a fresh one
(:func:`retry_disconnect`). Its pool keeps up to 15 connections (the default engines' 5 + 10
overflow) instead of closing the overflow at each check-in: pollers sharing a URL tick at the
same instant, and reopening 10 connections a second cost more than the reads (BENCHMARKS.md,
issue 31).
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import sqlalchemy as sa

from poller.sources.lenient import lenient_values
from shared.config import PollerConfig
from shared.errors import ConfigError, DbFanoutError, FetchError, SourceError
from shared.logs import get_logger
from shared.scrub import scrub

__all__ = [
    "db_errors",
    "dispose_engines",
    "driver_message",
    "is_transient",
    "make_engine",
    "read_engine_options",
    "require_driver",
    "retry_disconnect",
    "source_engine",
]

log = get_logger("poller.engines")

# The DBAPI module a URL's driver imports -> how a user gets it (requirements-drivers.txt lists them).
_DRIVER_FIX = {
    "psycopg": "uncomment psycopg[binary] in requirements-drivers.txt",
    "psycopg2": "use a postgresql+psycopg:// URL and uncomment psycopg[binary] in requirements-drivers.txt",
    "pymysql": "uncomment pymysql in requirements-drivers.txt",
    "MySQLdb": "use a mysql+pymysql:// URL and uncomment pymysql in requirements-drivers.txt",
    "pymysqlreplication": "uncomment mysql-replication (and pymysql) in requirements-drivers.txt",
    "pyodbc": "uncomment pyodbc in requirements-drivers.txt (and install the ODBC driver)",
}

# Driver messages that mean "fix the SQL", even when the driver calls them OperationalError (SQLite, MySQL).
_PROGRAMMING_HINTS = (
    "no such table", "no such column", "syntax error", "unknown column", "doesn't exist", "ambiguous",
    "error in your sql syntax", "does not exist", "unrecognized token",
)  # fmt: skip

_ENGINES: dict[tuple[str, bool], sa.Engine] = {}
#: Backends whose read engines run in autocommit (SQLAlchemy's AUTOCOMMIT isolation level).
_AUTOCOMMIT_READS = ("postgresql", "mysql", "mariadb", "mssql")
#: Connections a read engine's pool keeps (and its cap: no overflow beyond it).
READ_POOL_SIZE = 15
T = TypeVar("T")
_LOCK = threading.Lock()


def engine_options(url: str) -> dict[str, Any]:
    """The ``create_engine`` keyword arguments dbfanout uses for ``url``."""
    backend = sa.make_url(url).get_backend_name()
    options: dict[str, Any] = {"pool_pre_ping": True}
    if backend == "sqlite":
        return options
    options["pool_recycle"] = 1800
    if backend == "postgresql":
        options["connect_args"] = {"connect_timeout": 10}
    elif backend in ("mysql", "mariadb"):
        options["connect_args"] = {"connect_timeout": 10, "init_command": "SET time_zone = '+00:00'"}
    return options


def read_engine_options(url: str) -> dict[str, Any]:
    """The ``create_engine`` keyword arguments of a keyset read engine for ``url`` (module docstring)."""
    options = engine_options(url)
    backend = sa.make_url(url).get_backend_name()
    if backend not in _AUTOCOMMIT_READS:
        return options  # SQLite: its own pool and transactions, as for every engine
    if sa.make_url(url).get_driver_name() == "psycopg":
        # psycopg prepares a statement on the server at its 5th run on a connection (a ROLLBACK
        # used to discard them); a prepared `SELECT *` then fails after a migration ("cached
        # plan must not change result type") instead of showing the new columns.
        options["connect_args"] = {**options.get("connect_args", {}), "prepare_threshold": None}
    options.update(
        pool_pre_ping=False,  # a dead connection fails its read, which retry_disconnect repeats
        isolation_level="AUTOCOMMIT",
        pool_reset_on_return=None,  # autocommit: no transaction to roll back at check-in
        pool_size=READ_POOL_SIZE,
        max_overflow=0,
    )
    return options


def make_engine(url: str, *, key: str = "source_url", reads: bool = False) -> sa.Engine:
    """The process-wide engine for ``url`` (created on first use, then reused); with ``reads``,
    the keyset read engine (module docstring): callers must run their reads through
    :func:`retry_disconnect`.

    A driver that is not installed is a :class:`ConfigError` on ``key`` that names the package to
    add, not SQLAlchemy's bare ``No module named ...`` from deep inside the first tick.
    """
    with _LOCK:
        engine = _ENGINES.get((url, reads))
        if engine is None:
            try:
                engine = sa.create_engine(url, **(read_engine_options(url) if reads else engine_options(url)))
            except ModuleNotFoundError as exc:
                raise _missing_driver(key, sa.make_url(url).drivername, exc.name or "the driver") from exc
            lenient_values(engine)  # a value psycopg refuses arrives as its text (docs/types.md)
            _ENGINES[(url, reads)] = engine
        return engine


def source_engine(config: PollerConfig, engine: sa.Engine | None = None, *, reads: bool = False) -> sa.Engine:
    """``engine`` if given (tests, tools), else the process-wide engine of the poller's ``source_url``
    (its keyset read engine with ``reads``)."""
    if engine is not None:
        return engine
    return make_engine(config.source_url, key=f"pollers.{config.name}.source_url", reads=reads)


def retry_disconnect(read: Callable[[], T], on_disconnect: Callable[[], None] = lambda: None) -> T:
    """``read()``, once more when its connection turned out dead (a restarted server, a killed
    session, a load balancer's idle cut): a read engine pings nothing at checkout, so the read's
    own error is how a dead pooled connection shows. SQLAlchemy has then invalidated it and every
    pooled connection older than it; ``on_disconnect`` drops what the caller held, and the second
    read connects afresh. Any other error, or a second disconnect (the server is down), is raised.
    """
    try:
        return read()
    except sa.exc.DBAPIError as exc:
        if not exc.connection_invalidated:
            raise
        log.info("a pooled source connection was dead (%s); reading again on a new one", type(exc.orig).__name__)
        on_disconnect()
    return read()


def require_driver(module: str, key: str, what: str, *, label: str | None = None) -> None:
    """Raise a :class:`ConfigError` on ``key`` when the DBAPI ``module`` does not import (``what``
    needs it, ``label`` names it): a clear start-up error instead of an ImportError in a tick."""
    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise _missing_driver(key, what, module, label) from exc


def _missing_driver(key: str, what: str, module: str, label: str | None = None) -> ConfigError:
    root = module.partition(".")[0]
    return ConfigError(
        key,
        f"{what} needs {label or root + ' (not installed)'}: {_DRIVER_FIX.get(root, f'install {root}')}",
        hint="locally, the extras dbfanout[postgres] / dbfanout[mysql] install the drivers; "
        "in Azure, redeploy after editing requirements-drivers.txt",
    )


def dispose_engines() -> None:
    """Close every cached engine's pool (worker shutdown); the next use creates a new engine."""
    with _LOCK:
        engines = list(_ENGINES.values())
        _ENGINES.clear()
    for engine in engines:
        engine.dispose()


@contextmanager
def db_errors(context: str, url: str) -> Iterator[None]:
    """Driver errors become FetchError (retryable) or SourceError (fix the SQL), ``from`` the cause.

    ``context`` names the poller, the operation and the *redacted* URL; the password of ``url`` is
    scrubbed from driver messages too.
    """
    try:
        yield
    except DbFanoutError:
        raise
    except sa.exc.DBAPIError as exc:
        message = driver_message(exc, url)
        if is_transient(exc):
            raise FetchError(f"{context} failed: {message}") from exc
        raise SourceError(
            f"{context} failed: {message}",
            hint="check the poller's table/query, cursor, pk and filter settings against the database",
        ) from exc
    except sa.exc.TimeoutError as exc:
        raise FetchError(f"{context}: no pooled connection became free") from exc
    except sa.exc.SQLAlchemyError as exc:
        raise SourceError(f"{context}: {_scrub(str(exc), url)}") from exc


def driver_message(exc: sa.exc.DBAPIError, url: str) -> str:
    """The first line of the driver's message, with the password of ``url`` scrubbed."""
    text = str(exc.orig).strip()
    return _scrub(text.splitlines()[0] if text else repr(exc.orig), url)


def is_transient(exc: sa.exc.DBAPIError) -> bool:
    """Whether a driver error is the connection or the server (retry) rather than the SQL (fix it)."""
    transient = isinstance(exc, sa.exc.OperationalError | sa.exc.InterfaceError) or exc.connection_invalidated
    first_line = driver_message(exc, "").lower()
    return transient and not any(h in first_line for h in _PROGRAMMING_HINTS)


def _scrub(text: str, url: str) -> str:
    """``text`` with the URL's own password (wherever a driver put it) and any other secret masked."""
    password = sa.make_url(url).password if url else None
    return scrub(text.replace(str(password), "***") if password else text)
