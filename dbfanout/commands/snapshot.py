"""``dbfanout snapshot POLLER [--table T] [--where SQL] [--chunk-size N] [--cancel]``.

Queues an incremental snapshot of a live ``kind = "pg_logical"`` poller (or cancels the running
one) by writing a request row to the poller's signal table. The poller reads it from its slot in
order with the changes (poller/snapshot.py), so the request never races the poller's own state
writes; ``dbfanout status`` shows the progress.
"""

from __future__ import annotations

from typing import Annotated, Any

import sqlalchemy as sa
import typer

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
from poller.snapshot import ChunkReader, qualified, quote_table, request_statement
from poller.snapshot import chunk_size as snapshot_chunk_size
from shared.config import PollerConfig


def register(app: typer.Typer) -> None:
    """Mount ``snapshot`` on the root command."""
    app.command("snapshot")(snapshot_command)


def snapshot_command(
    poller: Annotated[str, typer.Argument(help='A kind = "pg_logical" poller')],
    table: Annotated[
        list[str] | None, typer.Option("--table", "-t", help="Only this table of the poller (repeatable; default: all)")
    ] = None,
    where: Annotated[
        str | None,
        typer.Option("--where", help="Only the rows this SQL condition selects (runs with the poller's credentials)"),
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
        ChunkReader(cfg, engine).check_published()  # the request reaches the poller only through its slot
        if where is not None and not cancel:
            _check_where(engine, tables or [qualified(t) for t in cfg.tables], where)
        statement, params = request_statement(cfg, tables=tables, where=where, chunk_size=chunk_size, cancel=cancel)
        with engine.begin() as conn:
            conn.execute(statement, params)
    out: dict[str, Any] = {
        "poller": cfg.name,
        "request": params["id"],
        "action": "cancel" if cancel else "snapshot",
        "tables": tables or [qualified(t) for t in cfg.tables],
        "where": where,
        "chunk_size": snapshot_chunk_size(cfg, chunk_size),
    }
    if json_out:
        print_json(out)
        return
    what = "cancel of the running snapshot" if cancel else f"snapshot of {', '.join(out['tables'])}"
    console.print(
        f"queued: {what} (request {params['id']}); poller {cfg.name} reads it from its slot on its next tick. "
        f"Follow it with `dbfanout status {cfg.name}`."
    )


def _tables(cfg: PollerConfig, asked: list[str]) -> list[str]:
    if cfg.kind == "mysql_binlog":
        fail(
            f'poller {cfg.name} is kind = "mysql_binlog": snapshots are not available for binlog pollers yet',
            EXIT_USAGE,
            "to deliver the rows that exist, run a keyset poller (same handler) over the tables; "
            "see docs/operations.md, MySQL and MariaDB binlog",
        )
    if cfg.kind != "pg_logical":
        fail(
            f'poller {cfg.name} is kind = "{cfg.kind}": snapshots are for kind = "pg_logical" pollers',
            EXIT_USAGE,
            "a keyset poller re-reads a table with `dbfanout checkpoint reset`; see docs/operations.md",
        )
    known = [qualified(t) for t in cfg.tables]
    tables = [qualified(t) for t in asked]
    unknown = [t for t in tables if t not in known]
    if unknown:
        fail(f"{', '.join(unknown)} not among poller {cfg.name}'s tables ({', '.join(known)})", EXIT_USAGE)
    return tables


def _check_where(engine: sa.Engine, tables: list[str], where: str) -> None:
    """A condition the poller could not run would stop its snapshot: try it now, on every table."""
    with engine.connect() as conn:
        for name in tables:
            try:
                conn.execute(sa.text(f"SELECT 1 FROM {quote_table(name)} WHERE ({where}) LIMIT 0"))
            except sa.exc.DBAPIError as exc:
                problem = str(exc.orig or exc).splitlines()[0]
                fail(f"--where does not run on {name}: {problem}", EXIT_USAGE)
            finally:
                conn.rollback()
