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

import threading
from typing import Any

import sqlalchemy as sa

__all__ = ["dispose_engines", "make_engine"]

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


def make_engine(url: str) -> sa.Engine:
    """The process-wide engine for ``url`` (created on first use, then reused)."""
    with _LOCK:
        engine = _ENGINES.get(url)
        if engine is None:
            engine = sa.create_engine(url, **engine_options(url))
            _ENGINES[url] = engine
        return engine


def dispose_engines() -> None:
    """Close every cached engine's pool (worker shutdown); the next use creates a new engine."""
    with _LOCK:
        engines = list(_ENGINES.values())
        _ENGINES.clear()
    for engine in engines:
        engine.dispose()
