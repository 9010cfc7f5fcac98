"""Which :class:`~poller.ports.Source` a poller reads, from its ``kind``."""

from __future__ import annotations

import sqlalchemy as sa

from poller.sources.keyset.source import SqlSource
from poller.sources.mysql_binlog.source import MysqlBinlogSource
from poller.sources.outbox import OutboxSource
from poller.sources.pg_logical.source import PgLogicalSource
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
