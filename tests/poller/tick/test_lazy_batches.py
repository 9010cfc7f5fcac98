"""Pages and batches are built lazily: the tick reads only the count and the last position.

A no-op or forwarding sink therefore costs no per-row work; a sink that reads the events gets
exactly what eager building gives (same ids, same order, same values).
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from poller.ports import Page, SourceRow
from poller.sources.keyset.source import SqlSource
from poller.tick.events import LazyEvents, page_batch, to_batch
from shared.codec import decode_batch, encode_batch
from shared.ids import batch_id_for_range
from shared.models import Position
from tests.poller.tick_support import SourceTable, make_poller


@pytest.fixture
def table(tmp_path: Path) -> SourceTable:
    return SourceTable(f"sqlite:///{tmp_path / 'src.db'}")


def _counting_page(n: int) -> tuple[Page, list[int]]:
    built: list[int] = []

    def make_row(i: int) -> SourceRow:
        built.append(i)
        return SourceRow(Position(i, {"id": i}), {"id": i, "v": f"r{i}"})

    return Page(tuples=list(range(n)), make_row=make_row), built


def test_the_tick_view_of_a_page_builds_only_its_ends() -> None:
    page, built = _counting_page(1000)
    # When the count, the last position and the batch id are read
    assert len(page) == 1000 and page.last == Position(999, {"id": 999})
    batch = page_batch(make_poller("sqlite://"), "fp", page)
    assert len(batch.events) == 1000
    # Then only the first and last rows were built (the batch id covers the page's range)
    assert sorted(set(built)) == [0, 999]
    # And reading the events builds every row once, in order; a second read builds nothing
    assert [e.pk["id"] for e in batch.events] == list(range(1000))
    assert len(built) == 2 + 1000
    assert batch.events[-1].pk == {"id": 999} and len(built) == 2 + 1000


def test_a_page_needs_rows_or_tuples_with_a_builder() -> None:
    with pytest.raises(ValueError):
        Page()
    with pytest.raises(ValueError):
        Page(tuples=[1])
    empty = Page(tuples=[], make_row=lambda t: t)
    assert len(empty) == 0 and empty.last is None and empty.rows == []


def test_lazy_events_equal_the_eagerly_built_ones_and_survive_the_codec(table: SourceTable) -> None:
    table.upsert(range(30))
    table.soft_delete(7)
    poller = make_poller(str(table.engine.url), batch_size=30)
    source = SqlSource(poller)
    page = source.fetch(None, 30)
    lazy = page_batch(poller, source.fingerprint, page)
    eager = to_batch(poller, source.fingerprint, source.fetch(None, 30).rows)
    assert isinstance(lazy.events, LazyEvents)
    assert lazy == eager  # same batch id, same events (ids, ops, values), same order
    assert {e.pk["id"]: e.op for e in lazy.events}[7] == "delete"
    assert decode_batch(encode_batch(lazy)) == eager


def test_re_fetching_a_page_gives_the_same_batch_id_and_another_page_another(table: SourceTable) -> None:
    table.upsert(range(25))
    poller = make_poller(str(table.engine.url))
    source = SqlSource(poller)
    first = page_batch(poller, source.fingerprint, source.fetch(None, 10))
    again = page_batch(poller, source.fingerprint, SqlSource(poller).fetch(None, 10))
    page = source.fetch(None, 10)
    second = page_batch(poller, source.fingerprint, source.fetch(page.last, 10))
    assert first.batch_id == again.batch_id
    assert second.batch_id != first.batch_id
    # A page of a different size over the same start is another batch
    assert page_batch(poller, source.fingerprint, source.fetch(None, 9)).batch_id != first.batch_id


positions = st.builds(
    lambda c, k: Position(c, {"id": k}),
    st.one_of(st.integers(), st.datetimes(timezones=st.just(dt.UTC)), st.text(max_size=8)),
    st.integers(min_value=-(2**70), max_value=2**70),
)


@settings(max_examples=200, deadline=None)
@given(a=st.tuples(positions, positions, st.integers(1, 5000)), b=st.tuples(positions, positions, st.integers(1, 5000)))
def test_batch_ids_are_a_function_of_the_page_range(a, b) -> None:
    id_a = batch_id_for_range("p", "fp", *a)
    assert id_a == batch_id_for_range("p", "fp", *a)
    assert id_a != batch_id_for_range("other", "fp", *a)
    if a != b:
        assert id_a != batch_id_for_range("p", "fp", *b)
