"""Fixtures for the infra/ tests: paths, the consistency module, and the offline gate's venv."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
INFRA = REPO / "infra"
FIXTURE_CONFIG = Path(__file__).resolve().parent / "fixtures" / "dbfanout.sample.toml"
ROOT_SAMPLE = REPO / "dbfanout.toml.sample"
INFRA_PYTHON = REPO / ".venv-infra" / "bin" / "python"


def load_consistency() -> ModuleType:
    """infra/consistency.py is a script beside the templates, not a package: load it by path."""
    name = "dbfanout_infra_consistency"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, INFRA / "consistency.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def sample_configs() -> list[Path]:
    """The fixture config, plus dbfanout.toml.sample at the repository root once it exists."""
    return [FIXTURE_CONFIG] + ([ROOT_SAMPLE] if ROOT_SAMPLE.is_file() else [])


@pytest.fixture(scope="session")
def consistency() -> ModuleType:
    return load_consistency()


@pytest.fixture
def infra_copy(tmp_path: Path) -> Path:
    """A private copy of infra/ to break on purpose."""
    dest = tmp_path / "infra"
    shutil.copytree(INFRA, dest, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


GATE_MODULES = ("checkov", "tree_sitter", "tree_sitter_bicep")


def gate_tools_missing() -> str | None:
    """Why the gate cannot run here (None: .venv-infra has its tools). `make test` installs them
    (scripts/bootstrap.sh --infra-gate); a venv left half-installed by a failed pip counts as missing."""
    if not INFRA_PYTHON.exists():
        return "no .venv-infra"
    probe = "import importlib.util as u, sys; sys.exit(0 if all(u.find_spec(m) for m in sys.argv[1:]) else 1)"
    found = subprocess.run([str(INFRA_PYTHON), "-c", probe, *GATE_MODULES], capture_output=True, check=False)
    return None if found.returncode == 0 else f".venv-infra lacks one of {', '.join(GATE_MODULES)}"


@pytest.fixture(scope="session")
def infra_python() -> Path:
    missing = gate_tools_missing()
    if missing:
        pytest.skip(
            f"the offline Bicep gate's tools are not installed ({missing}): `make test` installs them, "
            "or bash scripts/bootstrap.sh --infra-gate"
        )
    return INFRA_PYTHON


def replace_once(path: Path, old: str, new: str) -> None:
    text = path.read_text(encoding="utf-8")
    assert text.count(old) == 1, f"{old!r} occurs {text.count(old)} times in {path}"
    path.write_text(text.replace(old, new), encoding="utf-8")
