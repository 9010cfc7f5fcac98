"""The demo's Functions app folder: the real ``function_app.py`` plus a generated config.

The folder mirrors a deployment (``function_app.py``, ``host.json``, ``handlers/`` copied from
the checkout) with the demo's ``dbfanout.toml``, ``local.settings.json``, the SQLite source
and target databases and the marker file that "fixes" the demo handler.
"""

from __future__ import annotations

import json
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import sqlalchemy as sa

from dbfanout.demo.handler import FIX_SETTING
from dbfanout.demo.mysql_source import MysqlDemoSource
from dbfanout.demo.pg_source import PgDemoSource
from dbfanout.demo.services import ServiceError, project_root
from shared.outbox import create_outbox

__all__ = [
    "APP_FILES",
    "SOURCE_DDL",
    "TOPIC_SUBSCRIPTIONS",
    "DemoApp",
    "app_settings",
    "config_text",
    "sqlite_engine",
    "write_app_folder",
]

APP_FILES = ("function_app.py", "host.json")
SOURCE_DDL = (
    "CREATE TABLE orders ("
    " id INTEGER PRIMARY KEY,"
    " version INTEGER NOT NULL,"  # the cursor: one writer assigns it in commit order
    " updated_at TEXT NOT NULL,"
    " customer TEXT NOT NULL,"
    " amount REAL NOT NULL,"
    " status TEXT NOT NULL,"
    " deleted_at TEXT)"
)
KEYSET_INDEX = "CREATE INDEX ix_orders_keyset ON orders (version, id)"
# The demo queue's MaxDeliveryCount: low, so the poisoned row reaches the DLQ within seconds. The
# poller is told it too, so the worker splits a failing batch before crashes could use it up.
MAX_DELIVERY_COUNT = 3

# Why an integer version with settle_seconds = 0: the demo has one writer thread and SQLite lets
# one write transaction run at a time, so versions become visible in the order they were
# assigned and no row can commit behind the checkpoint (docs/cursors.md). A timestamp cursor
# written by concurrent transactions would need a settle window instead.
_POLLER_TEMPLATE = """\
# Written by `dbfanout demo`.
[app]
name = "{app_name}"
state_container = "db-state"
state_connection = "DBFANOUT_STATE"
servicebus_connection = "DBFANOUT_SERVICEBUS"

[pollers.orders]
source_url = "${{ORDERS_DB_URL}}"
{entity} = "{queue}"
schedule = "*/1 * * * * *"
batch_size = {batch_size}
max_batches_per_tick = 50
lease_ttl_seconds = 10
settle_seconds = 0
split_after_deliveries = 2
max_delivery_count = {max_delivery_count}
"""
CONFIG_TEMPLATE = (
    _POLLER_TEMPLATE
    + """\
table = "orders"
cursor = "version"
pk = ["id"]
soft_delete_column = "deleted_at"
handler = "dbfanout.demo.handler:handle"
"""
)
# ``dbfanout demo --topic``: the same poller sends to a topic; two subscriptions each run their own
# handler with their own retries, split and dead-letter queue (docs/operations.md, "Topics").
TOPIC_SUBSCRIPTIONS = ("replica", "audit")
TOPIC_CONFIG_TEMPLATE = (
    _POLLER_TEMPLATE
    + """\
table = "orders"
cursor = "version"
pk = ["id"]
soft_delete_column = "deleted_at"

# Replicates into the target table; has the demo's bug for poison rows until the fix.
[pollers.orders.subscriptions.replica]
handler = "dbfanout.demo.handler:handle"

# Records every event it is given: it must be given each exactly once.
[pollers.orders.subscriptions.audit]
handler = "dbfanout.demo.handler:handle_audit"
"""
)
# ``dbfanout demo --source outbox``: the writer hard-deletes and writes an outbox row per change in
# the same transaction; the poller reads the outbox (one writer on SQLite: no settle window needed)
# and prunes what it delivered.
OUTBOX_CONFIG_TEMPLATE = (
    _POLLER_TEMPLATE
    + """\
kind = "outbox"
table = "dbfanout_outbox"
outbox_retention_seconds = 30
handler = "dbfanout.demo.handler:handle_outbox"
"""
)
# ``dbfanout demo --source pg-logical``: the orders table on PostgreSQL, every change (hard deletes
# included) read from a replication slot (dbfanout.demo.pg_source creates and drops it).
PG_LOGICAL_CONFIG_TEMPLATE = (
    _POLLER_TEMPLATE
    + """\
kind = "pg_logical"
tables = ["{table}"]
slot = "{slot}"
publication = "{slot}"
signal_table = "{slot}.dbfanout_signal"
handler = "dbfanout.demo.handler:handle_pg_logical"
"""
)

# ``dbfanout demo --source mysql-binlog``: the orders table on MariaDB/MySQL, every change (hard deletes
# included) read from the binlog (dbfanout.demo.mysql_source creates and drops its database). No
# snapshot: the kind has none yet.
MYSQL_BINLOG_CONFIG_TEMPLATE = (
    _POLLER_TEMPLATE
    + """\
kind = "mysql_binlog"
tables = ["{table}"]
server_id = {server_id}
handler = "dbfanout.demo.handler:handle_mysql_binlog"
"""
)


