"""``dbfanout demo --source pg-logical``: the orders table on a reachable PostgreSQL, read by a slot.

Everything lives in a schema of its own (``dbfanout_demo_<hex>``): the writer's engine puts it
first on its search path, so its SQL is the SQLite demo's. The table has ``REPLICA IDENTITY
FULL`` (a delete carries the whole old row), and the publication and the slot are created the
way ``dbfanout validate --fix`` does. :meth:`PgDemoSource.drop` removes the slot, the publication
and the schema (the runner calls it on every way out: a slot left behind holds WAL forever).
"""

from __future__ import annotations

import uuid

import sqlalchemy as sa

from dbfanout.demo.services import ServiceError
from poller.sources.pg_logical.source import setup_sql
from shared.config import PollerConfig

__all__ = ["DEFAULT_PG_URL", "PG_URL_SETTING", "PgDemoSource"]

PG_URL_SETTING = "DBFANOUT_DEMO_PG_URL"
DEFAULT_PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"


class PgDemoSource:
    """The demo's source schema, publication and slot on ``url`` (one name for all three)."""

    def __init__(self, url: str, source_ddl: str) -> None:
        self.url = url
        self.name = f"dbfanout_demo_{uuid.uuid4().hex[:10]}"
        self._ddl = source_ddl
        self._admin = sa.create_engine(url)

    @property
    def table(self) -> str:
        return f"{self.name}.orders"

    def engine(self) -> sa.Engine:
        """An engine whose unqualified ``orders`` is the demo's table."""
        return sa.create_engine(self.url, connect_args={"options": f"-c search_path={self.name}"})

    def create(self) -> None:
        try:
            with self._admin.connect() as conn:
                level = conn.execute(sa.text("SHOW wal_level")).scalar()
        except sa.exc.SQLAlchemyError as exc:
            raise ServiceError(f"--source pg-logical: PostgreSQL at {sa.make_url(self.url).render_as_string()} "
                               f"is not reachable ({type(exc).__name__}); set {PG_URL_SETTING}") from None  # fmt: skip
        if level != "logical":
            raise ServiceError(f"--source pg-logical needs wal_level = logical (the server has {level}); "
                               "see docs/operations.md")  # fmt: skip
        with self._admin.begin() as conn:
            conn.execute(sa.text(f"CREATE SCHEMA {self.name}"))
            conn.execute(sa.text(self._ddl.replace("CREATE TABLE orders", f"CREATE TABLE {self.table}", 1)))
            conn.execute(sa.text(f"ALTER TABLE {self.table} REPLICA IDENTITY FULL"))
        config = PollerConfig(name="orders", source_url=self.url, cursor="", pk=(), queue="q", kind="pg_logical",
                              tables=(self.table,), slot=self.name, publication=self.name,
                              signal_table=f"{self.name}.dbfanout_signal")  # fmt: skip
        for statement in setup_sql(config):  # the slot needs a transaction of its own
            with self._admin.begin() as conn:
                conn.execute(sa.text(statement))

    def drop(self) -> None:
        """Remove the slot, the publication and the schema (best effort: each independently)."""
        statements = (
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = :n",
            f"DROP PUBLICATION IF EXISTS {self.name}",
            f"DROP SCHEMA IF EXISTS {self.name} CASCADE",
        )
        for statement in statements:
            try:
                with self._admin.begin() as conn:
                    conn.execute(sa.text(statement), {"n": self.name})
            except sa.exc.SQLAlchemyError:
                continue
        self._admin.dispose()
