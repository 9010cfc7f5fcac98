"""benchmarks/bench_slot_stream.py: its replication-protocol messages, and the two facts its figures
rest on — a stream decodes exactly what a peek decodes, and the slot moves to what the standby
status update reports as flushed, never to what the stream merely received (issue 41)."""

from __future__ import annotations

import struct
import sys
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import pytest
import sqlalchemy as sa
from hypothesis import given
from hypothesis import strategies as st

from poller.sources.pg_logical.peek import _PEEK_SQL, loader, stream
from poller.sources.pg_logical.pgoutput import Change
from shared.models import Lsn
from tests.poller.pg_logical_support import logical_reason
from tests.support.databases import unique_name
from tests.support.ports import wait_until

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # benchmarks import each other so

from bench_slot_stream import Counter, SlotStream, keepalive, status_update, xlog_payload

lsns = st.integers(min_value=0, max_value=2**64 - 1)


@given(lsns, lsns, st.integers(min_value=946_684_800_000_000, max_value=2**62))
def test_a_status_update_reports_the_confirmed_position_flushed_and_applied(a: int, b: int, now_us: int) -> None:
    received, confirmed = max(a, b), min(a, b)
    message = status_update(received, confirmed, now_us)
    assert struct.unpack(">cQQQqb", message) == (b"r", received, confirmed, confirmed, now_us - 946_684_800_000_000, 0)


@given(st.integers(min_value=0, max_value=2**64 - 2), st.data())
def test_a_status_update_never_confirms_past_what_was_received(received: int, data: st.DataObject) -> None:
    confirmed = data.draw(st.integers(min_value=received + 1, max_value=2**64 - 1))
    with pytest.raises(ValueError, match="cannot confirm past"):
        status_update(received, confirmed, 946_684_800_000_000)


@given(lsns, lsns, st.integers(min_value=-(2**63), max_value=2**63 - 1), st.binary(max_size=64))
def test_xlog_data_carries_its_payload(start: int, end: int, sent: int, payload: bytes) -> None:
    message = b"w" + struct.pack(">QQq", start, end, sent) + payload
    assert xlog_payload(message) == payload
    assert xlog_payload(memoryview(message)) == payload
    with pytest.raises(ValueError, match="not an XLogData"):
        xlog_payload(b"k" + message[1:])


@given(lsns, st.integers(min_value=-(2**63), max_value=2**63 - 1), st.booleans())
def test_a_keepalive_says_the_servers_end_and_whether_to_reply(end: int, sent: int, reply: bool) -> None:
    message = b"k" + struct.pack(">Qqb", end, sent, int(reply))
    assert keepalive(message) == (end, reply)
    with pytest.raises(ValueError, match="not a keepalive"):
        keepalive(b"w" + message[1:])


@pytest.fixture
def slot(pg_logical_url: str) -> Iterator[tuple[sa.Engine, str, str]]:
    reason = logical_reason(pg_logical_url)
    if reason:
        pytest.skip(reason)
    engine, name = sa.create_engine(pg_logical_url), unique_name("ss")
    url = sa.make_url(pg_logical_url)
    dsn = f"host={url.host} port={url.port} user={url.username} dbname={url.database}"
    with engine.begin() as conn:
        conn.execute(sa.text(f"CREATE TABLE {name} (id INTEGER PRIMARY KEY, v TEXT)"))
        conn.execute(sa.text(f"CREATE PUBLICATION {name} FOR TABLE {name}"))
    with engine.begin() as conn:
        conn.execute(sa.text("SELECT pg_create_logical_replication_slot(:s, 'pgoutput')"), {"s": name})
    try:
        yield engine, dsn, name
    finally:
        wait_until(lambda: not _slot_row(engine, name)[1], 30, "the walsender to let go of the slot")
        with engine.begin() as conn:
            conn.execute(sa.text("SELECT pg_drop_replication_slot(:s)"), {"s": name})
            conn.execute(sa.text(f"DROP PUBLICATION {name}"))
            conn.execute(sa.text(f"DROP TABLE {name}"))
        engine.dispose()


def _slot_row(engine: sa.Engine, name: str) -> tuple[Lsn, bool]:
    with engine.connect() as conn:
        text, active = conn.execute(
            sa.text("SELECT CAST(confirmed_flush_lsn AS text), active FROM pg_replication_slots WHERE slot_name = :s"),
            {"s": name},
        ).one()
    return Lsn.parse(text), bool(active)


def _peeked(engine: sa.Engine, name: str) -> list[Change]:
    with engine.begin() as conn:
        counter = Counter(loader(conn))
        with closing(stream(conn, _PEEK_SQL, {"slot": name, "n": None, "pub": name})) as rows:
            for data in rows:
                counter.feed(data)
    return counter.decoded


def _fields(changes: list[Change]) -> list[tuple[object, ...]]:
    return [(c.key, c.end_lsn, c.kind, c.new, c.old) for c in changes]


def test_the_stream_decodes_what_the_peek_decodes_and_the_slot_follows_only_what_is_confirmed(
    slot: tuple[sa.Engine, str, str],
) -> None:
    engine, dsn, name = slot
    for statement in (f"INSERT INTO {name} VALUES (1, 'a'), (2, 'b')", f"UPDATE {name} SET v = 'c' WHERE id = 1",
                      f"DELETE FROM {name} WHERE id = 2"):  # fmt: skip
        with engine.begin() as conn:
            conn.execute(sa.text(statement))
    peeked = _peeked(engine, name)
    assert [c.kind for c in peeked] == ["insert", "insert", "update", "delete"]
    before = _slot_row(engine, name)[0]

    with engine.connect() as conn:
        counter = Counter(loader(conn))
    reader = SlotStream(dsn, name, name)
    try:
        for data in reader.messages(idle=10.0):
            counter.feed(data)
            if counter.changes == len(peeked):
                break
        assert _fields(counter.decoded) == _fields(peeked)
        assert _slot_row(engine, name)[0] == before  # read, not consumed

        second = peeked[2].end_lsn  # the UPDATE's transaction: the "checkpoint"
        assert reader.received > second
        reader.confirm(second)
        wait_until(lambda: _slot_row(engine, name)[0] == second, 30, "the slot to move to the confirmed position")
    finally:
        reader.close()
    assert _fields(_peeked(engine, name)) == _fields(peeked[3:])  # what the stream received past it is kept
