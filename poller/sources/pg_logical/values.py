"""pgoutput's text values as keyset reads the same column (docs/types.md).

A keyset read gets each value typed by the server's own description, where a domain is
already its base type; pgoutput names the domain's OID, for which psycopg has no loader (a
domain over integer arrived as the string ``'42'``). Each user-defined OID is looked up once
per connection (on a connection of its own: the slot's is streaming) and a domain, or an array
of one, is loaded as its base type. A value psycopg cannot load (a timestamp ``infinity``, a
BC date, an interval past ``timedelta``) arrives as its text instead of stopping the poller.
"""

from __future__ import annotations

from poller.dbtypes import base_type
from shared.logs import get_logger

__all__ = ["as_text", "base_type"]

log = get_logger(__name__)

_WARNED: set[int] = set()


def as_text(oid: int, data: bytes, exc: Exception) -> str:
    """A value psycopg refused, as its text (logged once per type OID): a value never stops a poller."""
    if oid not in _WARNED:
        _WARNED.add(oid)
        log.warning("pg_logical: a value of type OID %d has no Python form (%s); it arrives as its text", oid, exc)
    return bytes(data).decode("utf-8", "replace")
