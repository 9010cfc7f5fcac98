"""checkpoint export / reset / clone: round trips through real ticks, and every guardrail."""

from __future__ import annotations

import datetime as dt
import json

import pytest

from dbfanout.ops import checkpoints as ops
from poller.lease.keeper import StickyLease
from poller.sources.factory import open_source
from poller.sources.keyset.source import SqlSource
from poller.tick.lifecycle import run_tick
from tests.cli.conftest import said
from tests.poller.tick_support import RecordingSink

pytestmark = pytest.mark.integration


def delivered(sink) -> list[int]:
    return [pk for pk, _version in sink.delivered()]


def test_reset_to_cursor_makes_the_next_tick_redeliver_from_that_point(workspace):
    # Given a poller that delivered rows 1..20 (version i for id i)
    workspace.source.upsert(range(1, 21))
    assert sorted(delivered(workspace.drain())) == list(range(1, 21))
    assert workspace.run("checkpoint", "export", "orders", "--out", "before.json").exit_code == 0
    # When the operator resets it to just after (version 12, id 12)
    result = workspace.run("checkpoint", "reset", "orders", "--to-cursor", "12", "--pk", "id=12", "--yes")
    # Then the next ticks deliver rows 13..20 again, and only those
    assert result.exit_code == 0, result.output + result.stderr
    assert sorted(delivered(workspace.drain())) == list(range(13, 21))
    # And the previous state was backed up and the reset audited
    container = workspace.store().container_client
    backups = [b.name for b in container.list_blobs(name_starts_with=f"backups/{workspace.app_name}/orders/")]
    assert len(backups) == 1
    audit_lines = container.download_blob(f"audit/{workspace.app_name}.jsonl").readall().decode().splitlines()
    assert json.loads(audit_lines[-1])["action"] == "reset"


def test_a_reset_to_an_earlier_position_keeps_the_order_so_its_redelivery_starts_a_new_epoch__issue_39(workspace):
    # Given a poller that delivered rows 1..20 (version i for id i), all in epoch 0
    workspace.source.upsert(range(1, 21))
    assert {b.epoch for b in workspace.drain().accepted} == {0}
    # When the operator resets it back to (version 12, id 12)
    result = workspace.run("checkpoint", "reset", "orders", "--to-cursor", "12", "--pk", "id=12", "--yes")
    assert result.exit_code == 0, result.output + result.stderr
    # Then the redelivered rows come in epoch 1: "apply only if newer" applies them, not skips them as old
    again = workspace.drain().accepted
    assert sorted(e.pk["id"] for b in again for e in b.events) == list(range(13, 21))
    assert {b.epoch for b in again} == {1}


def test_reset_from_an_exported_file_restores_that_position(workspace):
    # Given an export taken after rows 1..5, then rows 6..9 delivered
    workspace.source.upsert(range(1, 6))
    workspace.drain()
    assert workspace.run("checkpoint", "export", "orders", "--out", "cp.json").exit_code == 0
    workspace.source.upsert(range(6, 10))
    assert sorted(delivered(workspace.drain())) == [6, 7, 8, 9]
    # When the operator resets from the file
    result = workspace.run("checkpoint", "reset", "orders", "--from-file", "cp.json", "--yes")
    # Then rows 6..9 are delivered again
    assert result.exit_code == 0, result.output + result.stderr
    assert sorted(delivered(workspace.drain())) == [6, 7, 8, 9]


