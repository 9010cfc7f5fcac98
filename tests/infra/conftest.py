"""Fixtures for the infra/ tests: paths, the consistency module, and the offline gate's venv."""

from __future__ import annotations

import atexit
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
REPO_INFRA = REPO / "infra"
FIXTURE_CONFIG = Path(__file__).resolve().parent / "fixtures" / "dbfanout.sample.toml"
ROOT_SAMPLE = REPO / "dbfanout.toml.sample"
INFRA_PYTHON = REPO / ".venv-infra" / "bin" / "python"


def load_infra_script(name: str) -> ModuleType:
    """A script beside the templates (consistency.py, params.py) is not a package: load it by path."""
    module_name = f"dbfanout_infra_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, REPO_INFRA / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def generated_infra(config: Path, dest: Path) -> Path:
    """A copy of infra/ whose main.parameters.json is what ``infra/params.py`` writes for ``config``."""
    shutil.copytree(REPO_INFRA, dest, ignore=shutil.ignore_patterns("__pycache__"))
    out = dest / "main.parameters.json"
    existing = json.loads(out.read_text(encoding="utf-8"))
    out.write_text(json.dumps(load_infra_script("params").generate(config, existing), indent=2), encoding="utf-8")
    return dest


def _fixture_infra() -> Path:
    root = Path(tempfile.mkdtemp(prefix="dbfanout-infra-"))
    atexit.register(shutil.rmtree, root, True)
    return generated_infra(FIXTURE_CONFIG, root / "infra")


#: infra/ with the parameters generated from the fixture config (two queue pollers and a topic
#: poller), which most tests here check and break. The committed parameters are the root sample's
#: (one poller): ``REPO_INFRA``. Made at import, so module constants and defaults can name it.
INFRA = _fixture_infra()


def load_consistency() -> ModuleType:
    return load_infra_script("consistency")


def sample_configs() -> list[tuple[Path, Path]]:
    """``(config, infra)``: the fixture config with its generated copy, and dbfanout.toml.sample at the
    repository root with the committed infra/."""
    return [(FIXTURE_CONFIG, INFRA), (ROOT_SAMPLE, REPO_INFRA)]


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
