"""kind = "mysql_binlog" under SIGKILL: tick processes die inside catch-up ticks, and nothing is lost.

Two tables (one with a composite key), large transactions that span ticks, key changes, hard
deletes, rolled-back transactions and a second writer holding a transaction open across a kill.
Each killed tick runs as a real process (tests/poller/mysql_binlog_killed_tick.py) against the blob
state store on Azurite; its "queue" is a file fsynced before a send returns. The last ticks run
here. Delivered = every event of all of them, de-duplicated by event id as the queue does.
Small counts by default; DBFANOUT_FULL_TESTS=1 runs more rounds and larger transactions.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import random
import signal
import subprocess
import sys
import uuid
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from poller.sources.mysql_binlog.source import MysqlBinlogSource
from poller.state.blob import open_state_store
from shared.codec import decode_batch
from shared.models import Batch, RowChange
from shared.settings import StorageConnection
from tests.conftest import FULL
from tests.poller.mysql_binlog_support import BinlogTables, binlog_tables, events_of, rebuild, source_rows
from tests.poller.tick_support import RecordingSink, drain
from tests.support.azurite import Azurite

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[4]
ROUNDS, LARGE = (8, 400) if FULL else (3, 40)


@pytest.fixture
def tables(mysql_binlog_url: str) -> Iterator[BinlogTables]:
    with binlog_tables(mysql_binlog_url) as made:
        yield made


class _History:
    """Writes random changes to both tables, keeping count of the row changes and deletes committed."""

    def __init__(self, tables: BinlogTables) -> None:
        self.t, self.rng = tables, random.Random(30)
        self.ids: set[int] = set()
        self.pairs: set[tuple[int, str]] = set()
        self.next_id, self.changes, self.deletes = 1, 0, 0
        self.held: sa.Connection | None = None
        self.held_changes = 0

    def _run(self, conn: sa.Connection, sql: str, params: dict[str, Any] | None = None) -> int:
        return int(conn.execute(sa.text(sql.format(t=self.t.name, c=self.t.composite)), params or {}).rowcount)

    def round(self) -> None:
        rng = self.rng
        with self.t.engine.begin() as conn:  # a large transaction: spans pages and ticks
            new = list(range(self.next_id, self.next_id + LARGE))
            self.next_id += LARGE
            conn.execute(sa.text(f"INSERT INTO {self.t.name} (id, v, n) VALUES (:id, 'big', 0)"),
                         [{"id": i} for i in new])  # fmt: skip
            self.ids |= set(new)
            self.changes += LARGE
        if self.held is not None:  # the second writer commits what it held open across the last kill
            self.held.commit()
            self.held.close()
            self.changes += self.held_changes
            self.held = None
        for _ in range(12):
            with self.t.engine.begin() as conn:
                self._small(conn, rng)
        with self.t.engine.connect() as conn:  # rolled back: never delivered
            self._run(conn, "INSERT INTO {t} (id, v, n) VALUES (:i, 'rolled back', 0)", {"i": 10**6 + self.next_id})
            conn.rollback()
        # a second writer opens a transaction and holds it while the next tick process runs (and dies)
        self.held = self.t.engine.connect()
        held_id = self.next_id
        self.next_id += 1
        self.held_changes = self._run(self.held, "INSERT INTO {t} (id, v, n) VALUES (:i, 'held', 0)", {"i": held_id})
        self.ids.add(held_id)
        a = rng.randrange(10**5)
        self.held_changes += self._run(self.held, "INSERT INTO {c} (a, b, v) VALUES (:a, 'h', 'held')", {"a": a})
        self.pairs.add((a, "h"))

    def _small(self, conn: sa.Connection, rng: random.Random) -> None:
        choice = rng.randrange(6)
        if choice == 0 and self.ids:  # updates
            for i in rng.sample(sorted(self.ids), min(3, len(self.ids))):
                self.changes += self._run(conn, "UPDATE {t} SET v = 'upd', n = n + 1 WHERE id = :i", {"i": i})
        elif choice == 1 and self.ids:  # a key change
            old, new = rng.choice(sorted(self.ids)), self.next_id
            self.next_id += 1
            self.changes += self._run(conn, "UPDATE {t} SET id = :n, n = n + 1 WHERE id = :o", {"n": new, "o": old})
            self.ids = (self.ids - {old}) | {new}
        elif choice == 2 and self.ids:  # hard deletes
            gone = rng.sample(sorted(self.ids), min(2, len(self.ids)))
            for i in gone:
                count = self._run(conn, "DELETE FROM {t} WHERE id = :i", {"i": i})
                self.changes, self.deletes = self.changes + count, self.deletes + count
            self.ids -= set(gone)
        elif choice == 3:  # composite inserts
            for _ in range(3):
                pair = (rng.randrange(10**5), rng.choice("xyz"))
                if pair not in self.pairs:
                    self.changes += self._run(conn, "INSERT INTO {c} (a, b, v) VALUES (:a, :b, 'new')",
                                              {"a": pair[0], "b": pair[1]})  # fmt: skip
                    self.pairs.add(pair)
        elif choice == 4 and self.pairs:  # a composite key change
            a, b = rng.choice(sorted(self.pairs))
            moved = (a, b + "m")
            if moved not in self.pairs:
                self.changes += self._run(conn, "UPDATE {c} SET b = :nb, v = 'moved' WHERE a = :a AND b = :b",
                                          {"a": a, "b": b, "nb": moved[1]})  # fmt: skip
                self.pairs = (self.pairs - {(a, b)}) | {moved}
        elif self.pairs:  # a composite delete
            a, b = rng.choice(sorted(self.pairs))
            count = self._run(conn, "DELETE FROM {c} WHERE a = :a AND b = :b", {"a": a, "b": b})
            self.changes, self.deletes = self.changes + count, self.deletes + count
            self.pairs.discard((a, b))

    def finish(self) -> None:
        if self.held is not None:
            self.held.commit()
            self.held.close()
            self.changes += self.held_changes
            self.held = None


def _killed(tables: BinlogTables, azurite: Azurite, container: str, out: Path, send: int, offset: float) -> None:
    config = json.dumps(dataclasses.asdict(tables.config))
    args = [config, azurite.connection_string, container, str(out), str(send), str(offset)]
    proc = subprocess.run([sys.executable, "-m", "tests.poller.mysql_binlog_killed_tick", *args], cwd=ROOT,
                          capture_output=True, timeout=300)  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]


def _order(event: RowChange) -> tuple[int, ...]:
    cursor: Any = event.cursor  # MariaDB: (domain, GTID seq no, seq)
    return tuple(cursor)


def test_kills_inside_catch_up_ticks_lose_nothing_and_keep_order_and_ids(
    tables: BinlogTables, azurite: Azurite, tmp_path: Path
) -> None:
    # Given a poller with small pages whose starting point is checkpointed
    tables.config = dataclasses.replace(tables.config, batch_size=7, max_batches_per_tick=4, max_uncommitted_batches=3)
    ttl = tables.config.lease_ttl_seconds
    container = f"t-{uuid.uuid4().hex[:20]}"
    store = open_state_store(StorageConnection(connection_string=azurite.connection_string), container, "t",
                             tables.config.name)  # fmt: skip
    drain(tables.config, MysqlBinlogSource(tables.config), store, RecordingSink(), owner_id="first")
    history, rng = _History(tables), random.Random(7)
    # When rounds of changes are written and each is read by a tick process SIGKILLed after a few sends
    outs = []
    for n in range(ROUNDS):
        history.round()
        outs.append(tmp_path / f"killed-{n}.jsonl")
        _killed(tables, azurite, container, outs[-1], send=rng.randrange(1, 5), offset=(n + 1) * 3 * ttl)
    history.finish()
    later = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=(ROUNDS + 2) * 3 * ttl)
    last = open_state_store(StorageConnection(connection_string=azurite.connection_string), container, "t",
                            tables.config.name, clock=lambda: later)  # fmt: skip
    sink = RecordingSink()
    drain(tables.config, MysqlBinlogSource(tables.config), last, sink, owner_id="next", clock=lambda: later,
          max_ticks=500)  # fmt: skip
    killed: list[Batch] = [decode_batch(line) for out in outs for line in out.read_bytes().splitlines() if line]
    every = [e for b in [*killed, *sink.accepted] for e in b.events]
    events = events_of([*killed, *sink.accepted])
    # Then every committed row change arrived once (after de-duplication), none rolled back
    assert len(events) == history.changes
    assert not [e for e in events if e.after and e.after.get("v") == "rolled back"]
    # every delete as a delete, with its old row
    deletes = [e for e in events if e.change == "delete"]
    assert len(deletes) == history.deletes and all(e.op == "delete" and e.before for e in deletes)
    # in commit order, so in order per key
    per_key: dict[tuple[Any, ...], list[tuple[int, ...]]] = defaultdict(list)
    for e in events:
        per_key[(e.table, *e.pk.values())].append(_order(e))
    assert all(order == sorted(order) for order in per_key.values())
    assert [_order(e) for e in events] == sorted(_order(e) for e in events)
    # ids stable: re-sent changes came with the ids they had, and each change has one id
    assert len(every) > len(events)  # the kills made the ticks re-send
    ids_of: dict[tuple[Any, ...], set[str]] = defaultdict(set)
    for e in every:
        ids_of[(e.table, e.cursor)].add(e.event_id)
    assert all(len(found) == 1 for found in ids_of.values())
    # and the target rebuilt from the events equals the source
    assert rebuild(events) == source_rows(tables)
