"""Dead-letter queue: peek (filtered), export to JSONL, purge, and reading an export back.

Each function takes a queue name or an :class:`~dbfanout.ops.bus.Entity` (a queue, or one
subscription of a topic: its own ``$DeadLetterQueue``).
"""

from __future__ import annotations

import base64
import datetime as dt
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from azure.servicebus import ServiceBusClient, ServiceBusReceivedMessage, ServiceBusSubQueue
from azure.servicebus.exceptions import ServiceBusError

from dbfanout.dlq.selection import Progress, Selection, each_selected
from dbfanout.ops.bus import Entity, MessageView, as_entity, peek_all, peek_receiver
from shared.codec import dumps, loads
from shared.errors import SerializationError
from shared.logs import get_logger, ids

__all__ = ["export", "peek", "purge", "purge_start", "read_export"]

K = TypeVar("K", int, str)

log = get_logger("cli.dlq")


def _plain(view: MessageView) -> MessageView:
    return view


def peek(
    client: ServiceBusClient,
    queue: str | Entity,
    selection: Selection,
    limit: int | None,
    explain: Callable[[MessageView], MessageView] = _plain,
) -> list[MessageView]:
    """Dead-lettered messages matching ``selection`` (all when empty), at most ``limit``; ``explain``
    adds each one's failure record (:mod:`dbfanout.dlq.explain`)."""
    out: list[MessageView] = []
    for view in peek_all(client, queue):
        if selection.empty or selection.matches(view):
            out.append(explain(view))
            if limit is not None and len(out) >= limit:
                break
    return out


def export(
    client: ServiceBusClient,
    queue: str | Entity,
    out: Path,
    selection: Selection,
    explain: Callable[[MessageView], MessageView] = _plain,
) -> int:
    """Write every matching dead-lettered message as one JSON line (bodies and properties); returns the count.

    Written to a temporary file first and renamed, so a failed export never leaves half a file.
    """
    tmp = out.with_name(out.name + ".partial")
    count = 0
    with tmp.open("wb") as fh:
        for view in peek_all(client, queue):
            if selection.empty or selection.matches(view):
                fh.write(dumps(explain(view).to_json()) + b"\n")
                count += 1
    tmp.replace(out)
    return count


def read_export_bodies(path: Path, key: str, key_type: type[K]) -> dict[K, bytes]:
    """``key → body`` from an export (possibly edited). Raises ValueError naming the line."""
    bodies: dict[K, bytes] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            doc = loads(line)
        except SerializationError as exc:
            raise ValueError(f"{path}:{number}: not JSON ({exc})") from None
        if not isinstance(doc, dict) or not isinstance(doc.get(key), key_type):
            raise ValueError(f"{path}:{number}: each line needs a {key} (as written by dlq export)")
        if "body_base64" in doc:
            bodies[doc[key]] = base64.b64decode(doc["body_base64"])
        elif isinstance(doc.get("body"), str):
            bodies[doc[key]] = doc["body"].encode()
        else:
            raise ValueError(f"{path}:{number}: needs body (text) or body_base64")
    return bodies


def read_export(path: Path) -> dict[int, bytes]:
    """``sequence number → body`` from a Service Bus DLQ export."""
    return read_export_bodies(path, "sequence_number", int)


def purge_start(
    queue: str, older_than: dt.timedelta | None, dry_run: bool, now: Callable[[], dt.datetime]
) -> tuple[Callable[[MessageView], bool], dict[str, Any]]:
    """A purge's age filter (every message when ``older_than`` is None) and its result, nothing counted yet."""
    cutoff = now() - older_than if older_than is not None else None

    def old(view: MessageView) -> bool:
        return cutoff is None or (view.enqueued_time or now()) < cutoff

    return old, {"queue": queue, "selected": 0, "purged": 0, "dry_run": dry_run}


def purge(
    client: ServiceBusClient,
    queue: str | Entity,
    older_than: dt.timedelta | None,
    *,
    dry_run: bool = False,
    progress: Progress | None = None,
    now: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC),
) -> dict[str, Any]:
    """Complete (delete) dead-lettered messages, all or those enqueued more than ``older_than`` ago."""
    entity = as_entity(queue)
    old, result = purge_start(entity.label, older_than, dry_run, now)
    purged: list[int] = []
    with entity.receiver(client, sub_queue=ServiceBusSubQueue.DEAD_LETTER) as receiver:
        views = [v for v in peek_receiver(receiver) if old(v)]
        pending = {v.sequence_number for v in views}
        result["selected"] = len(views)
        if dry_run or not pending:
            return result

        def act(message: ServiceBusReceivedMessage) -> bool:
            try:
                receiver.complete_message(message)
            except (ServiceBusError, OSError) as exc:
                log.warning("purge: could not complete %s: %s", message.sequence_number, exc)
                return True
            purged.append(int(message.sequence_number or 0))
            log.info("purged", extra=ids(queue=entity.label, sequence_number=message.sequence_number))
            return True

        each_selected(receiver, pending, act, progress)
    result.update(purged=len(purged), not_found=sorted(pending))
    return result
