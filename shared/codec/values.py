"""One value to JSON and back: :func:`encode_value` gives ``(json_value, tag)``,
:func:`decode_value` reads it back under its tag (the full table: docs/types.md).

Values JSON carries exactly have no tag. Others travel as a string (or a list) with a tag:
``int`` past 2**53, ``float`` for NaN and infinities, ``decimal``, ``uuid``, ``bytes`` (base64),
``date``, ``time``, ``datetime`` (naive), ``timestamp`` (with offset), ``interval`` (seconds),
``pg_lsn``, ``ip_address``/``ip_interface``/``ip_network``, ``range:<bound tag>``,
``array:<element tag>``, ``set`` / ``set:<element tag>``, ``json`` (a JSON document whose
numbers JSON readers would round, as its text). Any other value never stops a
poller: it travels as its ``str`` under ``py:<its type's name>`` and arrives as that string.
Cursors and keys kept in the state blob must round-trip, so they refuse such values
(:func:`exact_value`).
"""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
import json
import math
import uuid
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from typing import Any

from shared.codec.ranges import is_range, parse_range, range_text
from shared.errors import SerializationError
from shared.models import Lsn

# Integers beyond this travel as strings: JavaScript and many JSON parsers lose precision past 2**53.
_SAFE_INT = 2**53 - 1
#: The tag prefix of a value only its text carries (a type the codec does not know).
TEXT_TAG = "py:"
_OTHER = ""  # _scalar_tag: not a scalar the codec knows


def tag_of(value: Any) -> str | None:
    """The type tag a value needs in JSON, or None when JSON carries it natively."""
    tag = _scalar_tag(value)
    return encode_value(value)[1] if tag == _OTHER else tag


def _scalar_tag(value: Any) -> str | None:
    if value is None or isinstance(value, bool | str):
        return None
    if isinstance(value, int):
        return "pg_lsn" if isinstance(value, Lsn) else None if -_SAFE_INT <= value <= _SAFE_INT else "int"
    if isinstance(value, float):
        return None if math.isfinite(value) else "float"
    if isinstance(value, dt.datetime):
        return "timestamp" if value.tzinfo is not None else "datetime"
    if isinstance(value, dt.date):
        return "date"
    if isinstance(value, dt.time):
        return "time"
    if isinstance(value, Decimal):
        return "decimal"
    if isinstance(value, uuid.UUID):
        return "uuid"
    if isinstance(value, bytes | bytearray | memoryview):
        return "bytes"
    if isinstance(value, dt.timedelta):
        return "interval"
    return _OTHER


def _iso(value: dt.datetime) -> str:
    text = value.isoformat(timespec="microseconds")
    return text[:-6] + "Z" if text.endswith("+00:00") else text


def encode_value(value: Any) -> tuple[Any, str | None]:
    """Encode one value to ``(json_value, tag)``; never raises (see the module's docstring)."""
    tag = _scalar_tag(value)
    if tag is None:
        return value, None
    if tag == _OTHER:
        return _encode_other(value)
    if tag == "int" or tag == "decimal" or tag == "uuid" or tag == "float" or tag == "pg_lsn":
        return str(value), tag
    if tag in ("timestamp", "datetime"):
        return _iso(value), tag
    if tag in ("date", "time"):
        return value.isoformat(), tag
    if tag == "bytes":
        return base64.b64encode(bytes(value)).decode("ascii"), tag
    return _seconds(value), tag  # interval


def _seconds(value: dt.timedelta) -> float | str:
    """A timedelta's seconds: a JSON number while that is exact (under ~285 years), else a decimal string."""
    seconds = value.total_seconds()
    if dt.timedelta(seconds=seconds) == value:
        return seconds
    micros = (value.days * 86_400 + value.seconds) * 1_000_000 + value.microseconds
    return str(Decimal(micros).scaleb(-6))


_IP_TAGS: dict[type, str] = {
    ipaddress.IPv4Address: "ip_address",
    ipaddress.IPv6Address: "ip_address",
    ipaddress.IPv4Interface: "ip_interface",  # an interface is an address; test it first
    ipaddress.IPv6Interface: "ip_interface",
    ipaddress.IPv4Network: "ip_network",
    ipaddress.IPv6Network: "ip_network",
}


def _encode_other(value: Any) -> tuple[Any, str | None]:
    if isinstance(value, list | tuple):
        return _encode_items(value, "array")
    if isinstance(value, dict):
        return _encode_document(value)
    if isinstance(value, set | frozenset):
        items, tag = _encode_items(value, "set")
        return sorted(items, key=_order), tag or "set"
    ip_tag = _IP_TAGS.get(type(value))
    if ip_tag is not None:
        return str(value), ip_tag
    if type(value).__name__ == "Multirange":  # psycopg's (a sequence of ranges): an array of them
        return _encode_items(list(value), "array")
    if is_range(value) and (found := range_text(value, encode_value)) is not None:
        return found
    return _text(value), TEXT_TAG + type(value).__name__


