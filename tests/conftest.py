from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from hypothesis import settings

from tests.support.azurite import Azurite, start_azurite
from tests.support.databases import MYSQL_URL, PG_URL, unreachable_reason

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
def pg_logical_url(pg_url: str) -> str:
    """A PostgreSQL URL whose server has wal_level = logical (for kind = "pg_logical" tests)."""
    from tests.poller.pg_logical_support import logical_reason

    reason = logical_reason(pg_url)
    if reason:
        pytest.skip(reason)
    return pg_url


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
