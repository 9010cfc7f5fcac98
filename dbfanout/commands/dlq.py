"""``dbfanout dlq peek|export|replay|purge ENTITY``: the poison quarantine, inspected and emptied safely.

ENTITY is a Service Bus queue (its ``$DeadLetterQueue``), ``TOPIC/SUBSCRIPTION`` of a topic poller
(that subscription's ``$DeadLetterQueue``; a configured queue of that name wins) or, for a poller
with ``transport = "storage-queue"``, its queue or ``<queue>-poison`` (see :mod:`dbfanout.ops.poison`).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from dbfanout.commands.common import (
    EXIT_CHECK_FAILED,
    EXIT_USAGE,
    ConfigOption,
    DryRunOption,
    JsonOption,
    YesOption,
    confirm_or_refuse,
    console,
    err_console,
    fail,
    load,
    mount_group,
    print_json,
    progress_bar,
    reporting_errors,
)
from dbfanout.ops import dlq as ops
from dbfanout.ops import poison as poison_ops
from dbfanout.ops.bus import Entity, MessageView, bus_client, resolve_entity
from dbfanout.ops.failures import explaining
from dbfanout.ops.replay import ReplayReport, Selection, replay
from dbfanout.ops.timeparse import parse_duration, parse_since

QueueArg = Annotated[
    str,
    typer.Argument(
        metavar="entity",
        help="The queue whose dead-letter queue to use (QUEUE/$DeadLetterQueue); TOPIC/SUBSCRIPTION for one "
        "subscription of a topic poller (its own dead-letter queue); or a storage-queue poller's queue (its "
        "QUEUE-poison queue)",
    ),
]
HoldOption = Annotated[
    int,
    typer.Option(
        "--hold",
        min=1,
        hidden=True,
        help="Storage queues: seconds a received poison message stays hidden while the command works",
    ),
]
ReasonOption = Annotated[str | None, typer.Option("--reason", help="Only messages with this DeadLetterReason")]
SinceOption = Annotated[
    str | None, typer.Option("--since", help="Only messages enqueued since T (ISO time, or an age: 2h, 7d)")
]


def register(app: typer.Typer) -> None:
    """Mount ``dlq`` on the root command."""
    mount_group(
        app,
        "dlq",
        "Inspect, export, replay and purge the dead-letter queue of a queue or of one topic subscription "
        "(TOPIC/SUBSCRIPTION).",
        {"peek": peek_command, "export": export_command, "replay": replay_command, "purge": purge_command},
    )


def _since(text: str | None) -> dt.datetime | None:
    if text is None:
        return None
    try:
        return parse_since(text)
    except ValueError as exc:
        fail(f"--since: {exc}", EXIT_USAGE)


def _entity(config_path: Path | None, name: str) -> Entity:
    """The queue or ``TOPIC/SUBSCRIPTION`` the operator named (checked against the config)."""
    with reporting_errors():
        return resolve_entity(load(config_path), name)


@contextmanager
def _client(config_path: Path | None) -> Iterator[Any]:
    with reporting_errors():
        config = load(config_path)
        with bus_client(config) as client:
            yield client


@contextmanager
def _poison(config_path: Path | None, queue: str, hold: int) -> Iterator[poison_ops.PoisonQueue | None]:
    """The storage-queue poison queue when QUEUE belongs to a storage-queue poller; else None (Service Bus)."""
    with reporting_errors():
        config = load(config_path)
        main = poison_ops.storage_queue_of(config, queue)
        if main is None:
            yield None
            return
        with poison_ops.opened(config, main, hold_seconds=hold) as poison:
            yield poison


def peek_command(
    queue: QueueArg,
    reason: ReasonOption = None,
    since: SinceOption = None,
    limit: Annotated[int, typer.Option("--limit", "-n", min=1, help="At most N messages")] = 50,
    json_out: JsonOption = False,
    config: ConfigOption = None,
) -> None:
    """List dead-lettered (or poison-queue) messages of a queue or TOPIC/SUBSCRIPTION (nothing is locked or changed)."""
    selection = Selection(reason=reason, since=_since(since))
    with _poison(config, queue, poison_ops.DEFAULT_HOLD_SECONDS) as poison:
        if poison is not None:
            with reporting_errors(), _explaining(config, poison.queue, storage_queue=True) as explain:
                views = poison.peek(selection, limit, explain=explain)
            _print_peek(views, poison.name, json_out, poison=True)
            return
    entity = _entity(config, queue)
    with _client(config) as client, reporting_errors(), _explaining(config, entity.label) as explain:
        views = ops.peek(client, entity, selection, limit, explain)
    _print_peek(views, entity.dlq_label, json_out)


@contextmanager
def _explaining(
    config_path: Path | None, entity: str, *, storage_queue: bool = False
) -> Iterator[Callable[[MessageView], MessageView]]:
    """Each view with the failure record its last delivery left (why it failed), when there is one."""
    with reporting_errors():
        config = load(config_path)
    with explaining(config, entity, stale_check=not storage_queue) as explain:
        yield explain


def _print_peek(views: list[MessageView], title: str, json_out: bool, *, poison: bool = False) -> None:
    if json_out:
        print_json([v.to_json() for v in views])
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
    if poison and len(views) >= poison_ops.PEEK_MAX:
        err_console.print("[dim]storage queues peek at most 32 messages; `dlq export` lists them all[/]")


def _failure_text(view: MessageView) -> str:
    """The last failure, as a table cell: ``Type: message (delivery N, at T)``."""
    failure = view.failure
    if not failure:
        return "-"
    text = str(failure.get("error") or failure.get("error_type") or "?")
    return f"{text[:160]} (delivery {failure.get('delivery_count')}, {str(failure.get('failed_at'))[:19]})"


def export_command(
    queue: QueueArg,
    out: Annotated[Path, typer.Option("--out", "-o", help="JSONL file to write (one message per line)")],
    reason: ReasonOption = None,
    since: SinceOption = None,
    json_out: JsonOption = False,
    config: ConfigOption = None,
    hold: HoldOption = poison_ops.DEFAULT_HOLD_SECONDS,
) -> None:
    """Write dead-lettered messages of a queue or TOPIC/SUBSCRIPTION (bodies and properties) to a JSONL file."""
    selection = Selection(reason=reason, since=_since(since))
    with _poison(config, queue, hold) as poison:
        if poison is not None:
            with reporting_errors(), _explaining(config, poison.queue, storage_queue=True) as explain:
                count = poison.export(out, selection, explain)
            source = poison.name
    if poison is None:
        entity = _entity(config, queue)
        with _client(config) as client, reporting_errors(), _explaining(config, entity.label) as explain:
            count = ops.export(client, entity, out, selection, explain)
        source = entity.dlq_label
    if json_out:
        print_json({"queue": queue, "out": str(out), "exported": count})
    else:
        console.print(f"exported {count} message(s) from {source} to {out}")


def replay_command(
    queue: QueueArg,
    all_: Annotated[bool, typer.Option("--all", help="Replay every dead-lettered message")] = False,
    sequence: Annotated[
        list[int] | None, typer.Option("--sequence", "-s", help="Replay this sequence number (repeatable)")
    ] = None,
    reason: ReasonOption = None,
    since: SinceOption = None,
    to: Annotated[
        str | None,
        typer.Option(
            "--to",
            help="Send the copies to this queue (default: QUEUE itself). Not for TOPIC/SUBSCRIPTION: its copies "
            "always go to the topic, addressed to that subscription only",
        ),
    ] = None,
    from_file: Annotated[
        Path | None, typer.Option("--from-file", help="Replay with the bodies of an (edited) dlq export file")
    ] = None,
    message_id: Annotated[
        list[str] | None, typer.Option("--id", help="Storage queues: replay this message id (repeatable)")
    ] = None,
    dry_run: DryRunOption = False,
    yes: YesOption = False,
    json_out: JsonOption = False,
    config: ConfigOption = None,
    hold: HoldOption = poison_ops.DEFAULT_HOLD_SECONDS,
) -> None:
    """Send each selected message again (new message id), then remove it from the DLQ — in that order.

    TOPIC/SUBSCRIPTION: each copy is sent to TOPIC with the property dbfanout-to = SUBSCRIPTION, so
    only that subscription receives it; the topic's other subscriptions never see a replay.
    """
    with _poison(config, queue, hold) as poison:
        if poison is not None:
            if sequence:
                fail("--sequence: storage queue messages have no sequence numbers", EXIT_USAGE, "use --id ID")
            _replay_poison(
                poison, all_, frozenset(message_id or ()), reason, since, to, from_file, dry_run, yes, json_out
            )
            return
    if message_id:
        fail("--id is for storage-queue poison queues", EXIT_USAGE, "use --sequence N for a Service Bus DLQ")
    entity = _entity(config, queue)
    if entity.is_subscription and to is not None:
        fail(
            f"--to: the dead letters of {entity.label} are replayed into that subscription only (through "
            f"topic {entity.name}, addressed with dbfanout-to = {entity.subscription})",
            EXIT_USAGE,
            "drop --to; to send them anywhere else, `dlq export` them and send the bodies yourself",
        )
    bodies = _read_file(from_file) if from_file else None
    selection = Selection(
        everything=all_ or bodies is not None, sequences=frozenset(sequence or ()), reason=reason, since=_since(since)
    )
    if selection.empty:
        fail(
            "say which messages to replay",
            EXIT_USAGE,
            "use --all, --sequence N, --reason R, --since T or --from-file F",
        )
    target = to or entity.label
    if entity.is_subscription:
        target = f"topic {entity.name} for subscription {entity.subscription} only"
    if not dry_run:
        confirm_or_refuse(yes, f"Replay the selected messages of {entity.dlq_label} into {target}?")
    with _client(config) as client, reporting_errors(), progress_bar("replaying", enabled=not json_out) as advance:
        report = replay(client, entity, selection, target=to, dry_run=dry_run, bodies=bodies, progress=advance)
    _print_report(report, json_out)
    if not report.ok:
        raise typer.Exit(EXIT_CHECK_FAILED)


def _replay_poison(
    poison: poison_ops.PoisonQueue,
    all_: bool,
    wanted: frozenset[str],
    reason: str | None,
    since: str | None,
    to: str | None,
    from_file: Path | None,
    dry_run: bool,
    yes: bool,
    json_out: bool,
) -> None:
    """The storage-queue replay: put the copy into the main queue, then delete the poison original."""
    bodies = None
    if from_file is not None:
        try:
            bodies = poison_ops.read_export_by_id(from_file)
        except (OSError, ValueError) as exc:
            fail(f"--from-file: {exc}", EXIT_USAGE, "pass a file written by `dbfanout dlq export`")
    selection = Selection(everything=all_ or bodies is not None or bool(wanted), reason=reason, since=_since(since))
    if selection.empty:
        fail("say which messages to replay", EXIT_USAGE, "use --all, --id ID, --reason R, --since T or --from-file F")
    target = to or poison.queue
    if not dry_run:
        confirm_or_refuse(yes, f"Replay the selected messages of {poison.name} into {target}?")
    with reporting_errors(), progress_bar("replaying", enabled=not json_out) as advance:
        report = poison.replay(selection, target=to, ids_=wanted, bodies=bodies, dry_run=dry_run, progress=advance)
    if json_out:
        print_json(report.to_json())
    else:
        count = len(report.selected) if report.dry_run else len(report.replayed)
        verb = "would replay" if report.dry_run else "replayed"
        console.print(
            f"{verb} {count} of {len(report.selected)} selected message(s) from {report.source} into {target}"
        )
        if report.dry_run:
            console.print("[dim](a dry run peeks: storage queues show at most 32 messages)[/]")
        for row in report.replayed:  # provenance: storage queue messages carry no properties
            console.print(
                f"  {row['original_id']} -> {row['replay_id']}{' (repaired body)' if row['repaired'] else ''}"
            )
        for row in report.sent_not_completed:
            err_console.print(
                f"[yellow]{row['original_id']}: copy {row['replay_id']} put but the original is still in the poison "
                f"queue ({row['error']}); a re-run puts another copy (handlers dedupe by event id)[/]"
            )
        if report.not_found:
            err_console.print(f"[yellow]not found in {report.source}: {report.not_found[:20]}[/]")
        if report.error:
            err_console.print(f"[bold red]error:[/] {report.error}; the unsent originals are still in the poison queue")
    if not report.ok:
        raise typer.Exit(EXIT_CHECK_FAILED)


def _read_file(path: Path) -> dict[int, bytes]:
    try:
        return ops.read_export(path)
    except (OSError, ValueError) as exc:
        fail(f"--from-file: {exc}", EXIT_USAGE, "pass a file written by `dbfanout dlq export`")


def _print_report(report: ReplayReport, json_out: bool) -> None:
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


def purge_command(
    queue: QueueArg,
    older_than: Annotated[
        str | None, typer.Option("--older-than", help="Only messages enqueued more than D ago (e.g. 7d, 12h)")
    ] = None,
    dry_run: DryRunOption = False,
    yes: YesOption = False,
    json_out: JsonOption = False,
    config: ConfigOption = None,
    hold: HoldOption = poison_ops.DEFAULT_HOLD_SECONDS,
) -> None:
    """Delete dead-lettered messages of a queue or TOPIC/SUBSCRIPTION for good (export them first if needed)."""
    age = None
    if older_than is not None:
        try:
            age = parse_duration(older_than)
        except ValueError as exc:
            fail(f"--older-than: {exc}", EXIT_USAGE)
    what = f"older than {older_than}" if older_than else "ALL"
    entity = _entity(config, queue)  # a storage-queue poller's queue resolves to itself
    if not dry_run:
        confirm_or_refuse(yes, f"Delete {what} dead-lettered messages of {entity.label} for good?", always_refuse=True)
    source = entity.dlq_label
    with _poison(config, queue, hold) as poison:
        if poison is not None:
            source = poison.name
            with reporting_errors(), progress_bar("purging", enabled=not json_out) as advance:
                result = poison.purge(age, dry_run=dry_run, progress=advance)
    if poison is None:
        purge: Callable[..., dict[str, Any]] = ops.purge
        with _client(config) as client, reporting_errors(), progress_bar("purging", enabled=not json_out) as advance:
            result = purge(client, entity, age, dry_run=dry_run, progress=advance)
    if json_out:
        print_json(result)
    else:
        verb = "would purge" if dry_run else "purged"
        console.print(f"{verb} {result['selected'] if dry_run else result['purged']} message(s) from {source}")
    if result.get("not_found"):
        raise typer.Exit(EXIT_CHECK_FAILED)
