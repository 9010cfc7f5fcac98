"""``dbfanout dlq`` on a storage-queue poller's poison queue, against Azurite.

Poison messages are made the way production makes them: the poller's storage-queue sink enqueues
real envelopes, and the worker's settlement moves them to ``<queue>-poison`` after a failure.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from azure.storage.queue import QueueClient, QueueServiceClient
from typer.testing import CliRunner, Result

from dbfanout.cli import app
from poller.sinks.storagequeue import StorageQueueSink
from poller.sources.keyset.source import SqlSource
from poller.state.blob import open_state_store
from poller.tick.lifecycle import run_tick
from shared.config import load_config
from shared.settings import StorageConnection
from shared.storagequeue import StorageQueueSender, decode_queue_text, encode_queue_text, poison_queue_name
from tests.cli.conftest import said
from tests.conftest import FULL
from tests.poller.tick_support import SourceTable
from tests.support.azurite import Azurite
from tests.support.ports import wait_until
from worker.queue_consumer import settle_queue_message
from worker.runtime import Delivery

pytestmark = pytest.mark.integration

KILLS = 30 if FULL else 4
SEED = 20  # below 32, so one peek sees the whole poison queue

TOML = """
[app]
name = "{app}"
state_container = "{container}"

[pollers.orders]
source_url = "${{ORDERS_DB_URL}}"
table = "orders"
cursor = "version"
pk = ["id"]
queue = "{queue}"
transport = "storage-queue"
batch_size = 2
lease_ttl_seconds = 30
settle_seconds = 0
soft_delete_column = "deleted_at"
"""


@dataclass
class PoisonWorkspace:
    root: Path
    config_path: Path
    queue: str
    main: QueueClient
    poison: QueueClient
    source: SourceTable
    container: str
    app_name: str
    azurite: Azurite

    def run(self, *args: str) -> Result:
        return CliRunner(env={"COLUMNS": "250"}).invoke(app, [*args, "--config", str(self.config_path)])

    def poison_rows(self, ids: list[int]) -> None:
        """Rows → the poller's real sink → a worker whose handler fails once → the poison queue."""
        self.source.upsert(ids)
        config = load_config(self.config_path, app_root=self.root)
        cfg = config.poller("orders")
        store = open_state_store(
            StorageConnection(connection_string=self.azurite.connection_string),
            self.container,
            self.app_name,
            "orders",
        )
        sink = StorageQueueSink(cfg, StorageQueueSender(self.main))
        run_tick(cfg, SqlSource(cfg), store, sink, owner_id="test")

        def fail(_: Delivery) -> None:
            raise RuntimeError("handler bug")

        for message in self.main.receive_messages(max_messages=32, visibility_timeout=30):
            settle_queue_message(self.main, self.poison, message, fail, max_dequeue_count=1)

    def texts(self, client: QueueClient) -> list[str]:
        return [str(m.content) for m in client.peek_messages(max_messages=32)]


@pytest.fixture
def ws(tmp_path: Path, azurite: Azurite, monkeypatch: pytest.MonkeyPatch) -> Iterator[PoisonWorkspace]:
    service = QueueServiceClient.from_connection_string(azurite.connection_string)
    queue = f"orders-{uuid.uuid4().hex[:10]}"
    main, poison = service.create_queue(queue), service.create_queue(poison_queue_name(queue))
    app_name, container = f"app{uuid.uuid4().hex[:8]}", f"state-{uuid.uuid4().hex[:10]}"
    source = SourceTable(f"sqlite:///{tmp_path / 'source.db'}")
    config_path = tmp_path / "dbfanout.toml"
    config_path.write_text(TOML.format(app=app_name, container=container, queue=queue))
    monkeypatch.setenv("ORDERS_DB_URL", str(source.engine.url))
    monkeypatch.setenv("DBFANOUT_STATE", azurite.connection_string)
    monkeypatch.chdir(tmp_path)
    yield PoisonWorkspace(tmp_path, config_path, queue, main, poison, source, container, app_name, azurite)
    main.delete_queue()
    poison.delete_queue()


