"""dlq peek / export / replay / purge against the Service Bus emulator."""

from __future__ import annotations

import json

import pytest

from dbfanout.ops.bus import peek_all
from tests.cli.conftest import dead_letter

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
