"""``dbfanout validate [POLLER] [--json]``: config, handler, database, index, cursor hazards, state and queue checks.

A topic poller: each subscription's handler, the topic, its subscriptions, their sessions and (with
the management API) duplicate detection, MaxDeliveryCount, rules and unnamed subscriptions.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Annotated

import typer
from rich.table import Table

from dbfanout.commands.common import (
    EXIT_CHECK_FAILED,
    ConfigOption,
    JsonOption,
    app_root_of,
    console,
    load,
    print_json,
    print_table,
    reporting_errors,
)
from dbfanout.ops.bus import bus_client
from dbfanout.ops.validation import Check, validate_poller
from shared.errors import ConfigError

_STYLE = {"ok": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}


def register(app: typer.Typer) -> None:
    """Mount ``validate`` on the root command."""
    app.command("validate")(validate_command)


def validate_command(
    poller: Annotated[str | None, typer.Argument(help="One poller (default: all)")] = None,
    json_out: JsonOption = False,
    config: ConfigOption = None,
    fix: Annotated[
        bool,
        typer.Option(
            "--fix",
            help='Create what a poller needs: kind = "pg_logical" its publication, then slot; kind = "outbox" '
            'its table or index; wake = "notify" its triggers',
        ),
    ] = False,
) -> None:
    """Check that every poller can run safely (a topic poller: its topic, subscriptions and rules too).
    Exit 1 when a check fails (warnings do not fail)."""
    with reporting_errors():
        cfg = load(config, lenient_settings=True)
        names = [cfg.poller(poller).name] if poller else sorted(cfg.pollers)
    checks: list[Check] = []
    with ExitStack() as stack:
        try:
            client = stack.enter_context(bus_client(cfg))
        except ConfigError as exc:
            client = None
            checks.append(Check("*", "servicebus connection", "fail", f"{exc.key}: {exc.problem}"))
        for name in names:
            checks.extend(validate_poller(cfg, name, client, fix=fix, app_root=app_root_of(config)))
    failed = [c for c in checks if c.status == "fail"]
    if json_out:
        print_json({"ok": not failed, "checks": [c.to_json() for c in checks]})
    else:
        table = Table(title=f"dbfanout validate ({cfg.path})")
        for column in ("poller", "check", "status", "detail"):
            table.add_column(column, overflow="fold")
        for c in checks:
            table.add_row(c.poller, c.name, f"[{_STYLE[c.status]}]{c.status}[/]", c.detail)
        print_table(table, "no checks ran (no poller selected)")
        console.print(f"{len(failed)} check(s) failed" if failed else "[green]all checks hold[/]")
    if failed:
        raise typer.Exit(EXIT_CHECK_FAILED)
