"""``dbfanout status --watch`` on a terminal: one live view of every poller, redrawn in place
(like the demo's view): lag, pending rows, how fast the checkpoint moves, queue depth and dead
letters, lease and problems. Elsewhere (a pipe, CI, ``--json``) ``status`` prints each refresh.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable, Mapping
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from dbfanout.ops.status import row_problems

__all__ = ["checkpoint_rate", "live_table", "watch_live"]

Rows = list[dict[str, Any]]


def _cursor_value(row: Mapping[str, Any]) -> Any:
    cursor = (row.get("checkpoint") or {}).get("cursor") or {}
    return cursor.get("value"), cursor.get("kind")


def checkpoint_rate(before: Mapping[str, Any] | None, now: Mapping[str, Any], seconds: float) -> str:
    """How fast the checkpoint moved between two refreshes: cursor units per second for a numeric
    cursor (rows per second for a dense id or version), times real time for a temporal one, WAL
    bytes per second for pg_logical (its confirmed position). "-" when it cannot tell."""
    if before is None or seconds <= 0:
        return "-"
    slot_now, slot_before = (now.get("source") or {}), (before.get("source") or {})
    if "confirmed_flush_lsn" in slot_now and "lag_bytes" in slot_now and "lag_bytes" in slot_before:
        return f"{max(0, slot_before['lag_bytes'] - slot_now['lag_bytes']) / 1024 / seconds:,.1f} KiB/s of WAL"
    (old, kind), (new, _) = _cursor_value(before), _cursor_value(now)
    if old is None or new is None:
        return "-"
    try:
        if kind in ("int", "float", "decimal") or isinstance(new, int | float):
            return f"{(float(new) - float(old)) / seconds:,.1f}/s"
        if isinstance(new, str) and isinstance(old, str):
            moved = (dt.datetime.fromisoformat(new) - dt.datetime.fromisoformat(old)).total_seconds()
            return f"{moved / seconds:,.1f}x real time"
    except (TypeError, ValueError):
        return "-"
    return "-"


def _lag(row: Mapping[str, Any]) -> str:
    source = row.get("source") or {}
    lag = source.get("lag")
    if lag is None:
        return "-"
    if isinstance(lag, int | float) and (row.get("checkpoint") or {}).get("cursor", {}).get("kind") in (
        "datetime",
        "timestamp",
    ):
        return f"{lag:,.1f} s"
    return str(lag)


def _queue(row: Mapping[str, Any]) -> tuple[str, Text]:
    depth = row.get("queue_depth") or {}
    if "topic" in row:
        subs = row.get("subscriptions") or []
        active = ", ".join(f"{s['name']} {s.get('active', '?')}" for s in subs) or "-"
        dead = sum(s.get("dead_letter") or 0 for s in subs if isinstance(s.get("dead_letter"), int))
    else:
        active = str(depth.get("active_unknown") or depth.get("active", "-"))
        dead_value = depth.get("dead_lettered")
        dead = dead_value if isinstance(dead_value, int) else 0
        if not isinstance(dead_value, int):
            return active, Text(str(dead_value if dead_value is not None else "-"))
    return active, Text(f"{dead:,}", style="bold red" if dead else "green")


def live_table(rows: Rows, previous: Mapping[str, Mapping[str, Any]], seconds: float) -> Table:
    """The watch view: one line per poller."""
    table = Table(title=f"dbfanout status --watch ({dt.datetime.now(dt.UTC):%H:%M:%S} UTC, Ctrl-C to stop)")
    for column in ("poller", "lag", "pending", "rate", "queue", "active", "DLQ", "lease", "problems"):
        table.add_column(column, overflow="fold", justify="right" if column in ("pending", "DLQ") else "left")
    for row in rows:
        active, dead = _queue(row)
        lease = row.get("lease") or {}
        found, notes = row_problems(row)
        problems = "; ".join([*found, *notes])
        table.add_row(
            row["poller"],
            _lag(row),
            str((row.get("source") or {}).get("pending_rows", "-")),
            checkpoint_rate(previous.get(row["poller"]), row, seconds),
            str(row.get("topic") or row.get("queue")),
            active,
            dead,
            f"{lease.get('state', '-')} ({lease.get('owner') or 'free'})",
            Text(problems or "-", style="red" if found else "dim"),
        )
    return table


def watch_live(console: Console, collect: Callable[[], Rows], interval: float) -> Rows:
    """Redraw the view every ``interval`` seconds until Ctrl-C; returns the last rows."""
    rows = collect()
    previous: dict[str, Mapping[str, Any]] = {}
    taken = time.monotonic()
    elapsed = 0.0
    with Live(Group(live_table(rows, previous, elapsed)), console=console, auto_refresh=False) as live:
        try:
            while True:
                time.sleep(interval)  # a refresh period, not a wait for a condition
                previous = {r["poller"]: r for r in rows}
                rows = collect()
                now = time.monotonic()
                elapsed, taken = now - taken, now
                live.update(Group(live_table(rows, previous, elapsed)), refresh=True)
        except KeyboardInterrupt:
            pass
    return rows
