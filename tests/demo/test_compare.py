"""The demo's verdict: the target must hold exactly the source's latest state, deletions included."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import sqlalchemy as sa

from dbfanout.demo.compare import TargetState, compare, normalize, read_source, read_target


def _row(i: int, version: int, *, deleted: bool = False, amount: float = 9.5) -> dict[str, Any]:
    return {
        "id": i,
        "version": version,
        "updated_at": "2024-01-01T00:00:00.000001+00:00",
        "customer": "ada",
        "amount": amount,
        "status": "paid",
        "deleted_at": "2024-01-02T00:00:00+00:00" if deleted else None,
    }


def _replicated(source: dict[int, dict[str, Any]]) -> TargetState:
    """What a correct pipeline leaves: live rows as the events carry them, every latest version."""
    return TargetState(
        rows={i: normalize(r) for i, r in source.items() if r["deleted_at"] is None},
        versions={i: (r["version"], r["deleted_at"] is not None) for i, r in source.items()},
    )


SOURCE = {1: _row(1, 5), 2: _row(2, 7, deleted=True), 3: _row(3, 9, amount=0.1)}


def test_a_faithful_replica_is_an_exact_match() -> None:
    # Given a target holding every live row and every latest version
    result = compare(SOURCE, _replicated(SOURCE))
    # Then it matches, with counts of live and deleted rows
    assert result.ok
    assert (result.source_rows, result.live_rows, result.deleted_rows, result.target_rows) == (3, 2, 1, 2)
    assert result.to_json()["exact_match"] is True


def test_a_missing_live_row_is_reported() -> None:
    target = _replicated(SOURCE)
    rows = dict(target.rows)
    del rows[3]
    result = compare(SOURCE, TargetState(rows=rows, versions=target.versions))
    assert not result.ok and result.missing == (3,)


def test_a_stale_column_value_is_reported_as_different() -> None:
    # Given the target kept an older amount for row 1
    target = _replicated(SOURCE)
    rows = {**target.rows, 1: normalize(_row(1, 5, amount=1.25))}
    result = compare(SOURCE, TargetState(rows=rows, versions=target.versions))
    assert result.different == (1,) and not result.ok


def test_a_deleted_row_still_in_the_target_is_resurrected() -> None:
    target = _replicated(SOURCE)
    rows = {**target.rows, 2: normalize(_row(2, 7))}
    result = compare(SOURCE, TargetState(rows=rows, versions=target.versions))
    assert result.resurrected == (2,) and not result.ok


def test_a_row_the_source_never_had_is_unknown() -> None:
    target = _replicated(SOURCE)
    rows = {**target.rows, 99: normalize(_row(99, 1))}
    result = compare(SOURCE, TargetState(rows=rows, versions=target.versions))
    assert result.unknown == (99,) and not result.ok


def test_a_delete_that_never_arrived_is_a_version_behind() -> None:
    # Given row 2 was inserted and soft-deleted, but the target never recorded the delete
    target = _replicated(SOURCE)
    versions = {k: v for k, v in target.versions.items() if k != 2}
    result = compare(SOURCE, TargetState(rows=target.rows, versions=versions))
    # Then the comparison fails even though no target row is wrong
    assert result.versions_behind == (2,) and not result.ok
    assert result.to_json()["mismatches"]["versions_behind"] == {"count": 1, "ids": [2]}


def test_an_older_applied_version_is_behind() -> None:
    target = _replicated(SOURCE)
    versions = {**target.versions, 1: (4, False)}
    assert compare(SOURCE, TargetState(rows=target.rows, versions=versions)).versions_behind == (1,)


def test_values_are_compared_as_the_codec_carries_them() -> None:
    # Large integers travel as tagged strings; the comparison must normalize the source likewise
    big = {"id": 1, "n": 2**60, "x": 0.1, "s": "a", "none": None}
    assert normalize(big) == {"id": 1, "n": str(2**60), "x": 0.1, "s": "a", "none": None}


def test_the_readers_round_trip_what_the_example_handler_writes(tmp_path: Path) -> None:
    # Given a source table and the example handler's tables with one applied upsert and one delete
    from handlers.example import key_of, target_tables
    from worker.ordering import encode_cursor

    engine = sa.create_engine(f"sqlite:///{tmp_path / 'db.sqlite'}")
    target_table, versions, _ = target_tables()
    target_table.metadata.create_all(engine)
    source = {1: _row(1, 3), 2: _row(2, 4, deleted=True)}
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "CREATE TABLE orders (id INTEGER PRIMARY KEY, version INTEGER, updated_at TEXT, customer TEXT,"
            " amount REAL, status TEXT, deleted_at TEXT)"
        )
        conn.execute(
            sa.text("INSERT INTO orders VALUES (:id, :version, :updated_at, :customer, :amount, :status, :deleted_at)"),
            list(source.values()),
        )
        import datetime as dt

        from shared.codec import dumps

        conn.execute(
            sa.insert(target_table).values(
                poller="orders", pk=key_of({"id": 1}), cursor=encode_cursor(3),
                row=dumps(normalize(source[1])).decode(), updated_at=dt.datetime.now(dt.UTC),
            )
        )  # fmt: skip
        conn.execute(
            sa.insert(versions),
            [
                {"poller": "orders", "pk": key_of({"id": 1}), "cursor": encode_cursor(3), "deleted": False},
                {"poller": "orders", "pk": key_of({"id": 2}), "cursor": encode_cursor(4), "deleted": True},
            ],
        )
    # When both sides are read back
    result = compare(read_source(engine), read_target(engine))
    # Then they match exactly
    assert result.ok, result.to_json()
    engine.dispose()


def test_an_empty_target_reads_as_empty(tmp_path: Path) -> None:
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'empty.sqlite'}")
    state = read_target(engine)
    assert state.rows == {} and state.versions == {} and state.processed_events == 0
    engine.dispose()


def test_hard_deletes_applied_as_deletes_are_counted_from_the_targets_versions() -> None:
    # Given a hard-deleting source: row 2 is gone, and the target recorded its delete (version 8, deleted)
    source = {1: _row(1, 5), 3: _row(3, 9)}
    replicated = _replicated(source)
    target = TargetState(rows=replicated.rows, versions={**replicated.versions, 2: (8.5, True)})
    # Then the match is exact and the delete is counted as applied
    result = compare(source, target)
    assert result.ok and result.deletes_applied == 1
    assert result.to_json()["deletes_applied"] == 1