def test_peek_shows_poison_messages_and_export_writes_them_without_changing_the_queue(ws: PoisonWorkspace) -> None:
    # Given four rows whose two messages the worker moved to the poison queue
    ws.poison_rows([1, 2, 3, 4])
    assert len(ws.texts(ws.poison)) == 2
    # When the operator peeks (by the main queue's name) and exports (by the poison queue's name)
    peek = ws.run("dlq", "peek", ws.queue, "--json")
    table = ws.run("dlq", "peek", ws.queue)
    out = ws.root / "poison.jsonl"
    export = ws.run("dlq", "export", poison_queue_name(ws.queue), "--out", str(out))
    # Then peek shows id, insertion time, dequeue count (0: the poison copy is a new message), poller,
    # event count and first pks
    assert peek.exit_code == 0, said(peek)
    views = json.loads(peek.stdout)
    assert sorted(pk["id"] for v in views for pk in v["first_pks"]) == [1, 2, 3, 4]
    assert all(v["poller"] == "orders" and v["event_count"] == 2 and v["delivery_count"] == 0 for v in views)
    assert all(v["message_id"] and v["enqueued_time"] for v in views)
    assert table.exit_code == 0 and "MaxDequeueCountExceeded (poison queue)" in said(table)
    # And the export holds both, in the Service Bus shape (body, properties), and the poison queue is unchanged
    assert export.exit_code == 0, said(export)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(line["message_id"] for line in lines) == sorted(v["message_id"] for v in views)
    assert all({"body", "application_properties", "dead_letter_reason"} <= set(line) for line in lines)
    wait_until(lambda: len(ws.texts(ws.poison)) == 2, 10, "the scanned messages to be visible again")


def test_replay_puts_the_unchanged_text_back_then_empties_the_poison_queue(ws: PoisonWorkspace) -> None:
    # Given two poison messages
    ws.poison_rows([1, 2, 3, 4])
    originals = sorted(ws.texts(ws.poison))
    # When the operator replays them all
    result = ws.run("dlq", "replay", ws.queue, "--all", "--yes", "--json")
    # Then each is in the main queue with its text unchanged, the poison queue is empty, provenance reported
    assert result.exit_code == 0, said(result)
    report = json.loads(result.stdout)
    assert report["replayed"] == 2 and report["target"] == ws.queue
    assert all(row["original_id"] and row["replay_id"] for row in report["messages"])
    assert sorted(ws.texts(ws.main)) == originals
    assert ws.texts(ws.poison) == []


def test_replay_from_an_edited_export_puts_the_repaired_body(ws: PoisonWorkspace) -> None:
    # Given an export whose first line the operator edited
    ws.poison_rows([1, 2])
    out = ws.root / "poison.jsonl"
    assert ws.run("dlq", "export", ws.queue, "--out", str(out)).exit_code == 0
    line = json.loads(out.read_text().splitlines()[0])
    line["body"] = '{"repaired": true}'
    out.write_text(json.dumps(line) + "\n")
    # When it is replayed from the file
    result = ws.run("dlq", "replay", ws.queue, "--from-file", str(out), "--yes")
    # Then the repaired body (base64, as the trigger expects) is in the main queue, and the original gone
    assert result.exit_code == 0, said(result)
    assert "(repaired body)" in said(result)
    assert [decode_queue_text(t) for t in ws.texts(ws.main)] == [b'{"repaired": true}']
    assert ws.texts(ws.poison) == []


def test_replay_and_purge_refuse_what_does_not_fit(ws: PoisonWorkspace) -> None:
    # Given one poison message
    ws.poison_rows([1])
    # Then a sequence number, a missing selection and a missing --yes are refused, and nothing moved
    assert ws.run("dlq", "replay", ws.queue, "--sequence", "1", "--yes").exit_code == 2
    assert ws.run("dlq", "replay", ws.queue, "--yes").exit_code == 2
    assert ws.run("dlq", "replay", ws.queue, "--all").exit_code == 3
    assert ws.run("dlq", "purge", ws.queue).exit_code == 3
    assert len(ws.texts(ws.poison)) == 1 and ws.texts(ws.main) == []


