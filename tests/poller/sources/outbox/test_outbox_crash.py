"""SIGKILL between enqueue and commit loses nothing from the outbox (and prunes nothing unconsumed).

A real poller process (tests/poller/outbox_kill_worker.py) ticks against the outbox with the blob
state store on Azurite; its sink records page N as accepted and then hangs, and we SIGKILL it
there: after the broker took the page, before its checkpoint write. The next owner (once the
dead one's lease lapsed) re-sends that page with the same batch and event ids — what the queue's
duplicate detection drops — and delivers every change exactly in order.
"""

from __future__ import annotations

import datetime as dt
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from poller.sources.factory import open_source
from poller.state.blob import open_state_store
from shared.settings import StorageConnection
from tests.poller.outbox_support import Outbox, outbox_poller, tick_until_caught_up
from tests.poller.tick_support import RecordingSink
from tests.support.azurite import ROOT, Azurite
from tests.support.ports import wait_until

pytestmark = pytest.mark.integration

ROWS = 23


@pytest.fixture
def outbox(any_db_url: str) -> Iterator[Outbox]:
    box = Outbox(any_db_url)
    yield box
    box.drop()


@pytest.mark.parametrize("killed_on_send", [1, 3])
def test_sigkill_between_enqueue_and_commit_loses_nothing(
    outbox: Outbox, azurite: Azurite, tmp_path: Path, killed_on_send: int
) -> None:
    for i in range(ROWS):
        outbox.write(str(i % 4), "update", {"seq": i})
    written = outbox.settled().ids()
    container, out = f"crash-{uuid.uuid4().hex[:12]}", tmp_path / "sent.jsonl"
    args = [str(outbox.engine.url), outbox.name, azurite.connection_string, container, str(out), str(killed_on_send)]
    child = subprocess.Popen([sys.executable, "-m", "tests.poller.outbox_kill_worker", *args], cwd=ROOT)
    try:
        # When the child is SIGKILLed while page N sits accepted but uncommitted
        wait_until(lambda: out.exists() and len(out.read_bytes().splitlines()) >= killed_on_send, 120, "page N sent")
        child.kill()
        assert child.wait(30) == -9
    finally:
        child.kill()
    sent = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    # Then no row it did not commit was pruned
    assert outbox.ids() == written
    # When the next owner ticks after the dead owner's lease lapsed
    poller = outbox_poller(str(outbox.engine.url), outbox.name, batch_size=5, max_batches_per_tick=10)

    def later() -> dt.datetime:
        return dt.datetime.now(dt.UTC) + dt.timedelta(seconds=poller.lease_ttl_seconds + 30)

    store = open_state_store(StorageConnection(connection_string=azurite.connection_string), container, "crash",
                             poller.name, clock=later)  # fmt: skip
    sink = RecordingSink()
    outbox.settled()
    tick_until_caught_up(poller, open_source(poller), store, sink)
    # Then it resumes right after what the dead owner committed (at most the pages before N), delivers
    # the rest in order, and re-sends the uncommitted page N with the same batch and event ids
    seqs = [e.after["seq"] for b in sink.accepted for e in b.events]  # type: ignore[index]
    assert seqs == list(range(ROWS - len(seqs), ROWS))
    assert ROWS - len(seqs) <= 5 * (killed_on_send - 1)
    resent = {b.batch_id: [e.event_id for e in b.events] for b in sink.accepted}
    assert resent[sent[-1]["batch_id"]] == sent[-1]["events"]
