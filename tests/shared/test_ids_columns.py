"""Event ids hashed from a page's columns are the row-by-row ids, for composite cursors too.

A log source's cursor is a tuple (pg_logical: the commit LSN and the change's place in its
transaction; mysql_binlog: a position and a sequence): its parts are columns of their own under one
``[..,..]`` spec, and the ids must still be exactly :meth:`EventIds.many`'s.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from shared.errors import SerializationError
from shared.ids import EventIds
from shared.models import Lsn

LSNS = st.builds(Lsn, st.integers(min_value=0, max_value=2**64 - 1))
PARTS = st.one_of(LSNS, st.integers(), st.text(max_size=3), st.none(), st.tuples(st.integers()))
CURSORS = st.one_of(
    st.tuples(LSNS, st.integers(min_value=0, max_value=10**6)),  # pg_logical's
    st.tuples(PARTS, PARTS, PARTS),
    st.tuples(PARTS),
    st.tuples(),
    PARTS,
)


@given(
    keys=st.lists(st.one_of(st.integers(), st.text(max_size=3)), min_size=1, max_size=8),
    data=st.data(),
    shape=st.sampled_from(["pg", "any"]),
)
def test_composite_cursor_ids_from_columns_are_the_row_by_row_ids(keys: list[Any], data: Any, shape: str) -> None:
    ids = EventIds("p%", "fp")
    strategy = CURSORS if shape == "any" else st.tuples(LSNS, st.integers(0, 10**6))
    cursors = data.draw(st.lists(strategy, min_size=len(keys), max_size=len(keys)))
    try:
        expected: list[str] | None = ids.many(({"id": k} for k in keys), cursors)
    except SerializationError:  # a composite cursor with an integer past 64 bits: no id at all
        expected = None
    fast = ids.of_columns({"id": keys}, cursors)
    assert fast is None or fast == expected
    if shape == "pg" and all(type(k) is not int or -(2**63) <= k < 2**64 for k in keys):
        assert fast is not None  # an LSN and a sequence: one template, never the fallback


@given(st.lists(st.tuples(LSNS, st.integers(0, 99)), min_size=1, max_size=5), st.data())
def test_distinct_composite_cursors_with_an_index_give_the_same_ids(values: list[Any], data: Any) -> None:
    ids = EventIds("p", "fp")
    index = data.draw(st.lists(st.integers(0, len(values) - 1), min_size=1, max_size=8))
    rows = [values[i] for i in index]
    keys = list(range(len(rows)))
    assert ids.of_columns({"id": keys}, values, index) == ids.many(({"id": k} for k in keys), rows)
