"""dlq peek / export / replay / purge against the Service Bus emulator."""

from __future__ import annotations

import json

import pytest
from azure.servicebus import ServiceBusMessage

from dbfanout.ops.bus import peek_all
from shared.models import HandlerContext, RowChange
from shared.servicebus import QueueSender
from tests.cli.conftest import consume_like_host, dead_letter, said
from worker.runtime import Worker
from worker.split import Splitter

pytestmark = pytest.mark.integration


def test_replay_all_sends_copies_with_new_ids_then_empties_the_dlq(workspace, bus):
    # Given three messages dead-lettered from the poller's queue (duplicate detection on)
    ids = dead_letter(bus, workspace.queue, [b'{"n": 1}', b'{"n": 2}', b'{"n": 3}'])
    # When the operator replays them all
    result = workspace.run("dlq", "replay", workspace.queue, "--all", "--yes", "--json")
    # Then each came back with a new id and its provenance, and the DLQ is empty
    assert result.exit_code == 0, result.output + result.stderr
    report = json.loads(result.stdout)
    assert report["replayed"] == 3
    copies = list(peek_all(bus, workspace.queue, dead_letter=False))
    assert sorted(c.application_properties["dbfanout-replay-of"] for c in copies) == sorted(ids)
    assert all(c.message_id not in ids for c in copies)
    assert all(c.application_properties["dbfanout-replay-count"] == 1 for c in copies)
    assert all(c.application_properties["dbfanout-replay-reason"] == "HandlerFailed" for c in copies)
    assert all("DeadLetterReason" not in c.application_properties for c in copies)
    assert {c.body for c in copies} == {b'{"n": 1}', b'{"n": 2}', b'{"n": 3}'}
    assert workspace.emulator.queue_stats(workspace.queue)["dead_lettered"] == 0


def test_replay_inside_the_duplicate_detection_window_redelivers_and_the_fixed_handler_succeeds(workspace, bus):
    # Given rows whose messages a broken handler drove into the DLQ (retries, split, then DLQ)
    workspace.source.upsert([1, 2, 3])
    assert workspace.tick(sink=workspace.bus_sink(bus)).rows == 3
    config = workspace.config
    handled: list[int] = []
    broken = True

    def handler(events: list[RowChange], context: HandlerContext) -> None:
        if broken:
            raise RuntimeError("handler bug")
        handled.extend(e.pk["id"] for e in events)

    senders: dict[str, QueueSender] = {}
    splitter = Splitter(config, lambda q, ms: senders.setdefault(q, QueueSender(bus, q)).send_all(ms))
    worker = Worker(config, splitter=splitter, handlers={"orders": handler})

    def stats() -> dict[str, int]:
        counts: dict[str, int] = workspace.emulator.queue_stats(workspace.queue)
        return counts

    consume_like_host(bus, workspace.queue, worker, lambda: stats()["dead_lettered"] == 3 and stats()["messages"] == 0)
    originals = [v.message_id for v in peek_all(bus, workspace.queue)]
    # (a re-send with an original id is dropped: we are inside the duplicate-detection window)
    with bus.get_queue_sender(workspace.queue) as sender:
        sender.send_messages(ServiceBusMessage(b"{}", message_id=originals[0]))
    assert stats()["messages"] == 0
    # When the handler is fixed and the operator replays the DLQ
    broken = False
    result = workspace.run("dlq", "replay", workspace.queue, "--reason", "MaxDeliveryCountExceeded", "--yes")
    # Then the copies are delivered (new ids), the handler succeeds for every row, the DLQ is empty
    assert result.exit_code == 0, result.output + result.stderr
    assert stats()["dead_lettered"] == 0
    consume_like_host(bus, workspace.queue, worker, lambda: sorted(handled) == [1, 2, 3])
    assert stats()["messages"] == 0 and stats()["dead_lettered"] == 0
    for sender in senders.values():
        sender.close()


def test_peek_filters_and_shows_the_envelope_summary(workspace, bus):
    body = b'{"schema": "dbfanout.batch/1", "poller": "orders", "events": [{"pk": {"id": 7}}]}'
    dead_letter(bus, workspace.queue, [body], reason="HandlerFailed")
    dead_letter(bus, workspace.queue, [b"not json"], reason="EnvelopeError")
    result = workspace.run("dlq", "peek", workspace.queue, "--reason", "HandlerFailed", "--json")
    assert result.exit_code == 0, result.stderr
    (row,) = json.loads(result.stdout)
    assert row["dead_letter_reason"] == "HandlerFailed" and row["first_pks"] == [{"id": 7}]
    assert row["poller"] == "orders" and row["event_count"] == 1
    table = workspace.run("dlq", "peek", workspace.queue)
    assert table.exit_code == 0 and "EnvelopeError" in table.stdout
    assert workspace.run("dlq", "peek", workspace.queue, "--since", "yesterday").exit_code == 2


def test_export_then_replay_from_the_repaired_file(workspace, bus, tmp_path):
    # Given a poison message exported, and its body repaired in the file
    dead_letter(bus, workspace.queue, [b'{"v": "poison"}'])
    out = tmp_path / "dlq.jsonl"
    assert workspace.run("dlq", "export", workspace.queue, "--out", str(out)).exit_code == 0
    line = json.loads(out.read_text())
    line["body"] = '{"v": "fixed"}'
    out.write_text(json.dumps(line) + "\n")
    # When it is replayed from the file
    result = workspace.run("dlq", "replay", workspace.queue, "--from-file", str(out), "--yes")
    # Then the repaired body was sent and the original left the DLQ
    assert result.exit_code == 0, result.stderr
    (copy,) = peek_all(bus, workspace.queue, dead_letter=False)
    assert copy.body == b'{"v": "fixed"}'
    assert workspace.emulator.queue_stats(workspace.queue)["dead_lettered"] == 0


def test_replay_refusals_and_dry_run(workspace, bus):
    dead_letter(bus, workspace.queue, [b"a", b"b"])
    nothing = workspace.run("dlq", "replay", workspace.queue, "--yes")
    assert nothing.exit_code == 2 and "--all" in said(nothing)
    no_yes = workspace.run("dlq", "replay", workspace.queue, "--all")
    assert no_yes.exit_code == 3 and "--yes" in said(no_yes)
    dry = workspace.run("dlq", "replay", workspace.queue, "--all", "--dry-run", "--json")
    assert dry.exit_code == 0 and json.loads(dry.stdout)["selected"] == 2
    assert workspace.emulator.queue_stats(workspace.queue)["dead_lettered"] == 2
    missing = workspace.run("dlq", "peek", "no-such-queue")
    assert missing.exit_code == 1 and "does not exist" in said(missing)


def test_purge_needs_yes_and_respects_older_than(workspace, bus):
    dead_letter(bus, workspace.queue, [b"a", b"b"])
    assert workspace.run("dlq", "purge", workspace.queue).exit_code == 3
    young = workspace.run("dlq", "purge", workspace.queue, "--older-than", "1h", "--yes", "--json")
    assert young.exit_code == 0 and json.loads(young.stdout)["purged"] == 0
    everything = workspace.run("dlq", "purge", workspace.queue, "--yes", "--json")
    assert everything.exit_code == 0 and json.loads(everything.stdout)["purged"] == 2
    assert workspace.emulator.queue_stats(workspace.queue)["dead_lettered"] == 0
