"""Install the way users install (issue 22), in fresh virtual environments, and run what they run.

1. The Functions app: a deployment copy of the project (what ``.funcignore`` leaves) and an
   environment from its ``requirements.txt`` alone, drivers commented out: ``function_app`` indexes,
   and a SQLite poller's tick delivers a row to a handler (Azurite and the emulator), on every
   Python the platform offers for a new app that this machine has (3.11, 3.13).
2. The same with ``pymysql`` uncommented in ``requirements-drivers.txt``: a MariaDB poller ticks.
3. The operator: the built wheel installed with ``[cli]`` and no driver: ``dbfanout --help``,
   ``dbfanout validate`` on a SQLite config, ``dbfanout emulator servicebus --help``.

Each runs on Python 3.11 and 3.13. pip's cache is reused (nothing is downloaded twice on one
machine). Each environment is made once per test session. Without the package registry (and
nothing cached), the tests skip and say so; a Python this machine does not have skips with its name.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import uuid
import zipfile
from pathlib import Path

import pytest
import sqlalchemy as sa

from sbemulator import Emulator
from sbemulator.testing import unique_queue
from tests.support.azurite import Azurite
from tests.support.databases import MYSQL_URL, unreachable_reason
from tests.support.deployment import PROBE_HANDLER, deployment_copy, probe_app_config

pytestmark = [pytest.mark.integration, pytest.mark.install]

REPO = Path(__file__).resolve().parents[2]
APP_TICK = Path(__file__).with_name("app_tick.py")
HOST_MESSAGES = REPO / "dbfanout" / "host" / "messages.py"
PIP_TIMEOUT = 600
ROWS = [(1, "first"), (2, "second")]


def find_python(version: str) -> str | None:
    """A ``python<version>`` that runs: on PATH, else a pyenv install (its shims refuse versions
    that are not selected); ``DBFANOUT_TEST_PYTHON_<3_13>`` overrides."""
    override = os.environ.get(f"DBFANOUT_TEST_PYTHON_{version.replace('.', '_')}")
    candidates = [override] if override else []
    candidates += [shutil.which(f"python{version}") or ""]
    candidates += sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{version}.*/bin/python{version}")))
    for candidate in filter(None, candidates):
        done = subprocess.run([candidate, "-c", "import ssl, sqlite3, venv"], capture_output=True, timeout=60)
        if done.returncode == 0:
            return candidate
    return None


def _pip(python: Path, *args: str) -> None:
    cmd = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT)
    if done.returncode != 0:
        if "No matching distribution" in done.stderr or "Could not find a version" in done.stderr:
            pytest.skip(f"cannot install {' '.join(args)} (package registry unreachable?): {done.stderr[-300:]}")
        raise AssertionError(f"pip install {' '.join(args)} failed:\n{done.stderr[-3000:]}")


def make_venv(where: Path, python: str) -> Path:
    subprocess.run([python, "-m", "venv", str(where)], check=True, capture_output=True, timeout=120)
    return where / "bin" / "python"


def uncomment_driver(app: Path, package: str) -> None:
    """What the README tells a user to do: uncomment their driver's line in requirements-drivers.txt."""
    path = app / "requirements-drivers.txt"
    lines = path.read_text().splitlines()
    hits = [i for i, line in enumerate(lines) if line.startswith(f"# {package}")]
    assert len(hits) == 1, f"requirements-drivers.txt has no commented line for {package}"
    lines[hits[0]] = lines[hits[0]][2:]
    path.write_text("\n".join(lines) + "\n")


