"""Joining a dead-lettered message to the failure record its last delivery left (shared.failures)."""

from __future__ import annotations

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
def explaining(config: Config, entity: str) -> Iterator[Explain]:
    """An :data:`Explain` for messages dead-lettered from ``entity`` (``queue`` or
    ``topic/subscription``; a storage-queue poller's main queue). Without a usable state
    connection, or when the store cannot be read, views pass through unchanged (said once)."""
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
        return view if record is None else replace(view, failure=record.to_json())

    try:
        yield explain
    finally:
        if store is not None:
            store.close()
