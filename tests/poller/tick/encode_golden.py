"""The golden pages of the encode path: pg_logical-shaped (and keyset) pages, and what main sends for them.

Imports only ``poller`` and ``shared`` (never ``tests``), so it runs on any checkout's code:

    PYTHONPATH=/tmp/base-encode /tmp/base-encode/.venv/bin/python tests/poller/tick/encode_golden.py \
        tests/poller/tick/data/encode_golden.json

wrote the fixture from main (129ca76); ``test_encode_golden.py`` runs :func:`outputs` on the code
under test and compares: message bodies, message ids, properties and event ids byte for byte.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import ipaddress
import json
import sys
import uuid
from collections.abc import Callable
from dataclasses import replace
from decimal import Decimal
from typing import Any
from zoneinfo import ZoneInfo

from poller.ports import EventFields, KeysetColumns, Page, SourceRow
from poller.tick.epochs import Order, page_batches
from poller.tick.events import page_batch
from shared.codec import encode_batch
from shared.config import PollerConfig
from shared.messages import pack_batch
from shared.models import Lsn, Position, RowChange

FINGERPRINT = "sha256:golden"
READ_AT = dt.datetime(2026, 11, 29, 1, 2, 3, 456789, tzinfo=dt.UTC)
BERLIN, UTC_ZONE = ZoneInfo("Europe/Berlin"), ZoneInfo("UTC")
PLUS_0530 = dt.timezone(dt.timedelta(hours=5, minutes=30))


def _poller(**changes: Any) -> PollerConfig:
    base = PollerConfig(
        name="orders",
        source_url="postgresql://golden/db",
        cursor="version",
        pk=("id",),
        queue="orders-changes",
        table="public.orders",
    )
    return replace(base, **changes)


PG = _poller(kind="pg_logical", pk=())
KEYSET = _poller(cursor="version", pk=("id",), table="orders")


def _orders_row(i: int) -> dict[str, Any]:
    """A public.orders row: integer, text (unicode), numeric, timestamptz, jsonb, array, bytea, NULLs."""
    zone = (dt.UTC, UTC_ZONE, BERLIN, PLUS_0530)[i % 4]
    return {
        "id": i,
        "status": ("paid", "neu \u2013 ünïcødé ✓", 'q"uote\\', "emoji 🎉", "")[i % 5],
        "amount": None if i % 7 == 3 else (Decimal("12.50"), Decimal("-0.001"), Decimal("1E+3"), Decimal(i))[i % 4],
        "updated_at": dt.datetime(
            2026, 1, 1 + i % 28, i % 24, i % 60, i % 60, (i * 7919) % 1_000_000 * (i % 3 > 0), zone
        ),
        "payload": None if i % 5 == 4 else {"n": i, "tags": ["a", "ü"], "deep": {"x": [1, 2.5, None, True]}},
        "labels": ["x", None, "y"] if i % 2 else [],
        "blob": None if i % 6 == 0 else bytes([i % 256, 0, 255]) * (i % 3 + 1),
    }


def _lines_row(i: int) -> dict[str, Any]:
    """public.order_lines: a composite key, a uuid, a date, big integers, json with a big integer."""
    return {
        "order_id": i // 3,
        "line": i % 3,
        "sku": uuid.UUID(int=i * 104729 + 1),
        "ship_on": dt.date(2026, 2, 1 + i % 27),
        "qty": (1, 2**53, -(2**60), 7)[i % 4],
        "doc": [{"k": 2**60 + i}] if i % 4 == 1 else {"k": i, "v": [i, "ä"]},
        "at": dt.time(i % 24, 5, 6, 700 * i % 1_000_000),
        "wait": dt.timedelta(seconds=i * 1.5),
        "ip": ipaddress.ip_address(f"10.0.0.{i % 250}"),
        "grid": [[1, 2], [3, i]],
        "prices": [Decimal("1.10"), None, Decimal(i)],
    }


class Log:
    """Hands out commit LSNs and in-transaction sequence numbers, like pgoutput's decoder."""

    def __init__(self, start: int = 0x16_B374_D848) -> None:
        self.lsn = start

    def commit(self) -> tuple[Lsn, dt.datetime | None]:
        self.lsn += 0x1A8
        when = dt.datetime(2026, 11, 28, 23, 59, 58, 123000, tzinfo=dt.UTC) if self.lsn % 3 else None
        return Lsn(self.lsn), when


