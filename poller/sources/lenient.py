"""PostgreSQL values psycopg refuses, as their text: a value never stops a poller (docs/types.md).

psycopg raises ``DataError`` on a ``timestamp``/``timestamptz``/``date`` of ``infinity`` or BC,
and on an ``interval`` past ``datetime.timedelta``: on every fetch of that row, for good. Every
connection of a dbfanout engine gets loaders for those types that return the value's text
instead (keyset reads, snapshots, and pg_logical's loading of pgoutput text alike).
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

__all__ = ["lenient_values"]

_TYPES = ("date", "timestamp", "timestamptz", "interval", "time", "timetz")


def lenient_values(engine: sa.Engine) -> None:
    """Register the lenient loaders on each new connection of ``engine`` (PostgreSQL only)."""
    if engine.dialect.name != "postgresql" or engine.dialect.driver != "psycopg":
        return
    sa.event.listen(engine, "connect", _register)


def _register(dbapi_connection: Any, _record: Any) -> None:
    import psycopg.types.datetime as loaders  # psycopg is installed: the engine's driver

    for name, base in zip(_TYPES, _bases(loaders), strict=True):
        dbapi_connection.adapters.register_loader(name, _lenient(base))


def _bases(loaders: Any) -> tuple[type, ...]:
    return (loaders.DateLoader, loaders.TimestampLoader, loaders.TimestamptzLoader, loaders.IntervalLoader,
            loaders.TimeLoader, loaders.TimetzLoader)  # fmt: skip


def _lenient(base: type) -> type:
    import psycopg

    class Lenient(base):  # type: ignore[misc]
        def load(self, data: Any) -> Any:
            try:
                return super().load(data)
            except psycopg.DataError:  # infinity, BC, past timedelta: PostgreSQL's own text
                return bytes(data).decode("utf-8", "replace")

    Lenient.__name__ = f"Lenient{base.__name__}"
    return Lenient