def test_reset_to_beginning_redelivers_everything(workspace):
    workspace.source.upsert(range(1, 8))
    workspace.drain()
    result = workspace.run("checkpoint", "reset", "orders", "--to-beginning", "--yes", "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["after"]["checkpoint"]["cursor"] is None
    assert sorted(delivered(workspace.drain())) == list(range(1, 8))


def test_reset_is_refused_while_a_live_lease_is_held_even_with_force(workspace):
    # Given a tick in progress (the lease is held and not expired)
    workspace.source.upsert([1])
    workspace.drain()
    store = workspace.store()
    assert store.try_acquire(
        "busy-tick", dt.timedelta(seconds=60), SqlSource(workspace.config.poller("orders")).fingerprint
    )
    before = store.load()
    # When the operator resets, with or without --force
    for extra in ([], ["--force"]):
        result = workspace.run("checkpoint", "reset", "orders", "--to-beginning", "--yes", *extra)
        # Then it is refused with exit 3, naming the holder, and nothing changed
        assert result.exit_code == 3
        assert "live lease" in said(result) and "busy-tick" in said(result)
    assert store.load() == before


def test_reset_with_take_over_moves_the_checkpoint_under_a_running_owner_that_then_reloads(workspace):
    # Given a running app's poller that delivered rows 1..5 and keeps its lease between ticks
    workspace.source.upsert(range(1, 6))
    cfg = workspace.config.poller("orders")
    source, store = open_source(cfg), workspace.store()
    owner = StickyLease(store, "app-1", dt.timedelta(seconds=cfg.lease_ttl_seconds), source.fingerprint)
    sink = RecordingSink()
    assert run_tick(cfg, source, store, sink, owner_id="app-1", lease=owner).rows == 5
    before = store.load()
    assert before.doc.lease.owner_id == "app-1"
    # When the operator resets without --take-over, Then it is refused, pointing at --take-over
    refused = workspace.run("checkpoint", "reset", "orders", "--to-beginning", "--yes")
    assert refused.exit_code == 3 and "--take-over" in said(refused)
    # And a dry run with --take-over says what it would do and writes nothing
    dry = workspace.run("checkpoint", "reset", "orders", "--to-beginning", "--take-over", "--dry-run")
    assert dry.exit_code == 0 and "taking over the live lease of app-1" in said(dry)
    assert store.load() == before
    # When the operator means it
    taken = workspace.run("checkpoint", "reset", "orders", "--to-beginning", "--take-over", "--yes")
    # Then the checkpoint moved, the lease is free with a higher token, and the old state was backed up
    assert taken.exit_code == 0, taken.stdout + taken.stderr
    after = store.load()
    assert after.doc.checkpoint.position is None and after.doc.lease.owner_id is None
    assert after.doc.lease.fencing_token == before.doc.lease.fencing_token + 1
    container = store.container_client
    assert list(container.list_blobs(name_starts_with=f"backups/{workspace.app_name}/orders/"))
    # When a row appears, the owner's commit fails its CAS; its next tick reloads and redelivers all
    workspace.source.upsert([6])
    assert run_tick(cfg, source, store, sink, owner_id="app-1", lease=owner).stop_reason == "lease_lost"
    sink.accepted.clear()
    result = run_tick(cfg, source, store, sink, owner_id="app-1", lease=owner)
    assert result.rows == 6 and sorted(delivered(sink)) == [1, 2, 3, 4, 5, 6]
    assert result.fencing_token == before.doc.lease.fencing_token + 2


def test_reset_over_an_expired_unreleased_lease_needs_force(workspace):
    # Given a lease whose owner crashed (expired long ago, never released)
    workspace.source.upsert([1, 2])
    workspace.drain()
    store = workspace.store()
    snap = store.load()
    past = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=10)
    crashed = snap.doc.with_lease(
        snap.doc.lease.__class__(
            "crashed", snap.doc.lease.fencing_token + 1, acquired_at=past, heartbeat_at=past, expires_at=past
        )
    )
    store.replace(snap, crashed)
    # When the operator resets without --force, then with it
    refused = workspace.run("checkpoint", "reset", "orders", "--to-beginning", "--yes")
    forced = workspace.run("checkpoint", "reset", "orders", "--to-beginning", "--yes", "--force")
    # Then the first is refused (exit 3, says --force) and the second writes
    assert refused.exit_code == 3 and "--force" in said(refused)
    assert forced.exit_code == 0, forced.stderr
    assert store.load().doc.checkpoint.position is None
    assert store.load().doc.lease.fencing_token > crashed.lease.fencing_token


def test_reset_without_yes_and_without_a_terminal_is_refused(workspace):
    workspace.source.upsert([1])
    workspace.drain()
    before = workspace.store().load()
    result = workspace.run("checkpoint", "reset", "orders", "--to-beginning")
    assert result.exit_code == 3 and "--yes" in said(result)
    assert workspace.store().load() == before


