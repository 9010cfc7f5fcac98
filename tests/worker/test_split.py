"""Split-on-failure builds singles with crash-safe ids (and sessions when the poller orders by key)."""

from __future__ import annotations

from dataclasses import replace

from shared.codec import decode_batch, encode_batch
from shared.ids import split_message_id
from tests.worker.support import QUEUE, Sent, batch, event_ids, make_config
from worker.split import PROP_SPLIT_FROM, Splitter


def test_singles_have_ids_derived_from_their_event_and_name_their_parent() -> None:
    sent = Sent()
    Splitter(make_config(), sent).split(batch(3), parent_message_id="msg-parent", queue=QUEUE)
    ((queue, singles),) = sent.messages
    assert queue == QUEUE
    assert [m.message_id for m in singles] == [split_message_id(f"ev-{i}") for i in range(3)]
    assert [[e.event_id for e in decode_batch(m.body).events] for m in singles] == [["ev-0"], ["ev-1"], ["ev-2"]]
    assert all(m.application_properties[PROP_SPLIT_FROM] == "msg-parent" and m.session_id is None for m in singles)
    # a re-split after a crash produces the very same messages (duplicate detection drops them)
    assert Splitter(make_config(), Sent()).singles(batch(3), "msg-parent") == singles


def test_with_sessions_every_message_carries_its_keys_session() -> None:
    singles = Splitter(make_config(sessions=True), Sent()).singles(batch(3), "msg-parent")
    assert [m.session_id for m in singles] == ["id=0", "id=1", "id=2"]
    assert event_ids(singles) == [("ev-0",), ("ev-1",), ("ev-2",)]


def test_singles_keep_their_parents_order_epoch__issue_39() -> None:
    # Given a delivered message of epoch 2 (after a failover made the cursors go backwards)
    parent = decode_batch(encode_batch(replace(batch(2), epoch=2)))
    # When it is split, Then each single carries epoch 2: "apply only if newer" orders it as its parent
    singles = Splitter(make_config(), Sent()).singles(parent, "msg-parent")
    assert [(b.epoch, [e.epoch for e in b.events]) for b in map(decode_batch, (m.body for m in singles))] == [
        (2, [2]),
        (2, [2]),
    ]
