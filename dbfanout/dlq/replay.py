"""Dead-letter replay that cannot lose a message (DESIGN §5, STYLE R7).

For each selected message of ``QUEUE/$DeadLetterQueue``, received in peek-lock:

1. send a copy to the target queue and wait until the broker accepted it;
2. only then complete the dead-lettered original.

A crash between 1 and 2 leaves both the copy and the original (the original's lock lapses and it
is back in the DLQ); nothing can vanish. Handlers absorb the duplicate through the event ids.

The copy gets a **new message id**, so duplicate detection does not drop it as a repeat of the
original: ``{root}.replay-{n}-{body hash}`` where ``root`` is the first message id in the replay
chain and ``n`` the replay count. The id is deterministic on purpose: re-running a replay that
was killed after step 1 sends the same id again, which duplicate detection drops inside its
window, while a repaired body (``--from-file``) or a later generation gets a fresh id.
Provenance travels in application properties (``dbfanout-replay-*``).

A subscription's DLQ (``TOPIC/SUB``) is replayed into the TOPIC, each copy addressed to SUB alone
by the application property ``dbfanout-to`` (:data:`shared.topology.PROP_TARGET`): SUB's rule lets
it in, every other subscription's rule keeps it out. Its id also depends on SUB, because the topic's
duplicate detection is shared by all subscriptions: two subscriptions replaying the same dead
batch must not produce the same copy id, or the second copy would be dropped.
"""

from __future__ import annotations

import datetime as dt
import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from azure.servicebus import (
    ServiceBusClient,
    ServiceBusMessage,
    ServiceBusReceivedMessage,
    ServiceBusReceiver,
    ServiceBusSender,
    ServiceBusSubQueue,
)
from azure.servicebus.exceptions import ServiceBusError

from dbfanout.dlq.selection import Progress, Selection, each_selected, release
from dbfanout.ops.bus import DLQ_DESCRIPTION, DLQ_REASON, Entity, MessageView, as_entity, peek_receiver
from shared.errors import EnqueueError
from shared.logs import get_logger, ids
from shared.servicebus import bus_errors
from shared.topology import PROP_TARGET

__all__ = [
    "PROP_REPLAY_COUNT",
    "PROP_REPLAY_OF",
    "PROP_REPLAY_ORIGINAL_SEQUENCE",
    "PROP_REPLAY_REASON",
    "PROP_REPLAY_TIME",
    "ReplayReport",
    "replay",
    "replay_copy",
    "replay_message_id",
]

log = get_logger("cli.replay")

PROP_REPLAY_OF = "dbfanout-replay-of"
PROP_REPLAY_ORIGINAL_SEQUENCE = "dbfanout-replay-original-sequence"
PROP_REPLAY_REASON = "dbfanout-replay-reason"
PROP_REPLAY_TIME = "dbfanout-replay-time"
PROP_REPLAY_COUNT = "dbfanout-replay-count"

MAX_MESSAGE_ID = 128


@dataclass
class ReplayReport:
    """What a replay did, for either transport (ids: sequence numbers, or storage message ids)."""

    source: str
    target: str
    selected: list[int | str] = field(default_factory=list)
    replayed: list[dict[str, Any]] = field(default_factory=list)
    sent_not_completed: list[dict[str, Any]] = field(default_factory=list)
    not_found: list[int | str] = field(default_factory=list)
    error: str | None = None
    dry_run: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None and not self.sent_not_completed and not self.not_found

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "target": self.target,
            "dry_run": self.dry_run,
            "selected": len(self.selected),
            "replayed": len(self.replayed),
            "sent_not_completed": self.sent_not_completed,
            "not_found": self.not_found,
            "error": self.error,
            "messages": self.replayed,
        }


def replay_message_id(root_id: str, count: int, body: bytes, subscription: str | None = None) -> str:
    """The copy's id: new per replay generation, per body and per subscription, stable across a
    re-run (see module doc). Queue replays (``subscription`` None) keep their ids."""
    salt = b"" if subscription is None else subscription.encode() + b"\0"
    digest = hashlib.sha256(salt + body).hexdigest()[:8]
    candidate = f"{root_id}.replay-{count}-{digest}"
    if len(candidate) <= MAX_MESSAGE_ID:
        return candidate
    return f"replay-{count}-{hashlib.sha256(root_id.encode()).hexdigest()[:40]}-{digest}"