class FunctionsApp:
    """A deployment copy with its own environment from requirements.txt."""

    def __init__(self, root: Path, python: str, drivers: tuple[str, ...] = ()) -> None:
        self.root = deployment_copy(root / "app")
        for driver in drivers:
            uncomment_driver(self.root, driver)
        (self.root / "handlers" / "probe.py").write_text(PROBE_HANDLER)
        self.python = make_venv(root / "venv", python)
        _pip(self.python, "-r", str(self.root / "requirements.txt"))

    def installed(self) -> set[str]:
        done = subprocess.run(
            [str(self.python), "-m", "pip", "list", "--format=json", "--disable-pip-version-check"],
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        )
        return {p["name"].lower() for p in json.loads(done.stdout)}

    def tick(self, settings: dict[str, str], queue: str) -> dict[str, object]:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/tmp"), **settings}
        cmd = [str(self.python), str(APP_TICK), "--app", str(self.root), "--poller", "orders", "--queue", queue]
        done = subprocess.run(
            [*cmd, "--messages-module", str(HOST_MESSAGES)], env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, f"the app's tick failed:\n{done.stderr[-4000:]}"
        result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
        return result


@pytest.fixture(scope="session")
def install_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("user-installs")


def _app_env(python_version: str, install_root: Path, drivers: tuple[str, ...] = ()) -> FunctionsApp:
    python = find_python(python_version)
    if python is None:
        pytest.skip(f"python{python_version} is not installed on this machine")
    return FunctionsApp(install_root / f"py{python_version}-{'-'.join(drivers) or 'nodriver'}", python, drivers)


# The oldest Python the project supports, and the newest the platform offers for a new app (from
# 3.13 the platform loads apps through azure-functions-runtime, and pip picks azure-functions 2.x).
PYTHONS = ["3.11", "3.13"]


@pytest.fixture(scope="session", params=PYTHONS)
def functions_app(request: pytest.FixtureRequest, install_root: Path) -> FunctionsApp:
    return _app_env(request.param, install_root)


@pytest.fixture(scope="session", params=PYTHONS)
def mysql_functions_app(request: pytest.FixtureRequest, install_root: Path) -> FunctionsApp:
    reason = unreachable_reason(MYSQL_URL)
    if reason:
        pytest.skip(reason)
    return _app_env(request.param, install_root, ("pymysql",))


def _settings(
    app: FunctionsApp, tmp_path: Path, azurite: Azurite, servicebus: Emulator, source_url: str
) -> dict[str, str]:
    return {
        "DBFANOUT_CONFIG": str(tmp_path / "dbfanout.toml"),
        "DBFANOUT_STATE": azurite.connection_string,
        "DBFANOUT_SERVICEBUS": servicebus.connection_string,
        "ORDERS_DB_URL": source_url,
        "PROBE_FILE": str(tmp_path / "handled.jsonl"),
    }


def _write_config(tmp_path: Path, table: str, queue: str) -> None:
    (tmp_path / "dbfanout.toml").write_text(probe_app_config(table, queue))


def _handled(tmp_path: Path) -> list[dict[str, object]]:
    path = tmp_path / "handled.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _fill(engine: sa.Engine, table: str, rows: list[tuple[int, str]]) -> None:
    with engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE TABLE {table} (id INTEGER PRIMARY KEY, version INTEGER NOT NULL, v VARCHAR(40))")
        conn.exec_driver_sql(f"CREATE INDEX ix_{table}_keyset ON {table} (version, id)")  # validate asks for it
        for i, v in rows:
            conn.exec_driver_sql(f"INSERT INTO {table} (id, version, v) VALUES ({i}, {i}, '{v}')")


def test_a_requirements_txt_app_ticks_a_sqlite_poller_end_to_end(
    functions_app: FunctionsApp,
    tmp_path: Path,
    azurite: Azurite,
    servicebus: Emulator,
) -> None:
    # Given an app installed from requirements.txt alone (no driver, no CLI extra) and a SQLite table
    installed = functions_app.installed()
    assert not installed & {"psycopg", "psycopg-binary", "pymysql", "typer", "rich", "croniter", "python-qpid-proton"}
    queue = unique_queue(servicebus, "inst", requires_duplicate_detection=True)
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'source.db'}")
    _fill(engine, "orders", ROWS)
    engine.dispose()
    _write_config(tmp_path, "orders", queue)
    settings = _settings(functions_app, tmp_path, azurite, servicebus, f"sqlite:///{tmp_path / 'source.db'}")
    # When the platform would fire the timer, then hand the queue's message to the worker function
    result = functions_app.tick(settings, queue)
    # Then both functions were indexed, the rows reached the handler, and no optional package loaded
    assert result["functions"] == ["poll_orders", f"work_{queue.replace('-', '_')}"]
    assert result["optional_loaded"] == []
    assert sorted((e["pk"]["id"], e["after"]["v"]) for e in _handled(tmp_path)) == ROWS  # type: ignore[index]


