"""How the ``dlq`` commands show what they found and did (tables and one-line reports)."""

from __future__ import annotations

from rich.table import Table

from dbfanout.commands.common import console, err_console, print_json
from dbfanout.dlq.poison import PEEK_MAX
from dbfanout.dlq.replay import ReplayReport
from dbfanout.ops.bus import MessageView

__all__ = ["print_peek", "print_poison_report", "print_report"]


def print_peek(
    views: list[MessageView], title: str, json_out: bool, *, poison: bool = False, filtered: bool = False
) -> None:
    """The peeked messages as a table; one line when there are none (``filtered``: none matched)."""
    if json_out:
        print_json([v.to_json() for v in views])
        return
    if not views:
        console.print(f"{title}: no message matches the filters" if filtered else f"{title} is empty")
        return
    table = Table(title=f"{title} ({len(views)} shown)")
    columns = ("seq", "message id", "enqueued", "deliveries", "reason", "description", "poller", "events", "pks")
    for column in (*columns, "failure"):
        table.add_column(column, overflow="fold")
    for v in views:
        poller, count, pks = v.envelope_summary()
        enqueued = v.enqueued_time.strftime("%Y-%m-%d %H:%M:%S") if v.enqueued_time else "-"
        table.add_row(
            "-" if poison else str(v.sequence_number),
            v.message_id,
            enqueued,
            str(v.delivery_count),
            f"{v.reason} (poison queue)" if poison else v.reason or "-",
            (v.description or "-")[:80],
            poller or "-",
            str(count) if count is not None else "-",
            ", ".join(str(pk) for pk in pks) or "-",
            _failure_text(v),
        )
    console.print(table)
    if poison and len(views) >= PEEK_MAX:
        err_console.print("[dim]storage queues peek at most 32 messages; `dlq export` lists them all[/]")


def _failure_text(view: MessageView) -> str:
    """The last failure, as a table cell: ``Type: message (delivery N, at T)``."""
    failure = view.failure
    if not failure:
        return "-"
    text = str(failure.get("error") or failure.get("error_type") or "?")
    return f"{text[:160]} (delivery {failure.get('delivery_count')}, {str(failure.get('failed_at'))[:19]})"


def print_report(report: ReplayReport, json_out: bool) -> None:
    if json_out:
        print_json(report.to_json())
        return
    verb = "would replay" if report.dry_run else "replayed"
    count = len(report.replayed) if not report.dry_run else len(report.selected)
    console.print(
        f"{verb} {count} of {len(report.selected)} selected message(s) from {report.source} into {report.target}"
    )
    if report.dry_run:
        for row in report.replayed:
            console.print(f"  seq {row['sequence_number']}: {row['original_id']} -> {row['replay_id']}")
    for row in report.sent_not_completed:
        err_console.print(
            f"[yellow]seq {row['sequence_number']}: copy {row['replay_id']} sent but the original is still in the "
            f"DLQ ({row['error']}); re-run the replay (duplicate detection drops the repeat)[/]"
        )
    if report.not_found:
        err_console.print(
            f"[yellow]{len(report.not_found)} selected message(s) were not received (gone, or locked by another "
            f"receiver): {report.not_found[:20]}; re-run once their locks lapse[/]"
        )
    if report.error:
        err_console.print(f"[bold red]error:[/] {report.error}; the unsent originals are still in the DLQ")


def print_poison_report(report: ReplayReport, target: str, json_out: bool) -> None:
    """A storage-queue replay's outcome, with each copy's provenance (its messages carry no properties)."""
    if json_out:
        print_json(report.to_json())
        return
    count = len(report.selected) if report.dry_run else len(report.replayed)
    verb = "would replay" if report.dry_run else "replayed"
    console.print(f"{verb} {count} of {len(report.selected)} selected message(s) from {report.source} into {target}")
    if report.dry_run:
        console.print("[dim](a dry run peeks: storage queues show at most 32 messages)[/]")
    for row in report.replayed:  # provenance: storage queue messages carry no properties
        console.print(f"  {row['original_id']} -> {row['replay_id']}{' (repaired body)' if row['repaired'] else ''}")
    for row in report.sent_not_completed:
        err_console.print(
            f"[yellow]{row['original_id']}: copy {row['replay_id']} put but the original is still in the poison "
            f"queue ({row['error']}); a re-run puts another copy (handlers dedupe by event id)[/]"
        )
    if report.not_found:
        err_console.print(f"[yellow]not found in {report.source}: {report.not_found[:20]}[/]")
    if report.error:
        err_console.print(f"[bold red]error:[/] {report.error}; the unsent originals are still in the poison queue")
