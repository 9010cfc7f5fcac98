from __future__ import annotations

import os
import tempfile
import uuid
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from hypothesis import settings

from tests.support.azurite import Azurite, start_azurite
from tests.support.databases import MYSQL_URL, PG_URL, unreachable_reason
from tests.support.private_postgres import (
    LOGICAL_SETTINGS,
    PostgresBinariesMissing,
    shared_private_postgres,
    stop_recorded,
)

FULL = os.environ.get("DBFANOUT_FULL_TESTS") == "1"

# pytest-xdist's workers inherit COLUMNS=80 (and LINES) from the controller, and rich fixes a
# console's width from COLUMNS when the console is made: the CLI's consoles are made at import, so
# they would keep 80 columns and the CLI tests could not widen them with their own COLUMNS.
os.environ.pop("COLUMNS", None)
os.environ.pop("LINES", None)

# No per-example deadline: CI runs the 3.13 tests beside the 3.11 suite at the lowest CPU priority,
# where an example may wait for the CPU; what the properties check is correctness, not speed.
settings.register_profile("dbfanout", deadline=None)
settings.load_profile("dbfanout")


@pytest.fixture(scope="session")
def azurite() -> Iterator[Azurite]:
    """One in-memory Azurite for the session; tests use their own containers."""
    server = start_azurite()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def pg_url() -> str:
    reason = unreachable_reason(PG_URL)
    if reason:
        pytest.skip(reason)
    return PG_URL


@pytest.fixture(scope="session")
def mysql_url() -> str:
    reason = unreachable_reason(MYSQL_URL)
    if reason:
        pytest.skip(reason)
    return MYSQL_URL


@pytest.fixture(scope="session")
def mysql_binlog_url() -> Iterator[str]:
    """A MariaDB/MySQL URL whose server writes a row-based binlog (for kind = "mysql_binlog" tests).

    The shared test server's when it already has the binlog on (ROW, FULL images and metadata),
    else a private ``mariadbd`` started for this session (one per xdist worker), removed at the end.
    """
    from tests.support.private_mariadb import binaries_missing, binlog_reason, start_private_mariadb

    url = os.environ.get("DBFANOUT_TEST_MYSQL_BINLOG_URL", MYSQL_URL)
    if binlog_reason(url) is None:
        yield url
        return
    missing = binaries_missing()
    if missing:
        pytest.skip(f"{url.split('@')[-1]} has no row-based binlog and {missing}")
    server = start_private_mariadb()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'source.db'}"


@pytest.fixture(params=["sqlite", "postgresql", "mariadb"])
def any_db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Each test runs once per dialect; absent servers skip with the reason."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'source.db'}"
    url = PG_URL if request.param == "postgresql" else MYSQL_URL
    reason = unreachable_reason(url)
    if reason:
        pytest.skip(reason)
    return url


@pytest.fixture
def engine_for() -> Iterator[object]:
    engines: list[sa.Engine] = []

    def make(url: str) -> sa.Engine:
        engine = sa.create_engine(url)
        engines.append(engine)
        return engine

    yield make
    for e in engines:
        e.dispose()


@pytest.fixture(scope="session")
def servicebus() -> Iterator[object]:
    """The project's Service Bus emulator on a free port; tests create their own queues."""
    from sbemulator import EmulatorConfig
    from sbemulator.testing import running_emulator

    with running_emulator(EmulatorConfig()) as emulator:
        yield emulator


# ----------------------------------------------------------------------------------------------
# Private servers: when the server at a test URL cannot do what a test needs (PostgreSQL without
# wal_level = logical), the session starts its own from the installed binaries. One per session:
# the first test that needs it starts it and records it in the session's folder, which the
# controller hands to the xdist workers; the controller stops what is recorded at the end.

SESSION_DIR = pytest.StashKey[Path]()
SESSION_OWNER = pytest.StashKey[int]()


class _HandSessionToWorkers:
    """xdist hook: each worker shares the controller's session folder and owner pid."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    def pytest_configure_node(self, node: object) -> None:
        workerinput = node.workerinput  # type: ignore[attr-defined]
        workerinput["dbfanout_session_dir"] = str(self.config.stash[SESSION_DIR])
        workerinput["dbfanout_session_owner"] = self.config.stash[SESSION_OWNER]


def pytest_configure(config: pytest.Config) -> None:
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        config.stash[SESSION_DIR] = Path(workerinput["dbfanout_session_dir"])
        config.stash[SESSION_OWNER] = int(workerinput["dbfanout_session_owner"])
        return
    config.stash[SESSION_DIR] = Path(tempfile.gettempdir()) / f"dbfanout-session-{uuid.uuid4().hex[:12]}"
    config.stash[SESSION_OWNER] = os.getpid()
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_HandSessionToWorkers(config), "dbfanout-session-to-workers")


def pytest_unconfigure(config: pytest.Config) -> None:
    if getattr(config, "workerinput", None) is None and SESSION_DIR in config.stash:
        stop_recorded(config.stash[SESSION_DIR])


@pytest.fixture(scope="session")
def pg_logical_url(request: pytest.FixtureRequest) -> str:
    """A PostgreSQL URL whose server has wal_level = logical (for kind = "pg_logical" tests): the
    test server's when it can, else a private instance this session starts (skip: no binaries)."""
    from tests.poller.pg_logical_support import logical_reason

    reason = unreachable_reason(PG_URL) or logical_reason(PG_URL)
    if reason is None:
        return PG_URL
    config = request.config
    try:
        return shared_private_postgres(
            config.stash[SESSION_DIR], "logical", LOGICAL_SETTINGS, config.stash[SESSION_OWNER]
        )
    except PostgresBinariesMissing as exc:
        pytest.skip(f"{reason}, and no private instance can start: {exc}")


# ----------------------------------------------------------------------------------------------
# The skip summary: one line per skip reason before pytest's closing line (CI reads that line,
# so it stays last). Under xdist the controller receives every worker's reports.


def skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    reason = str(longrepr[2]) if isinstance(longrepr, tuple | list) else str(longrepr)
    return reason.removeprefix("Skipped: ")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if r.skipped]
    if not skipped:
        return
    files: dict[str, set[str]] = defaultdict(set)
    counts: dict[str, int] = defaultdict(int)
    for report in skipped:
        reason = skip_reason(report)
        counts[reason] += 1
        files[reason].add(report.nodeid.split("::")[0])
    terminalreporter.section(f"{len(skipped)} skipped, by reason", sep="-")
    for reason, count in sorted(counts.items(), key=lambda item: (-item[1], item[0])):
        where = sorted(files[reason])
        shown = ", ".join(where[:3]) + (f" and {len(where) - 3} more files" if len(where) > 3 else "")
        terminalreporter.line(f"{count:>4}  {reason}  [{shown}]")
