"""``dbfanout run`` across a simulated MariaDB failover (issue 39, "order that survives a failover"):
after the switch, the source's changes carry *lower* cursors, and a handler that applies a change
only if it is newer (the example handler, over ``worker.ordering.LatestVersions``) still applies
every later one: the target equals the source.

The switch: the first changes are written in GTID domain 9, the later ones in domain 0 (one
session's ``gtid_domain_id`` on the private MariaDB), as a failover to a server whose GTIDs sort
lower writes them; the cursors ``(domain, seq no, seq)`` go from ``(9, ...)`` back to ``(0, ...)``.
Before the order epoch, every later change of a key written before the switch was skipped for good.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from poller.tick.epochs import Order
from sbemulator import Emulator
from tests.host.app_support import HostProcess, Target, wait_for
from tests.host.test_run_mysql_binlog import binlog_app
from tests.poller.mysql_binlog_support import BinlogTables, binlog_tables
from tests.support.azurite import Azurite

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _in_domain(tables: BinlogTables, domain: int, *statements: str) -> None:
    """Each statement its own transaction, its GTID in ``domain`` (this session only)."""
    with tables.engine.connect() as conn:
        conn.execute(sa.text(f"SET SESSION gtid_domain_id = {domain}"))
        for statement in statements:
            conn.execute(sa.text(statement.format(t=tables.name)))
            conn.commit()


def _source_rows(tables: BinlogTables) -> dict[int, dict[str, Any]]:
    with tables.engine.connect() as conn:
        rows = conn.execute(sa.text(f"SELECT id, v, n FROM {tables.name}")).all()
    return {r.id: {"id": r.id, "v": r.v, "n": r.n} for r in rows}


def test_later_changes_with_lower_cursors_after_a_failover_are_applied__issue_39(
    tmp_path: Path, azurite: Azurite, servicebus: Emulator, mysql_binlog_url: str
) -> None:
    with binlog_tables(mysql_binlog_url) as tables:
        app, queue, store = binlog_app(tmp_path, azurite, servicebus, tables, "failover", "batch_size = 4\n")

        def checkpoint_metadata() -> dict[str, Any]:
            snap = store.load()
            return dict(snap.doc.checkpoint.metadata) if snap is not None and snap.doc.checkpoint.position else {}

        target, host = Target(app.root / "target.db"), HostProcess(app)
        try:
            # Given a running host, and keys 1-5 written and updated on the old primary (domain 9), handled
            host.start()
            wait_for(lambda: bool(checkpoint_metadata()), 120, "the poller's first checkpoint")
            _in_domain(
                tables,
                9,
                *(f"INSERT INTO {{t}} (id, v, n) VALUES ({k}, 'old primary', 0)" for k in range(1, 6)),
                "UPDATE {t} SET n = 1 WHERE id IN (1, 2)",
            )
            before = _source_rows(tables)
            wait_for(lambda: target.rows() == before, 120, "the old primary's changes to be handled")
            # When the new primary (domain 0: lower cursors) updates them, deletes one, inserts one
            _in_domain(
                tables,
                0,
                "UPDATE {t} SET v = 'new primary', n = n + 10 WHERE id IN (1, 3)",
                "DELETE FROM {t} WHERE id = 2",
                "UPDATE {t} SET v = 'new primary', n = n + 20 WHERE id = 4",
                "INSERT INTO {t} (id, v, n) VALUES (6, 'new primary', 0)",
                "UPDATE {t} SET n = n + 1 WHERE id = 1",
                "INSERT INTO {t} (id, v, n) VALUES (-1, 'end', 0)",  # the last change to wait for
            )
            expected = _source_rows(tables)

            def settled() -> bool:  # the last change handled and nothing left in the queue
                return -1 in target.rows() and servicebus.queue_stats(queue)["messages"] == 0

            wait_for(settled, 180, "the last change to be handled and the queue to drain")
            # Then every later change was applied (none skipped as older), the delete included
            assert target.rows() == expected, host.log_tail()
            assert expected[1] == {"id": 1, "v": "new primary", "n": 12} and 2 not in expected
            # And the poller is in its next order epoch, which it keeps in the checkpoint
            assert Order.of(checkpoint_metadata()).epoch == 1
        finally:
            host.stop_quietly()
            target.close()