def _change(
    table: str,
    pk_cols: tuple[str, ...],
    kind: str,
    new: dict[str, Any] | None,
    old: dict[str, Any] | None,
    lsn: Lsn,
    seq: int,
    committed_at: dt.datetime | None,
    *,
    old_is_key: bool = False,
) -> SourceRow:
    """A SourceRow exactly as ``PgLogicalSource.row`` builds it."""
    deleted = kind == "delete"
    image = old if deleted else new
    source = image or {}
    before = old
    if kind == "update" and old_is_key and old is not None:
        before = {p: old[p] for p in pk_cols if p in old}
    fields = EventFields(
        pk={p: source[p] for p in pk_cols},
        cursor=(lsn, seq),
        change=kind,
        before=before,
        table=table,
        committed_at=committed_at,
    )
    return SourceRow(Position(lsn, {"seq": seq}, None), dict(new or {}), deleted, fields)


def _inserts(log: Log, count: int, per_commit: int, base: int = 0) -> list[SourceRow]:
    rows: list[SourceRow] = []
    for i in range(count):
        if i % per_commit == 0:
            lsn, when = log.commit()
        rows.append(_change("public.orders", ("id",), "insert", _orders_row(base + i), None, lsn, i % per_commit, when))
    return rows


def _mixed(log: Log, count: int) -> list[SourceRow]:
    """Inserts, updates (no before, full before, key change), deletes (old key, full old row), two tables."""
    rows: list[SourceRow] = []
    for i in range(count):
        if i % 4 == 0:
            lsn, when = log.commit()
        seq, k = i % 4, i % 9
        if i % 2:
            pk: tuple[str, ...] = ("order_id", "line")
            new, table = _lines_row(i), "public.order_lines"
        else:
            pk, new, table = ("id",), _orders_row(i), "public.orders"
        old = {**new, "qty" if "qty" in new else "status": "old"}
        if k in (0, 1):
            rows.append(_change(table, pk, "insert", new, None, lsn, seq, when))
        elif k == 2:
            rows.append(_change(table, pk, "update", new, None, lsn, seq, when))
        elif k == 3:
            rows.append(_change(table, pk, "update", new, old, lsn, seq, when))  # REPLICA IDENTITY FULL
        elif k == 4:
            moved = {**new, pk[0]: new[pk[0]] + 1000}
            rows.append(_change(table, pk, "update", moved, new, lsn, seq, when, old_is_key=True))
        elif k == 5:
            rows.append(_change(table, pk, "delete", None, {p: new[p] for p in pk}, lsn, seq, when))
        elif k == 6:
            rows.append(_change(table, pk, "delete", None, old, lsn, seq, when))
        elif k == 7:
            rows.append(_change('public."Wéird % ta""ble"', pk, "insert", new, None, lsn, seq, when))
        else:
            rows.append(_change(table, pk, "update", {**new, "status": None}, {}, lsn, seq, when))
    return rows


def _big_keys(log: Log) -> list[SourceRow]:
    """Keys past 2**53 and past 64 bits (the event ids' fallback form), text keys with unicode."""
    lsn, when = log.commit()
    rows = []
    for seq, key in enumerate([2**53 + 1, 2**64 + 5, -(2**63) - 1, 5]):
        rows.append(_change("public.big", ("id",), "insert", {"id": key, "v": seq}, None, lsn, seq, when))
    for seq, word in enumerate(["ä", "%s", '"', "𝄞"], start=4):
        rows.append(_change("public.words", ("w",), "insert", {"w": word, "n": None}, None, lsn, seq, when))
    return rows


def _snapshot_reads(log: Log) -> list[SourceRow]:
    """Snapshot chunk rows (``read``, a version in the id), as the coordinator builds them."""
    lsn, _ = log.commit()
    position, cursor = Position(lsn, {"seq": 0}, None), (lsn, 0)
    return [
        SourceRow(
            position,
            _orders_row(i),
            False,
            EventFields({"id": i}, cursor, "read", None, "public.orders", f"read/snap-1/public.orders/{700 + i}"),
        )
        for i in range(12)
    ]


def _keyset_page(count: int, nullable: bool) -> Page:
    columns = KeysetColumns(keys=("id", "version", "status", "amount", "deleted_at"), cursor="version", pk=("id",))
    when = dt.datetime(2026, 3, 4, 5, 6, 7, 890, tzinfo=dt.UTC)
    tuples = [
        (i, when + dt.timedelta(seconds=i), f"s{i} ü", None if nullable and i % 3 == 0 else Decimal(i) / 4, None)
        for i in range(count)
    ]
    return Page(tuples=tuples, make_row=columns.row_builder(), columns=columns)


