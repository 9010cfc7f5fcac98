"""Optional packages stay optional (issue 22): the deployed app installs ``requirements.txt`` only
(plus the one driver a user uncomments), the operator ``pip install "dbfanout[cli]"`` with no driver.

The dev extra installs everything, so these tests hide packages the way a user's environment lacks
them (``sys.modules[name] = None`` makes ``import name`` fail) in a fresh interpreter each.
``tests/app/test_user_installs.py`` installs for real.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DRIVERS = ("psycopg", "psycopg2", "pymysql", "MySQLdb", "pyodbc", "pymysqlreplication")
CLI_EXTRA = ("typer", "rich", "croniter", "proton", "cproton")
PACKAGES = ("poller", "worker", "shared", "dbfanout", "sbemulator")

CONFIG = """
[app]
name = "shop"
servicebus_connection = "SB_CONN"

[pollers.orders]
source_url = "sqlite:///orders.db"
table = "orders"
cursor = "version"
pk = ["id"]
queue = "orders-changes"
schedule = "*/5 * * * * *"
handler = "handlers.orders:handle"

[pollers.stream]
kind = "pg_logical"
source_url = "postgresql+psycopg://app@db/shop"
tables = ["public.orders"]
slot = "shop_slot"
publication = "shop_pub"
pk = ["id"]
queue = "stream-changes"
schedule = "*/5 * * * * *"
handler = "handlers.orders:handle"

[pollers.binlog]
kind = "mysql_binlog"
source_url = "mysql+pymysql://app@db/shop"
tables = ["orders"]
queue = "binlog-changes"
schedule = "*/5 * * * * *"
handler = "handlers.orders:handle"
"""


def _run(code: str, hidden: tuple[str, ...], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    prelude = f"import sys\nfor _m in {hidden!r}: sys.modules[_m] = None\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "DBFANOUT_CONFIG": str(tmp_path / "dbfanout.toml"), "SB_CONN": "x"},
    )


def test_the_deployed_app_imports_with_no_driver_and_no_cli_extra(tmp_path: Path) -> None:
    (tmp_path / "dbfanout.toml").write_text(CONFIG)
    done = _run(
        """
        import function_app, poller.sources.factory, poller.runtime, worker.functions
        import poller.sources.pg_logical.source, poller.sources.mysql_binlog.source
        import worker.consumer, worker.idempotency, worker.queue_consumer, shared
        from shared import HandlerContext, RowChange
        names = sorted(f.get_function_name() for f in function_app.app.get_functions())
        print(names)
        """,
        DRIVERS + CLI_EXTRA,
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "poll_stream" in done.stdout and "work_orders_changes" in done.stdout and "poll_binlog" in done.stdout


def test_the_cli_starts_with_no_driver(tmp_path: Path) -> None:
    done = _run(
        """
        import dbfanout.cli, dbfanout.ops.validation, dbfanout.ops.status, dbfanout.host.runner
        import sbemulator.cli
        """,
        DRIVERS,
        tmp_path,
    )
    assert done.returncode == 0, done.stderr


def test_a_pg_logical_poller_without_psycopg_fails_its_start_with_the_fix(tmp_path: Path) -> None:
    (tmp_path / "dbfanout.toml").write_text(CONFIG)
    done = _run(
        """
        from shared.config import load_config
        from poller.sources.factory import open_source
        from shared.errors import ConfigError
        config = load_config()
        open_source(config.poller("orders"))  # a keyset poller on SQLite needs no driver
        try:
            open_source(config.poller("stream"))
        except ConfigError as exc:
            print(exc)
        """,
        ("psycopg",),
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert (
        'pollers.stream: kind = "pg_logical" needs psycopg 3: uncomment psycopg[binary] in requirements-drivers.txt'
        in done.stdout
    )


def test_a_mysql_binlog_poller_without_mysql_replication_fails_its_start_with_the_fix(tmp_path: Path) -> None:
    (tmp_path / "dbfanout.toml").write_text(CONFIG)
    done = _run(
        """
        from shared.config import load_config
        from poller.sources.factory import open_source
        from shared.errors import ConfigError
        try:
            open_source(load_config().poller("binlog"))
        except ConfigError as exc:
            print(exc)
        """,
        ("pymysqlreplication",),
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert (
        'pollers.binlog: kind = "mysql_binlog" needs mysql-replication: uncomment mysql-replication (and pymysql) '
        "in requirements-drivers.txt" in done.stdout
    )


def test_a_url_whose_driver_is_missing_names_the_package(tmp_path: Path) -> None:
    done = _run(
        """
        from poller.sources.engines import make_engine
        from shared.errors import ConfigError
        try:
            make_engine("mysql+pymysql://root:s3cret@db/shop", key="pollers.orders.source_url")
        except ConfigError as exc:
            print(exc)
        """,
        ("pymysql",),
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "pollers.orders.source_url: mysql+pymysql needs pymysql (not installed)" in done.stdout
    assert "uncomment pymysql in requirements-drivers.txt" in done.stdout
    assert "s3cret" not in done.stdout


def _imports(package: str) -> dict[str, set[str]]:
    """Module -> the modules of our packages it imports, anywhere in its body (function-level and
    TYPE_CHECKING imports included: a circle through them is still a circle)."""
    modules: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        if not name.startswith(package):
            continue
        edges = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for target in targets:
                found = resolve(target)
                if found and found != name and not name.startswith(found + "."):  # not its own package
                    edges.add(found)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in list(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_circles() -> None:
    assert _cycles(_imports("")) == []


def test_the_cycle_finder_finds_one() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("package", ["sbemulator"])
def test_the_emulator_imports_nothing_of_dbfanout(package: str) -> None:
    leaks = {m: sorted(t for t in ts if not t.startswith(package)) for m, ts in _imports(package).items()}
    assert {m: ts for m, ts in leaks.items() if ts} == {}
