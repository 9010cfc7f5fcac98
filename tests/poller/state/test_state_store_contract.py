"""The StateStore contract (seed 002 §4-§8), run against the in-memory fake and Azurite (R8)."""

from __future__ import annotations

import datetime as dt
import json
import threading
import uuid
from decimal import Decimal

import pytest

from poller.ports import Snapshot, StateStore
from shared.codec import encode_state
from shared.errors import FingerprintMismatchError, LostLeaseError, StateFormatError
from shared.models import Checkpoint, CursorValue, Position, StateDoc
from tests.poller.conftest import FINGERPRINT, FakeClock, StoreHarness

TTL = dt.timedelta(seconds=30)
SKEW = dt.timedelta(seconds=5)  # default: min(ttl / 2, 5 s)


def acquire(store: StateStore, owner: str = "A") -> Snapshot:
    snap = store.try_acquire(owner, TTL, FINGERPRINT)
    assert snap is not None, f"{owner} should have acquired the lease"
    return snap


def checkpoint(n: int, clock: FakeClock) -> Checkpoint:
    return Checkpoint(
        position=Position(cursor=T(n), pk={"id": n}),
        last_successful_batch_id=f"batch_{n:04d}",
        updated_at=clock(),
        metadata={"row_count": n},
    )


def T(n: int) -> dt.datetime:
    return dt.datetime(2026, 4, 7, 1, 0, tzinfo=dt.UTC) + dt.timedelta(seconds=n)


def stored(harness: StoreHarness) -> dict[str, object]:
    raw = harness.raw()
    assert raw is not None
    doc: dict[str, object] = json.loads(raw)
    return doc


# --------------------------------------------------------------------------------------------
# Acquisition (seed 002 §6)


def test_first_acquire_creates_the_blob_with_token_1_and_the_seed_002_fields(
    harness: StoreHarness, store: StateStore, clock: FakeClock
) -> None:
    # Given no state blob
    assert store.load() is None
    # When A acquires
    snap = acquire(store, "A")
    # Then the blob exists with fencing token 1, A as owner, and exactly the seed-002 layout
    raw = stored(harness)
    assert set(raw) == {"version", "poller_name", "source_fingerprint", "checkpoint", "lease"}
    assert raw["version"] == 1 and raw["poller_name"] == harness.poller_name
    assert raw["source_fingerprint"] == FINGERPRINT
    assert isinstance(raw["checkpoint"], dict) and isinstance(raw["lease"], dict)
    assert set(raw["checkpoint"]) == {"cursor", "last_successful_batch_id", "updated_at", "metadata"}
    assert set(raw["lease"]) == {"owner_id", "fencing_token", "acquired_at", "heartbeat_at", "expires_at"}
    assert raw["lease"]["owner_id"] == "A" and raw["lease"]["fencing_token"] == 1
    assert raw["lease"]["expires_at"] == "2026-04-07T01:23:30.000000Z"
    lease = snap.doc.lease
    assert (lease.acquired_at, lease.heartbeat_at, lease.expires_at) == (clock(), clock(), clock() + TTL)
    assert store.load() == snap


def test_a_held_lease_is_not_acquired__R4(harness: StoreHarness, store: StateStore, clock: FakeClock) -> None:
    # Given A holds the lease
    acquire(store, "A")
    before = harness.raw()
    # When B tries just before it lapses (expiry + skew margin)
    clock.advance((TTL + SKEW).total_seconds() - 0.001)
    result = harness.make(clock).try_acquire("B", TTL, FINGERPRINT)
    # Then B gets None, and nothing was written
    assert result is None
    assert harness.raw() == before


def test_a_live_lease_that_names_us_is_ours_renewed_with_its_token(
    harness: StoreHarness, store: StateStore, clock: FakeClock
) -> None:
    # Given A holds the lease (say its acquire landed but the answer was lost: A has no snapshot)
    first = acquire(store, "A")
    clock.advance(10)
    # When A tries again on another instance of the store, while the lease is live
    snap = acquire(harness.make(clock), "A")
    # Then A holds it with the same token, extended from now, in one conditional write
    assert snap.doc.lease.owner_id == "A" and snap.doc.lease.fencing_token == first.doc.lease.fencing_token
    assert snap.doc.lease.expires_at == clock() + TTL
    assert snap.etag != first.etag
    # And B still cannot take it
    assert harness.make(clock).try_acquire("B", TTL, FINGERPRINT) is None


