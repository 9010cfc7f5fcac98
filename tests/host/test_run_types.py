"""Every type, through the whole path, as a handler gets it (issue 42): ``dbfanout run`` streams.

tests/poller/sources/test_types_{postgres,mysql}.py drive each source directly; here the same
every-type tables and the same expected values go through the poller, the envelope, the Service
Bus emulator, the worker's decode and a handler. One app per database runs two pollers on one
table, a keyset one and a log one (pg_logical, mysql_binlog), each with its own queue and the
recording handler ``types_probe.py``. While the host runs, rows are inserted, then updated; each
value the handler got is compared (value and Python type) with what the driver reads for that
row at that moment, and the two source kinds with each other.
"""

from __future__ import annotations

import pickle
import shutil
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from poller.state.blob import open_state_store
from sbemulator import Emulator
from sbemulator.testing import unique_queue
from shared.settings import StorageConnection
from tests.host.app_support import AppDir, HostProcess, wait_for
from tests.poller.pg_logical_support import LogicalTable
from tests.poller.sources import test_types_mysql as my_types
from tests.poller.sources import test_types_postgres as pg_types
from tests.support.azurite import Azurite

pytestmark = pytest.mark.integration

PROBE = Path(__file__).with_name("types_probe.py")
Rows = dict[int, dict[str, Any]]
# Each write, and the cursor column ``c`` it sets for a row's id
PHASES: dict[str, Callable[[int], int]] = {"insert": lambda i: i, "update": lambda i: 10 + i}

# The every-type tables of the source tests, as fixtures of this module
pg_table = pg_types.table
my_table = my_types.table


def _app(root: Path, azurite: Azurite, servicebus: Emulator, url: str, keyset: str, log: str) -> AppDir:
    """An app folder with two pollers on the source at ``url``, ``keyset`` and ``log`` (their own
    TOML keys), each with a fresh queue, handing every batch to the recording handler."""
    queues = {
        name: unique_queue(servicebus, f"ty{name}", requires_duplicate_detection=True, lock_duration="PT30S")
        for name in ("keyset", "log")
    }
    app = AppDir.create(
        root, queue=queues["keyset"], storage=azurite.connection_string,
        servicebus=servicebus.connection_string, source_url=url,
    )  # fmt: skip
    shutil.copy(PROBE, root / "types_probe.py")
    common = 'source_url = "${ORDERS_DB_URL}"\nschedule = "*/1 * * * * *"\nhandler = "types_probe:handle"\n'
    sections = "".join(
        f'\n[pollers.{name}]\n{common}queue = "{queues[name]}"\n{keys}'
        for name, keys in (("keyset", keyset), ("log", log))
    )
    (root / "dbfanout.toml").write_text(f'[app]\nname = "{app.app_name}"\n{sections}')
    return app


def _handled(app: AppDir) -> list[dict[str, Any]]:
    """Every event the handler was given so far (duplicates included), in no particular order."""
    folder = app.root / "events"
    files = sorted(folder.glob("*.pickle")) if folder.exists() else []
    return [record for path in files for record in pickle.loads(path.read_bytes())]


def _rows(app: AppDir, poller: str, keep: Callable[[dict[str, Any]], bool], image: str = "after") -> Rows:
    """The ``image`` of the events of ``poller`` that ``keep`` accepts, by id."""
    return {r["pk"]["id"]: dict(r[image]) for r in _handled(app) if r["poller"] == poller and keep(r)}


def _phase_rows(app: AppDir, phase: str, image: str = "after") -> tuple[Rows, Rows]:
    """Each poller's events of the row states ``phase`` wrote, by id: keyset's, then the log
    source's (``image``: its after or before image). The cursor column ``c`` tells the states
    apart (the insert sets ``c = id``, the update ``c = 10 + id``)."""
    c = PHASES[phase]

    def wrote(r: dict[str, Any]) -> bool:
        return r["after"] is not None and r["after"]["c"] == c(r["pk"]["id"])

    keyset = _rows(app, "keyset", wrote)
    return keyset, _rows(app, "log", lambda r: r["change"] == phase and wrote(r), image)


def _stream_and_compare(
    app: AppDir,
    ids: set[int],
    write: Callable[[str], None],
    driver: Callable[[], Rows],
    agree: Callable[[Rows, Rows], None],
) -> None:
    """Insert (``write("insert")``), wait for both pollers' events, compare each with what the
    driver reads then; the same for the update, whose before image (the log source's) is the
    inserted row as the driver read it."""
    previous: Rows | None = None
    for phase in PHASES:
        write(phase)
        wait_for(partial(_delivered, app, phase, ids), 120, f"the {phase}s through both pollers")
        expected = driver()
        keyset, log = _phase_rows(app, phase)
        agree(expected, keyset)
        agree(expected, log)
        agree(keyset, log)  # the same column: the same value and type through both source kinds
        if previous is not None:
            agree(previous, _phase_rows(app, phase, image="before")[1])
        previous = expected


def _delivered(app: AppDir, phase: str, ids: set[int]) -> bool:
    return all(set(rows) == ids for rows in _phase_rows(app, phase))


