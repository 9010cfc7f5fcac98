"""``dbfanout status [POLLER] [--json] [--watch]``: checkpoint, lease, fingerprint, lag, queue depth.

A topic poller's row also has ``topic`` and ``subscriptions``: ``[{"name", "active", "dead_letter"}]``,
one per configured subscription; its ``queue_depth`` is their sum.
"""

from __future__ import annotations

import datetime as dt
import time
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from dbfanout.commands.common import (
    EXIT_CHECK_FAILED,
    ConfigOption,
    JsonOption,
    console,
    load,
    print_json,
    print_table,
    reporting_errors,
)
from dbfanout.ops.bus import bus_client
from dbfanout.ops.status import (
    poller_status,
    queue_depth,
    row_problems,
    storage_queue_depth,
    topic_depth,
)
from shared.codec import dumps
from shared.config import Config


def register(app: typer.Typer) -> None:
    """Mount ``status`` on the root command."""
    app.command("status")(status_command)


def collect(config: Config, only: str | None) -> list[dict[str, Any]]:
    """Status of the named poller, or of every configured one, with its queue's (or subscriptions') depth."""
    names = [only] if only else sorted(config.pollers)
    now = dt.datetime.now(dt.UTC)
    rows = [poller_status(config, name, now) for name in names]
    depths: dict[str, dict[str, Any]] = {}
    for row in rows:  # storage-queue pollers: their queue and its poison queue
        if config.pollers[row["poller"]].transport == "storage-queue":
            queue = row["queue"]
            row["queue_depth"] = depths.setdefault(queue, storage_queue_depth(config, queue))
    bus_rows = [row for row in rows if "queue_depth" not in row]
    if not bus_rows:
        return rows
    try:
        with bus_client(config) as client:
            for row in bus_rows:
                queue = row["queue"]
                if "topic" in row:
                    row.update(topic_depth(config, client, config.pollers[row["poller"]]))
                    continue
                if queue not in depths:
                    depths[queue] = queue_depth(config, client, queue)
                row["queue_depth"] = depths[queue]
    except Exception as exc:  # no Service Bus setting, or unreachable: show the rest
        for row in bus_rows:
            row["queue_depth"] = {"queue": row["queue"], "error": f"{type(exc).__name__}: {exc}"}
            if "topic" in row:
                row.setdefault("subscriptions", [])
    return rows


def _healthy(row: dict[str, Any]) -> bool:
    return not row_problems(row)[0]


def _text(value: Any) -> str:
    if value is None:
        return "-"
    return value if isinstance(value, str) else dumps(value).decode()


def _wide_table(rows: list[dict[str, Any]]) -> Table:
    """``--wide``: every detail, cells over several lines (lease owner, batch id, each subscription)."""
    table = Table(title=_title())
    for column in ("poller", "checkpoint", "last batch / updated", "lease", "fingerprint", "lag", "queue", "problems"):
        table.add_column(column, overflow="fold")
    for row in rows:
        cp, lease, src, depth = (
            row.get("checkpoint") or {},
            row.get("lease") or {},
            row.get("source") or {},
            row["queue_depth"],
        )
        cursor = cp.get("cursor")
        where = (
            "(beginning)"
            if "checkpoint" in row and cursor is None
            else _text(cursor and [cursor["value"], cursor["tiebreaker"]])
        )
        lease_text = f"{lease.get('state', '-')} {lease.get('owner') or ''} token {lease.get('fencing_token', '-')}"
        if lease.get("held_since"):
            lease_text += f", held since {lease['held_since'][:19]}"
        if lease.get("expires_in_seconds") is not None:
            lease_text += f", expires in {lease['expires_in_seconds']}s"
        fp = row.get("fingerprint_match")
        match = "-" if fp is None else "[green]match[/]" if fp else "[red]MISMATCH[/]"
        lag = f"{_text(src.get('lag'))} ({_text(src.get('pending_rows'))} pending)" if src else "-"
        active = depth.get("active_unknown") or f"{_text(depth.get('active'))} active"
        queue = f"{depth['queue']}: {active}, {_text(depth.get('dead_lettered'))} DLQ"
        if "topic" in row:
            queue = _subscription_lines(row)
        found, notes = row_problems(row)
        problems = "; ".join([*(f"[red]{escape(p)}[/]" for p in found), *map(escape, notes)])
        table.add_row(
            row["poller"],
            where,
            f"{_text(cp.get('last_batch_id'))}\n{_text(cp.get('updated_at'))}",
            lease_text,
            match,
            lag,
            queue,
            problems or "-",
        )
    return table


