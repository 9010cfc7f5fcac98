"""decode_events against main's implementation before issue 41's changes (kept here verbatim):
for generated batches shaped like every source's (repeated commit times and LSNs, composite and
tagged cursors, before images, epochs), the events a handler receives are the same, field by field
and type by type; the decoded objects are real, frozen, independent RowChanges."""

from __future__ import annotations

import copy
import dataclasses
import datetime as dt
import pickle
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared import codec
from shared.codec.cursors import _decode_cursor
from shared.codec.envelope import _optional_time, decode_event
from shared.codec.values import decode_value
from shared.errors import EnvelopeError, SerializationError
from shared.models import Batch, Lsn, RowChange
from tests.shared.test_codec import _same, cursors, pks, scalars

_OPS = frozenset({"upsert", "delete"})
_new_event = object.__new__
(
    _set_event_id,
    _set_op,
    _set_pk,
    _set_cursor,
    _set_after,
    _set_poller,
    _set_before,
    _set_source,
    _set_change,
    _set_table,
    _set_committed_at,
    _set_epoch,
) = (getattr(RowChange, name).__set__ for name in RowChange.__slots__)


def _old_decode_events(raws: list[Any], poller: str) -> tuple[RowChange, ...]:
    """main's decode_events (129ca76), before issue 41's worker changes, kept verbatim as the reference."""
    out: list[RowChange] = []
    append = out.append
    str_, dict_, ops = str, dict, _OPS
    for raw in raws:
        try:
            event_id, op, pk, cursor = raw["event_id"], raw["op"], raw["pk"], raw["cursor"]
        except (KeyError, TypeError, AttributeError):  # not an object, or a field missing
            append(decode_event(raw, poller))  # raises the precise error
            continue
        if type(raw) is not dict_:
            append(decode_event(raw, poller))
            continue
        after, before, change, types = raw.get("after"), raw.get("before"), raw.get("change"), raw.get("types")
        table = raw.get("table")
        if (
            op not in ops
            or type(event_id) is not str_
            or type(pk) is not dict_
            or (after is not None and type(after) is not dict_)
            or (before is not None and type(before) is not dict_)
            or (change is not None and type(change) is not str_)
            or (table is not None and type(table) is not str_)
        ):
            append(decode_event(raw, poller))  # raises the precise error
            continue
        if types:
            try:
                if type(types) is not dict_:
                    raise _OldSlow
                tag = types.get("cursor")
                if tag is not None:
                    cursor = _decode_cursor(cursor, tag)
                pk = _old_tagged(pk, types.get("pk"))
                if after is not None:
                    after = _old_tagged(after, types.get("after"))
                if before is not None:
                    before = _old_tagged(before, types.get("before"))
            except (_OldSlow, SerializationError, TypeError, AttributeError, ValueError):
                append(decode_event(raw, poller))  # decodes it, or raises the precise error
                continue
        event = _new_event(RowChange)
        _set_event_id(event, event_id)
        _set_op(event, op)
        _set_pk(event, pk)
        _set_cursor(event, cursor)
        _set_after(event, after)
        _set_poller(event, poller)
        _set_before(event, before)
        _set_source(event, {})
        _set_change(event, change)
        _set_table(event, table)
        committed = raw.get("committed_at")
        _set_committed_at(event, None if committed is None else _optional_time(committed))
        _set_epoch(event, 0)  # the envelope's: decode_batch sets it
        append(event)
    return tuple(out)


class _OldSlow(Exception):
    """An event the fast path leaves to :func:`decode_event`."""


def _old_tagged(values: dict[str, Any], tags: Any) -> dict[str, Any]:
    """``values`` with its tagged entries decoded (a copy; untagged maps are returned as they are)."""
    if not tags:
        return values
    if type(tags) is not dict:
        raise _OldSlow
    out = dict(values)
    for key, tag in tags.items():
        if key in out:
            out[key] = decode_value(out[key], tag)
    return out


def _reference(body: bytes) -> tuple[RowChange, ...]:
    """The events main's decode_batch gave: the old loop, then the envelope's epoch on each."""
    raw = codec.loads(body)
    events = _old_decode_events(raw["events"], raw["poller"])
    for event in events:
        _set_epoch(event, raw.get("epoch", 0))
    return events


def _fields(event: RowChange) -> list[tuple[str, Any]]:
    return [(name, getattr(event, name)) for name in RowChange.__slots__]


