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
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa

from shared.config import PollerConfig
from shared.errors import ConfigError, DbFanoutError, FetchError, SourceError
from shared.scrub import scrub

__all__ = [
    "db_errors",
    "dispose_engines",
    "driver_message",
    "is_transient",
    "make_engine",
    "require_driver",
    "source_engine",
]

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

_ENGINES: dict[str, sa.Engine] = {}
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


def make_engine(url: str, *, key: str = "source_url") -> sa.Engine:
    """The process-wide engine for ``url`` (created on first use, then reused).

    A driver that is not installed is a :class:`ConfigError` on ``key`` that names the package to
    add, not SQLAlchemy's bare ``No module named ...`` from deep inside the first tick.
    """
    with _LOCK:
        engine = _ENGINES.get(url)
        if engine is None:
            try:
                engine = sa.create_engine(url, **engine_options(url))
            except ModuleNotFoundError as exc:
                raise _missing_driver(key, sa.make_url(url).drivername, exc.name or "the driver") from exc
            _ENGINES[url] = engine
        return engine


def source_engine(config: PollerConfig, engine: sa.Engine | None = None) -> sa.Engine:
    """``engine`` if given (tests, tools), else the process-wide engine of the poller's ``source_url``."""
    return engine if engine is not None else make_engine(config.source_url, key=f"pollers.{config.name}.source_url")


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