def test_a_lapsed_lease_is_taken_with_the_fencing_token_bumped(
    harness: StoreHarness, store: StateStore, clock: FakeClock
) -> None:
    # Given A held the lease and let it lapse past the skew margin
    acquire(store, "A")
    clock.advance((TTL + SKEW).total_seconds())
    # When B tries
    snap = acquire(harness.make(clock), "B")
    # Then B holds it with token 2 and fresh times
    assert snap.doc.lease.owner_id == "B" and snap.doc.lease.fencing_token == 2
    assert snap.doc.lease.acquired_at == clock() and snap.doc.lease.expires_at == clock() + TTL


@pytest.mark.parametrize(
    ("ttl_s", "skew_margin", "expected_skew"),
    [(30, None, 5.0), (4, None, 2.0), (30, dt.timedelta(seconds=12), 12.0)],
    ids=["default-capped-at-5s", "default-half-ttl", "explicit"],
)
def test_the_skew_margin_keeps_an_expired_lease_untouchable_for_a_while(
    harness: StoreHarness, clock: FakeClock, ttl_s: int, skew_margin: dt.timedelta | None, expected_skew: float
) -> None:
    # Given A's lease has just expired
    ttl = dt.timedelta(seconds=ttl_s)
    a = harness.make(clock, skew_margin)
    assert a.try_acquire("A", ttl, FINGERPRINT) is not None
    b = harness.make(clock, skew_margin)
    clock.advance(ttl_s + expected_skew - 0.01)
    # When B tries within the skew margin, Then it is refused
    assert b.try_acquire("B", ttl, FINGERPRINT) is None
    # When B tries once the margin has passed, Then it gets it
    clock.advance(0.01)
    assert b.try_acquire("B", ttl, FINGERPRINT) is not None


