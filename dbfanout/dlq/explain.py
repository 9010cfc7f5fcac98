"""Joining a dead-lettered message to the failure record its last delivery left (shared.failures)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace

from azure.core.exceptions import AzureError

from dbfanout.ops.bus import MessageView
from shared.config import Config
from shared.errors import ConfigError
from shared.failures import FailureStore, open_failure_store
from shared.logs import get_logger, ids

__all__ = ["Explain", "explaining"]

log = get_logger("cli.dlq")

#: A view → the same view with its ``failure`` filled in when a record exists.
Explain = Callable[[MessageView], MessageView]


@contextmanager
def explaining(config: Config, entity: str, *, stale_check: bool = True) -> Iterator[Explain]:
    """An :data:`Explain` for messages dead-lettered from ``entity`` (``queue`` or
    ``topic/subscription``; a storage-queue poller's main queue). Without a usable state
    connection, or when the store cannot be read, views pass through unchanged (said once).

    ``stale_check``: a record older than the message's enqueued time is marked ``stale`` (Service
    Bus keeps the enqueued time of the copy that failed; a storage queue's poison copy is enqueued
    after the failures, so storage queues pass False)."""
    try:
        store: FailureStore | None = open_failure_store(config)
    except ConfigError as exc:
        log.warning("failure records unavailable; reasons not shown", extra=ids(error=str(exc)))
        store = None
    broken = False

    def explain(view: MessageView) -> MessageView:
        nonlocal broken
        if store is None or broken:
            return view
        try:
            record = store.lookup(entity, view.body)
        except AzureError as exc:
            broken = True
            log.warning("cannot read failure records; reasons not shown", extra=ids(error=type(exc).__name__))
            return view
        if record is None:
            return view
        failure = record.to_json()
        if _older_than(record.failed_at, view.enqueued_time) and stale_check:
            # An earlier copy's failure (this body was replayed, then dead-lettered again without a
            # delivery that raised, e.g. a crash): shown, but marked.
            failure["stale"] = True
        return replace(view, failure=failure)

    try:
        yield explain
    finally:
        if store is not None:
            store.close()


def _older_than(failed_at: str, enqueued: dt.datetime | None) -> bool:
    if enqueued is None:
        return False
    try:
        when = dt.datetime.fromisoformat(failed_at)
    except ValueError:
        return False
    return when.tzinfo is not None and when < enqueued
