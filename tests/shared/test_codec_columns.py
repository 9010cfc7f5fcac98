"""A column's JSON pieces (``column_json``, ``column_pieces``) are exactly each value's ``encode_value`` JSON.

Documents (json/jsonb, arrays) take a shortcut when JSON carries them exactly: anything it does not
(an integer past 2**53, a NaN, a non-string key, a datetime, a tuple, an int subclass) must leave it.
"""

from __future__ import annotations

import datetime as dt
import uuid
from decimal import Decimal
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from shared.codec import column_json, dumps, encode_value
from shared.codec.columns import column_pieces
from shared.models import Lsn

LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from([2**53 - 1, 2**53, -(2**53), 10**15, 2**64, 123456789012345678]),
    st.floats(),
    st.text(max_size=4),
    st.sampled_from(["1234567890123456", "%s", '"', "ü"]),
)
ODD = st.one_of(
    st.datetimes(timezones=st.just(dt.UTC)),
    st.uuids(),
    st.decimals(allow_nan=False),
    st.builds(Lsn, st.integers(min_value=0, max_value=2**64 - 1)),
    st.tuples(st.integers()),
    st.frozensets(st.integers(), max_size=2),
)
DOCUMENTS = st.recursive(
    LEAVES | ODD,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(max_size=3), inner, max_size=3)
        | st.dictionaries(st.integers(), inner, max_size=2)
    ),
    max_leaves=8,
)
COLUMNS = st.lists(
    st.one_of(st.none(), st.lists(DOCUMENTS, max_size=3), st.dictionaries(st.text(max_size=3), DOCUMENTS)),
    min_size=1,
    max_size=6,
)


def _expected(values: list[Any]) -> tuple[list[bytes], list[str | None]]:
    pairs = [encode_value(v) for v in values]
    return [dumps(v) for v, _ in pairs], [t for _, t in pairs]


def _check(values: list[Any]) -> None:
    want, tags = _expected(values)
    found = column_json(values)
    if found is not None:
        pieces, spec, tag = found
        assert [spec % p for p in pieces] == want
        assert tags == [tag] * len(values)
    got = column_pieces(values)
    assert got is not None
    assert [got[1] % p for p in got[0]] == want
    assert (got[2] if isinstance(got[2], list) else [got[2]] * len(values)) == tags


@settings(max_examples=400, deadline=None)
@given(COLUMNS)
def test_document_columns_encode_as_each_value(values: list[Any]) -> None:
    _check(values)


@given(st.lists(st.one_of(st.builds(Lsn, st.integers(min_value=0, max_value=2**64 - 1)), st.none()), min_size=1))
def test_lsn_columns_encode_as_each_value(values: list[Any]) -> None:
    _check(values)


def test_a_document_json_cannot_carry_exactly_leaves_the_shortcut() -> None:
    for doc in ({"n": 2**53}, [float("nan")], {1: "a"}, {"at": dt.datetime(2026, 1, 1, tzinfo=dt.UTC)}, [(1, 2)]):
        values = [doc, {"plain": 1}]
        assert [p for p in column_pieces(values)[0]] == _expected(values)[0]  # type: ignore[index]
    assert column_pieces([{"n": 2**53}])[0] == [b'"{\\"n\\":9007199254740992}"']  # type: ignore[index]
    assert column_pieces([[uuid.UUID(int=1)], [Decimal("1.5")]])[2] == ["array:uuid", "array:decimal"]  # type: ignore[index]


@given(st.lists(st.one_of(st.none(), st.text(max_size=4), st.sampled_from(['","', '"', ","])), min_size=1))
def test_nullable_text_columns_encode_as_each_value(values: list[Any]) -> None:
    _check(values)