def test_two_stores_racing_from_the_same_read_exactly_one_wins(
    harness: StoreHarness, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given A and B both read "no blob yet" before either wrote
    a, b = harness.make(clock), harness.make(clock)
    monkeypatch.setattr(b, "load", lambda: None)
    # When A creates first, then B creates from its stale read
    won = a.try_acquire("A", TTL, FINGERPRINT)
    lost = b.try_acquire("B", TTL, FINGERPRINT)
    # Then A won and B's create was refused (If-None-Match: *) as an outcome, not an error
    assert won is not None and lost is None
    # And the same for a takeover: both read the lapsed lease, A writes first
    clock.advance((TTL + SKEW).total_seconds())
    lapsed = a.load()
    monkeypatch.setattr(b, "load", lambda: lapsed)
    assert a.try_acquire("A2", TTL, FINGERPRINT) is not None
    assert b.try_acquire("B2", TTL, FINGERPRINT) is None
    snap = a.load()
    assert snap is not None and snap.doc.lease.owner_id == "A2" and snap.doc.lease.fencing_token == 2


def test_many_instances_racing_for_a_new_blob_produce_exactly_one_owner(
    harness: StoreHarness, clock: FakeClock
) -> None:
    # Given four instances starting at once
    stores = [harness.make(clock) for _ in range(4)]
    results: dict[str, Snapshot | None] = {}
    start = threading.Barrier(len(stores))

    def run(i: int) -> None:
        start.wait()
        results[f"owner-{i}"] = stores[i].try_acquire(f"owner-{i}", TTL, FINGERPRINT)

    # When they all try_acquire
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    # Then exactly one holds the lease, and it is the one on disk
    winners = [owner for owner, snap in results.items() if snap is not None]
    assert len(results) == 4 and len(winners) == 1
    assert stored(harness)["lease"] == {**stored(harness)["lease"], "owner_id": winners[0]}  # type: ignore[dict-item]


def test_a_fingerprint_mismatch_is_refused_without_writing(harness: StoreHarness, store: StateStore) -> None:
    # Given a state blob written for another source definition
    snap = acquire(store)
    store.release(snap)
    before = harness.raw()
    # When a poller with a different source tries to acquire
    # Then FingerprintMismatchError, and the blob is untouched (seed 002 §9)
    with pytest.raises(FingerprintMismatchError):
        store.try_acquire("B", TTL, "sha256:another-source")
    assert harness.raw() == before


# --------------------------------------------------------------------------------------------
# Fencing (seed 001 case C / W4)


def test_a_stale_owners_commit_after_takeover_is_rejected__case_C_W4(harness: StoreHarness, clock: FakeClock) -> None:
    # Given A's lease lapsed, B took over and committed
    a, b = harness.make(clock), harness.make(clock)
    a_snap = acquire(a, "A")
    clock.advance((TTL + SKEW).total_seconds())
    b_snap = b.commit(acquire(b, "B"), checkpoint(2, clock))
    # When A commits, heartbeats or releases with its old snapshot
    # Then each is LostLeaseError, and the checkpoint on disk is still B's
    with pytest.raises(LostLeaseError) as info:
        a.commit(a_snap, checkpoint(1, clock), ttl=TTL)
    assert info.value.window == "W4"
    with pytest.raises(LostLeaseError):
        a.heartbeat(a_snap, TTL)
    with pytest.raises(LostLeaseError):
        a.release(a_snap)
    on_disk = a.load()
    assert on_disk == b_snap
    assert on_disk.doc.checkpoint == checkpoint(2, clock) and on_disk.doc.lease.owner_id == "B"


def test_a_commit_with_a_stale_etag_of_our_own_is_rejected(store: StateStore, clock: FakeClock) -> None:
    # Given we committed once, moving the ETag
    snap = acquire(store)
    store.commit(snap, checkpoint(1, clock))
    # When we commit again with the older snapshot, Then LostLeaseError (the ETag is the fence)
    with pytest.raises(LostLeaseError):
        store.commit(snap, checkpoint(2, clock))


def test_commit_without_a_held_lease_is_refused_without_writing(
    harness: StoreHarness, store: StateStore, clock: FakeClock
) -> None:
    # Given a snapshot taken after release (nobody owns the lease)
    released = store.release(acquire(store))
    before = harness.raw()
    # When it is used to commit, Then LostLeaseError and nothing was written
    with pytest.raises(LostLeaseError):
        store.commit(released, checkpoint(1, clock))
    assert harness.raw() == before


# --------------------------------------------------------------------------------------------
# Heartbeat, commit, release (seed 002 §7, §8)


def test_heartbeat_extends_the_lease_for_the_same_owner_and_token(store: StateStore, clock: FakeClock) -> None:
    # Given A holds the lease
    snap = acquire(store)
    # When A heartbeats 20 s later
    clock.advance(20)
    beat = store.heartbeat(snap, TTL)
    # Then expires_at is now + ttl, owner/token/acquired_at unchanged, and a new ETag
    assert beat.doc.lease.expires_at == clock() + TTL and beat.doc.lease.heartbeat_at == clock()
    assert (beat.doc.lease.owner_id, beat.doc.lease.fencing_token) == ("A", 1)
    assert beat.doc.lease.acquired_at == snap.doc.lease.acquired_at
    assert beat.etag != snap.etag and store.load() == beat


def test_commit_with_ttl_extends_the_lease_in_the_same_write(store: StateStore, clock: FakeClock) -> None:
    # Given A holds the lease
    snap = acquire(store)
    # When A commits 20 s later with the TTL
    clock.advance(20)
    new = store.commit(snap, checkpoint(1, clock), ttl=TTL)
    # Then the checkpoint moved, expires_at is now + ttl, the fencing token is unchanged
    assert new.doc.checkpoint == checkpoint(1, clock)
    assert new.doc.lease.expires_at == clock() + TTL and new.doc.lease.fencing_token == 1
    # And a commit without TTL leaves the lease alone
    clock.advance(5)
    plain = store.commit(new, checkpoint(2, clock))
    assert plain.doc.lease == new.doc.lease
    assert store.load() == plain


def test_release_makes_the_lease_immediately_acquirable_by_another_owner(
    harness: StoreHarness, store: StateStore, clock: FakeClock
) -> None:
    # Given A holds the lease and committed
    snap = store.commit(acquire(store, "A"), checkpoint(1, clock))
    # When A releases it
    rel = store.release(snap)
    # Then nobody owns it, it expired now, the token and checkpoint are kept
    assert rel.doc.lease.owner_id is None and rel.doc.lease.expires_at == clock()
    assert rel.doc.lease.fencing_token == 1 and rel.doc.checkpoint == checkpoint(1, clock)
    assert stored(harness)["lease"]["owner_id"] is None  # type: ignore[index]
    # And B takes it at once, with token 2
    b = acquire(harness.make(clock), "B")
    assert b.doc.lease.fencing_token == 2 and b.doc.checkpoint == checkpoint(1, clock)


def test_replace_creates_or_compares_and_swaps(harness: StoreHarness, store: StateStore, clock: FakeClock) -> None:
    # Given no blob: an operator write creates it
    doc = StateDoc(poller_name=harness.poller_name, source_fingerprint=FINGERPRINT, checkpoint=checkpoint(5, clock))
    created = store.replace(None, doc)
    assert store.load() == created and created.doc == doc
    # When a second create races it, Then LostLeaseError (If-None-Match: *)
    with pytest.raises(LostLeaseError):
        store.replace(None, doc)
    # When replacing against the current ETag, Then it lands; against a stale one, LostLeaseError
    newer = store.replace(created, doc.with_checkpoint(checkpoint(6, clock)))
    with pytest.raises(LostLeaseError):
        store.replace(created, doc)
    assert store.load() == newer


# --------------------------------------------------------------------------------------------
# Corrupt and unknown state (never overwritten)


def _unknown_version(harness: StoreHarness) -> bytes:
    raw = json.loads(encode_state(StateDoc(poller_name=harness.poller_name, source_fingerprint=FINGERPRINT)))
    raw["version"] = 2
    return json.dumps(raw).encode()


@pytest.mark.parametrize(
    "make_bytes",
    [lambda h: b'{"version": 1, "checkpoint": {"cursor": ', _unknown_version, lambda h: b"[]"],
    ids=["truncated-json", "unknown-version", "not-an-object"],
)
def test_an_undecodable_blob_raises_state_format_error_and_is_left_byte_for_byte(
    harness: StoreHarness, store: StateStore, make_bytes: object
) -> None:
    # Given a state blob that does not decode
    data: bytes = make_bytes(harness)  # type: ignore[operator]
    harness.put_raw(data)
    # When loading or acquiring
    with pytest.raises(StateFormatError):
        store.load()
    with pytest.raises(StateFormatError):
        store.try_acquire("A", TTL, FINGERPRINT)
    # Then the blob is exactly as it was: acquire never "repairs" it
    assert harness.raw() == data


# --------------------------------------------------------------------------------------------
# Every cursor kind round-trips (R9)

CURSORS: dict[str, CursorValue] = {
    "timestamp-offset": dt.datetime(2026, 4, 7, 10, 23, 45, 123456, tzinfo=dt.timezone(dt.timedelta(hours=9))),
    "timestamp-utc": dt.datetime(2026, 4, 7, 1, 23, 45, 1, tzinfo=dt.UTC),
    "big-int": 2**70 + 1,
    "small-int": 12093,
    "decimal": Decimal("12345.67000"),
    "string": "order-\u00e9-42",
    "uuid": uuid.UUID("12345678-1234-5678-1234-567812345678"),
    "date": dt.date(2026, 4, 7),
    "composite": (dt.datetime(2026, 4, 7, 1, 0, tzinfo=dt.UTC), 7, Decimal("1.50")),
}


@pytest.mark.parametrize("kind", list(CURSORS))
def test_every_cursor_kind_round_trips_through_the_store(
    harness: StoreHarness, store: StateStore, clock: FakeClock, kind: str
) -> None:
    # Given a checkpoint at a cursor of this kind, with a composite primary key
    position = Position(cursor=CURSORS[kind], pk={"tenant": uuid.UUID(int=5), "id": 2**64, "line": "a"})
    cp = Checkpoint(position, "batch_20260407_012346_0001", clock(), {"row_count": 100})
    # When committed and read back by another instance
    store.commit(acquire(store), cp, ttl=TTL)
    loaded = harness.make(clock).load()
    # Then it is equal, down to offsets, exponents and types
    assert loaded is not None
    assert loaded.doc.checkpoint == cp
    assert repr(loaded.doc.checkpoint.position) == repr(position)