def _pg_write(table: LogicalTable) -> Callable[[str], None]:
    """Writes the source test's rows (first literals, second literals, all NULL): the insert, or
    the update of each row to the next one's values."""
    rows = [
        [first for _, first, _ in pg_types.COLUMNS.values()],
        [second for _, _, second in pg_types.COLUMNS.values()],
    ]
    rows.append(["NULL"] * len(pg_types.COLUMNS))

    def write(phase: str) -> None:
        names = ", ".join(pg_types.COLUMNS)
        with table.engine.begin() as conn:
            for i, literals in enumerate(rows if phase == "insert" else rows[1:] + rows[:1], 1):
                c = PHASES[phase](i)
                sets = ", ".join(f"{n} = {v}" for n, v in zip(pg_types.COLUMNS, literals, strict=True))
                statement = (
                    f"INSERT INTO {table.name} (id, c, {names}) VALUES ({i}, {c}, {', '.join(literals)})"
                    if phase == "insert"
                    else f"UPDATE {table.name} SET c = {c}, {sets} WHERE id = {i}"
                )
                conn.execute(sa.text(statement))

    return write


def test_every_postgres_type_reaches_a_handler_as_psycopg_reads_it_through_keyset_and_pg_logical(
    tmp_path: Path, azurite: Azurite, servicebus: Emulator, pg_table: LogicalTable
) -> None:
    # Given a running host with a keyset and a pg_logical poller on a table of every type
    cfg = pg_table.config
    keyset = f'table = "{pg_table.name}"\ncursor = "c"\npk = ["id"]\nsettle_seconds = 0\n'
    log = (
        f'kind = "pg_logical"\ntables = ["{pg_table.name}"]\nslot = "{cfg.slot}"\n'
        f'publication = "{cfg.publication}"\nsignal_table = "{cfg.signal_table}"\n'
    )
    app = _app(tmp_path / "app", azurite, servicebus, pg_table.url, keyset, log)
    host = HostProcess(app)
    try:
        host.start()
        wait_for(host.started, 120, "the host to start")
        # When rows are inserted, then updated, while it streams
        # Then each value the handler got is psycopg's, of the same type, through both pollers
        _stream_and_compare(app, {1, 2, 3}, _pg_write(pg_table), lambda: pg_types._driver(pg_table), pg_types._agree)
    except BaseException:
        print(host.log_tail(80))
        raise
    finally:
        host.stop_quietly()


def _mysql_write(engine: sa.Engine, name: str) -> Callable[[str], None]:
    """Writes the source test's rows: the insert, or the update of each row to the next one's
    values. Every column any row sets (the source test writes the first row's: ``tm2`` stays NULL)."""
    names = ["id", "c", *dict.fromkeys(k for row in my_types.ROWS for k in row if k != "id")]
    rows = my_types.ROWS

    def write(phase: str) -> None:
        with engine.begin() as conn:
            if phase == "insert":
                insert = f"INSERT INTO {name} ({', '.join(names)}) VALUES ({', '.join(':' + n for n in names)})"
                for row in rows:
                    conn.execute(sa.text(insert), {**{n: row.get(n) for n in names}, "c": PHASES[phase](row["id"])})
                return
            update = f"UPDATE {name} SET {', '.join(f'{n} = :{n}' for n in names if n != 'id')} WHERE id = :id"
            for row, other in zip(rows, rows[1:] + rows[:1], strict=True):
                conn.execute(
                    sa.text(update),
                    {**{n: other.get(n) for n in names}, "id": row["id"], "c": PHASES[phase](row["id"])},
                )

    return write


def test_every_mysql_type_reaches_a_handler_as_the_driver_reads_it_through_keyset_and_the_binlog(
    tmp_path: Path, azurite: Azurite, servicebus: Emulator, mysql_binlog_url: str, my_table: tuple[str, sa.Engine]
) -> None:
    name, engine = my_table
    database = sa.make_url(mysql_binlog_url).database or "test"
    # Given a running host with a keyset and a mysql_binlog poller on a table of every type
    keyset = f'table = "{name}"\ncursor = "c"\npk = ["id"]\nsettle_seconds = 0\n'
    log = f'kind = "mysql_binlog"\ntables = ["{database}.{name}"]\n'
    app = _app(tmp_path / "app", azurite, servicebus, mysql_binlog_url, keyset, log)
    store = open_state_store(
        StorageConnection(connection_string=azurite.connection_string), "db-state", app.app_name, "log"
    )

    def positioned() -> bool:  # the binlog poller starts where the binlog is at its first tick
        snap = store.load()
        return snap is not None and snap.doc.checkpoint.position is not None

    host = HostProcess(app)
    try:
        host.start()
        wait_for(positioned, 120, "the binlog poller's starting point")
        # When rows are inserted, then updated, while it streams
        # Then each value the handler got is the driver's (docs/types.md's forms), through both pollers
        rows = {row["id"] for row in my_types.ROWS}
        driver = lambda: my_types._driver(engine, name)  # noqa: E731
        _stream_and_compare(app, rows, _mysql_write(engine, name), driver, my_types._agree)
    except BaseException:
        print(host.log_tail(80))
        raise
    finally:
        host.stop_quietly()
