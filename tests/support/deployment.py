"""A Functions app as a deployment ships it, for tests that run it the way the platform does."""

from __future__ import annotations

import fnmatch
import shutil
import uuid
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


#: A one-poller app whose handler is the probe: state in ``DBFANOUT_STATE``, Service Bus in
#: ``DBFANOUT_SERVICEBUS``, the source in ``ORDERS_DB_URL``.
PROBE_APP_CONFIG = """
[app]
name = "{app}"
state_connection = "DBFANOUT_STATE"
servicebus_connection = "DBFANOUT_SERVICEBUS"

[pollers.orders]
source_url = "${{ORDERS_DB_URL}}"
table = "{table}"
cursor = "version"
pk = ["id"]
queue = "{queue}"
schedule = "*/5 * * * * *"
settle_seconds = 0
handler = "handlers.probe:handle"
"""


def probe_app_config(table: str, queue: str) -> str:
    """``dbfanout.toml`` of a probe app on ``table``, sending to ``queue``, under a fresh app name."""
    return PROBE_APP_CONFIG.format(app=f"probe{uuid.uuid4().hex[:8]}", table=table, queue=queue)


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