def test_dry_run_shows_the_change_and_writes_nothing(workspace):
    workspace.source.upsert([1, 2, 3])
    workspace.drain()
    before = workspace.store().load()
    result = workspace.run("checkpoint", "reset", "orders", "--to-beginning", "--dry-run", "--json")
    assert result.exit_code == 0
    doc = json.loads(result.stdout)
    assert doc["written"] is False and doc["before"]["checkpoint"]["cursor"]["tiebreaker"] == {"id": 3}
    assert workspace.store().load() == before


def test_unknown_poller_is_a_usage_error(workspace):
    result = workspace.run("checkpoint", "reset", "nosuch", "--to-beginning", "--yes")
    assert result.exit_code == 2 and "no such poller" in said(result)


@pytest.mark.parametrize(
    ("cursor", "pk", "says"),
    [("yesterday", "id=1", "not a valid int"), ("5", "id=x", "--pk id"), ("5", "nope=1", "missing ['id']")],
)
def test_a_bad_cursor_or_pk_literal_is_a_usage_error(workspace, cursor, pk, says):
    workspace.source.upsert([1])
    workspace.drain()
    result = workspace.run("checkpoint", "reset", "orders", "--to-cursor", cursor, "--pk", pk, "--yes")
    assert result.exit_code == 2
    assert says in said(result)


def test_a_changed_source_is_refused_until_the_new_fingerprint_is_accepted(workspace):
    # Given a checkpoint, then a change to the source definition (a filter)
    workspace.source.upsert([1, 2])
    workspace.drain()
    workspace.config_path.write_text(
        workspace.config_path.read_text().replace('pk = ["id"]', 'pk = ["id"]\nfilter = "id > 0"', 1)
    )
    # When the operator resets without accepting, then with --accept-fingerprint (keeping the position)
    refused = workspace.run("checkpoint", "reset", "orders", "--to-beginning", "--yes")
    accepted = workspace.run("checkpoint", "reset", "orders", "--accept-fingerprint", "--yes")
    # Then the first is refused as a fingerprint mismatch; after the second the poller runs on
    assert refused.exit_code == 3 and "fingerprint mismatch" in said(refused)
    assert accepted.exit_code == 0, accepted.stderr
    workspace.source.upsert([3])
    assert delivered(workspace.drain()) == [3]


def test_a_tick_between_plan_and_write_is_reported_not_overwritten(workspace):
    # Given a reset planned while the poller is idle
    workspace.source.upsert([1, 2])
    workspace.drain()
    store = workspace.store()
    fingerprint = SqlSource(workspace.config.poller("orders")).fingerprint
    plan = ops.plan_reset(
        store,
        kind="beginning",
        position=None,
        current_fingerprint=fingerprint,
        ttl_seconds=30,
        now=dt.datetime.now(dt.UTC),
        operator="test",
    )
    # When a tick commits before the write
    workspace.source.upsert([3])
    workspace.drain()
    after_tick = store.load()
    # Then the write is refused and the tick's checkpoint stands
    with pytest.raises(ops.Refused, match="changed between reading and writing"):
        ops.apply(plan, store, workspace.app_name, now=lambda: dt.datetime.now(dt.UTC))
    assert store.load() == after_tick


def test_clone_gives_an_independent_poller_that_delivers_everything_again(workspace):
    # Given a production poller that delivered every row, and a backfill poller configured
    workspace.source.upsert(range(1, 16))
    workspace.drain()
    workspace.add_backfill()
    # When the operator clones it from the beginning
    result = workspace.run("checkpoint", "clone", "orders", "orders_backfill", "--from-beginning", "--yes")
    # Then the clone delivers all rows again, and the original's checkpoint is untouched
    assert result.exit_code == 0, result.stderr
    original = workspace.store().load().doc.checkpoint
    assert sorted(delivered(workspace.drain("orders_backfill"))) == list(range(1, 16))
    assert workspace.store().load().doc.checkpoint == original
    assert delivered(workspace.drain("orders")) == []


def test_clone_copies_the_position_and_never_overwrites(workspace):
    workspace.source.upsert(range(1, 6))
    workspace.drain()
    workspace.add_backfill()
    assert workspace.run("checkpoint", "clone", "orders", "orders_backfill", "--yes").exit_code == 0
    workspace.source.upsert([6])
    assert delivered(workspace.drain("orders_backfill")) == [6]
    again = workspace.run("checkpoint", "clone", "orders", "orders_backfill", "--yes")
    assert again.exit_code == 3 and "never overwrites" in said(again)
