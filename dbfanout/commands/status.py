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
    reporting_errors,
)
from dbfanout.ops.bus import bus_client
from dbfanout.ops.status import (
    poller_status,
    queue_depth,
    sink_refusing_line,
    snapshot_line,
    storage_queue_depth,
    topic_depth,
    truncate_line,
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
    if row.get("sink_refusing"):
        return False  # the broker refuses its sends: nothing is delivered meanwhile
    return not any(k in row for k in ("state_error", "source_error")) and row.get("fingerprint_match", True)


def _text(value: Any) -> str:
    if value is None:
        return "-"
    return value if isinstance(value, str) else dumps(value).decode()


def _table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title=f"dbfanout status ({dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M:%S} UTC)")
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
        if "snapshot" in row:
            lag += "\n" + escape(snapshot_line(row["snapshot"]))
        if "snapshot_hint" in row:
            lag += "\n[yellow]" + escape(row["snapshot_hint"]) + "[/]"
        if "last_truncate" in row:
            lag += "\n[yellow]" + escape(truncate_line(row["last_truncate"])) + "[/]"
        active = depth.get("active_unknown") or f"{_text(depth.get('active'))} active"
        queue = f"{depth['queue']}: {active}, {_text(depth.get('dead_lettered'))} DLQ"
        if "topic" in row:
            queue = _subscription_lines(row)
        problems = "; ".join(str(row[k]) for k in ("state", "state_error", "source_error") if k in row)
        problems += f"; {depth['error']}" if "error" in depth else ""
        if row.get("sink_refusing"):
            problems += ("; " if problems else "") + f"[red]{sink_refusing_line(row['sink_refusing'])}[/]"
        for truncate in row.get("truncates") or ():  # read from the binlog, not delivered (docs/operations.md)
            line = f"TRUNCATE of {truncate.get('table')} at {truncate.get('at')} not delivered"
            problems += ("; " if problems else "") + f"[yellow]{escape(line)}[/]"
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
    config: ConfigOption = None,
) -> None:
    """Show where each poller stands (a topic poller: each subscription's active and dead-letter count).
    Exit 1 when a poller's state, source or fingerprint is not healthy, or its broker refuses sends."""
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
            console.print(_table(rows))
        if not watch:
            break
        try:
            time.sleep(interval)  # a refresh period, not a wait for a condition
        except KeyboardInterrupt:
            break
    if not all(_healthy(r) for r in rows):
        raise typer.Exit(EXIT_CHECK_FAILED)
