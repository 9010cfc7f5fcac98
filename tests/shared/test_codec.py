"""Codec round-trips: every supported cursor/pk/value type comes back exactly (hypothesis)."""

from __future__ import annotations

import datetime as dt
import uuid
from dataclasses import replace
from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared import codec
from shared.errors import EnvelopeError, SerializationError, StateFormatError
from shared.messages import pack_batch
from shared.models import Batch, Checkpoint, Lease, Lsn, Position, RowChange, SnapshotState, StateDoc

offsets = st.integers(min_value=-14 * 60, max_value=14 * 60).map(lambda m: dt.timezone(dt.timedelta(minutes=m)))
aware = st.datetimes(min_value=dt.datetime(1, 1, 2), max_value=dt.datetime(9999, 12, 30), timezones=offsets)
scalars = st.one_of(
    st.integers(min_value=-(10**40), max_value=10**40),
    st.text(max_size=20),
    st.decimals(allow_nan=False, allow_infinity=False),
    st.uuids(),
    aware,
    st.dates(),
    st.binary(max_size=16),
    st.floats(allow_nan=False, allow_infinity=False),
)
cursors = st.one_of(scalars, st.tuples(scalars, scalars), st.tuples(scalars, scalars, scalars))
pks = st.dictionaries(st.text(min_size=1, max_size=8), scalars, min_size=1, max_size=3)


def _same(a: object, b: object) -> bool:
    """Equal, with the same type (and the same UTC offset for datetimes, same exponent for Decimals)."""
    if isinstance(a, tuple):
        return isinstance(b, tuple) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if type(a) is not type(b) and not (isinstance(a, uuid.UUID) and isinstance(b, uuid.UUID)):
        return False
    if isinstance(a, dt.datetime):
        assert isinstance(b, dt.datetime)
        return a == b and a.utcoffset() == b.utcoffset()
    if isinstance(a, Decimal):
        return str(a) == str(b)
    return a == b


@settings(max_examples=300, deadline=None)
@given(value=scalars)
def test_every_scalar_round_trips_exactly(value: object) -> None:
    encoded, tag = codec.encode_value(value)
    again = codec.decode_value(codec.loads(codec.dumps(encoded)), tag)
    assert _same(value, again)


@settings(max_examples=200, deadline=None)
@given(cursor=cursors, pk=pks, fence=st.integers(min_value=0, max_value=2**62))
def test_state_doc_round_trips_every_cursor_kind(cursor: object, pk: dict[str, object], fence: int) -> None:
    now = dt.datetime(2026, 4, 7, 1, 23, 45, 123456, tzinfo=dt.UTC)
    doc = StateDoc(
        poller_name="orders",
        source_fingerprint="sha256:abc",
        checkpoint=Checkpoint(Position(cursor, pk), "batch-1", now, {"row_count": 3}),  # type: ignore[arg-type]
        lease=Lease("host/1", fence, now, now, now + dt.timedelta(seconds=120)),
    )
    again = codec.decode_state(codec.encode_state(doc))
    assert again.lease == doc.lease and again.checkpoint.updated_at == now
    assert again.checkpoint.position is not None
    assert _same(doc.checkpoint.position.cursor, again.checkpoint.position.cursor)  # type: ignore[union-attr]
    assert all(_same(v, again.checkpoint.position.pk[k]) for k, v in pk.items())


def test_state_blob_uses_the_seed_002_field_names() -> None:
    # Given a checkpointed doc with a timestamp cursor; When encoded; Then the seed's keys are there
    ts = dt.datetime(2026, 4, 7, 1, 23, 45, 123456, tzinfo=dt.UTC)
    doc = StateDoc("orders", "sha256:x", Checkpoint(Position(ts, {"id": 12093}), "b1", ts), Lease("o", 42, ts, ts, ts))
    raw = codec.loads(codec.encode_state(doc))
    assert set(raw) == {"version", "poller_name", "source_fingerprint", "checkpoint", "lease"}
    assert set(raw["checkpoint"]) == {"cursor", "last_successful_batch_id", "updated_at", "metadata"}
    assert raw["checkpoint"]["cursor"]["kind"] == "timestamp+pk"
    assert raw["checkpoint"]["cursor"]["value"] == "2026-04-07T01:23:45.123456Z"
    assert raw["checkpoint"]["cursor"]["tiebreaker"] == {"id": 12093}
    assert set(raw["lease"]) == {"owner_id", "fencing_token", "acquired_at", "heartbeat_at", "expires_at"}