def replay_copy(
    view: MessageView, now: dt.datetime, *, body: bytes | None = None, subscription: str | None = None
) -> ServiceBusMessage:
    """The message to send for ``view``: same body, subject, content type and properties; new id.

    ``subscription``: the copy goes to a topic, addressed to that subscription only.
    """
    props = {k: v for k, v in view.application_properties.items() if k not in (DLQ_REASON, DLQ_DESCRIPTION)}
    count = int(props.get(PROP_REPLAY_COUNT, 0) or 0) + 1
    root = str(props.get(PROP_REPLAY_OF) or view.message_id)
    payload = view.body if body is None else body
    props.update(
        {
            PROP_REPLAY_OF: root,
            PROP_REPLAY_ORIGINAL_SEQUENCE: view.sequence_number,
            PROP_REPLAY_REASON: view.reason or "",
            PROP_REPLAY_TIME: now.isoformat(),
            PROP_REPLAY_COUNT: count,
        }
    )
    if subscription is not None:
        props[PROP_TARGET] = subscription  # only this subscription's rule lets the copy in
    return ServiceBusMessage(
        payload,
        message_id=replay_message_id(root, count, payload, subscription),
        subject=view.subject,
        content_type=view.content_type,
        correlation_id=view.correlation_id,
        session_id=view.session_id,
        application_properties=props,  # type: ignore[arg-type]
    )


def replay(
    client: ServiceBusClient,
    queue: str | Entity,
    selection: Selection,
    *,
    target: str | None = None,
    dry_run: bool = False,
    bodies: Mapping[int, bytes] | None = None,
    progress: Progress | None = None,
    clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC),
) -> ReplayReport:
    """Replay the selected messages of ``queue``'s DLQ into ``target`` (default: ``queue``).

    A subscription (``Entity(topic, sub)``) is replayed into its topic, addressed to ``sub`` only;
    ``target`` must then be None (a ValueError otherwise).

    ``bodies`` (``--from-file``) replaces the body of the listed sequence numbers and limits the
    replay to them. The selection is fixed by a peek first, so copies that fail again and land in
    the same DLQ during the run are not replayed a second time.
    """
    source = as_entity(queue)
    if source.is_subscription and target is not None:
        raise ValueError(f"{source.label} replays into its own subscription only; no other target")
    into = source if target is None else Entity(target)
    report = ReplayReport(source.label, into.label, dry_run=dry_run)
    files = bodies or {}
    sub = source.subscription

    def copy_of(view: MessageView) -> ServiceBusMessage:
        return replay_copy(view, clock(), body=files.get(view.sequence_number), subscription=sub)

    with source.receiver(client, sub_queue=ServiceBusSubQueue.DEAD_LETTER) as receiver:
        views = [
            v
            for v in peek_receiver(receiver)
            if selection.matches(v) and (bodies is None or v.sequence_number in files)
        ]
        report.selected = [v.sequence_number for v in views]
        if dry_run or not views:
            report.replayed = [_row(v, copy_of(v)) for v in views]
            return report
        pending = {v.sequence_number for v in views}
        with into.sender(client) as sender:

            def act(message: ServiceBusReceivedMessage) -> bool:
                _replay_one(receiver, sender, message, report, copy_of)
                return report.error is None

            each_selected(receiver, pending, act, progress)
    report.not_found = sorted(pending)
    return report


def _replay_one(
    receiver: ServiceBusReceiver,
    sender: ServiceBusSender,
    message: ServiceBusReceivedMessage,
    report: ReplayReport,
    copy_of: Callable[[MessageView], ServiceBusMessage],
) -> None:
    view = MessageView.of(message)
    copy = copy_of(view)
    row = _row(view, copy)
    try:
        with bus_errors("replay send", report.target):
            sender.send_messages(copy)  # 1. the copy is durable in the target queue (or topic) ...
    except EnqueueError as exc:  # nothing was completed: the original stays in the DLQ
        report.error = f"sending the copy of sequence {view.sequence_number} failed: {exc}"
        release(receiver, [message])
        return
    try:
        receiver.complete_message(message)  # 2. ... only then does the original leave the DLQ
    except (ServiceBusError, OSError) as exc:
        # The copy went out; the original stays (its lock lapsed). A re-run sends the same id
        # again, which duplicate detection drops inside its window; handlers dedupe by event id.
        row["error"] = f"{type(exc).__name__}: {exc}"
        report.sent_not_completed.append(row)
        log.warning("copy sent but the original was not completed", extra=ids(**_log_ids(row)))
        return
    report.replayed.append(row)
    log.info("replayed", extra=ids(**_log_ids(row)))


def _row(view: MessageView, copy: ServiceBusMessage) -> dict[str, Any]:
    return {
        "sequence_number": view.sequence_number,
        "original_id": view.message_id,
        "replay_id": copy.message_id,
        "reason": view.reason,
    }


def _log_ids(row: Mapping[str, Any]) -> dict[str, Any]:
    return {"sequence_number": row["sequence_number"], "message_id": row["original_id"], "replay_id": row["replay_id"]}
