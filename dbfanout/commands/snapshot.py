"""``dbfanout snapshot POLLER [--table T] [--where SQL] [--chunk-size N] [--cancel]``.

Queues an incremental snapshot of a live ``kind = "pg_logical"`` or ``kind = "mysql_binlog"``
poller (or cancels the running one) by writing a request row to the poller's signal table. The
poller reads it from its log (the slot, the binlog) in order with the changes (poller/snapshot.py),
so the request never races the poller's own state writes; ``dbfanout status`` shows the progress.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

import sqlalchemy as sa
import typer
from rich.markup import escape

from dbfanout.commands.common import (
    EXIT_USAGE,
    ConfigOption,
    JsonOption,
    console,
    fail,
    load,
    print_json,
    reporting_errors,
)
from poller.engines import source_engine
from poller.snapshot import ChunkReader, qualified, request_statement
from poller.snapshot import chunk_size as snapshot_chunk_size
from poller.snapshot_coordinator import ChunkSource
from poller.snapshot_where import WhereRefused
from shared.config import PollerConfig

Request = Callable[..., tuple[sa.TextClause, dict[str, Any]]]


def register(app: typer.Typer) -> None:
    """Mount ``snapshot`` on the root command."""
    app.command("snapshot")(snapshot_command)


def snapshot_command(
    poller: Annotated[str, typer.Argument(help='A kind = "pg_logical" or "mysql_binlog" poller')],
    table: Annotated[
        list[str] | None, typer.Option("--table", "-t", help="Only this table of the poller (repeatable; default: all)")
    ] = None,
    where: Annotated[
        str | None,
        typer.Option(
            "--where",
            help="Only the rows this condition selects: the table's columns compared with literals "
            "(=, <>, <, <=, >, >=, AND, OR, NOT, IN, BETWEEN, IS NULL, IS NOT NULL); anything else is refused",
        ),
    ] = None,
    chunk_size: Annotated[
        int | None,
        typer.Option("--chunk-size", min=1, help="Rows per chunk (default: snapshot_chunk_size, else 4 pages)"),
    ] = None,
    cancel: Annotated[bool, typer.Option("--cancel", help="Cancel the poller's running snapshot")] = False,
    json_out: JsonOption = False,
    config: ConfigOption = None,
) -> None:
    """Queue a snapshot of a live pg_logical or mysql_binlog poller's tables (or --cancel it): every row is
    delivered once as a "read" event while the changes keep flowing. Follow it with `dbfanout status POLLER`."""
    with reporting_errors():
        cfg = load(config).poller(poller)
        qualify, reader, request = _snapshot_sql(cfg)
        tables = _tables(cfg, table or [], qualify)
        if cancel and (table or where or chunk_size):
            fail("--cancel takes no --table, --where or --chunk-size", EXIT_USAGE)
        reader.check_published()  # the request reaches the poller only through its log
        if where is not None and not cancel:
            _check_where(reader, tables or [qualify(t) for t in cfg.tables], where)
        engine = source_engine(cfg)
        statement, params = request(cfg, tables=tables, where=where, chunk_size=chunk_size, cancel=cancel)
        with engine.begin() as conn:
            conn.execute(statement, params)
    out: dict[str, Any] = {
        "poller": cfg.name,
        "request": params["id"],
        "action": "cancel" if cancel else "snapshot",
        "tables": tables or [qualify(t) for t in cfg.tables],
        "where": where,
        "chunk_size": snapshot_chunk_size(cfg, chunk_size),
    }
    if json_out:
        print_json(out)
        return
    what = "cancel of the running snapshot" if cancel else f"snapshot of {', '.join(out['tables'])}"
    console.print(
        f"queued: {what} (request {params['id']}); poller {cfg.name} reads it from its log on its next tick. "
        f"Follow it with `dbfanout status {cfg.name}`."
    )


def _snapshot_sql(cfg: PollerConfig) -> tuple[Callable[[str], str], ChunkSource, Request]:
    """How the poller's log names a table, its chunk reader (the checks) and its request statement."""
    if cfg.kind == "mysql_binlog":
        # Imported here: the MySQL snapshot SQL is for binlog pollers only
        from poller.mysql_binlog import table_qualifier
        from poller.snapshot_mysql import MysqlChunkReader, mysql_request_statement

        return table_qualifier(cfg), MysqlChunkReader(cfg, source_engine(cfg)), mysql_request_statement
    if cfg.kind != "pg_logical":
        fail(
            f'poller {cfg.name} is kind = "{cfg.kind}": snapshots are for kind = "pg_logical" and "mysql_binlog" '
            "pollers",
            EXIT_USAGE,
            "a keyset poller re-reads a table with `dbfanout checkpoint reset`; see docs/operations.md",
        )
    return qualified, ChunkReader(cfg, source_engine(cfg)), request_statement


def _tables(cfg: PollerConfig, asked: list[str], qualify: Callable[[str], str]) -> list[str]:
    known = [qualify(t) for t in cfg.tables]
    tables = [qualify(t) for t in asked]
    unknown = [t for t in tables if t not in known]
    if unknown:
        fail(f"{', '.join(unknown)} not among poller {cfg.name}'s tables ({', '.join(known)})", EXIT_USAGE)
    return tables


def _check_where(reader: ChunkSource, tables: list[str], where: str) -> None:
    """The condition must be a sentence of the grammar over every table's columns; nothing of it runs."""
    try:
        reader.check_where(tables, where)
    except WhereRefused as exc:
        fail(
            escape(f"--where refused: {exc}"),  # the condition is the user's text: no markup in it
            EXIT_USAGE,
            "a condition names the table's columns and compares them with literals: =, <>, <, <=, >, >=, AND, OR, "
            "NOT, IN (...), BETWEEN, IS NULL, IS NOT NULL (e.g. --where \"region = 'eu' AND id >= 1000\"); see "
            "docs/operations.md",
        )
