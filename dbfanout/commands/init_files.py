"""The files ``dbfanout init`` writes: the poller's TOML, a handler stub, local settings, and the
app's entry points when they are missing.

Existing files are kept: ``dbfanout.toml`` gets the new poller appended, ``local.settings.json``
gets only the settings it lacks, a handler module that exists is left alone.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dbfanout.commands.init_table import TableShape

__all__ = [
    "PLACEHOLDER",
    "PollerPlan",
    "copy_entry_points",
    "enable_drivers",
    "handler_stub",
    "merge_local_settings",
    "poller_toml",
    "write_config",
]

# Marks every value init could not know: `dbfanout validate` fails on each until it is replaced.
PLACEHOLDER = "TODO-dbfanout-init"
LOCAL_EMULATOR = (
    "Endpoint=sb://localhost:5672;SharedAccessKeyName=RootManageSharedAccessKey;"
    "SharedAccessKey=SAS_KEY_VALUE;UseDevelopmentEmulator=true"
)
ENTRY_POINTS = ("function_app.py", "host.json")


@dataclass(frozen=True, slots=True)
class PollerPlan:
    """What one poller section says; ``shape`` is None without a database (placeholders)."""

    name: str
    kind: str  # keyset, pg_logical or mysql_binlog
    table: str
    url_setting: str
    queue: str
    shape: TableShape | None

    @property
    def handler_module(self) -> str:
        return re.sub(r"\W", "_", self.name)


def _s(value: str) -> str:
    """A TOML basic string (JSON's escapes are TOML's)."""
    return json.dumps(value)


def poller_toml(plan: PollerPlan) -> str:
    """The ``[pollers.NAME]`` section, each guess commented, each unknown marked with PLACEHOLDER."""
    shape = plan.shape
    lines = [f"[pollers.{plan.name}]"]
    if plan.kind != "keyset":
        lines.append(f"kind = {_s(plan.kind)}")
    lines.append(f"source_url = {_s('${' + plan.url_setting + '}')}     # the app setting holding the URL")
    if plan.kind == "keyset":
        lines += _keyset_lines(plan, shape)
    else:
        table = plan.table if "." in plan.table or plan.kind != "pg_logical" else f"public.{plan.table}"
        lines.append(f"tables = [{_s(table)}]")
        if plan.kind == "pg_logical":
            lines.append('snapshot = "initial"                  # first start: every existing row too')
    lines.append(f"queue = {_s(plan.queue)}")
    lines.append('schedule = "*/5 * * * * *"              # NCRONTAB, six fields, seconds first')
    lines.append(f"handler = {_s(f'handlers.{plan.handler_module}:handle')}")
    return "\n".join(lines) + "\n"


def _keyset_lines(plan: PollerPlan, shape: TableShape | None) -> list[str]:
    lines = [f"table = {_s(plan.table)}"]
    if shape is None or shape.cursor is None:
        why = "a column every write sets (updated_at, version): docs/cursors.md"
        lines.append(f"cursor = {_s(PLACEHOLDER + '-cursor')}   # {why}")
    else:
        lines.append(f"cursor = {_s(shape.cursor)}   # {shape.cursor_reason}")
        if shape.cursor_naive:
            lines.append(
                'cursor_timezone = "UTC"                # the column has no time zone: the one its values are in'
            )
    pk = list(shape.pk) if shape is not None and shape.pk else [PLACEHOLDER + "-pk"]
    lines.append(f"pk = [{', '.join(_s(c) for c in pk)}]")
    if shape is not None and shape.soft_delete:
        lines.append(f"soft_delete_column = {_s(shape.soft_delete)}   # rows with a value here arrive as op delete")
    lines.append("settle_seconds = 2                      # read rows older than now() - 2 s (late commits)")
    return lines


def write_config(path: Path, app_name: str, section: str) -> str:
    """Create ``dbfanout.toml`` with ``[app]`` and the section, or append the section; returns what
    was done (for the summary)."""
    if path.exists():
        text = path.read_text(encoding="utf-8")
        path.write_text(text.rstrip("\n") + "\n\n" + section, encoding="utf-8")
        return f"{path.name}: poller appended"
    header = (
        "# Written by `dbfanout init`. Keys: README.md, Configure a poller; dbfanout.toml.sample.\n"
        "# Secrets never go here: ${NAME} is the app setting NAME (local.settings.json locally).\n\n"
        "[app]\n"
        f"name = {_s(app_name)}                        # namespaces the state blobs\n"
        'state_connection = "DBFANOUT_STATE"\n'
        'servicebus_connection = "DBFANOUT_SERVICEBUS"\n\n'
    )
    path.write_text(header + section, encoding="utf-8")
    return f"{path.name}: written"


def merge_local_settings(path: Path, url_setting: str, url: str | None) -> str:
    """Write ``local.settings.json``, or add to it the settings it lacks (a URL given is always set)."""
    doc: dict[str, Any] = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {"IsEncrypted": False}
    values: dict[str, str] = doc.setdefault("Values", {})
    defaults = {
        "AzureWebJobsStorage": "UseDevelopmentStorage=true",
        "FUNCTIONS_WORKER_RUNTIME": "python",
        "DBFANOUT_CONFIG": "dbfanout.toml",
        "DBFANOUT_STATE": "UseDevelopmentStorage=true",
        "DBFANOUT_SERVICEBUS": LOCAL_EMULATOR,
        url_setting: f"{PLACEHOLDER}: a SQLAlchemy URL, e.g. postgresql+psycopg://user@host:5432/db",
    }
    existed = path.exists()
    for name, value in defaults.items():
        values.setdefault(name, value)
    if url:
        values[url_setting] = url
    path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return f"{path.name}: {'settings added' if existed else 'written'}"


def copy_entry_points(root: Path, template: Path) -> list[str]:
    """Copy ``function_app.py`` and ``host.json`` from the template checkout where missing."""
    done = []
    for name in ENTRY_POINTS:
        if (root / name).exists():
            continue
        if not (template / name).exists():
            done.append(f"{name}: missing, and no template checkout to copy it from (clone dbfanout)")
            continue
        shutil.copy(template / name, root / name)
        done.append(f"{name}: copied from {template}")
    return done


# The driver packages a URL's dialect (and a log source) needs, as requirements-drivers.txt names them.
DRIVERS = {"postgresql": ("psycopg[binary]",), "mysql": ("pymysql",), "mariadb": ("pymysql",), "mssql": ("pyodbc",)}
LOG_DRIVERS = {"pg_logical": ("sqlglot",), "mysql_binlog": ("mysql-replication", "sqlglot")}


def enable_drivers(path: Path, url: str | None, kind: str) -> list[str]:
    """Uncomment the drivers the poller needs in ``requirements-drivers.txt`` (the remote build
    installs that file); nothing when it is missing or no URL was given."""
    if url is None or not path.exists():
        return []
    dialect = url.split(":", 1)[0].split("+", 1)[0]
    wanted = DRIVERS.get(dialect, ()) + LOG_DRIVERS.get(kind, ())
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    enabled = []
    for i, line in enumerate(lines):
        body = line.removeprefix("# ")
        if line.startswith("# ") and any(re.match(rf"{re.escape(pkg)}[<>=!~ ]", body) for pkg in wanted):
            lines[i] = body
            enabled.append(body.split()[0])
    if not enabled:
        return []
    path.write_text("".join(lines), encoding="utf-8")
    return [f"{path.name}: enabled {', '.join(enabled)} (the deployment installs it)"]


def handler_stub(plan: PollerPlan) -> str:
    """A handler module that logs each change, with the event's fields documented."""
    columns = ""
    if plan.shape is not None and plan.shape.columns:
        columns = "".join(f"        {name}: {kind}\n" for name, kind in plan.shape.columns)
        columns = "\n    The table's columns (``event.after``):\n\n" + columns
    return _STUB.format(poller=plan.name, table=plan.table, columns=columns)


