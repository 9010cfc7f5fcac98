"""The Functions package holds what the app imports and nothing else (issue 38).

The package is built the way a deployment builds it (every top-level entry ``.funcignore`` does not
exclude: ``tests/support/deployment.py``), then ``function_app.py`` is imported from it in a fresh
interpreter: every Python package the package ships must be one the app imports, and the operator
side (the CLI, the local host, the demo: ``dbfanout/``) and the emulator are not shipped at all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.deployment import PROBE_HANDLER, deployment_copy, probe_app_config

_IMPORT = """
import json, sys
import function_app
from shared.config import load_config
for poller in load_config().pollers.values():   # what the worker imports at its first delivery
    __import__(poller.handler.split(":")[0])
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules})))
"""


def _shipped_packages(app: Path) -> set[str]:
    return {p.name for p in app.iterdir() if p.is_dir() and any(p.glob("*.py"))} | {p.stem for p in app.glob("*.py")}


def test_the_package_ships_what_the_app_imports_and_nothing_else(tmp_path: Path) -> None:
    # Given the app packed as a deployment packs it, with a handler of the user's
    app = deployment_copy(tmp_path / "app")
    (app / "handlers" / "probe.py").write_text(PROBE_HANDLER)
    (tmp_path / "dbfanout.toml").write_text(probe_app_config("orders", "orders-changes"))
    # When the platform imports function_app.py from it (no editable install on the path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(DBFANOUT_CONFIG=str(tmp_path / "dbfanout.toml"), ORDERS_DB_URL=f"sqlite:///{tmp_path / 's.db'}")
    done = subprocess.run(
        [sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(app)!r})\n{_IMPORT}"],
        cwd=app, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    imported = set(json.loads(done.stdout.strip().splitlines()[-1]))
    # Then every package shipped is one the app imported, and the operator side is not shipped
    shipped = _shipped_packages(app)
    assert shipped <= imported, f"shipped but never imported: {sorted(shipped - imported)}"
    assert {"function_app", "poller", "worker", "shared", "handlers"} <= shipped
    assert not (app / "dbfanout").exists() and not (app / "sbemulator").exists()
    assert not imported & {"dbfanout", "sbemulator", "typer", "rich"}, "the app imports the operator side"
    assert (app / "host.json").exists() and (app / "requirements.txt").exists()
