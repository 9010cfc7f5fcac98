"""The poller and the worker emit their metrics through the OpenTelemetry API (issue 4)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from poller.sources.keyset.source import SqlSource
from poller.state.memory import MemoryStateStore
from poller.tick.lifecycle import run_tick
from tests.poller.tick_support import RecordingSink, SourceTable, make_poller
from tests.support import otel
from tests.support.databases import unique_name


@pytest.fixture(scope="module")
def reader() -> Iterator[InMemoryMetricReader]:
    # The global provider can be set once per process; dbfanout's instruments were created on the
    # API's proxy meter at import and start recording as soon as a real provider exists.
    otel.install()
    yield otel.READER


def _points(reader: InMemoryMetricReader) -> dict[str, list[tuple[dict[str, object], float]]]:
    data = reader.get_metrics_data()
    out: dict[str, list[tuple[dict[str, object], float]]] = {}
    for rm in data.resource_metrics if data else []:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                for p in metric.data.data_points:
                    # counters carry .value, histograms .sum
                    value = getattr(p, "value", None)
                    total = float(value if value is not None else getattr(p, "sum", 0.0))
                    out.setdefault(metric.name, []).append((dict(p.attributes or {}), total))
    return out


def test_a_tick_counts_rows_and_failures_by_stage(reader: InMemoryMetricReader, tmp_path: Path) -> None:
    table = SourceTable(f"sqlite:///{tmp_path / 's.db'}")
    table.upsert(range(25))
    poller = make_poller(str(table.engine.url))
    store = MemoryStateStore("orders")
    # The process's SDK is shared with other tests (the worker's tests also use a poller "orders"):
    # count what this test adds
    before = _points(reader)
    # Given one failing send, then a good tick
    with pytest.raises(Exception, match="injected"):
        run_tick(poller, SqlSource(poller), store, RecordingSink(fail_next=1), owner_id="a")
    run_tick(poller, SqlSource(poller), store, RecordingSink(), owner_id="a")
    points = _points(reader)

    def by(name: str, points: dict[str, list[tuple[dict[str, object], float]]], key: str) -> dict[object, float]:
        out: dict[object, float] = {}
        for attrs, v in points.get(name, []):
            if attrs.get("poller") == "orders" and (key != "stage" or "stage" in attrs):
                out[attrs.get(key)] = out.get(attrs.get(key), 0.0) + v
        return out

    fetched = by("dbfanout.rows_fetched", points, "poller").get("orders", 0) - by(
        "dbfanout.rows_fetched", before, "poller"
    ).get("orders", 0)
    assert fetched >= 10 + 25  # the failed tick's first page, then every row
    failures = {
        stage: v - by("dbfanout.failures", before, "stage").get(stage, 0.0)
        for stage, v in by("dbfanout.failures", points, "stage").items()
    }
    assert {stage: v for stage, v in failures.items() if v} == {"send": 1}
    assert "dbfanout.last_success_timestamp" in points


def _latest(reader: InMemoryMetricReader, name: str, poller: str) -> float | None:
    found = [v for attrs, v in _points(reader).get(name, []) if attrs.get("poller") == poller]
    return found[-1] if found else None


@pytest.mark.parametrize("database", ["sqlite", "postgresql", "mariadb"])
def test_lag_rows_counts_the_backlog_a_tick_left_and_is_zero_once_caught_up(
    database: str, reader: InMemoryMetricReader, request: pytest.FixtureRequest
) -> None:
    url = request.getfixturevalue({"sqlite": "sqlite_url", "postgresql": "pg_url", "mariadb": "mysql_url"}[database])
    name = unique_name("lagrows")
    table = SourceTable(url, name)
    table.upsert(range(57))
    # Given a poller that sends at most 2 pages of 10 rows a tick
    poller = replace(make_poller(url, name, max_batches_per_tick=2), name=name)
    store = MemoryStateStore(name)
    try:
        # When a tick stops short of the end, the gauge is the rest: 57 - 20
        result = run_tick(poller, SqlSource(poller), store, RecordingSink(), owner_id="a")
        assert result.stop_reason == "max_batches"
        assert _latest(reader, "dbfanout.lag_rows", name) == 37
        # ... counted only up to the bound (a deep backlog costs one bounded count, not a scan)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("poller.tick.commits.LAG_ROWS_LIMIT", 5)
            run_tick(poller, SqlSource(poller), store, RecordingSink(), owner_id="a")
        assert _latest(reader, "dbfanout.lag_rows", name) == 5
        # Then a tick that reaches the end says 0
        result = run_tick(poller, SqlSource(poller), store, RecordingSink(), owner_id="a")
        assert result.stop_reason == "caught_up"
        assert _latest(reader, "dbfanout.lag_rows", name) == 0
    finally:
        with table.engine.begin() as conn:
            conn.exec_driver_sql(f"DROP TABLE IF EXISTS {name}")
        table.engine.dispose()