_STUB = '''"""Handler of poller ``{poller}`` (table ``{table}``), written by ``dbfanout init``.

``handle`` gets a batch of changes (one Service Bus message) and must be idempotent: a message can
come again (retry, split, replay). Return to complete the message; raise to have it retried; after
the queue's MaxDeliveryCount it goes to the dead-letter queue (``dbfanout dlq``).
"""

from __future__ import annotations

import logging

from shared.models import HandlerContext, RowChange

__all__ = ["handle"]

log = logging.getLogger(__name__)


def handle(events: list[RowChange], context: HandlerContext) -> None:
    """Handle a batch of changes.

    Each ``event`` (shared.models.RowChange) has:

        event_id   stable across redeliveries, splits and replays: de-duplicate on it
                   (worker.idempotency.ProcessedEvents records it in your transaction)
        op         "upsert", or "delete" (soft delete column set, or a log source's delete)
        pk         the primary key, e.g. {{"id": 42}}
        cursor     the cursor value (timestamp, integer, ...); a log source: its position
        after      the row's columns; None for a log source's delete
        before     None for polling; a log source: the old key (or row)
        change     "insert" / "update" / "delete" / "read" (snapshot) when the source knows it
        table      the table the row came from
        poller     "{poller}"
        committed_at  the commit time where the source knows it, else None
{columns}
    ``context`` (shared.models.HandlerContext): poller, message_id, delivery_count (1 on the
    first delivery), enqueued_time, batch_id, subscription (topics).
    """
    for event in events:
        # Replace with your side effect; keep it idempotent (keyed by event.event_id or event.pk).
        log.info(
            "handled %s %s of %s",
            event.op,
            event.pk,
            event.table,
            extra={{"event_id": event.event_id, "delivery_count": context.delivery_count}},
        )
'''
