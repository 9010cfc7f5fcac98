"""Database drivers reach a deployment through requirements-drivers.txt (issue 13).

``requirements.txt`` is generated (a test keeps it in sync), so users add drivers to
``requirements-drivers.txt``, which the generated file includes with ``-r``. These tests check the
include with pip itself, the installer the Functions remote build runs, and that the generator
refuses what a remote build cannot resolve (``dbfanout[postgres]``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GENERATOR = REPO / "scripts" / "gen_requirements.py"


def _deployment(tmp_path: Path, drivers: str) -> Path:
    """A copy of the deployed requirements files, with ``drivers`` as the user's driver file."""
    app = tmp_path / "app"
    app.mkdir()
    shutil.copy(REPO / "requirements.txt", app / "requirements.txt")
    (app / "requirements-drivers.txt").write_text(drivers)
    return app


def test_the_generated_requirements_include_the_drivers_file() -> None:
    lines = (REPO / "requirements.txt").read_text().splitlines()
    assert lines[-1] == "-r requirements-drivers.txt"
    assert (REPO / "requirements-drivers.txt").is_file()
    funcignore = (REPO / ".funcignore").read_text().splitlines()
    assert "requirements-drivers.txt" not in funcignore  # deployed beside requirements.txt


def test_pip_installs_the_drivers_named_in_the_drivers_file(tmp_path: Path) -> None:
    # Given a deployment whose drivers file names a driver
    app = _deployment(tmp_path, "# PostgreSQL\npsycopg[binary]>=3.1,<4\npymysql>=1.1,<2\n")
    # When pip resolves requirements.txt from another working directory, as a remote build may
    report = tmp_path / "report.json"
    pip = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-deps", "--quiet"]
    done = subprocess.run(
        [*pip, "--report", str(report), "-r", str(app / "requirements.txt")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode != 0 and "No matching distribution" in done.stderr + done.stdout:
        pytest.skip(f"package registry unreachable: {done.stderr[-300:]}")
    assert done.returncode == 0, done.stderr
    # Then the drivers are installed along with the runtime
    names = {item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]}
    assert {"psycopg", "pymysql", "azure-functions", "sqlalchemy"} <= names


def test_the_generator_refuses_dbfanout_extras_in_the_drivers_file(tmp_path: Path) -> None:
    # Given a drivers file that names dbfanout[postgres] (not on a registry: a remote build fails)
    app = _deployment(tmp_path, "dbfanout[postgres]\n")
    # When the generator checks the deployment
    done = subprocess.run(
        [sys.executable, str(GENERATOR), "--check", "--output", str(app / "requirements.txt")],
        capture_output=True,
        text=True,
    )
    # Then it fails, naming the line and the fix
    assert done.returncode == 1
    assert "requirements-drivers.txt:1" in done.stderr and "psycopg[binary]" in done.stderr
