"""``dbfanout dlq peek|export|replay|purge ENTITY``: the poison quarantine, inspected and emptied safely.

ENTITY is a Service Bus queue (its ``$DeadLetterQueue``), ``TOPIC/SUBSCRIPTION`` of a topic poller
(that subscription's ``$DeadLetterQueue``; a configured queue of that name wins) or, for a poller
with ``transport = "storage-queue"``, its queue or ``<queue>-poison`` (see :mod:`dbfanout.dlq.poison`).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer

from dbfanout.commands.common import (
    EXIT_CHECK_FAILED,
    EXIT_USAGE,
    ConfigOption,
    DryRunOption,
    JsonOption,
    YesOption,
    confirm_or_refuse,
    console,
    fail,
    load,
    mount_group,
    print_json,
    progress_bar,
    reporting_errors,
)
from dbfanout.dlq import deadletter as ops
from dbfanout.dlq import poison as poison_ops
from dbfanout.dlq.explain import explaining
from dbfanout.dlq.render import print_peek, print_poison_report, print_report
from dbfanout.dlq.replay import replay
from dbfanout.dlq.selection import Selection
from dbfanout.dlq.timeparse import parse_duration, parse_since
from dbfanout.ops.bus import Entity, MessageView, bus_client, resolve_entity

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
            print_peek(views, poison.name, json_out, poison=True, filtered=not selection.empty)
            return
    entity = _entity(config, queue)
    with _client(config) as client, reporting_errors(), _explaining(config, entity.label) as explain:
        views = ops.peek(client, entity, selection, limit, explain)
    print_peek(views, entity.dlq_label, json_out, filtered=not selection.empty)


@contextmanager
def _explaining(
    config_path: Path | None, entity: str, *, storage_queue: bool = False
) -> Iterator[Callable[[MessageView], MessageView]]:
    """Each view with the failure record its last delivery left (why it failed), when there is one."""
    with reporting_errors():
        config = load(config_path)
    with explaining(config, entity, stale_check=not storage_queue) as explain:
        yield explain


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
    print_report(report, json_out)
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
    print_poison_report(report, target, json_out)
    if not report.ok:
        raise typer.Exit(EXIT_CHECK_FAILED)


def _read_file(path: Path) -> dict[int, bytes]:
    try:
        return ops.read_export(path)
    except (OSError, ValueError) as exc:
        fail(f"--from-file: {exc}", EXIT_USAGE, "pass a file written by `dbfanout dlq export`")


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
