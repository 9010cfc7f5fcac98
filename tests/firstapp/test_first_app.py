"""docs/first-app.md, steps 1-4, as a user follows them from an empty folder (issue 40).

1. clone the template; 2. ``dbfanout init --url ... --table orders``; 3. ``dbfanout run`` (it starts
Azurite and the Service Bus emulator itself); 4. insert a row: the handler init wrote logs it.
On SQLite and on PostgreSQL, each bounded in time, waiting on the run's log.
"""

from __future__ import annotations

import datetime as dt
import tomllib
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.firstapp.support import Run, dbfanout, template_clone
from tests.host.app_support import drop_pg_schema, pg_schema_url

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

HOST_START = 120.0  # Azurite, the emulator and the app's import on a loaded 2-core machine
HANDLED = 90.0  # a 5 s schedule, 2 s settle window, one delivery


def follow_the_page(app: Path, url: str, insert: str, *init_flags: str, params: dict[str, object] | None = None) -> str:
    """Steps 2-4; returns the run's log."""
    # Step 2: init writes the poller, the handler and the settings, and validates them.
    result = dbfanout(app, "init", "--url", url, "--table", "orders", *init_flags)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "next: `dbfanout run`" in result.stdout, result.stdout
    poller = tomllib.loads((app / "dbfanout.toml").read_text())["pollers"]["orders"]
    assert (poller["cursor"], poller["pk"], poller["queue"]) == ("updated_at", ["id"], "orders-changes")
    assert (app / "handlers" / "orders.py").exists() and (app / "local.settings.json").exists()
    # Step 3: one command, no emulator started by hand.
    run = Run(app)
    try:
        run.wait_for("dbfanout host running", HOST_START, "dbfanout run to start")
        assert "started Azurite" in run.text() and "started Service Bus emulator" in run.text()
        # Step 4: a change on the user's table reaches the handler.
        engine = sa.create_engine(url)
        with engine.begin() as conn:
            conn.execute(sa.text(insert), params or {})
        engine.dispose()
        run.wait_for("handled upsert {'id': 1} of orders", HANDLED, "the handler to log the inserted row")
    finally:
        code = run.stop()
    assert code == 0, run.text()[-3000:]
    return run.text()


def test_the_first_app_page_reaches_a_handled_change_on_sqlite(tmp_path: Path) -> None:
    # Given a clone of the template and a SQLite database with the user's table
    app = template_clone(tmp_path / "myapp")
    url = f"sqlite:///{app / 'shop.db'}"
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "CREATE TABLE orders (id INTEGER PRIMARY KEY, customer TEXT NOT NULL, amount REAL,"
            " updated_at TIMESTAMP NOT NULL)"
        )
        conn.exec_driver_sql("CREATE INDEX ix_orders_changed ON orders (updated_at, id)")
    engine.dispose()
    # When the user follows docs/first-app.md; Then the handler logs the inserted row
    now = dt.datetime.now(dt.UTC).replace(tzinfo=None)  # a naive column holding UTC, as init assumes
    follow_the_page(app, url, "INSERT INTO orders (customer, amount, updated_at) VALUES ('ada', 42, :at)",
                    params={"at": now})  # fmt: skip
    assert 'cursor_timezone = "UTC"' in (app / "dbfanout.toml").read_text()  # a naive TIMESTAMP column


@pytest.fixture
def pg_shop(pg_url: str) -> Iterator[str]:
    schema = f"firstapp_{uuid.uuid4().hex[:8]}"
    url = pg_schema_url(pg_url, schema)
    yield url
    drop_pg_schema(pg_url, schema)


def test_the_first_app_page_reaches_a_handled_change_on_postgresql(tmp_path: Path, pg_shop: str) -> None:
    # Given a clone of the template and a PostgreSQL table without the keyset index
    app = template_clone(tmp_path / "myapp")
    engine = sa.create_engine(pg_shop)
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "CREATE TABLE orders (id serial PRIMARY KEY, customer text NOT NULL, amount numeric,"
            " updated_at timestamptz NOT NULL DEFAULT now())"
        )
    engine.dispose()
    # When the user follows docs/first-app.md, letting init create the index it names
    follow_the_page(app, pg_shop, "INSERT INTO orders (customer, amount) VALUES ('ada', 42)", "--create-index")
    # Then the index exists and the deployment installs the driver
    assert "ix_orders_dbfanout" in {ix["name"] for ix in sa.inspect(sa.create_engine(pg_shop)).get_indexes("orders")}
    assert any(
        line.startswith("psycopg[binary]") for line in (app / "requirements-drivers.txt").read_text().splitlines()
    )
