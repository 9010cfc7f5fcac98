"""The live view (rich) and the final summary, as text.

On a terminal the view redraws about twice a second; elsewhere (CI, ``--json``, a pipe) each
step of the story is printed once to stderr instead, so logs stay readable.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from dbfanout.demo.probe import Snapshot
from dbfanout.ops.status import snapshot_line

__all__ = ["LiveView", "render_summary"]


def _panel(s: Snapshot, deletes: str = "soft deletes") -> Panel:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_column(style="dim")
    w = s.written
    table.add_row("rows written", f"{s.version:,}", f"{w['insert']:,} inserts, {w['update']:,} updates, "
                  f"{w['delete']:,} {deletes}")  # fmt: skip
    table.add_row("enqueued", f"{s.enqueued:,}", "changes up to the poller's committed checkpoint")
    table.add_row("lag", f"{s.lag_changes:,}", f"changes not yet enqueued ({s.lag_seconds:.1f} s behind)")
    table.add_row("in the queue", f"{s.queue_messages:,}", "messages waiting or being handled")
    table.add_row("handled", f"{s.handled:,}", f"events ({s.distinct:,} distinct)")
    table.add_row("duplicates absorbed", f"{s.duplicates:,}", "redelivered events skipped by processed-events")
    dlq_style = "bold red" if s.dlq else "green"
    table.add_row("dead-letter queue", Text(f"{s.dlq:,}", style=dlq_style), "poison messages in quarantine")
    if s.audit_events is not None:
        again = s.audit_duplicates or 0
        table.add_row(
            "audit subscription",
            Text(f"{s.audit_events:,}", style="bold red" if again else "green"),
            f"events it was given; {again:,} more than once (the replica's retries never reach it)",
        )
    if s.snapshot is not None:
        table.add_row("snapshot", f"{s.snapshot['rows']:,}", snapshot_line(s.snapshot).removeprefix("snapshot "))
    story = Text("\n".join(s.log[-6:]) or "starting...", style="cyan")
    title = f"dbfanout demo · {s.phase} · {s.elapsed:5.1f} s"
    return Panel(Group(table, Text(""), story), title=title, border_style="blue")


class LiveView:
    """Shows snapshots: a redrawn panel on a terminal, else the story lines once each."""

    def __init__(self, console: Console, *, live: bool, hard_deletes: bool = False) -> None:
        self._console = console
        self._deletes = "hard deletes" if hard_deletes else "soft deletes"
        self._live = Live(console=console, refresh_per_second=4, transient=False) if live else None
        self._printed = 0

    def __enter__(self) -> LiveView:
        if self._live is not None:
            self._live.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._live is not None:
            self._live.__exit__(exc_type, exc, tb)

    def show(self, snapshot: Snapshot) -> None:
        if self._live is not None:
            self._live.update(_panel(snapshot, self._deletes))
            return
        for line in snapshot.log[self._printed :]:
            self._console.print(f"[{snapshot.elapsed:5.1f} s] {line}", highlight=False, markup=False, soft_wrap=True)
        self._printed = len(snapshot.log)


def render_summary(summary: dict[str, Any], console: Console) -> None:
    """The end-of-run verdict, for people."""
    check = summary["check"]
    ok = check["exact_match"]
    table = Table(show_header=False, box=None, padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    w = summary["written"]
    soft = summary["source"] == "keyset"  # the other sources hard-delete: no row is left to compare
    table.add_row("written", f"{w['total']:,} changes: {w['insert']:,} inserts, {w['update']:,} updates, "
                  f"{w['delete']:,} {'soft' if soft else 'hard'} deletes")  # fmt: skip
    table.add_row("source", f"{check['source_rows']:,} rows: {check['live_rows']:,} live, "
                  f"{check['deleted_rows']:,} soft-deleted" if soft else f"{check['source_rows']:,} rows")  # fmt: skip
    table.add_row("target", f"{check['target_rows']:,} rows; {check['deletes_applied']:,} deletes applied as deletes")
    p = summary["pipeline"]
    table.add_row("handled", f"{p['handled_events']:,} events, {p['distinct_events']:,} distinct, "
                  f"{p['duplicates_absorbed']:,} duplicates absorbed")  # fmt: skip
    d = summary["dlq"]
    table.add_row("poison", f"row {d['poison_id']}: dead-lettered {d['dead_lettered']}, replayed {d['replayed']}, "
                  f"left in DLQ {d['left']}")  # fmt: skip
    audit = p.get("audit")
    if audit is not None:
        table.add_row("audit", f"{audit['events']:,} events given to the audit subscription, "
                      f"{audit['given_more_than_once']:,} more than once")  # fmt: skip
    table.add_row("drained", f"in {summary['drain_seconds']:.1f} s")
    if not ok:
        for kind, found in check["mismatches"].items():
            if found["count"]:
                table.add_row(f"[red]{kind}[/]", f"{found['count']} rows, e.g. ids {found['ids']}")
    for problem in summary["problems"]:
        table.add_row("[red]problem[/]", problem)
    if summary.get("app_dir"):
        table.add_row("kept", summary["app_dir"])
    verdict = "[bold green]EXACT MATCH[/]" if summary["ok"] else "[bold red]MISMATCH[/]"
    console.print(Panel(table, title=f"dbfanout demo summary · {verdict}", border_style="green" if ok else "red"))
