"""Packing a batch into messages: size limits, deterministic ids, oversize rows."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.codec import decode_batch, dumps, encode_event
from shared.errors import OversizeRowError
from shared.messages import PROPERTY_ALLOWANCE, EncodedEvents, pack_batch, session_key
from shared.models import Batch, RowChange


def _batch(sizes: list[int]) -> Batch:
    events = tuple(
        RowChange(f"ev-{i}", "upsert", {"id": i}, i, {"id": i, "blob": "x" * n}, "orders") for i, n in enumerate(sizes)
    )
    return Batch("orders", "batch-1", "sha256:f", events)


@settings(max_examples=100, deadline=None)
@given(sizes=st.lists(st.integers(min_value=0, max_value=9000), min_size=1, max_size=60))
def test_packing_keeps_every_event_in_order_under_the_limit(sizes: list[int]) -> None:
    limit = 16 * 1024
    batch = _batch(sizes)
    messages = pack_batch(batch, limit)
    assert all(len(m.body) <= limit - PROPERTY_ALLOWANCE for m in messages)
    delivered = [e.event_id for m in messages for e in decode_batch(m.body).events]
    assert delivered == [e.event_id for e in batch.events]
    assert [m.message_id for m in pack_batch(batch, limit)] == [m.message_id for m in messages]  # deterministic
    assert len({m.message_id for m in messages}) == len(messages)


@settings(max_examples=50, deadline=None)
@given(sizes=st.lists(st.integers(min_value=0, max_value=300), min_size=1, max_size=20), slack=st.integers(-3, 3))
def test_a_batch_that_just_fits_or_just_does_not_packs_as_event_by_event(sizes: list[int], slack: int) -> None:
    # A page that fits is encoded in one call; it must be exactly where event-by-event packing
    # (forced here by max_events) puts the limit, byte for byte, one byte either side.
    batch = _batch(sizes)
    (whole,) = pack_batch(batch, 1024 * 1024)
    limit = len(whole.body) + PROPERTY_ALLOWANCE + slack
    if limit - PROPERTY_ALLOWANCE < max(len(m.body) for m in pack_batch(batch, limit * 4, max_events=1)):
        return  # a single event would not fit: the oversize path, tested below
    assert pack_batch(batch, limit) == pack_batch(batch, limit, max_events=len(sizes) + 1)
    # (the packer counts a comma after every event, the last one included: one byte of margin)
    assert len(pack_batch(batch, limit)) == (1 if slack >= 1 or len(sizes) == 1 else 2)


def _reference(event: RowChange, size: int) -> RowChange:
    """A claim-check stand-in: the oversize event replaced by a small reference event."""
    return RowChange(event.event_id, event.op, event.pk, event.cursor, {"ref": size}, event.poller)


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=0, max_value=3000), min_size=1, max_size=80),
    limit=st.integers(min_value=4 * 1024 + 600, max_value=24 * 1024),
    claim_check=st.booleans(),
)
def test_messages_split_exactly_where_event_by_event_packing_splits(sizes: list[int], limit: int, claim_check) -> None:
    # Without max_events a batch is packed a chunk of events per encoder call; max_events forces
    # the event-by-event loop. Same messages, byte for byte, oversize events (claim-check) included.
    batch, hook = _batch(sizes), _reference if claim_check else None
    try:
        expected = pack_batch(batch, limit, oversize=hook, max_events=len(sizes) + 1)
    except OversizeRowError:
        with pytest.raises(OversizeRowError):
            pack_batch(batch, limit, oversize=hook)
        return
    assert pack_batch(batch, limit, oversize=hook) == expected


class _AsText(tuple[RowChange, ...]):
    """Events that hand over their JSON, as a keyset page does (poller.tick.events.encode_page)."""

    def encoded(self) -> EncodedEvents:
        return [e.event_id for e in self], [dumps(encode_event(e)) for e in self]


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=0, max_value=3000), min_size=1, max_size=80),
    limit=st.integers(min_value=4 * 1024 + 600, max_value=24 * 1024),
    claim_check=st.booleans(),
    unicode=st.booleans(),
    max_events=st.sampled_from([None, 1, 7]),
)
def test_events_given_as_json_pack_into_the_messages_of_their_dicts(
    sizes: list[int], limit: int, claim_check: bool, unicode: bool, max_events: int | None
) -> None:
    # Given a batch's events, and the same events handing over their JSON (with non-ASCII text:
    # sizes are bytes, not characters); When both are packed; Then the same messages, byte
    # for byte, or the same oversize error.
    batch, hook = _batch(sizes), _reference if claim_check else None
    if unicode:
        events = tuple(
            replace(e, after={**(e.after or {}), "blob": "é😀" * (len(str(e.after)) // 3)}) for e in batch.events
        )
        batch = replace(batch, events=events)
    as_text = replace(batch, events=_AsText(batch.events))
    try:
        expected = pack_batch(batch, limit, oversize=hook, max_events=max_events)
    except OversizeRowError as exc:
        with pytest.raises(OversizeRowError, match=re.escape(str(exc))):
            pack_batch(as_text, limit, oversize=hook, max_events=max_events)
        return
    assert pack_batch(as_text, limit, oversize=hook, max_events=max_events) == expected


@settings(max_examples=100, deadline=None)
@given(sizes=st.lists(st.integers(min_value=0, max_value=300), min_size=1, max_size=20), slack=st.integers(-3, 3))
def test_events_given_as_json_split_at_the_very_byte_of_the_event_by_event_path(sizes: list[int], slack: int) -> None:
    # Given a limit one byte either side of where a batch just fits; Then text events split
    # exactly where the event-by-event loop does.
    batch = _batch(sizes)
    as_text = replace(batch, events=_AsText(batch.events))
    (whole,) = pack_batch(batch, 1024 * 1024)
    limit = len(whole.body) + PROPERTY_ALLOWANCE + slack
    try:
        expected = pack_batch(batch, limit, max_events=len(sizes) + 1)
    except OversizeRowError:
        return
    assert pack_batch(as_text, limit) == expected


def test_oversize_row_names_poller_and_pk() -> None:
    with pytest.raises(OversizeRowError, match=r"poller orders: row \{'id': 1\}"):
        pack_batch(_batch([10, 30_000]), 16 * 1024)


def test_message_properties_name_schema_poller_and_count() -> None:
    (message,) = pack_batch(_batch([1, 2, 3]), 256 * 1024)
    assert message.subject == "orders" and message.content_type == "application/json"
    assert message.application_properties["dbfanout-schema"] == "dbfanout.batch/1"
    assert message.application_properties["dbfanout-event-count"] == 3


def test_the_tables_property_names_every_table_of_the_batch_framed_by_commas() -> None:
    # Given a batch of two tables' events (a delete names its table too) and one of a query poller
    events = (
        RowChange("ev-1", "upsert", {"id": 1}, 1, {"id": 1}, "p", table="public.orders"),
        RowChange("ev-2", "delete", {"id": 1}, 2, None, "p", before={"id": 1}, table="public.order_lines"),
        RowChange("ev-3", "upsert", {"id": 2}, 3, {"id": 2}, "p", table="public.orders"),
    )
    (message,) = pack_batch(Batch("p", "b", "sha256:f", events), 256 * 1024)
    # Then a subscription filter can match one table exactly (LIKE '%,public.orders,%')
    assert message.application_properties["dbfanout-tables"] == ",public.order_lines,public.orders,"
    (plain,) = pack_batch(_batch([1, 2]), 256 * 1024)
    assert "dbfanout-tables" not in plain.application_properties


def test_the_session_of_a_change_log_event_is_its_own_key() -> None:
    row = RowChange("ev-1", "upsert", {"id": 7}, 1, {"id": 7}, "orders")
    outbox = RowChange("ev-2", "upsert", {"aggregate": "order:7"}, 12, {}, "changes", change="update")
    assert session_key(("id",), row) == "id=7"
    assert session_key(("id",), outbox) == "aggregate=order:7"
