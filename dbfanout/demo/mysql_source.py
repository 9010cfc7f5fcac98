"""``dbfanout demo --source mysql-binlog``: the orders table on a reachable MariaDB/MySQL, read from its binlog.

Everything lives in a database of its own (``dbfanout_demo_<hex>``), named in the URL the writer
and the poller use, so the writer's SQL is the SQLite demo's. Before anything is created, the
server is checked with ``dbfanout validate``'s own binlog checks (``log_bin``, ``binlog_format =
ROW``, full row images and metadata, the grants, a replication stream opened as the poller's
replica id): a server that cannot serve the demo is refused at once, saying what to set.
:meth:`MysqlDemoSource.drop` removes the database (the runner calls it on every way out; the
binlog needs no clean-up: nothing on the server holds it for a reader).
"""

from __future__ import annotations

import importlib.util
import random
import uuid

import sqlalchemy as sa

from dbfanout.demo.services import ServiceError
from dbfanout.ops.binlog_checks import binlog_checks
from shared.config import PollerConfig
from shared.settings import redact_url

__all__ = ["DEFAULT_MYSQL_URL", "MYSQL_URL_SETTING", "MysqlDemoSource"]

MYSQL_URL_SETTING = "DBFANOUT_DEMO_MYSQL_URL"
DEFAULT_MYSQL_URL = "mysql+pymysql://root@127.0.0.1:3306/"
_SERVER_SETTINGS = (
    "log_bin = ON, binlog_format = ROW, binlog_row_image = FULL, binlog_row_metadata = FULL "
    "(mariadbd --log-bin --binlog-format=ROW --binlog-row-image=FULL --binlog-row-metadata=FULL --server-id=1)"
)


class MysqlDemoSource:
    """The demo's database and orders table on the server at ``url``."""

    def __init__(self, url: str, source_ddl: str) -> None:
        self.admin_url = url
        self.name = f"dbfanout_demo_{uuid.uuid4().hex[:10]}"
        # The poller's replica id: one of its own per run (two connections with one id make the server drop one).
        self.server_id = 1_000_000_000 + random.randrange(1_000_000_000)
        # MySQL wants a length on indexed text and the binlog reader decodes VARCHAR as text everywhere.
        self._ddl = source_ddl.replace(" TEXT", " VARCHAR(64)")
        self._admin: sa.Engine | None = None

    @property
    def url(self) -> str:
        """The URL of the demo's database (the app's ``ORDERS_DB_URL``): an unqualified ``orders`` is its table."""
        return sa.make_url(self.admin_url).set(database=self.name).render_as_string(hide_password=False)

    @property
    def table(self) -> str:
        return f"{self.name}.orders"

    def engine(self) -> sa.Engine:
        return sa.create_engine(self.url)

    def create(self) -> None:
        """Check the server serves a row-based binlog (else :class:`ServiceError` saying what to set),
        then create the database and its table."""
        missing = [name for name in ("pymysql", "pymysqlreplication") if importlib.util.find_spec(name) is None]
        if missing:
            raise ServiceError(f"--source mysql-binlog needs {' and '.join(missing)}: "
                               "pip install 'dbfanout[mysql-binlog]'")  # fmt: skip
        try:
            dialect = sa.make_url(self.admin_url).get_dialect().name
        except (sa.exc.ArgumentError, sa.exc.NoSuchModuleError):
            dialect = None
        if dialect not in ("mysql", "mariadb"):
            raise ServiceError(f"--mysql-url must be a MariaDB/MySQL SQLAlchemy URL such as {DEFAULT_MYSQL_URL} "
                               f"(got {redact_url(self.admin_url)})")  # fmt: skip
        where = f"the server at {redact_url(sa.make_url(self.admin_url).render_as_string())}"
        self._admin = sa.create_engine(self.admin_url, connect_args={"connect_timeout": 5})
        try:
            with self._admin.connect() as conn:
                conn.execute(sa.text("SELECT 1"))
        except sa.exc.SQLAlchemyError as exc:
            why = redact_url(str(getattr(exc, "orig", None) or exc).splitlines()[0][:200])
            raise ServiceError(f"--source mysql-binlog: cannot connect to {where} ({why}); "
                               f"point --mysql-url (or {MYSQL_URL_SETTING}) at a MariaDB or MySQL "
                               f"with {_SERVER_SETTINGS}") from None  # fmt: skip
        failed = [check for check in binlog_checks(self._check_config()) if check.status == "fail"]
        if failed:
            reasons = "; ".join(f"{check.name}: {redact_url(check.detail)}" for check in failed)
            raise ServiceError(
                f"--source mysql-binlog: {where} cannot serve the demo: {reasons}. Set {_SERVER_SETTINGS}, "
                f"or point --mysql-url (or {MYSQL_URL_SETTING}) at a server that has them; see docs/operations.md, "
                '"MySQL and MariaDB binlog"'
            )
        with self._admin.begin() as conn:
            conn.execute(sa.text(f"CREATE DATABASE {self.name}"))
            conn.execute(sa.text(self._ddl.replace("CREATE TABLE orders", f"CREATE TABLE {self.table}", 1)))

    def drop(self) -> None:
        """Remove the demo's database (best effort)."""
        if self._admin is None:
            return
        try:
            with self._admin.begin() as conn:
                conn.execute(sa.text(f"DROP DATABASE IF EXISTS {self.name}"))
        except sa.exc.SQLAlchemyError:
            pass
        self._admin.dispose()

    def _check_config(self) -> PollerConfig:
        # No tables yet: the checks are the server's (settings, grants, replica id, a stream).
        return PollerConfig(name="orders", source_url=self.admin_url, cursor="", pk=(), queue="q",
                            kind="mysql_binlog", tables=(), server_id=self.server_id)  # fmt: skip
