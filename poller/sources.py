"""Which :class:`~poller.ports.Source` a poller reads, from its ``kind``."""

from __future__ import annotations

import sqlalchemy as sa

from poller.mysql_binlog import MysqlBinlogSource
from poller.outbox import OutboxSource
from poller.pg_logical import PgLogicalSource
from poller.source import SqlSource
from shared.config import PollerConfig

__all__ = ["open_source"]


def open_source(
    config: PollerConfig, engine: sa.Engine | None = None
) -> SqlSource | OutboxSource | PgLogicalSource | MysqlBinlogSource:
    """The poller's source (no connection yet: the first fetch resolves it)."""
    if config.kind == "outbox":
        return OutboxSource(config, engine)
    if config.kind == "pg_logical":
        return PgLogicalSource(config, engine)
    if config.kind == "mysql_binlog":
        return MysqlBinlogSource(config, engine)
    return SqlSource(config, engine)
