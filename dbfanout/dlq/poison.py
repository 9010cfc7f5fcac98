"""The storage-queue quarantine: ``<queue>-poison`` behind the same ``dlq`` commands as Service Bus.

Storage Queues differ from a dead-letter queue in ways that shape this module:

* **Peeking shows at most the first 32 messages** and nothing else can be read without
  receiving. ``peek`` and dry runs peek (nothing changes); ``export``, ``replay`` and ``purge``
  *scan*: they receive every message once, hidden for ``hold`` seconds, act on the selected
  ones and make the others visible again at the end. A killed scan changes nothing for good:
  hidden messages reappear when their hold runs out. Each scan adds one to a poison message's
  dequeue count (nothing consumes the poison queue, so the count means nothing there).
* **No properties, no sequence numbers, service-assigned ids.** A replayed copy keeps the body
  text unchanged (base64, as the trigger expects); its provenance (original id → new id) is in
  the report and the log. An export line is keyed by ``message_id``.
* **Replay is lossless**: the copy is put into the main queue and only after the service stored
  it is the poison original deleted. A crash in between leaves both; handlers dedupe by event id
  (Storage Queues have no duplicate detection).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from azure.core.exceptions import AzureError
from azure.storage.queue import QueueClient, QueueMessage, QueueServiceClient

from dbfanout.dlq.deadletter import purge_start, read_export_bodies
from dbfanout.dlq.replay import ReplayReport
from dbfanout.dlq.selection import Progress, Selection
from dbfanout.ops.bus import MessageView
from shared.codec import dumps
from shared.config import Config
from shared.logs import get_logger, ids
from shared.settings import storage_connection
from shared.storagequeue import (
    decode_queue_text,
    encode_queue_text,
    poison_queue_name,
    queue_errors,
    queue_service_client,
)

__all__ = [
    "POISON_REASON",
    "PoisonQueue",
    "read_export_by_id",
    "storage_queue_of",
]

log = get_logger("cli.poison")

POISON_REASON = "MaxDequeueCountExceeded"
POISON_DESCRIPTION = "moved to the poison queue after maxDequeueCount failed attempts"
PEEK_MAX = 32  # the service's limit for a peek (and for one receive)
DEFAULT_HOLD_SECONDS = 30


def storage_queue_of(config: Config, name: str) -> str | None:
    """The main queue when ``name`` is a storage-queue poller's queue (or its ``-poison`` queue), else None."""
    for queue, pollers in config.queues().items():
        if any(p.transport == "storage-queue" for p in pollers) and name in (queue, poison_queue_name(queue)):
            return queue
    return None


def _view(message: QueueMessage) -> MessageView:
    """A poison message as the operator sees a dead-lettered one (no sequence number, no properties)."""
    text = str(message.content)
    try:
        body = decode_queue_text(text)
    except (ValueError, TypeError):
        body = text.encode()  # a foreign producer's plain text: shown as it is
    return MessageView(
        sequence_number=0,
        message_id=str(message.id),
        enqueued_time=message.inserted_on,
        delivery_count=int(message.dequeue_count or 0),
        reason=POISON_REASON,
        description=POISON_DESCRIPTION,
        subject=None,
        content_type=None,
        correlation_id=None,
        session_id=None,
        application_properties={},
        body=body,
    )


def export_line(view: MessageView, queue: str) -> dict[str, Any]:
    """The Service Bus export shape, keyed by message id (there are no sequence numbers)."""
    doc = view.to_json()
    doc.update(sequence_number=None, transport="storage-queue", queue=queue)
    return doc