def _title() -> str:
    return f"dbfanout status ({dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M:%S} UTC)"


COMPACT_COLUMNS = ("poller", "lease", "lag", "active", "DLQ", "health")


def _compact_table(rows: list[dict[str, Any]]) -> Table:
    """The default: one line per poller that fits 80 columns (a long value ends in an ellipsis; the
    checkpoint itself is in --wide and --json, its distance from the source is the lag); what is
    wrong is listed below the table, one line each."""
    table = Table(title=_title())
    for column in COMPACT_COLUMNS:
        table.add_column(column, no_wrap=True, overflow="ellipsis", justify="right" if column == "DLQ" else "left")
    for row in rows:
        depth, src = row["queue_depth"], row.get("source") or {}
        found, notes = row_problems(row)
        health = "[green]ok[/]" if not notes else "[yellow]see note[/]"
        if found:
            health = f"[red]{len(found)} problem{'s' if len(found) > 1 else ''}[/]"
        table.add_row(
            row["poller"],
            (row.get("lease") or {}).get("state", "-"),
            _short_lag(src),
            _text(depth.get("active")) if "active_unknown" not in depth else "n/a",
            _text(depth.get("dead_lettered")),
            health,
        )
    return table


def _short_lag(src: dict[str, Any]) -> str:
    if not src:
        return "-"
    if "lag_bytes" in src:  # pg_logical: the WAL after the slot's confirmed position
        return f"{src['lag_bytes'] / 1024 / 1024:.1f} MiB of WAL"
    pending = src.get("pending_rows")
    return _text(src.get("lag")) + (f", {pending} pending" if pending is not None else "")


def _print_findings(rows: list[dict[str, Any]]) -> None:
    """Below the compact table: each problem and note, one poller's per line (prose may wrap)."""
    lines = []
    for row in rows:
        found, notes = row_problems(row)
        lines += [f"  [red]problem[/] {escape(row['poller'])}: {escape(p)}" for p in found]
        lines += [f"  [dim]note[/] {escape(row['poller'])}: {escape(n)}" for n in notes]
    if lines:
        console.print("\n".join(lines))


def _print_status(rows: list[dict[str, Any]], wide: bool) -> None:
    if wide:
        print_table(_wide_table(rows), "no pollers configured")
        return
    print_table(_compact_table(rows), "no pollers configured")
    _print_findings(rows)


def _subscription_lines(row: dict[str, Any]) -> str:
    """A topic poller's queue cell: the topic, then one line per subscription."""
    lines = [f"{row['topic']} (topic)"]
    for sub in row.get("subscriptions", []):
        active = "active n/a (sessions)" if sub.get("active_unknown") else f"{_text(sub.get('active'))} active"
        lines.append(f"  {sub['name']}: {active}, {_text(sub.get('dead_letter'))} DLQ")
    return "\n".join(lines)


def status_command(
    poller: Annotated[str | None, typer.Argument(help="One poller (default: all)")] = None,
    json_out: JsonOption = False,
    watch: Annotated[bool, typer.Option("--watch", "-w", help="Refresh until interrupted")] = False,
    interval: Annotated[float, typer.Option("--interval", min=1.0, help="Seconds between refreshes")] = 5.0,
    wide: Annotated[
        bool,
        typer.Option("--wide", help="Every detail: lease owner, last batch, each subscription (needs a wide terminal)"),
    ] = False,
    config: ConfigOption = None,
) -> None:
    """Show where each poller stands, one line each, and below it what is wrong (--wide: every detail).
    Exit 1 when a poller's state, source or fingerprint is not healthy, its broker refuses sends, or
    a message waits in its dead-letter (or poison) queue."""
    with reporting_errors():
        cfg = load(config)
        if poller:
            cfg.poller(poller)
    if watch and not json_out and console.is_terminal:  # a live view, redrawn in place
        from dbfanout.commands.status_watch import watch_live

        rows = watch_live(console, lambda: collect(cfg, poller), interval)
        if not all(_healthy(r) for r in rows):
            raise typer.Exit(EXIT_CHECK_FAILED)
        return
    while True:
        rows = collect(cfg, poller)
        if json_out:
            print_json(rows if not watch else {"time": dt.datetime.now(dt.UTC).isoformat(), "pollers": rows})
        else:
            if watch:
                console.clear()
            _print_status(rows, wide)
        if not watch:
            break
        try:
            time.sleep(interval)  # a refresh period, not a wait for a condition
        except KeyboardInterrupt:
            break
    if not all(_healthy(r) for r in rows):
        raise typer.Exit(EXIT_CHECK_FAILED)
