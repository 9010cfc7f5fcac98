"""The processed-events helper absorbs duplicates on every dialect, atomically with the side effect."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import sqlalchemy as sa

from shared.models import RowChange
from tests.support.databases import unique_name
from worker.idempotency import ProcessedEvents


def _events(n: int) -> list[RowChange]:
    return [RowChange(f"ev-{i}", "upsert", {"id": i}, i, {"id": i}, "orders") for i in range(n)]


def test_duplicates_are_skipped_and_rollback_forgets_them(
    any_db_url: str, engine_for: Callable[[str], sa.Engine]
) -> None:
    engine = engine_for(any_db_url)
    processed = ProcessedEvents(engine, table=unique_name("processed"))
    try:
        # Given a first delivery that is handled
        with engine.begin() as conn:
            assert [e.event_id for e in processed.fresh(conn, _events(3))] == ["ev-0", "ev-1", "ev-2"]
        # When a transaction records events and then fails
        with pytest.raises(RuntimeError), engine.begin() as conn:
            assert len(processed.fresh(conn, _events(5))) == 2
            raise RuntimeError("side effect failed")
        # Then the redelivery sees only the never-committed events as fresh
        with engine.begin() as conn:
            assert [e.event_id for e in processed.fresh(conn, _events(5))] == ["ev-3", "ev-4"]
        assert processed.count() == 5
    finally:
        processed.table.drop(engine)


def test_a_large_batch_with_repeated_ids_is_fresh_once_per_id(
    any_db_url: str, engine_for: Callable[[str], sa.Engine]
) -> None:
    engine = engine_for(any_db_url)
    processed = ProcessedEvents(engine, table=unique_name("processed"))
    try:
        # Given ids seen before, and a batch larger than one statement's parameters, repeating an id
        with engine.begin() as conn:
            processed.fresh(conn, _events(10))
        batch = [*_events(2500), _events(11)[10], *_events(3)]
        # When it is recorded
        with engine.begin() as conn:
            fresh = [e.event_id for e in processed.fresh(conn, batch)]
        # Then each new id is fresh once, at its first place, in the batch's order
        assert fresh == [f"ev-{i}" for i in range(10, 2500)]
        assert processed.count() == 2500
    finally:
        processed.table.drop(engine)