class PoisonQueue:
    """``<queue>-poison`` of one storage-queue poller: peek, export, replay, purge."""

    def __init__(self, service: QueueServiceClient, queue: str, *, hold_seconds: int = DEFAULT_HOLD_SECONDS) -> None:
        self.queue = queue
        self.name = poison_queue_name(queue)
        self._service = service
        self.client: QueueClient = service.get_queue_client(self.name)
        self.hold = max(1, hold_seconds)

    @classmethod
    def open(cls, config: Config, queue: str, *, hold_seconds: int = DEFAULT_HOLD_SECONDS) -> PoisonQueue:
        conn = storage_connection(config.settings, config.app.storage_queue_connection)
        return cls(queue_service_client(conn), queue, hold_seconds=hold_seconds)

    def close(self) -> None:
        self.client.close()
        self._service.close()

    # ---- reading -----------------------------------------------------------------------------
    def peek(
        self,
        selection: Selection,
        limit: int | None,
        ids_: frozenset[str] = frozenset(),
        explain: Callable[[MessageView], MessageView] = lambda v: v,
    ) -> list[MessageView]:
        """The first (at most 32) poison messages matching ``selection``; nothing is changed.
        ``explain`` adds each one's failure record (:mod:`dbfanout.dlq.explain`)."""
        with queue_errors("peek", self.name):
            messages = self.client.peek_messages(max_messages=PEEK_MAX)
        views = [v for v in map(_view, messages) if _matches(selection, ids_, v)]
        return [explain(v) for v in (views[:limit] if limit is not None else views)]

    def export(
        self, out: Path, selection: Selection, explain: Callable[[MessageView], MessageView] = lambda v: v
    ) -> int:
        """Every matching poison message as one JSON line (a scan); written to a temp file, then renamed."""
        tmp = out.with_name(out.name + ".partial")
        count = 0
        with tmp.open("wb") as fh:

            def write(_: QueueMessage, view: MessageView) -> bool:
                nonlocal count
                if _matches(selection, frozenset(), view):
                    fh.write(dumps(export_line(explain(view), self.name)) + b"\n")
                    count += 1
                return True  # keep it: an export changes nothing

            self._scan(write)
        tmp.replace(out)
        return count

    # ---- changing ----------------------------------------------------------------------------
    def replay(
        self,
        selection: Selection,
        *,
        target: str | None = None,
        ids_: frozenset[str] = frozenset(),
        bodies: Mapping[str, bytes] | None = None,
        dry_run: bool = False,
        progress: Progress | None = None,
    ) -> ReplayReport:
        """Put a copy of each selected message into ``target`` (default: the main queue), then delete it here."""
        target = target or self.queue
        report = ReplayReport(self.name, target, dry_run=dry_run)
        if target == self.name:
            report.error = "refusing to replay a poison queue into itself"
            return report
        wanted = ids_ | frozenset(bodies or ())
        started = dt.datetime.now(dt.UTC)
        if dry_run:
            report.selected = [v.message_id for v in self.peek(selection, None, wanted)]
            return report
        sender = self._service.get_queue_client(target)
        try:

            def act(message: QueueMessage, view: MessageView) -> bool:
                if _arrived_since(view, started) or not _matches(selection, wanted, view):
                    return True
                report.selected.append(view.message_id)
                kept = self._replay_one(sender, message, view, report, (bodies or {}).get(view.message_id))
                if progress is not None:
                    progress(len(report.selected), len(report.selected))
                return kept

            self._scan(act, stop=lambda: report.error is not None)
        finally:
            sender.close()
        report.not_found = sorted(wanted - set(report.selected))
        return report

    def _replay_one(
        self,
        sender: QueueClient,
        message: QueueMessage,
        view: MessageView,
        report: ReplayReport,
        body: bytes | None,
    ) -> bool:
        """Copy first, delete after. Returns True when the original is still here."""
        text = str(message.content) if body is None else encode_queue_text(body)  # unchanged unless repaired
        row: dict[str, Any] = {"original_id": view.message_id, "replay_id": None, "repaired": body is not None}
        try:
            with queue_errors("replay send", sender.queue_name):
                sent = sender.send_message(text)  # 1. the copy is stored in the target queue ...
        except Exception as exc:  # nothing was deleted: the original stays in the poison queue
            report.error = f"putting the copy of {view.message_id} failed: {exc}"
            return True
        row["replay_id"] = str(sent.id)
        try:
            self.client.delete_message(message)  # 2. ... only then does the original leave
        except AzureError as exc:
            # The hold ran out (stale pop receipt): the original is back. A re-run puts another
            # copy (no duplicate detection on Storage Queues); handlers dedupe by event id.
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
            report.sent_not_completed.append(row)
            log.warning("copy put but the original was not deleted", extra=ids(queue=self.name, **row))
            return True
        report.replayed.append(row)
        log.info("replayed", extra=ids(queue=self.name, target=sender.queue_name, **row))
        return False

    def purge(
        self,
        older_than: dt.timedelta | None,
        *,
        dry_run: bool = False,
        progress: Progress | None = None,
        now: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC),
    ) -> dict[str, Any]:
        """Delete poison messages, all or those inserted more than ``older_than`` ago."""
        old, result = purge_start(self.name, older_than, dry_run, now)
        if dry_run:
            result["selected"] = sum(1 for v in self.peek(Selection(), None) if old(v))
            result["note"] = "storage queues peek at most 32 messages"
            return result
        failed: list[str] = []

        started = now()

        def act(message: QueueMessage, view: MessageView) -> bool:
            if _arrived_since(view, started) or not old(view):
                return True
            result["selected"] += 1
            try:
                self.client.delete_message(message)
            except AzureError as exc:
                log.warning("purge: could not delete %s: %s", view.message_id, exc)
                failed.append(view.message_id)
                return True
            result["purged"] += 1
            if progress is not None:
                progress(result["purged"], result["selected"])
            return False

        self._scan(act)
        result["not_found"] = failed
        return result

    # ---- the scan ----------------------------------------------------------------------------
    def _scan(self, act: Callable[[QueueMessage, MessageView], bool], stop: Callable[[], bool] = lambda: False) -> None:
        """Receive every message once (hidden for ``hold`` s); ``act`` returns True to keep one.

        Kept messages are made visible again at the end (or on an error). A message whose hold
        ran out during a long scan comes back with a new pop receipt; it was seen, so it is only
        kept again, and a receive that brings nothing new ends the scan.
        """
        seen: set[str] = set()
        kept: list[QueueMessage] = []
        try:
            while not stop():
                with queue_errors("receive", self.name):
                    batch = list(
                        self.client.receive_messages(
                            messages_per_page=PEEK_MAX, max_messages=PEEK_MAX, visibility_timeout=self.hold
                        )
                    )
                fresh = [m for m in batch if str(m.id) not in seen]
                kept.extend(m for m in batch if str(m.id) in seen)
                if not fresh:
                    return
                for message in fresh:
                    seen.add(str(message.id))
                    if stop() or act(message, _view(message)):
                        kept.append(message)
        finally:
            _release(self.client, kept)