@pytest.mark.parametrize(
    "blob",
    [b"", b"{", b"[]", b'{"version": 2}', b'{"version": 1}', b'{"version": 1, "poller_name": "p"}'],
)
def test_corrupt_or_unknown_state_is_a_state_format_error(blob: bytes) -> None:
    with pytest.raises(StateFormatError):
        codec.decode_state(blob)


def test_naive_timestamp_tag_is_rejected() -> None:
    with pytest.raises(SerializationError):
        codec.decode_value("2026-01-01T00:00:00", "timestamp")


@settings(max_examples=150, deadline=None)
@given(cursor=cursors, pk=pks, after=st.dictionaries(st.text(max_size=8), st.one_of(scalars, st.none()), max_size=5))
def test_batch_envelope_round_trips(cursor: object, pk: dict[str, object], after: dict[str, object]) -> None:
    event = RowChange("ev-1", "upsert", pk, cursor, after, "orders")  # type: ignore[arg-type]
    batch = Batch("orders", "batch-1", "sha256:x", (event,))
    again = codec.decode_batch(codec.encode_batch(batch)).events[0]
    assert _same(event.cursor, again.cursor)
    assert all(_same(v, again.pk[k]) for k, v in pk.items())
    assert again.after is not None and all(_same(v, again.after[k]) for k, v in after.items())


@given(before=st.dictionaries(st.text(max_size=8), st.one_of(scalars, st.none()), max_size=5), seq=st.integers(0, 9))
def test_a_change_log_event_round_trips_its_lsn_cursor_and_before(before: dict[str, object], seq: int) -> None:
    # Given a pg_logical delete: cursor (commit LSN, seq), no after, the old row as before
    cursor = (Lsn(0x16B374D848), seq)
    event = RowChange("ev-1", "delete", {"id": 1}, cursor, None, "orders", before=before, change="delete")
    body = codec.encode_batch(Batch("orders", "batch-1", "sha256:x", (event,)))
    again = codec.decode_batch(body).events[0]
    # Then the LSN comes back as an Lsn, written as PostgreSQL writes it, and before exactly
    assert again.cursor == cursor and type(again.cursor[0]) is Lsn  # type: ignore[index]
    assert codec.loads(body)["events"][0]["cursor"] == ["16/B374D848", seq]
    assert again.before is not None and all(_same(v, again.before[k]) for k, v in before.items())
    assert again.after is None and again.change == "delete"


def test_an_lsn_checkpoint_is_kind_pg_lsn_with_the_position_as_tiebreaker() -> None:
    doc = StateDoc("orders", "sha256:x", Checkpoint(Position(Lsn.parse("0/1DE8350"), {"seq": 3})))
    raw = codec.loads(codec.encode_state(doc))["checkpoint"]["cursor"]
    assert (raw["kind"], raw["value"], raw["tiebreaker"]) == ("pg_lsn", "0/1DE8350", {"seq": 3})
    again = codec.decode_state(codec.encode_state(doc)).checkpoint.position
    assert again == doc.checkpoint.position and isinstance(again.cursor, Lsn)  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="not an LSN"):
        Lsn.parse("16B374D848")


@settings(max_examples=100, deadline=None)
@given(
    last_key=st.one_of(st.none(), st.dictionaries(st.sampled_from(["id", "tenant"]), scalars, min_size=1)),
    tables=st.lists(st.sampled_from(["public.orders", "s.lines"]), max_size=2),
    rows=st.integers(0, 10**12),
    where=st.one_of(st.none(), st.text(max_size=20)),
    cancelled=st.booleans(),
)
def test_a_snapshot_state_round_trips_beside_the_checkpoint_cursor(
    last_key: dict[str, object] | None, tables: list[str], rows: int, where: str | None, cancelled: bool
) -> None:
    at = dt.datetime(2026, 11, 24, 12, 0, 0, 5, tzinfo=dt.UTC)
    state = SnapshotState(
        "req-1", tuple(tables), 500, where, last_key, rows, 3, 10**6, at, None if tables else at, cancelled
    )
    doc = StateDoc("orders", "sha256:x", Checkpoint(Position(Lsn(2**33 + 7), {"seq": 2}, state)))
    raw = codec.loads(codec.encode_state(doc))["checkpoint"]
    # The cursor is written as before (an older dbfanout reads it and ignores "snapshot")
    assert raw["cursor"]["tiebreaker"] == {"seq": 2} and raw["snapshot"]["id"] == "req-1"
    again = codec.decode_state(codec.encode_state(doc))
    assert again == doc
    assert again.checkpoint.position is not None and again.checkpoint.position.snapshot == state