def sqlite_engine(path: Path | str) -> sa.Engine:
    """An engine on a WAL-mode SQLite file (a path or a ``sqlite:///`` URL), so readers never block
    the writer (or the reverse)."""
    url = path if isinstance(path, str) else f"sqlite:///{path}"
    engine = sa.create_engine(url, connect_args={"timeout": 30})
    with engine.begin() as conn:
        conn.exec_driver_sql("PRAGMA journal_mode=WAL")
    return engine


def app_settings(
    root: Path, *, storage: str, servicebus: str, source_url: str | None = None, target_url: str | None = None
) -> dict[str, str]:
    """The app settings of a local app folder: emulated storage and Service Bus, SQLite files by default."""
    return {
        "AzureWebJobsStorage": storage,
        "FUNCTIONS_WORKER_RUNTIME": "python",
        "DBFANOUT_CONFIG": "dbfanout.toml",
        "DBFANOUT_STATE": storage,
        "DBFANOUT_SERVICEBUS": servicebus,
        "ORDERS_DB_URL": source_url or f"sqlite:///{root / 'source.db'}",
        "TARGET_DB_URL": target_url or f"sqlite:///{root / 'target.db'}",
    }


def write_app_folder(root: Path, settings: dict[str, str]) -> None:
    """Copy the deployable app (``function_app.py``, ``host.json``, ``handlers/``) from the checkout
    into ``root`` and write ``local.settings.json`` with ``settings``."""
    source = project_root()
    missing = [name for name in (*APP_FILES, "handlers") if not (source / name).exists()]
    if missing:
        raise ServiceError(
            f"{', '.join(missing)} not found in {source}: run the demo from a dbfanout checkout "
            "(pip install -e . or `make demo`)"
        )
    root.mkdir(parents=True, exist_ok=True)
    for name in APP_FILES:
        shutil.copy(source / name, root / name)
    shutil.copytree(source / "handlers", root / "handlers", ignore=shutil.ignore_patterns("__pycache__"))
    (root / "local.settings.json").write_text(json.dumps({"IsEncrypted": False, "Values": settings}, indent=2))


def config_text(
    app_name: str,
    queue: str,
    *,
    batch_size: int = 100,
    outbox: bool = False,
    topic: bool = False,
    pg_logical: PgDemoSource | None = None,
    mysql_binlog: MysqlDemoSource | None = None,
) -> str:
    """The demo's ``dbfanout.toml`` (``queue`` names the topic with ``topic=True``)."""
    names: dict[str, object] = {}
    if topic:
        template = TOPIC_CONFIG_TEMPLATE
    elif pg_logical:
        template, names = PG_LOGICAL_CONFIG_TEMPLATE, {"table": pg_logical.table, "slot": pg_logical.name}
    elif mysql_binlog:
        template = MYSQL_BINLOG_CONFIG_TEMPLATE
        names = {"table": mysql_binlog.table, "server_id": mysql_binlog.server_id}
    else:
        template = OUTBOX_CONFIG_TEMPLATE if outbox else CONFIG_TEMPLATE
    return template.format(
        app_name=app_name,
        entity="topic" if topic else "queue",
        queue=queue,
        batch_size=batch_size,
        max_delivery_count=MAX_DELIVERY_COUNT,
        **names,
    )


@dataclass
class DemoApp:
    """Paths and settings of one demo app folder."""

    root: Path
    queue: str
    settings: dict[str, str]
    app_name: str = field(default_factory=lambda: "demo" + uuid.uuid4().hex[:6])

    def __post_init__(self) -> None:
        self.source_db = self.root / "source.db"
        self.target_db = self.root / "target.db"
        self.config_file = self.root / "dbfanout.toml"
        self.fix_file = self.root / "handler-fixed"  # its presence "fixes" the demo handler
        self.host_log = self.root / "host.log"

    @classmethod
    def create(
        cls,
        root: Path,
        *,
        queue: str,
        storage: str,
        servicebus: str,
        batch_size: int = 100,
        outbox: bool = False,
        topic: bool = False,
        pg_logical: PgDemoSource | None = None,
        mysql_binlog: MysqlDemoSource | None = None,
        app_name: str | None = None,
    ) -> DemoApp:
        """Write the folder, create the source table and prepare the target database."""
        source_url = pg_logical.url if pg_logical else mysql_binlog.url if mysql_binlog else None
        settings = {
            **app_settings(root, storage=storage, servicebus=servicebus, source_url=source_url),
            FIX_SETTING: str(root / "handler-fixed"),
        }
        write_app_folder(root, settings)
        app = cls(root, queue, settings) if app_name is None else cls(root, queue, settings, app_name)
        text = config_text(app.app_name, queue, batch_size=batch_size, outbox=outbox, topic=topic,
                           pg_logical=pg_logical, mysql_binlog=mysql_binlog)  # fmt: skip
        app.config_file.write_text(text)
        engine = sqlite_engine(app.source_db)
        with engine.begin() as conn:
            conn.exec_driver_sql(SOURCE_DDL)
            conn.exec_driver_sql(KEYSET_INDEX)
            if outbox:
                create_outbox(conn)
        engine.dispose()
        sqlite_engine(app.target_db).dispose()  # WAL before the handler creates its tables
        return app
