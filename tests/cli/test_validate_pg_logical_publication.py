"""validate (--fix) and a pg_logical poller's publication: partitioned tables, truncate, quoted names.

Issue 42: a partitioned table named in ``tables`` is published via its root, and a second
``--fix`` changes nothing; a publication without ``truncate`` is repaired. Issue 39: every name
``--fix`` writes into DDL is quoted (``public.Orders`` is not ``public.orders``). Real PostgreSQL.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from tests.cli.conftest import Workspace
from tests.poller.pg_logical_support import LogicalTable, logical_table

pytestmark = pytest.mark.integration

_MEMBERS = sa.text(
    "SELECT n.nspname || '.' || c.relname FROM pg_publication p JOIN pg_publication_rel r ON r.prpubid = p.oid"
    " JOIN pg_class c ON c.oid = r.prrelid JOIN pg_namespace n ON n.oid = c.relnamespace WHERE p.pubname = :pub"
)


@pytest.fixture
def unset_up(pg_logical_url: str) -> Iterator[LogicalTable]:
    """A table with neither publication nor slot (validate --fix creates both; dropped afterwards)."""
    with logical_table(pg_logical_url, slot=False) as table:
        yield table


def _add_poller(workspace: Workspace, table: LogicalTable, tables: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PG_LOGICAL_URL", table.url)
    workspace.config_path.write_text(
        workspace.config_path.read_text()
        + f'\n[pollers.changes]\nkind = "pg_logical"\nsource_url = "${{PG_LOGICAL_URL}}"\ntables = [{tables}]\n'
        + f'slot = "{table.config.slot}"\npublication = "{table.config.publication}"\nqueue = "{workspace.queue}"\n'
        + f'signal_table = "{table.config.signal_table}"\n'
    )


def _publication(workspace: Workspace, *args: str) -> dict[str, str]:
    result = workspace.run("validate", "changes", "--json", *args)
    (check,) = [c for c in json.loads(result.stdout)["checks"] if c["name"] == "publication"]
    return {"status": check["status"], "detail": check["detail"]}


def _checks_ok(workspace: Workspace, name: str) -> bool:
    checks = json.loads(workspace.run("validate", "changes", "--json", "--fix").stdout)["checks"]
    return all(c["status"] == "ok" for c in checks if c["poller"] == "changes" and c["name"] == name)


def _members(table: LogicalTable) -> set[str]:
    with table.engine.connect() as conn:
        return set(conn.execute(_MEMBERS, {"pub": table.config.publication}).scalars())


def test_a_partitioned_table_is_published_via_its_root_and_a_second_fix_changes_nothing__issue_42(
    workspace: Workspace, unset_up: LogicalTable, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a partitioned table (two partitions) named in tables
    parted = f"{unset_up.name}_parted"
    unset_up.sql(
        f"CREATE TABLE {parted} (id INTEGER, region TEXT, v TEXT, PRIMARY KEY (id, region)) PARTITION BY LIST (region)",
        f"CREATE TABLE {parted}_eu PARTITION OF {parted} FOR VALUES IN ('eu')",
        f"CREATE TABLE {parted}_us PARTITION OF {parted} FOR VALUES IN ('us')",
    )
    try:
        _add_poller(workspace, unset_up, f'"{parted}"', monkeypatch)
        # When validate --fix creates the publication
        first = _publication(workspace, "--fix")
        # Then it publishes the root (with publish_via_partition_root) and validate agrees
        assert first["status"] == "ok" and "publish_via_partition_root = true" in first["detail"], first
        checks = json.loads(workspace.run("validate", "changes", "--json").stdout)["checks"]
        mine = {c["name"]: c["status"] for c in checks if c["poller"] == "changes"}
        assert mine["publication"] == mine["replica identity"] == mine["slot"] == "ok", mine
        with unset_up.engine.connect() as conn:
            via_root = conn.execute(
                sa.text("SELECT pubviaroot FROM pg_publication WHERE pubname = :p"), {"p": unset_up.config.publication}
            ).scalar_one()
        assert via_root is True
        # And a second --fix changes nothing and says so
        second = _publication(workspace, "--fix")
        assert second["status"] == "ok" and "nothing to change" in second["detail"], second
    finally:
        unset_up.sql(f"DROP PUBLICATION IF EXISTS {unset_up.config.publication}", f"DROP TABLE IF EXISTS {parted}")


def test_fix_turns_publish_via_partition_root_on_for_a_publication_made_without_it__issue_42(
    workspace: Workspace, unset_up: LogicalTable, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a partitioned table already in a publication made by hand without via-root or truncate
    parted = f"{unset_up.name}_parted"
    pub = unset_up.config.publication
    unset_up.sql(
        f"CREATE TABLE {parted} (id INTEGER PRIMARY KEY, v TEXT) PARTITION BY RANGE (id)",
        f"CREATE TABLE {parted}_a PARTITION OF {parted} FOR VALUES FROM (0) TO (100)",
        f"CREATE TABLE IF NOT EXISTS {unset_up.config.signal_table} (poller text, kind text, id text, data text,"
        " written_at timestamptz, PRIMARY KEY (poller, kind))",
        f"CREATE PUBLICATION {pub} FOR TABLE {parted}, {unset_up.config.signal_table}"
        " WITH (publish = 'insert, update, delete')",
    )
    try:
        _add_poller(workspace, unset_up, f'"{parted}"', monkeypatch)
        # When validate runs: it fails and names what is wrong
        before = _publication(workspace)
        assert before["status"] == "fail", before
        assert "publish_via_partition_root" in before["detail"] and "TRUNCATE" in before["detail"]
        # When --fix runs: it says exactly which statements it ran
        fixed = _publication(workspace, "--fix")
        assert fixed["status"] == "ok", fixed
        assert "SET (publish_via_partition_root = true)" in fixed["detail"]
        assert "SET (publish = 'insert, update, delete, truncate')" in fixed["detail"]
        assert "ADD TABLE" not in fixed["detail"]  # the root is a member already (DuplicateObject before)
        # Then validate agrees, and a second --fix changes nothing
        assert _publication(workspace)["status"] == "ok"
        assert "nothing to change" in _publication(workspace, "--fix")["detail"]
    finally:
        unset_up.sql(f"DROP PUBLICATION IF EXISTS {pub}", f"DROP TABLE IF EXISTS {parted}")


def test_fix_adds_a_mixed_case_schema_qualified_table_by_its_quoted_name__issue_39(
    workspace: Workspace, unset_up: LogicalTable, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given "Orders"-style and orders-style tables side by side, and a publication holding neither
    mixed = unset_up.name.capitalize()
    pub = unset_up.config.publication
    unset_up.sql(
        f'CREATE TABLE public."{mixed}" (id INTEGER PRIMARY KEY, v TEXT)',
        f"CREATE TABLE IF NOT EXISTS {unset_up.config.signal_table} (poller text, kind text, id text, data text,"
        " written_at timestamptz, PRIMARY KEY (poller, kind))",
        f"CREATE PUBLICATION {pub} FOR TABLE {unset_up.config.signal_table}"
        " WITH (publish = 'insert, update, delete, truncate', publish_via_partition_root = true)",
    )
    try:
        _add_poller(workspace, unset_up, f'"public.{mixed}"', monkeypatch)
        # When validate --fix adds the table
        fixed = _publication(workspace, "--fix")
        # Then the publication holds public."Mixed" (not the lower-case table) and says what it ran
        assert fixed["status"] == "ok", fixed
        assert _members(unset_up) == {f"public.{mixed}", unset_up.config.signal_table}
        assert f'ADD TABLE "public"."{mixed}"' in fixed["detail"]
        assert _publication(workspace)["status"] == "ok"
        # And the mixed-case table's changes reach the poller (the twin's do not)
        assert _checks_ok(workspace, "slot")
        unset_up.sql(f"INSERT INTO public.\"{mixed}\" VALUES (1, 'a')", "INSERT INTO {t} (id, v) VALUES (2, 'b')")
        events = [e for b in workspace.drain("changes").accepted for e in b.events]
        assert [(e.table, e.pk) for e in events] == [(f"public.{mixed}", {"id": 1})]
    finally:
        unset_up.sql(f"DROP PUBLICATION IF EXISTS {pub}", f'DROP TABLE IF EXISTS public."{mixed}"')


def test_fix_adds_truncate_to_a_publication_made_before_it_was_asked_for__issue_42(
    workspace: Workspace, unset_up: LogicalTable, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a publication of the poller's tables made without truncate (as validate --fix made them before)
    pub = unset_up.config.publication
    unset_up.sql(
        f"CREATE TABLE IF NOT EXISTS {unset_up.config.signal_table} (poller text, kind text, id text, data text,"
        " written_at timestamptz, PRIMARY KEY (poller, kind))",
        f"CREATE PUBLICATION {pub} FOR TABLE {unset_up.name}, {unset_up.config.signal_table}"
        " WITH (publish = 'insert, update, delete')",
    )
    try:
        _add_poller(workspace, unset_up, f'"{unset_up.name}"', monkeypatch)
        # When validate runs: a warning that names TRUNCATE (the stream still flows without it)
        before = _publication(workspace)
        assert before["status"] == "warn" and "TRUNCATE" in before["detail"], before
        # When --fix runs: it adds truncate and says so; then validate is ok and a second --fix changes nothing
        fixed = _publication(workspace, "--fix")
        assert fixed["status"] == "ok" and "SET (publish = 'insert, update, delete, truncate')" in fixed["detail"]
        with unset_up.engine.connect() as conn:
            truncate = conn.execute(sa.text("SELECT pubtruncate FROM pg_publication WHERE pubname = :p"), {"p": pub})
            assert truncate.scalar_one() is True
        assert _publication(workspace)["status"] == "ok"
        assert "nothing to change" in _publication(workspace, "--fix")["detail"]
    finally:
        unset_up.sql(f"DROP PUBLICATION IF EXISTS {pub}")
