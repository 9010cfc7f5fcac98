"""Split-on-failure builds singles with crash-safe ids (and sessions when the poller orders by key)."""

from __future__ import annotations

from dataclasses import replace

from poller.sink_servicebus import ServiceBusSink
from shared.codec import decode_batch
from shared.config import AppConfig, Config
from shared.ids import split_message_id
from shared.messages import OutgoingMessage
from shared.models import Batch, RowChange
from tests.poller.tick_support import make_poller
from worker.split import PROP_SPLIT_FROM, Splitter


def _batch() -> Batch:
    events = tuple(RowChange(f"ev-{i}", "upsert", {"id": i}, i, {"id": i}, "orders") for i in range(3))
    return Batch("orders", "batch-1", "sha256:f", events)


def _config(sessions: bool) -> Config:
    poller = replace(make_poller("sqlite://"), sessions=sessions)
    return Config(AppConfig("app"), {"orders": poller})


def test_singles_have_ids_derived_from_their_event_and_name_their_parent() -> None:
    sent: list[tuple[str, list[OutgoingMessage]]] = []
    splitter = Splitter(_config(False), lambda q, m: sent.append((q, m)))
    splitter.split(_batch(), parent_message_id="msg-parent", queue="orders-changes")
    ((queue, singles),) = sent
    assert queue == "orders-changes"
    assert [m.message_id for m in singles] == [split_message_id(f"ev-{i}") for i in range(3)]
    assert [[e.event_id for e in decode_batch(m.body).events] for m in singles] == [["ev-0"], ["ev-1"], ["ev-2"]]
    assert all(m.application_properties[PROP_SPLIT_FROM] == "msg-parent" and m.session_id is None for m in singles)
    # a re-split after a crash produces the very same messages (duplicate detection drops them)
    assert Splitter(_config(False), lambda q, m: None).singles(_batch(), "msg-parent") == singles


def test_with_sessions_every_message_carries_its_keys_session() -> None:
    config = _config(True)
    singles = Splitter(config, lambda q, m: None).singles(_batch(), "msg-parent")
    assert [m.session_id for m in singles] == ["id=0", "id=1", "id=2"]
    # and the poller's sink does the same: one event per message, in the key's session
    sink = ServiceBusSink(config.pollers["orders"], sender=None)  # type: ignore[arg-type]
    assert [(m.session_id, m.event_ids) for m in sink.messages_for(_batch())] == [
        ("id=0", ("ev-0",)),
        ("id=1", ("ev-1",)),
        ("id=2", ("ev-2",)),
    ]
