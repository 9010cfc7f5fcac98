"""Racing pollers: several processes tick the same poller while a writer changes the table.

Each racer runs with a different clock offset, so the fast-clock ones regard the others' leases
as lapsed and take over mid-tick: real lease steals, and real stale commits for the fencing
to reject. Two racers keep their lease between ticks (sticky), the others acquire per tick.
Small counts by default; DBFANOUT_FULL_TESTS=1 runs 4 x 250 ticks.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import uuid
from collections import defaultdict
from pathlib import Path

import orjson
import pytest

from tests.conftest import FULL
from tests.poller.tick_support import SourceTable
from tests.support.azurite import ROOT, Azurite

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RACERS = 4
TICKS = 250 if FULL else 50  # per racer: 200 ticks in all by default


def test_racing_pollers_lose_nothing_and_never_commit_as_two_owners(tmp_path: Path, azurite: Azurite) -> None:
    table = SourceTable(f"sqlite:///{tmp_path / 'race.db'}")
    with table.engine.begin() as conn:
        conn.exec_driver_sql("PRAGMA journal_mode=WAL")
    table.upsert(range(40))
    stop = threading.Event()
    written: set[int] = set(range(40))

    def writer() -> None:
        next_id = 40
        while not stop.is_set():
            table.upsert([next_id, next_id % 17])  # an insert and an update
            written.add(next_id)
            next_id += 1
            stop.wait(0.02)

    container = f"race-{uuid.uuid4().hex[:12]}"
    logs = [tmp_path / f"racer{i}.jsonl" for i in range(RACERS)]
    offsets = [0, 0, 8, 20]  # seconds; racer 4 sees every 10 s lease (+5 s skew margin) as lapsed: it steals
    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.poller.race_worker",
                str(table.engine.url),
                azurite.connection_string,
                container,
                str(TICKS),
                str(offsets[i]),
                str(logs[i]),
                "0",
                "sticky" if i in (1, 2) else "per-tick",  # two keep their lease between ticks (racer 4 steals)
            ],
            cwd=ROOT,
        )
        for i in range(RACERS)
    ]
    try:
        for p in procs:
            assert p.wait(timeout=600) == 0
    finally:
        for p in procs:
            p.kill()
        stop.set()
        thread.join()

    # One more racer (no skew) ticks after the writer stopped, to catch up the tail
    final_log = tmp_path / "final.jsonl"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.poller.race_worker",
            str(table.engine.url),
            azurite.connection_string,
            container,
            "40",
            "30",
            str(final_log),
        ],
        cwd=ROOT,
        check=True,
        timeout=300,
    )
    records = [orjson.loads(line) for log in [*logs, final_log] for line in log.read_bytes().splitlines()]

    sent = {(r[0], r[1]) for rec in records if "sent" in rec for r in rec["sent"]}
    # No loss: every row's final state reached the sink, and every id ever written was delivered
    assert table.states() <= sent
    assert written <= {i for i, _ in sent}
    # Never two owners committing under one fencing token, and checkpoints only move forward
    owners_by_token: dict[int, set[str]] = defaultdict(set)
    commits = [rec for rec in records if rec.get("commit")]
    for rec in commits:
        owners_by_token[rec["token"]].add(rec["owner"])
    assert all(len(owners) == 1 for owners in owners_by_token.values()), owners_by_token
    by_token = sorted(commits, key=lambda r: r["token"])
    assert len(owners_by_token) > 1  # the lease really changed hands
    positions = [tuple(r["position"]) for r in by_token]
    assert positions == sorted(positions)
    ticks = [rec["tick"] for rec in records if "tick" in rec]
    assert len(ticks) >= RACERS * TICKS
    assert "lease_held" in ticks  # contention happened
    assert "lease_lost" in ticks  # a steal happened mid-tick, and the stale owner's commit was refused