def test_a_requirements_txt_app_with_pymysql_ticks_a_mariadb_poller(
    mysql_functions_app: FunctionsApp,
    tmp_path: Path,
    azurite: Azurite,
    servicebus: Emulator,
) -> None:
    # Given requirements.txt with only pymysql uncommented, and a MariaDB table
    installed = mysql_functions_app.installed()
    assert "pymysql" in installed and not installed & {"psycopg", "psycopg-binary", "typer", "croniter"}
    table = "inst_" + uuid.uuid4().hex[:10]
    queue = unique_queue(servicebus, "inst", requires_duplicate_detection=True)
    engine = sa.create_engine(MYSQL_URL)
    _fill(engine, table, ROWS)
    try:
        _write_config(tmp_path, table, queue)
        settings = _settings(mysql_functions_app, tmp_path, azurite, servicebus, MYSQL_URL)
        # When the timer fires and the worker function gets the message
        result = mysql_functions_app.tick(settings, queue)
        # Then the rows reached the handler, and of the optional packages only pymysql was loaded
        assert result["optional_loaded"] == ["pymysql"] or all(
            str(m).startswith("pymysql")
            for m in result["optional_loaded"]  # type: ignore[attr-defined]
        )
        assert sorted((e["pk"]["id"], e["after"]["v"]) for e in _handled(tmp_path)) == ROWS  # type: ignore[index]
    finally:
        with engine.begin() as conn:
            conn.exec_driver_sql(f"DROP TABLE {table}")
        engine.dispose()


@pytest.fixture(scope="session")
def wheel(install_root: Path) -> Path:
    """``python -m build --wheel`` of this checkout (a copy, so no build/ folder is left behind)."""
    src = install_root / "src"
    shutil.copytree(
        REPO, src, ignore=shutil.ignore_patterns(".git", ".venv*", "node_modules", "build", "dist", "*.egg-info")
    )
    done = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--outdir", str(install_root / "dist"), str(src)],
        capture_output=True,
        text=True,
        timeout=PIP_TIMEOUT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (built,) = (install_root / "dist").glob("dbfanout-*.whl")
    return built


@pytest.fixture(scope="session", params=PYTHONS)
def operator_venv(request: pytest.FixtureRequest, install_root: Path, wheel: Path) -> Path:
    python = find_python(request.param)
    if python is None:
        pytest.skip(f"python{request.param} is not installed on this machine")
    venv = make_venv(install_root / f"operator-venv-{request.param}", python)
    _pip(venv, f"{wheel}[cli]")
    return venv.parent


def test_the_wheel_holds_every_file_the_packages_read(wheel: Path) -> None:
    # Given the files git tracks under the packages (modules and anything they read at run time)
    tracked = subprocess.run(
        ["git", "ls-files", "poller", "worker", "shared", "dbfanout", "sbemulator"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    # Then the wheel has each of them
    names = set(zipfile.ZipFile(wheel).namelist())
    assert sorted(set(tracked) - names) == []


def test_the_operator_wheel_runs_without_a_driver(
    operator_venv: Path, tmp_path: Path, azurite: Azurite, servicebus: Emulator
) -> None:
    installed = subprocess.run(
        [str(operator_venv / "python"), "-m", "pip", "list", "--format=json", "--disable-pip-version-check"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert not {p["name"].lower() for p in json.loads(installed)} & {"psycopg", "psycopg-binary", "pymysql"}
    dbfanout = str(operator_venv / "dbfanout")
    env = {"PATH": f"{operator_venv}:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp")}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([dbfanout, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)

    assert run("--help").returncode == 0
    emulator_help = run("emulator", "servicebus", "--help")
    assert emulator_help.returncode == 0 and "--app-config" in emulator_help.stdout, emulator_help.stderr
    # validate on a SQLite config, with the state account and Service Bus of a local run
    source = tmp_path / "source.db"
    engine = sa.create_engine(f"sqlite:///{source}")
    _fill(engine, "orders", [(1, "a")])
    engine.dispose()
    (tmp_path / "handlers").mkdir()
    (tmp_path / "handlers" / "__init__.py").write_text("")
    (tmp_path / "handlers" / "probe.py").write_text(PROBE_HANDLER)
    queue = unique_queue(servicebus, "inst", requires_duplicate_detection=True)
    _write_config(tmp_path, "orders", queue)
    env.update(
        ORDERS_DB_URL=f"sqlite:///{source}",
        DBFANOUT_STATE=azurite.connection_string,
        DBFANOUT_SERVICEBUS=servicebus.connection_string,
    )
    done = run("validate", "--config", str(tmp_path / "dbfanout.toml"), "--json")
    report = json.loads(done.stdout)
    statuses = {c["name"]: c["status"] for c in report["checks"]}
    assert statuses["handler"] == "ok" and statuses["source"] == "ok", (done.stdout, done.stderr)
    assert report["ok"] and done.returncode == 0, [c for c in report["checks"] if c["status"] == "fail"]
