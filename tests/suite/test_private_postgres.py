"""The private PostgreSQL the suite starts when the test server cannot decode logically: it runs
with the asked settings, has the ``test`` database, and leaves nothing behind (stopped, or killed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.support.ports import free_port, port_open, wait_until
from tests.support.private_postgres import (
    LOGICAL_SETTINGS,
    PostgresBinariesMissing,
    find_bindir,
    start_private_postgres,
)

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def binaries() -> None:
    try:
        find_bindir()
    except PostgresBinariesMissing as exc:
        pytest.skip(str(exc))


def test_a_private_instance_decodes_logically_and_is_gone_once_stopped() -> None:
    # Given a private instance with the pg_logical tests' settings
    with start_private_postgres({**LOGICAL_SETTINGS, "application_name": "it's private"}) as pg:
        engine = sa.create_engine(pg.url)
        try:
            with engine.connect() as conn:
                # Then it has them (a quote in a value too), and the URL's database is ``test``
                assert conn.execute(sa.text("SHOW wal_level")).scalar() == "logical"
                assert conn.execute(sa.text("SHOW max_replication_slots")).scalar() == "40"
                assert conn.execute(sa.text("SHOW application_name")).scalar() != ""
                assert conn.execute(sa.text("SELECT current_database()")).scalar() == "test"
                assert conn.execute(sa.text("SELECT current_setting('listen_addresses')")).scalar() == "127.0.0.1"
        finally:
            engine.dispose()
        assert pg.root.is_dir() and port_open(pg.port)
    # When it is stopped: no server, no folder
    assert not pg.root.exists()
    assert not port_open(pg.port)
    pg.stop()  # again: nothing to do


def test_an_instance_whose_owner_is_killed_is_stopped_and_removed_by_its_watchdog(tmp_path: Path) -> None:
    # Given a process that starts a private instance and is SIGKILLed before it can stop it
    script = (
        "import os, signal, sys\n"
        "from tests.support.private_postgres import start_private_postgres\n"
        "pg = start_private_postgres({'wal_level': 'logical'})\n"
        "print(pg.root, pg.port, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == -9, done.stderr[-2000:]
    root_text, port_text = done.stdout.split()
    root, port = Path(root_text), int(port_text)
    # Then the watchdog stops the server and deletes its folder
    wait_until(lambda: not root.exists(), 60, "the killed owner's instance to be removed")
    wait_until(lambda: not port_open(port), 30, "the killed owner's server to stop")


def test_a_session_shares_one_instance_between_its_workers_and_stops_it_at_the_end(tmp_path: Path) -> None:
    # Given two test files that need a logical server, and a test URL where no server answers
    for name in ("test_one.py", "test_two.py"):
        (tmp_path / name).write_text(
            "from pathlib import Path\n\n"
            "def test_url(pg_logical_url):\n"
            "    Path(__file__).with_suffix('.url').write_text(pg_logical_url)\n"
        )
    env = {**os.environ, "DBFANOUT_TEST_PG_URL": f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/test"}
    # When pytest runs them in two xdist workers with the suite's conftest
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-q", "-n", "2",
         "--dist", "loadfile", "--rootdir", str(tmp_path), str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    # Then both got the same private instance, and it is stopped once the run has ended
    urls = {(tmp_path / name).read_text() for name in ("test_one.url", "test_two.url")}
    assert len(urls) == 1, urls
    (url,) = urls
    assert url != env["DBFANOUT_TEST_PG_URL"]
    assert not port_open(sa.make_url(url).port or 0)


def test_without_binaries_a_logical_test_skips_with_both_reasons_in_the_summary(tmp_path: Path) -> None:
    # Given a test URL where no server answers and no PostgreSQL binaries where the session looks
    (tmp_path / "test_logical.py").write_text("def test_url(pg_logical_url):\n    pass\n")
    empty = tmp_path / "no-binaries"
    empty.mkdir()
    env = {
        **os.environ,
        "DBFANOUT_TEST_PG_URL": f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/test",
        "DBFANOUT_TEST_PG_BINDIR": str(empty),
    }
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-q",
         "--rootdir", str(tmp_path), str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    # Then the test skips (the run passes), and the skip summary says why: no server, no binaries
    assert done.returncode == 0, done.stdout[-3000:]
    (line,) = [line for line in done.stdout.splitlines() if line.strip().startswith("1  ")]
    assert "not reachable" in line and "initdb and pg_ctl are not in DBFANOUT_TEST_PG_BINDIR" in line
    assert "1 skipped" in done.stdout.splitlines()[-1]
