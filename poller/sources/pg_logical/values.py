"""pgoutput's text values as keyset reads the same column (docs/types.md).

A keyset read gets each value typed by the server's own description, where a domain is
already its base type; pgoutput names the domain's OID, for which psycopg has no loader (a
domain over integer arrived as the string ``'42'``). Each user-defined OID is looked up once
per connection (on a connection of its own: the slot's is streaming) and a domain, or an array
of one, is loaded as its base type. A value psycopg cannot load (a timestamp ``infinity``, a
BC date, an interval past ``timedelta``) arrives as its text instead of stopping the poller.
"""

from __future__ import annotations

import sqlalchemy as sa

from shared.logs import get_logger

__all__ = ["as_text", "base_type"]

log = get_logger(__name__)

_FIRST_USER_OID = 16384  # PostgreSQL's FirstNormalObjectId: built-in types are below it
_TYPE = sa.text("SELECT typtype, typbasetype, typelem, typcategory FROM pg_type WHERE oid = :oid")
_ARRAY_OF = sa.text("SELECT typarray FROM pg_type WHERE oid = :oid")
_WARNED: set[int] = set()
_CACHE = "dbfanout_base_types"  # in the connection's info: the same lookups serve every tick


def base_type(conn: sa.Connection, oid: int) -> int:
    """The OID whose loader reads ``oid``'s text: a domain's base type (an array of a domain:
    the array of its base type), else ``oid`` itself."""
    if oid < _FIRST_USER_OID:
        return oid
    cache: dict[int, int] = conn.info.setdefault(_CACHE, {})
    found = cache.get(oid)
    if found is None:
        with conn.engine.connect() as side:
            found = cache[oid] = _resolve(side, oid)
    return found


def _resolve(conn: sa.Connection, oid: int) -> int:
    row = conn.execute(_TYPE, {"oid": oid}).first()
    if row is None:
        return oid
    typtype, basetype, elem, category = row
    if typtype == "d":
        return _resolve(conn, int(basetype))
    if category == "A" and elem:
        base = _resolve(conn, int(elem))
        if base != int(elem):
            array = conn.execute(_ARRAY_OF, {"oid": base}).scalar()
            return int(array) if array else oid
    return oid


def as_text(oid: int, data: bytes, exc: Exception) -> str:
    """A value psycopg refused, as its text (logged once per type OID): a value never stops a poller."""
    if oid not in _WARNED:
        _WARNED.add(oid)
        log.warning("pg_logical: a value of type OID %d has no Python form (%s); it arrives as its text", oid, exc)
    return bytes(data).decode("utf-8", "replace")