def test_purge_older_than_keeps_young_messages_and_purge_all_deletes(ws: PoisonWorkspace) -> None:
    # Given two poison messages inserted just now
    ws.poison_rows([1, 2, 3, 4])
    # When the operator purges those older than an hour, then rehearses and purges all
    old = ws.run("dlq", "purge", ws.queue, "--older-than", "1h", "--yes", "--json")
    dry = ws.run("dlq", "purge", ws.queue, "--dry-run", "--json")
    everything = ws.run("dlq", "purge", ws.queue, "--yes")
    # Then the first deletes nothing, the dry run counts two, and the last empties the poison queue
    assert old.exit_code == 0, said(old)
    assert json.loads(old.stdout)["purged"] == 0
    assert json.loads(dry.stdout)["selected"] == 2
    assert everything.exit_code == 0 and "purged 2 message(s)" in said(everything)
    assert ws.texts(ws.poison) == [] and ws.texts(ws.main) == []


def test_replay_killed_at_random_points_never_loses_a_poison_message(ws: PoisonWorkspace) -> None:
    # Given a poison queue of unique messages (refilled when a replay empties it)
    seed = int(os.environ.get("DBFANOUT_TEST_SEED", "0")) or random.randrange(1 << 30)
    rng = random.Random(seed)
    originals: set[bytes] = set()
    copied: set[bytes] = set()

    def refill(n: int) -> None:
        for _ in range(n):
            body = f'{{"n": "{uuid.uuid4().hex}"}}'.encode()
            ws.poison.send_message(encode_queue_text(body))
            originals.add(body)

    def nothing_vanished() -> bool:
        # Take the copies out of the main queue (so later peeks stay under 32), then look at the
        # poison queue; originals a killed replay was holding are invisible until --hold runs out.
        for message in ws.main.receive_messages(max_messages=32, visibility_timeout=30):
            copied.add(decode_queue_text(message.content))
            ws.main.delete_message(message)
        in_poison = {decode_queue_text(t) for t in ws.texts(ws.poison)}
        return originals <= in_poison | copied

    command = [sys.executable, "-m", "dbfanout.cli", "dlq", "replay", ws.queue, "--all", "--yes", "--hold", "2"]
    command += ["--config", str(ws.config_path)]
    refill(SEED)
    kills = run = 0
    while kills < KILLS:  # runs until KILLS replays were killed mid-way (some end before their kill)
        run += 1
        assert run <= 4 * KILLS, f"seed {seed}: only {kills} of {run - 1} replays were still running at their kill"
        if not ws.texts(ws.poison):
            refill(5)
        # When a replay process is SIGKILLed at a random point (start-up, mid-scan, between put and delete)
        before = len(copied)
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ws.root)
        if rng.random() < 0.4:
            time.sleep(rng.uniform(0.2, 2.5))  # the kill moment itself is what is random here
        else:
            k = rng.randint(1, 3)
            wait_until(_ended_or_copied(proc, ws.main, k), 30, "copies to arrive", interval=0.005)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.wait(30)
        # Then every original is still in the poison queue or its copy reached the main queue
        wait_until(nothing_vanished, 20, f"seed {seed} run {run}: every original accounted for (a loss never is)")
        assert len(copied) >= before
    # And a clean replay empties the poison queue with every original copied
    result = ws.run("dlq", "replay", ws.queue, "--all", "--yes", "--hold", "2")
    assert result.exit_code == 0, said(result)
    wait_until(lambda: nothing_vanished() and not ws.texts(ws.poison), 30, "the poison queue to be empty")
    assert originals <= copied


def _ended_or_copied(proc: subprocess.Popen[bytes], main: QueueClient, k: int) -> Callable[[], bool]:
    """The replay ended, or ``k`` copies are in the (drained before each run) main queue."""
    return lambda: proc.poll() is not None or int(main.get_queue_properties().approximate_message_count or 0) >= k


def test_status_counts_a_storage_queue_pollers_queue_and_poison_queue(ws: PoisonWorkspace) -> None:
    # Given two messages poisoned and one more batch waiting in the main queue
    ws.poison_rows([1, 2, 3, 4])
    ws.main.send_message(encode_queue_text(b'{"waiting": true}'))
    # When the operator asks for the status
    result = ws.run("status", "orders", "--json")
    # Then the depth comes from the storage queue and its poison queue, not from Service Bus
    (row,) = json.loads(result.stdout)
    depth = row["queue_depth"]
    assert depth["queue"] == ws.queue and depth["how"].startswith("approximate")
    assert (depth["active"], depth["dead_lettered"]) == (1, 2)
