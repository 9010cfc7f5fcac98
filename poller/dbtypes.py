"""Database type facts that the sources and the snapshot chunks both read (docs/types.md).

Below both wings (nothing under ``poller/snapshot`` imports ``poller/sources``): a ``BIT(n)``
value as its n bits, and a PostgreSQL domain's base type (the OID whose loader reads it).
"""

from __future__ import annotations

import sqlalchemy as sa

__all__ = ["base_type", "bits"]

_FIRST_USER_OID = 16384  # PostgreSQL's FirstNormalObjectId: built-in types are below it
_TYPE = sa.text("SELECT typtype, typbasetype, typelem, typcategory FROM pg_type WHERE oid = :oid")
_ARRAY_OF = sa.text("SELECT typarray FROM pg_type WHERE oid = :oid")
_CACHE = "dbfanout_base_types"  # in the connection's info: the same lookups serve every tick


def bits(value: bytes | int, width: int) -> str:
    """A BIT(width) value as its string of ``width`` 0s and 1s, most significant first."""
    number = int.from_bytes(value, "big") if isinstance(value, bytes | bytearray) else value
    return format(number, f"0{width}b")


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
