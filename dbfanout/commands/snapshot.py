"""``dbfanout snapshot POLLER [--table T] [--where SQL] [--chunk-size N] [--cancel]``.

Queues an incremental snapshot of a live ``kind = "pg_logical"`` poller (or cancels the running
one) by writing a request row to the poller's signal table. The poller reads it from its slot in
order with the changes (poller/snapshot/chunks.py), so the request never races the poller's own state
writes; ``dbfanout status`` shows the progress. A ``kind = "mysql_binlog"`` poller reads the same
row from its binlog (poller/snapshot/mysql.py: MySQL's SQL, tables named ``database.table``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

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
from poller.snapshot.chunks import chunk_size as snapshot_chunk_size
from poller.snapshot.chunks import qualified
from poller.snapshot.postgres import ChunkReader, request_statement
from poller.snapshot.where import WhereRefused
from poller.sources.engines import source_engine
from shared.config import PollerConfig

if TYPE_CHECKING:
    from poller.snapshot.mysql import MysqlChunkReader


def register(app: typer.Typer) -> None:
    """Mount ``snapshot`` on the root command."""
    app.command("snapshot")(snapshot_command)


def snapshot_command(
    poller: Annotated[str, typer.Argument(help='A kind = "pg_logical" (or "mysql_binlog") poller')],
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
    """Queue a snapshot of a live pg_logical poller's tables (or --cancel it): every row is delivered once
    as a "read" event while the changes keep flowing. Follow it with `dbfanout status POLLER`."""
    with reporting_errors():
        cfg = load(config).poller(poller)
        tables = _tables(cfg, table or [])
        if cancel and (table or where or chunk_size):
            fail("--cancel takes no --table, --where or --chunk-size", EXIT_USAGE)
        engine = source_engine(cfg)
        reader = _reader(cfg)
        reader.check_published()  # the request reaches the poller only through its log
        if where is not None and not cancel:
            _check_where(reader, tables or _known(cfg), where)
        if cfg.kind == "mysql_binlog":
            from poller.snapshot.mysql import mysql_request_statement

            write = mysql_request_statement
        else:
            write = request_statement
        statement, params = write(cfg, tables=tables, where=where, chunk_size=chunk_size, cancel=cancel)
        with engine.begin() as conn:
            conn.execute(statement, params)
    out: dict[str, Any] = {
        "poller": cfg.name,
        "request": params["id"],
        "action": "cancel" if cancel else "snapshot",
        "tables": tables or _known(cfg),
        "where": where,
        "chunk_size": snapshot_chunk_size(cfg, chunk_size),
    }
    if json_out:
        print_json(out)
        return
    what = "cancel of the running snapshot" if cancel else f"snapshot of {', '.join(out['tables'])}"
    console.print(
        f"queued: {what} (request {params['id']}); poller {cfg.name} reads it from its "
        f"{'binlog' if cfg.kind == 'mysql_binlog' else 'slot'} on its next tick. "
        f"Follow it with `dbfanout status {cfg.name}`."
    )


def _reader(cfg: PollerConfig) -> ChunkReader | MysqlChunkReader:
    if cfg.kind == "mysql_binlog":
        from poller.snapshot.mysql import MysqlChunkReader  # MySQL's SQL: imported for binlog pollers only

        return MysqlChunkReader(cfg, source_engine(cfg))
    return ChunkReader(cfg, source_engine(cfg))


def _known(cfg: PollerConfig) -> list[str]:
    """The poller's tables as its log names them (pg_logical: ``schema.table``; binlog: ``database.table``)."""
    if cfg.kind == "mysql_binlog":
        database = sa.make_url(cfg.source_url).database
        return [t if "." in t or not database else f"{database}.{t}" for t in cfg.tables]
    return [qualified(t) for t in cfg.tables]


def _tables(cfg: PollerConfig, asked: list[str]) -> list[str]:
    if cfg.kind == "mysql_binlog":
        known = _known(cfg)
        tables = [t if "." in t else next((k for k in known if k.partition(".")[2] == t), t) for t in asked]
        return _among(cfg, tables, known)
    if cfg.kind != "pg_logical":
        fail(
            f'poller {cfg.name} is kind = "{cfg.kind}": snapshots are for kind = "pg_logical" and "mysql_binlog" '
            "pollers",
            EXIT_USAGE,
            "a keyset poller re-reads a table with `dbfanout checkpoint reset`; see docs/operations.md",
        )
    return _among(cfg, [qualified(t) for t in asked], _known(cfg))


def _among(cfg: PollerConfig, tables: list[str], known: list[str]) -> list[str]:
    unknown = [t for t in tables if t not in known]
    if unknown:
        fail(f"{', '.join(unknown)} not among poller {cfg.name}'s tables ({', '.join(known)})", EXIT_USAGE)
    return tables


def _check_where(reader: ChunkReader | MysqlChunkReader, tables: list[str], where: str) -> None:
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