def _arrived_since(view: MessageView, started: dt.datetime) -> bool:
    """Poisoned during this run (e.g. a replayed copy that failed again): not part of the selection.

    The Service Bus path fixes its selection with a peek; a storage queue cannot be peeked past
    32 messages, so the insertion time draws the line. A copy needs ``maxDequeueCount`` failed
    attempts to come back, far longer than any clock skew between here and the service.
    """
    return view.enqueued_time is not None and view.enqueued_time >= started


def _matches(selection: Selection, wanted: frozenset[str], view: MessageView) -> bool:
    if wanted and view.message_id not in wanted:
        return False
    return selection.matches(view)


def _release(client: QueueClient, messages: list[QueueMessage]) -> None:
    """Visible again now (best effort: a lapsed hold frees a message anyway)."""
    for message in messages:
        try:
            client.update_message(message, visibility_timeout=0)
        except AzureError:
            log.debug("release failed; the hold will lapse", exc_info=True)


def read_export_by_id(path: Path) -> dict[str, bytes]:
    """``message id → body`` from a poison-queue export (possibly edited)."""
    return read_export_bodies(path, "message_id", str)


@contextmanager
def opened(config: Config, queue: str, *, hold_seconds: int = DEFAULT_HOLD_SECONDS) -> Iterator[PoisonQueue]:
    """A PoisonQueue for the command's lifetime."""
    poison = PoisonQueue.open(config, queue, hold_seconds=hold_seconds)
    try:
        yield poison
    finally:
        poison.close()