def _encode_document(value: dict[Any, Any] | list[Any]) -> tuple[Any, str | None]:
    """A JSON document (json/jsonb): as itself while JSON carries every value in it exactly,
    else its JSON text, tagged ``json`` (an integer past 2**53 inside, a NaN): the worker
    parses it back with Python's json, which keeps every integer."""
    plain = {str(k): _plain(v) for k, v in value.items()} if isinstance(value, dict) else [_plain(v) for v in value]
    if _exact_json(value):
        return plain, None
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False), "json"
    except (TypeError, ValueError):  # not a JSON document (Python objects inside): readable, untagged
        return plain, None


def _exact_json(value: Any) -> bool:
    if value is None or isinstance(value, str | bool):
        return True
    if isinstance(value, int):
        return -_SAFE_INT <= value <= _SAFE_INT
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(map(_exact_json, value))
    if isinstance(value, dict):
        return all(isinstance(k, str) for k in value) and all(map(_exact_json, value.values()))
    return False


def _text(value: Any) -> str:
    try:
        return str(value)
    except Exception:
        return repr(value)


def _order(item: Any) -> tuple[str, str]:
    return type(item).__name__, str(item)


def _encode_items(values: Any, kind: str) -> tuple[list[Any], str | None]:
    """A list's (or set's) items; tagged ``<kind>:<tag>`` when the non-null items share one tag.

    Items of mixed tags travel untagged (their JSON forms, as inside a JSON column), except
    numbers where some are tagged (``[1, 2**60]``, ``[1.5, nan]``): ``int``/``float`` also
    read the plain ones."""
    pairs = [encode_value(v) for v in values]
    tags = {t for _, t in pairs}
    encoded = [v for v, _ in pairs]
    tags.discard(None)
    if not tags:
        return encoded, None
    if len(tags) == 1:
        (tag,) = tags
        plain = [v for (v, t) in pairs if t is None and v is not None]
        if not plain or (tag == "int" and all(type(v) is int for v in plain)):
            return encoded, f"{kind}:{tag}"
        if tag == "float" and all(type(v) is float for v in plain):
            return encoded, f"{kind}:{tag}"
        if tag == "json" and all(type(v) is dict for v in plain):  # a jsonb array: every document as text
            texts = [v if t is not None or v is None else json.dumps(v, separators=(",", ":")) for v, t in pairs]
            return texts, f"{kind}:{tag}"
    if kind == "array" and isinstance(values, list):  # a JSON array (json/jsonb): as a document
        return _encode_document(values)
    return [_plain(v) for v in values], None


def _plain(value: Any) -> Any:
    """Encode a value nested inside a JSON column (no tags: best-effort readable form)."""
    encoded, _ = encode_value(value)
    return encoded


def exact_value(value: Any) -> tuple[Any, str | None]:
    """:func:`encode_value`, refusing a value that would not decode back to itself (state blob)."""
    encoded, tag = encode_value(value)
    if tag is not None and TEXT_TAG in tag:
        raise SerializationError(f"cannot encode a value of type {type(value).__name__} exactly")
    return encoded, tag


def _interval(value: Any) -> dt.timedelta:
    if isinstance(value, str):  # past a float's exact range: decimal seconds
        return dt.timedelta(microseconds=int(Decimal(value).scaleb(6)))
    return dt.timedelta(seconds=value)


_DECODERS: dict[str, Callable[[Any], Any]] = {
    "int": int,
    "decimal": Decimal,
    "uuid": uuid.UUID,
    "float": float,
    "timestamp": dt.datetime.fromisoformat,
    "datetime": dt.datetime.fromisoformat,
    "date": dt.date.fromisoformat,
    "time": dt.time.fromisoformat,
    "bytes": base64.b64decode,
    "interval": _interval,
    "pg_lsn": Lsn.parse,
    "ip_address": ipaddress.ip_address,
    "ip_interface": ipaddress.ip_interface,
    "ip_network": ipaddress.ip_network,
    "set": set,
    "json": json.loads,
}


def decode_value(value: Any, tag: str | None) -> Any:
    """Inverse of :func:`encode_value`."""
    if tag is None:
        return value
    decoder = _DECODERS.get(tag)
    try:
        result = decoder(value) if decoder is not None else _decode(value, tag)
    except (ValueError, TypeError, InvalidOperation, OverflowError) as exc:
        raise SerializationError(f"cannot decode {value!r} as {tag}") from exc
    if tag == "timestamp" and result.tzinfo is None:
        raise SerializationError(f"timestamp {value!r} has no UTC offset")
    return result


def _decode(value: Any, tag: str) -> Any:
    """A value under a composite tag (``array:…``, ``set:…``, ``range:…``, ``py:…``)."""
    kind, _, inner = tag.partition(":")
    if kind == "array" and inner:
        return [None if v is None else decode_value(v, inner) for v in _list(value)]
    if kind == "set" and inner:
        return {None if v is None else decode_value(v, inner) for v in _list(value)}
    if kind == "range":
        return parse_range(value, inner or None, decode_value)
    if kind + ":" == TEXT_TAG and isinstance(value, str):
        return value
    raise SerializationError(f"unknown type tag {tag!r}")


def _list(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise TypeError(f"expected a list, got {type(value).__name__}")
    return value
