"""Property: paging through any table with the source delivers each row exactly once, in order.

Random tables (SQLite in memory) with many cursor ties, integer or text-timestamp cursors stored in
mixed precisions, single or composite keys, random batch sizes; every page resumes from a
checkpoint that went through the state blob codec, as a restarted poller would.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from poller.sources.keyset.source import SqlSource
from shared.codec import decode_position, encode_position
from tests.poller.source_fixtures import poller_config

# The same instants written differently, plus later ones: text order is what SQLite sorts by
TEXT_CURSORS = [
    "2026-01-01 10:00:00",
    "2026-01-01 10:00:00.000000",
    "2026-01-01 10:00:00.000001",
    "2026-01-01 10:00:00.5",
    "2026-01-01 10:00:00.500000",
    "2026-01-01 10:00:01",
    "2026-01-02 00:00:00.123",
]


@st.composite
def tables(draw: st.DrawFn) -> dict[str, Any]:
    composite = draw(st.booleans())
    text_cursor = draw(st.booleans())
    keys = st.tuples(st.integers(0, 3), st.integers(-50, 50)) if composite else st.tuples(st.integers(-500, 500))
    pk_values = draw(st.lists(keys, min_size=0, max_size=60, unique=True))
    cursor = st.sampled_from(TEXT_CURSORS) if text_cursor else st.integers(-3, 3)
    rows = [(draw(cursor), *pk) for pk in pk_values]
    return {"composite": composite, "text": text_cursor, "rows": rows, "batch": draw(st.integers(1, 9))}


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=tables())
def test_paging_delivers_every_row_exactly_once_in_cursor_pk_order(spec: dict[str, Any]) -> None:
    # Given a random table
    pk = ("a", "b") if spec["composite"] else ("a",)
    engine = sa.create_engine("sqlite://")
    cursor_type = "DATETIME" if spec["text"] else "INTEGER"
    with engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE TABLE t (c {cursor_type} NOT NULL, {', '.join(f'{k} INTEGER' for k in pk)}, "
                             f"PRIMARY KEY ({', '.join(pk)}))")  # fmt: skip
        conn.exec_driver_sql(f"CREATE INDEX ix ON t (c, {', '.join(pk)})")
        marks = ", ".join("?" for _ in range(len(pk) + 1))
        for row in spec["rows"]:
            conn.exec_driver_sql(f"INSERT INTO t VALUES ({marks})", row)
    cfg = poller_config("sqlite://", pk=pk, cursor_timezone="UTC")
    # When a poller pages through it, restarting from the stored checkpoint after every page
    delivered: list[tuple[Any, ...]] = []
    after = None
    for _ in range(len(spec["rows"]) + 2):
        page = SqlSource(cfg, engine).fetch(after, spec["batch"])
        if not page.rows:
            break
        assert len(page.rows) <= spec["batch"]
        delivered += [(r.position.cursor, *(r.position.pk[k] for k in pk)) for r in page.rows]
        after = decode_position(encode_position(page.last))
    engine.dispose()
    # Then every row arrives exactly once, in (cursor, pk) order
    assert delivered == sorted(spec["rows"])