def _claim(event: RowChange, size: int) -> RowChange:
    """A deterministic claim-check reference (what the hook returns: a small event)."""
    return replace(event, after={"claim_check": f"blob-{event.event_id}", "bytes": size}, before=None)


# name -> (poller, the page's builder, the order before it, (limit, max_events, claim-check)...)
Packing = tuple[int, int | None, bool]
LIMITS: tuple[Packing, ...] = ((256 * 1024, None, False), (9 * 1024, None, False), (256 * 1024, 1, False))


def cases() -> dict[str, tuple[PollerConfig, Callable[[], Page], Order, tuple[Packing, ...]]]:
    """Every golden case (pages are rebuilt for each use: a page caches what it builds)."""

    def rows(make: Callable[[Log], list[SourceRow]]) -> Callable[[], Page]:
        return lambda: Page(make(Log()))

    far = Order(2, (Lsn(0x17_0000_0000), 3))
    return {
        "pg_inserts_one_table": (PG, rows(lambda log: _inserts(log, 120, 10)), Order(), LIMITS),
        "pg_inserts_epoch_carried": (PG, rows(lambda log: _inserts(log, 30, 5)), Order(3, None), LIMITS[:1]),
        "pg_inserts_epoch_regressed": (PG, rows(lambda log: _inserts(log, 30, 5)), far, LIMITS[:1]),
        "pg_regression_inside_page": (
            PG,
            rows(lambda log: _inserts(log, 20, 4) + _inserts(Log(), 12, 3, 500)),
            Order(),
            LIMITS[:2],
        ),
        "pg_mixed_tables": (PG, rows(lambda log: _mixed(log, 160)), Order(), LIMITS),
        "pg_big_keys": (PG, rows(_big_keys), Order(), LIMITS[:1]),
        "pg_snapshot_reads": (PG, rows(_snapshot_reads), Order(1, None), LIMITS[:1]),
        "pg_oversize_claim_check": (PG, rows(lambda log: _mixed(log, 40)), Order(), ((4 * 1024 + 700, None, True),)),
        "keyset_tuples": (KEYSET, lambda: _keyset_page(60, False), Order(), LIMITS[:2]),
        "keyset_tuples_nullable": (KEYSET, lambda: _keyset_page(60, True), Order(), LIMITS[:1]),
    }


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def outputs() -> dict[str, Any]:
    """What the code on ``sys.path`` sends for every case: JSON-ready."""
    return {name: outputs_of(name) for name in cases()}


def outputs_of(name: str) -> dict[str, Any]:
    """What the code on ``sys.path`` sends for one case, per packing, and its events built one by one."""
    poller, make_page, order, packings = cases()[name]
    case: dict[str, Any] = {}
    for n, (limit, max_events, claim) in enumerate(packings):
        page = make_page()
        batches, after = page_batches(poller, FINGERPRINT, page, page_batch(poller, FINGERPRINT, page), order)
        sent = []
        for batch in batches:
            batch = replace(batch, read_at=READ_AT, traceparent="00-" + "ab" * 16 + "-" + "cd" * 8 + "-01")
            messages = pack_batch(batch, limit, oversize=_claim if claim else None, max_events=max_events)
            sent.append(
                {
                    "batch_id": batch.batch_id,
                    "epoch": batch.epoch,
                    "messages": [
                        {
                            "message_id": m.message_id,
                            "event_ids": list(m.event_ids),
                            "properties": dict(m.application_properties),
                            # The first packing's bodies as text (readable diffs), the others' digests.
                            **({"body": m.body.decode()} if n == 0 else {"body_sha256": _sha(m.body)}),
                        }
                        for m in messages
                    ],
                }
            )
        case[f"{limit}/{max_events}/{claim}"] = {"batches": sent, "order": repr(after)}
    # The events built one by one (LazyEvents' own path), and encode_batch over them.
    page = make_page()
    batch = page_batch(poller, FINGERPRINT, page)
    case["built"] = {
        "event_ids": [e.event_id for e in batch.events],
        "encode_batch_sha256": _sha(encode_batch(replace(batch, read_at=READ_AT))),
    }
    return case


if __name__ == "__main__":
    doc = {"how": __doc__.split("\n\n")[1].strip() if __doc__ else "", "cases": outputs()}
    with open(sys.argv[1], "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, indent=0, sort_keys=True)
        f.write("\n")