def test_a_blob_written_before_snapshots_loads_with_none() -> None:
    blob = (
        b'{"version":1,"poller_name":"p","source_fingerprint":"sha256:x","checkpoint":{"cursor":{"kind":"pg_lsn",'
        b'"value":"0/1DE8350","tiebreaker":{"seq":3},"types":{"value":"pg_lsn","tiebreaker":{}}},'
        b'"last_successful_batch_id":"b","updated_at":null,"metadata":{}},"lease":{"owner_id":null,"fencing_token":4}}'
    )
    position = codec.decode_state(blob).checkpoint.position
    assert position is not None and position.snapshot is None and position.pk == {"seq": 3}
    # and the same document is written byte for byte as before (no "snapshot" key)
    assert b"snapshot" not in codec.encode_state(codec.decode_state(blob))


@pytest.mark.parametrize(
    "snapshot",
    [
        {"id": "x"},
        {"id": "x", "tables": "public.orders", "chunk_size": 5},
        {"id": "x", "tables": [], "chunk_size": "5"},
    ],
)
def test_a_malformed_snapshot_state_is_a_state_format_error(snapshot: dict[str, object]) -> None:
    doc = codec.loads(codec.encode_state(StateDoc("p", "sha256:x", Checkpoint(Position(Lsn(5), {"seq": 0})))))
    doc["checkpoint"]["snapshot"] = snapshot
    with pytest.raises(StateFormatError, match="snapshot"):
        codec.decode_state(codec.dumps(doc))


@pytest.mark.parametrize("change", [None, "insert", "order.shipped"])
def test_the_optional_change_field_round_trips_and_is_absent_when_unset(change: str | None) -> None:
    event = RowChange("ev-1", "upsert", {"id": 1}, 1, {"id": 1}, "orders", change=change)
    body = codec.encode_batch(Batch("orders", "batch-1", "sha256:x", (event,)))
    assert ("change" in codec.loads(body)["events"][0]) is (change is not None)
    assert codec.decode_batch(body).events[0].change == change


@pytest.mark.parametrize("table", [None, "public.orders"])
def test_the_optional_table_field_round_trips_and_is_absent_when_unset(table: str | None) -> None:
    event = RowChange("ev-1", "delete", {"id": 1}, 1, None, "orders", before={"id": 1}, table=table)
    body = codec.encode_batch(Batch("orders", "batch-1", "sha256:x", (event,)))
    raw = codec.loads(body)["events"][0]
    assert ("table" in raw) is (table is not None) and raw.get("table") == table
    assert codec.decode_batch(body).events[0].table == table
    assert codec.decode_event(raw, "orders").table == table


def test_a_message_written_before_the_table_field_decodes_with_table_none() -> None:
    # A body exactly as the previous release wrote it (no "table" key): it still decodes.
    body = (
        b'{"schema":"dbfanout.batch/1","poller":"p","batch_id":"b","source_fingerprint":"f","events":'
        b'[{"event_id":"e","op":"upsert","pk":{"id":1},"cursor":1,"after":{"id":1},"before":null,"change":"insert"}]}'
    )
    (event,) = codec.decode_batch(body).events
    assert event.table is None and event.change == "insert" and event.event_id == "e"


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"not json", "not JSON"),
        (b'{"schema": "other/1"}', "unknown message schema"),
        (
            b'{"schema": "dbfanout.batch/1", "poller": "p", "batch_id": "b", "source_fingerprint": "f", "events": []}',
            "non-empty",
        ),
        (
            b'{"schema": "dbfanout.batch/1", "poller": "p", "batch_id": "b", "source_fingerprint": "f", '
            b'"events": [{"event_id": "e", "op": "merge", "pk": {}, "cursor": 1}]}',
            "upsert or delete",
        ),
        (
            b'{"schema": "dbfanout.batch/1", "poller": "p", "batch_id": "b", "source_fingerprint": "f", '
            b'"events": [{"event_id": "e", "op": "upsert", "pk": {}, "cursor": 1, "change": 7}]}',
            "change must be a string",
        ),
        (
            b'{"schema": "dbfanout.batch/1", "poller": "p", "batch_id": "b", "source_fingerprint": "f", '
            b'"events": [{"event_id": "e", "op": "upsert", "pk": {}, "cursor": 1, "table": ["x"]}]}',
            "table must be a string",
        ),
    ],
)
def test_foreign_or_malformed_bodies_are_envelope_errors(body: bytes, why: str) -> None:
    with pytest.raises(EnvelopeError, match=why):
        codec.decode_batch(body)