def _assert_same_events(new: Sequence[RowChange], old: Sequence[RowChange]) -> None:
    assert len(new) == len(old)
    for a, b in zip(new, old, strict=True):
        assert type(a) is RowChange and type(b) is RowChange
        assert repr(a) == repr(b)  # every field, committed_at and epoch included, with its type's repr
        for (name, x), (_, y) in zip(_fields(a), _fields(b), strict=True):
            if isinstance(x, dict) and isinstance(y, dict):
                assert list(x) == list(y), name  # the same keys in the same order
                assert all(_same(x[k], y[k]) for k in x), name
            else:
                assert _same(x, y), name


TIME = dt.datetime(2026, 11, 29, 1, 2, 3, 456789, tzinfo=dt.UTC)


@st.composite
def log_batches(draw: st.DrawFn) -> Batch:
    """A change-log page: transactions of several changes sharing a commit LSN and time (what the
    decode shares between events), each change with a sequence number, a table, a before image."""
    events: list[RowChange] = []
    for txn in range(draw(st.integers(1, 4))):
        lsn = Lsn(draw(st.integers(0, 2**64 - 1)))
        when = TIME + dt.timedelta(milliseconds=draw(st.integers(-(10**9), 10**9)))
        when = when.astimezone(dt.timezone(dt.timedelta(minutes=draw(st.integers(-840, 840)))))
        for seq in range(draw(st.integers(1, 4))):
            events.append(
                RowChange(
                    f"e-{txn}-{seq}",
                    draw(st.sampled_from(["upsert", "delete"])),
                    draw(pks),
                    (lsn, seq) if draw(st.booleans()) else draw(cursors),
                    draw(st.one_of(st.none(), st.dictionaries(st.text(max_size=6), st.one_of(scalars, st.none())))),
                    "orders",
                    before=draw(st.one_of(st.none(), st.dictionaries(st.text(max_size=6), scalars, max_size=3))),
                    change=draw(st.one_of(st.none(), st.sampled_from(["insert", "update", "delete", "read"]))),
                    table=draw(st.one_of(st.none(), st.just("public.orders"))),
                    committed_at=draw(st.one_of(st.none(), st.just(when))),
                )
            )
    return Batch("orders", "b-1", "sha256:f", tuple(events), epoch=draw(st.integers(0, 3)))


@settings(max_examples=300, deadline=None)
@given(batch=log_batches())
def test_decode_batch_gives_what_mains_decode_gave(batch: Batch) -> None:
    # Given a page encoded by the (unchanged) encode path
    body = codec.encode_batch(batch)
    # When it is decoded; Then every event is the one main's decode gave, field by field
    _assert_same_events(codec.decode_batch(body).events, _reference(body))


@settings(max_examples=100, deadline=None)
@given(batch=log_batches())
def test_decoded_events_are_frozen_independent_row_changes(batch: Batch) -> None:
    # Given a decoded page
    events = codec.decode_batch(codec.encode_batch(batch)).events
    for event in events:
        # Then each is a frozen RowChange that copies and pickles like one built by its constructor
        with pytest.raises(dataclasses.FrozenInstanceError):
            event.op = "delete"  # type: ignore[misc]
        assert copy.copy(event) == event and pickle.loads(pickle.dumps(event)) == event
        assert repr(dataclasses.replace(event)) == repr(event)
    # And no two events share a mutable part: a handler that edits one event's maps edits no other
    mutable = [id(m) for e in events for m in (e.pk, e.after, e.before, e.source) if m is not None]
    assert len(mutable) == len(set(mutable))


def test_a_malformed_event_after_a_shared_value_still_fails_with_the_precise_error() -> None:
    # Given a batch whose first event decodes an LSN and a commit time (kept for the rest of the
    # message), and whose second carries the same LSN beside a malformed part of its cursor
    good = codec.encode_event(RowChange("e1", "upsert", {"id": 1}, (Lsn(5), 0), {}, "p", committed_at=TIME))
    bad = {**good, "event_id": "e2", "cursor": [good["cursor"][0], "x"]}
    bad["types"] = {"cursor": ["pg_lsn", "int"]}
    body = codec.dumps(
        {"schema": "dbfanout.batch/1", "poller": "p", "batch_id": "b", "source_fingerprint": "f", "events": [good, bad]}
    )
    # When it is decoded; Then it fails as decoding the bad event alone does
    with pytest.raises(EnvelopeError) as alone:
        decode_event(bad, "p")
    with pytest.raises(EnvelopeError) as at_once:
        codec.decode_batch(body)
    assert str(at_once.value) == str(alone.value)
