"""A Functions app as a deployment ships it, for tests that run it the way the platform does."""

from __future__ import annotations

import fnmatch
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

#: ``handlers/probe.py`` of a test app: appends each event it is given to the file ``PROBE_FILE`` names.
PROBE_HANDLER = """
import json, os

def handle(events, context):
    with open(os.environ["PROBE_FILE"], "a") as f:
        for e in events:
            f.write(json.dumps({"pk": e.pk, "op": e.op, "after": e.after, "poller": e.poller}, default=str) + "\\n")
"""


def deployment_copy(dest: Path) -> Path:
    """The project as a deployment packs it: every top-level entry ``.funcignore`` does not exclude."""
    patterns = [
        line.strip().rstrip("/")
        for line in (REPO / ".funcignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]

    def ignored(name: str) -> bool:
        return any(fnmatch.fnmatch(name, p) for p in patterns)

    dest.mkdir(parents=True)
    for entry in REPO.iterdir():
        if ignored(entry.name):
            continue
        if entry.is_dir():
            shutil.copytree(entry, dest / entry.name, ignore=lambda _d, names: [n for n in names if ignored(n)])
        else:
            shutil.copy(entry, dest / entry.name)
    return dest