events_strategy = st.lists(
    st.builds(
        RowChange,
        event_id=st.text(min_size=1, max_size=8),
        op=st.sampled_from(["upsert", "delete"]),
        pk=pks,
        cursor=cursors,
        after=st.one_of(st.none(), st.dictionaries(st.text(max_size=8), st.one_of(scalars, st.none()), max_size=4)),
        poller=st.just("orders"),
        before=st.one_of(st.none(), st.dictionaries(st.text(max_size=8), scalars, max_size=3)),
        change=st.one_of(st.none(), st.sampled_from(["insert", "order.shipped", "read"])),
        table=st.one_of(st.none(), st.sampled_from(["public.orders", 'odd."schema".t'])),
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=150, deadline=None)
@given(events=events_strategy)
def test_decoding_a_batch_at_once_equals_decoding_each_event(events: list[RowChange]) -> None:
    # Given a batch of events of every kind (tagged and untagged values, before, change)
    body = codec.encode_batch(Batch("orders", "batch-1", "sha256:x", tuple(events)))
    # When the batch is decoded at once, and each event on its own
    at_once = codec.decode_batch(body).events
    each = tuple(codec.decode_event(raw, "orders") for raw in codec.loads(body)["events"])
    # Then both give the same events, with the same types (repr shows them), and every value round-trips
    assert at_once == each and repr(at_once) == repr(each)
    for event, again in zip(events, at_once, strict=True):
        assert _same(event.cursor, again.cursor) and again.event_id == event.event_id and again.op == event.op
        assert all(_same(v, again.pk[k]) for k, v in event.pk.items())
        assert (again.after is None) is (event.after is None) and again.change == event.change
        assert again.table == event.table


GOOD = {"event_id": "e", "op": "upsert", "pk": {"id": 1}, "cursor": 1}


@pytest.mark.parametrize(
    "raw",
    [
        ["not", "an", "object"],
        "text",
        {"op": "upsert", "pk": {}, "cursor": 1},
        {**GOOD, "op": "merge"},
        {**GOOD, "event_id": 7},
        {**GOOD, "pk": [1]},
        {**GOOD, "after": [1]},
        {**GOOD, "before": "x"},
        {**GOOD, "change": 7},
        {**GOOD, "table": 7},
        {**GOOD, "types": {"cursor": "nope"}},
        {**GOOD, "types": {"pk": {"id": "timestamp"}}},
        {**GOOD, "cursor": [1], "types": {"cursor": ["int", "int"]}},
        {**GOOD, "after": {"at": "2026-01-01T00:00:00"}, "types": {"after": {"at": "timestamp"}}},
    ],
)
def test_a_malformed_event_fails_the_batch_as_decoding_it_alone_does(raw: object) -> None:
    # Given a batch whose second event is malformed
    body = codec.dumps(
        {"schema": "dbfanout.batch/1", "poller": "p", "batch_id": "b", "source_fingerprint": "f", "events": [GOOD, raw]}
    )
    # When it is decoded at once, and the bad event alone; Then both raise the same error
    with pytest.raises(EnvelopeError) as alone:
        codec.decode_event(raw, "p")
    with pytest.raises(EnvelopeError) as at_once:
        codec.decode_batch(body)
    assert str(at_once.value) == str(alone.value)


def test_the_order_epoch_round_trips_on_the_envelope_and_is_absent_while_0__issue_39() -> None:
    # Given a batch of two events (one tagged cursor, one plain), packed as the poller and the splitter pack it
    events = (
        RowChange("ev-1", "upsert", {"id": 1}, (Lsn(0x16B374D848), 0), {"id": 1}, "orders"),
        RowChange("ev-2", "delete", {"id": 2}, 7, None, "orders", before={"id": 2}, change="delete"),
    )
    plain = Batch("orders", "batch-1", "sha256:x", events)
    bumped = Batch("orders", "batch-1", "sha256:x", events, epoch=3)
    for body in (codec.encode_batch(bumped), pack_batch(bumped, 256 * 1024)[0].body):
        # When it has an epoch, Then the envelope carries it and every decoded event has it
        assert codec.loads(body)["epoch"] == 3
        again = codec.decode_batch(body)
        assert again.epoch == 3 and [e.epoch for e in again.events] == [3, 3]
        assert again.events == events  # the epoch is not the event's identity (its id does not change)
    # And without one the body is exactly as before epochs existed, and reads as epoch 0
    body = codec.encode_batch(plain)
    assert "epoch" not in codec.loads(body) and body == codec.encode_batch(replace(bumped, epoch=0))
    again = codec.decode_batch(body)
    assert again.epoch == 0 and [e.epoch for e in again.events] == [0, 0]
    # And a malformed epoch fails the message (it orders changes) instead of reading as 0
    for wrong in ('"3"', "-1", "1.5", "true"):
        with pytest.raises(EnvelopeError, match="epoch"):
            codec.decode_batch(body.replace(b'{"schema"', b'{"epoch":' + wrong.encode() + b',"schema"', 1))
