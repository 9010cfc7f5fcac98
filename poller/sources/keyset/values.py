"""The processors a keyset page's columns take, so a value arrives as every source kind gives it.

SQLAlchemy's result processors for reflected MariaDB/MySQL types change what the driver read:
``DOUBLE`` becomes a Decimal rounded to 10 digits (1e308 a 309-digit one), ``TIME`` a
``datetime.time`` taken modulo 24 hours (``-838:59:59`` arrives as 01:00:01), ``BIT(n)`` an
integer. The binlog gives a float, a signed ``timedelta`` and a bit string; docs/types.md
chooses those (a bit string as PostgreSQL's ``bit(n)`` is one), and this module gives them
here. On SQLite, a NUMERIC/DECIMAL value is the Decimal of the number stored (SQLAlchemy's
rounds it to the declared scale), and a value its column's type cannot parse arrives as stored.
An array of a PostgreSQL domain is read as an array of the domain's base type. Every other type
keeps SQLAlchemy's processor.
"""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql, postgresql

from poller.dbtypes import bits

__all__ = ["bits", "result_processor"]

Processor = Callable[[Any], Any] | None


def result_processor(type_: sa.types.TypeEngine[Any], dialect: sa.Dialect, code: Any) -> Processor:
    """The processor for a reflected column's values (``code``: the driver's type code)."""
    default = type_.dialect_impl(dialect).result_processor(dialect, code)
    if dialect.name == "postgresql" and isinstance(type_, sa.ARRAY):
        return _pg_array(type_, dialect, default)
    if dialect.name == "sqlite":
        if isinstance(type_, sa.Numeric) and not isinstance(type_, sa.Float):
            return _sqlite_decimal  # SQLAlchemy's rounds to the declared scale (12.345 in DECIMAL(10,2): 12.35)
        return None if default is None else _or_raw(default)
    if dialect.name not in ("mysql", "mariadb"):
        return default
    if isinstance(type_, mysql.BIT):
        return _bit_string(type_.length or 1)
    if isinstance(type_, sa.Float | sa.Time):
        return None  # the driver's float, and its signed timedelta (TIME spans -838:59:59 to 838:59:59)
    return default


def _pg_array(type_: sa.ARRAY[Any], dialect: sa.Dialect, default: Processor) -> Processor:
    """An array of a domain: psycopg reads its text (the server describes the domain's array
    type, which psycopg does not know) and SQLAlchemy's processor would split that text into
    characters; read as an array of the domain's base type, as pg_logical does."""
    from psycopg import postgres  # psycopg is installed wherever a postgresql URL is used
    from psycopg.adapt import Transformer
    from psycopg.pq import Format

    item = type_.item_type
    while isinstance(item, postgresql.DOMAIN):
        item = item.data_type
    name = str(item.compile(dialect=dialect)).lower().partition("(")[0].strip()
    info = postgres.types.get(name)
    if info is None or not info.array_oid:
        return default
    load = Transformer().get_loader(info.array_oid, Format.TEXT).load

    def process(value: Any) -> Any:
        if isinstance(value, str):
            return load(value.encode())
        return value if default is None else default(value)

    return process


def _sqlite_decimal(value: Any) -> Any:
    if isinstance(value, int):
        return Decimal(value)
    if isinstance(value, float):
        return Decimal(repr(value))  # the shortest decimal that is this double: the number SQLite holds
    return value  # NULL, or text NUMERIC affinity kept as text


def _or_raw(process: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """SQLite keeps any text in a DATE or DATETIME column ('2024-02-30'): a value SQLAlchemy cannot
    parse arrives as it is stored, instead of stopping the poller."""

    def safe(value: Any) -> Any:
        try:
            return process(value)
        except (ValueError, TypeError, ArithmeticError):
            return value

    return safe


def _bit_string(width: int) -> Callable[[Any], Any]:
    def process(value: Any) -> Any:
        return None if value is None else bits(value, width)

    return process
