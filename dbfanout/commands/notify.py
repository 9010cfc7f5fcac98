"""``dbfanout notify drop POLLER``: remove the notify triggers of a ``wake = "notify"`` poller.

``dbfanout validate --fix`` creates them; drop them before switching a poller back to
``wake = "poll"`` (or before removing it), so its tables stop notifying a channel nobody listens to.
"""

from __future__ import annotations

from typing import Annotated

import typer

from dbfanout.commands import common
from dbfanout.ops.notify import drop_notify_triggers, missing_notify_triggers
from poller.tick.wake import notify_tables

PollerArg = Annotated[str, typer.Argument(help="The poller (a pollers.NAME table of dbfanout.toml)")]


def register(app: typer.Typer) -> None:
    """Mount ``notify`` on the root command."""
    common.mount_group(app, "notify", 'The PostgreSQL triggers of wake = "notify" pollers.', {"drop": drop_command})


def drop_command(
    poller: PollerArg,
    yes: common.YesOption = False,
    dry_run: common.DryRunOption = False,
    config: common.ConfigOption = None,
) -> None:
    """Drop the poller's notify triggers (its wake may be "poll" already; the table keeps its data)."""
    with common.reporting_errors():
        cfg = common.load(config).poller(poller)
        if not cfg.source_url.startswith("postgresql"):
            common.fail(f"poller {poller}: notify triggers exist on PostgreSQL sources only", common.EXIT_USAGE)
        missing = set(missing_notify_triggers(cfg))
    present = [t for t in notify_tables(cfg) if t not in missing]
    if not present:
        common.console.print(f"poller {poller}: no notify trigger to drop")
        return
    common.console.print(f"poller {poller}: notify trigger on {', '.join(present)}")
    if dry_run:
        common.console.print("[dim]dry run: nothing was dropped[/]")
        return
    common.confirm_or_refuse(yes, f"Drop the notify triggers of poller {poller}?")
    with common.reporting_errors():
        dropped = drop_notify_triggers(cfg)
    common.console.print(f"[green]dropped[/] {', '.join(dropped)}")


__all__ = ["register"]
