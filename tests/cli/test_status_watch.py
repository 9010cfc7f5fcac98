"""``dbfanout status --watch`` (issue 24): a live view of every poller — lag, pending rows, how fast
the checkpoint moves, queue depth and dead letters — redrawn in place on a terminal."""

from __future__ import annotations

import io
from typing import Any

import pytest
from azure.servicebus import ServiceBusClient
from rich.console import Console

from dbfanout.commands.status import collect
from dbfanout.commands.status_watch import checkpoint_rate, live_table, watch_live
from tests.cli.conftest import Workspace, dead_letter

pytestmark = pytest.mark.integration


def test_the_live_view_shows_rate_lag_and_dead_letters(workspace: Workspace, bus: ServiceBusClient) -> None:
    # Given a poller that sent 30 rows, with one message dead-lettered in its queue
    ws = workspace
    ws.source.upsert(range(30))
    config = ws.config
    sink = ws.bus_sink(bus)
    ws.tick(sink=sink)
    dead_letter(bus, ws.queue, [b'{"poison": true}'])
    calls: list[list[dict[str, Any]]] = []

    def refresh() -> list[dict[str, Any]]:
        # When rows arrive between refreshes and the poller sends them; the third refresh is Ctrl-C
        if len(calls) == 1:
            ws.source.upsert(range(30, 50))
            ws.tick(sink=sink)
        if len(calls) == 2:
            raise KeyboardInterrupt
        calls.append(collect(config, None))
        return calls[-1]

    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=200, record=True)
    rows = watch_live(console, refresh, interval=0.01)
    # Then the view was redrawn with the latest rows, the checkpoint's speed, and the DLQ count
    assert len(calls) == 2 and rows == calls[-1]
    text = console.export_text()
    assert "dbfanout status --watch" in text and "orders" in text and ws.queue in text
    row = rows[0]
    assert row["queue_depth"]["dead_lettered"] == 1
    rate = checkpoint_rate(calls[0][0], row, 2.0)
    assert rate.endswith("/s") and float(rate[:-2].replace(",", "")) > 0  # the version cursor moved
    view = Console(file=io.StringIO(), width=200, record=True)
    view.print(live_table(rows, {"orders": calls[0][0]}, 2.0))
    line = next(line for line in view.export_text().splitlines() if line.lstrip("│ ").startswith("orders"))
    assert rate in line and " 1 " in line  # the DLQ column


def test_rate_reads_temporal_cursors_as_times_real_time() -> None:
    before = {"checkpoint": {"cursor": {"kind": "datetime", "value": "2026-01-01T00:00:00+00:00"}}}
    after = {"checkpoint": {"cursor": {"kind": "datetime", "value": "2026-01-01T00:00:30+00:00"}}}
    assert checkpoint_rate(before, after, 10.0) == "3.0x real time"
    assert checkpoint_rate(None, after, 10.0) == "-"
