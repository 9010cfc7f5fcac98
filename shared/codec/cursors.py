"""Rows, keys and cursors as value maps with their tags; the generic JSON of every document."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from shared.codec.values import decode_value, encode_value, exact_value, tag_of
from shared.errors import SerializationError
from shared.models import CursorValue, Lsn


def _encode_map(values: Mapping[str, Any], *, exact: bool = False) -> tuple[dict[str, Any], dict[str, str]]:
    """A row or key's values and their tags (``exact``: refuse what would not decode back, for the state blob)."""
    encode = exact_value if exact else encode_value
    out: dict[str, Any] = {}
    tags: dict[str, str] = {}
    for key, value in values.items():
        out[key], tag = encode(value)
        if tag is not None:
            tags[key] = tag
    return out, tags


def _decode_map(values: Mapping[str, Any], tags: Mapping[str, str]) -> dict[str, Any]:
    return {key: decode_value(value, tags.get(key)) for key, value in values.items()}


def _encode_cursor(cursor: CursorValue, *, exact: bool = False) -> tuple[Any, Any]:
    encode = exact_value if exact else encode_value
    if isinstance(cursor, tuple):
        parts = [encode(v) for v in cursor]
        return [p[0] for p in parts], [p[1] for p in parts]
    return encode(cursor)


def _decode_cursor(value: Any, tag: Any) -> CursorValue:
    if isinstance(tag, list):
        if not isinstance(value, list) or len(value) != len(tag):
            raise SerializationError("composite cursor value and its type tags differ in length")
        return tuple(decode_value(v, t) for v, t in zip(value, tag, strict=True))
    decoded: CursorValue = decode_value(value, tag)
    return decoded


def cursor_kind(cursor: CursorValue) -> str:
    """The seed-002 ``kind`` string, e.g. ``timestamp+pk`` or ``composite+pk``."""
    if isinstance(cursor, tuple):
        return "composite+pk"
    if isinstance(cursor, Lsn):
        return "pg_lsn"  # value: the commit LSN; tiebreaker: the change's position in the transaction
    tag = tag_of(cursor)
    if tag is None:
        tag = {bool: "bool", int: "int", str: "string", float: "float"}.get(type(cursor), "value")
    return f"{tag}+pk"


def dumps(obj: Any) -> bytes:
    """orjson with the options every dbfanout document uses."""
    try:
        return orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS)
    except TypeError as exc:
        raise SerializationError(f"cannot encode document: {exc}") from exc


def loads(data: bytes | str) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise SerializationError(f"not valid JSON: {exc}") from exc


def _json_object(data: bytes | str, error: type[SerializationError], what: str) -> dict[str, Any]:
    """``data`` parsed as a JSON object; ``error`` (naming ``what``) when it is not one."""
    try:
        raw = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise error(f"{what} is not JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise error(f"{what} must be a JSON object")
    return raw
