"""``dbfanout checkpoint export|reset|clone``: move a poller's checkpoint, with guardrails (seed 002 §10)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from dbfanout.commands import common
from dbfanout.ops import checkpoints as ops
from dbfanout.ops.context import open_store, template_position
from dbfanout.ops.literals import LiteralError, parse_position
from poller.sources.factory import open_source
from shared.codec import dumps, encode_position, loads
from shared.config import Config, PollerConfig
from shared.errors import SerializationError
from shared.models import Position, StateDoc

PollerArg = Annotated[str, typer.Argument(help="The poller (a pollers.NAME table of dbfanout.toml)")]


def register(app: typer.Typer) -> None:
    """Mount ``checkpoint`` on the root command."""
    common.mount_group(
        app,
        "checkpoint",
        "Export, reset and clone poller checkpoints (with guardrails).",
        {"export": export_command, "reset": reset_command, "clone": clone_command},
    )


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def export_command(
    poller: PollerArg,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="Write to this file (default: stdout)")] = None,
    config: common.ConfigOption = None,
) -> None:
    """Print (or save) the poller's state blob as JSON; `reset --from-file` reads it back."""
    cfg, _ = _load_poller(config, poller)
    with common.reporting_errors():
        snap = open_store(cfg, poller).load()
    if snap is None:
        common.fail(f"poller {poller} has no state yet (it never ran)", hint="nothing to export")
    doc = {**ops.state_json(snap.doc), "etag": snap.etag}
    if out is None:
        common.print_json(doc)
        return
    out.write_bytes(dumps(doc) + b"\n")
    common.err_console.print(f"exported the state of {poller} to {out}")


def _load_poller(config: Path | None, poller: str) -> tuple[Config, PollerConfig]:
    """The configuration and its ``pollers.POLLER`` table; a missing file or poller ends the command."""
    with common.reporting_errors():
        cfg = common.load(config)
        pcfg = cfg.poller(poller)
    return cfg, pcfg


def _target(
    cfg: Config, poller: str, to_beginning: bool, to_cursor: str | None, pk: list[str], from_file: Path | None
) -> tuple[ops.TargetKind, Position | None, str | None]:
    chosen = sum([to_beginning, to_cursor is not None, from_file is not None])
    if chosen > 1:
        common.fail("choose one of --to-beginning, --to-cursor, --from-file", common.EXIT_USAGE)
    if pk and to_cursor is None:
        common.fail("--pk goes with --to-cursor", common.EXIT_USAGE)
    if to_beginning:
        return "beginning", None, None
    if from_file is not None:
        try:
            position, fingerprint = ops.position_from_export(loads(from_file.read_bytes()))
        except (OSError, ValueError, SerializationError) as exc:
            common.fail(
                f"--from-file {from_file}: {exc}",
                common.EXIT_USAGE,
                "pass a file written by `dbfanout checkpoint export`",
            )
        return "file", position, fingerprint
    if to_cursor is not None:
        with common.reporting_errors():
            template = template_position(cfg, poller)
        if template is None:
            common.fail(
                f"poller {poller}: the source has no rows and no checkpoint; cannot tell the cursor type",
                common.EXIT_USAGE,
                "use --to-beginning",
            )
        pcfg = cfg.poller(poller)
        ties = ("seq",) if pcfg.kind == "pg_logical" else pcfg.pk  # an LSN's tiebreaker: the change's position
        try:
            return "cursor", parse_position(to_cursor, pk, template, ties), None
        except LiteralError as exc:
            common.fail(str(exc), common.EXIT_USAGE, "the value is read as the cursor column's type")
    return "keep", None, None


def reset_command(
    poller: PollerArg,
    to_beginning: Annotated[bool, typer.Option("--to-beginning", help="Re-deliver every row")] = False,
    to_cursor: Annotated[
        str | None, typer.Option("--to-cursor", help="Deliver rows after (VALUE, pk); typed like the cursor")
    ] = None,
    pk: Annotated[list[str] | None, typer.Option("--pk", help="Tiebreaker NAME=VALUE for --to-cursor")] = None,
    from_file: Annotated[Path | None, typer.Option("--from-file", help="Position from a checkpoint export")] = None,
    accept_fingerprint: Annotated[
        bool, typer.Option("--accept-fingerprint", help="Adopt the configured source's fingerprint")
    ] = False,
    force: Annotated[bool, typer.Option("--force", help="Override a lease that expired without release")] = False,
    take_over: Annotated[
        bool,
        typer.Option("--take-over", help="Move the checkpoint under a live lease (a running app reloads it)"),
    ] = False,
    yes: common.YesOption = False,
    dry_run: common.DryRunOption = False,
    json_out: common.JsonOption = False,
    config: common.ConfigOption = None,
) -> None:
    """Move the checkpoint. Refuses on a live lease (unless --take-over) and on a fingerprint mismatch."""
    cfg, pcfg = _load_poller(config, poller)
    kind, position, file_fp = _target(cfg, poller, to_beginning, to_cursor, pk or [], from_file)
    if kind == "keep" and not accept_fingerprint:
        common.fail(
            "say where to move the checkpoint",
            common.EXIT_USAGE,
            "use --to-beginning, --to-cursor VALUE --pk k=v, --from-file F (or --accept-fingerprint alone)",
        )
    with common.reporting_errors():
        store = open_store(cfg, poller)
        try:
            plan = ops.plan_reset(
                store,
                kind=kind,
                position=position,
                current_fingerprint=open_source(pcfg).fingerprint,
                file_fingerprint=file_fp,
                accept_fingerprint=accept_fingerprint,
                force=force,
                take_over=take_over,
                ttl_seconds=pcfg.lease_ttl_seconds,
                now=_now(),
                operator=ops.operator_id(),
            )
        except ops.Refused as exc:
            common.fail(str(exc.args[0]), common.EXIT_REFUSED, exc.hint)
    _write(plan, cfg, store, yes=yes, dry_run=dry_run, json_out=json_out)


def clone_command(
    poller: PollerArg,
    new_name: Annotated[str, typer.Argument(help="The new poller's name (configure pollers.NEW_NAME to run it)")],
    from_beginning: Annotated[
        bool, typer.Option("--from-beginning", help="Start the clone with no checkpoint (a full backfill)")
    ] = False,
    yes: common.YesOption = False,
    dry_run: common.DryRunOption = False,
    json_out: common.JsonOption = False,
    config: common.ConfigOption = None,
) -> None:
    """Copy a poller's checkpoint into a new, independent state blob (backfills, experiments)."""
    cfg, _ = _load_poller(config, poller)
    with common.reporting_errors():
        source, target = open_store(cfg, poller), open_store(cfg, new_name, check_name=True)
        try:
            plan = ops.plan_clone(source, target, now=_now(), operator=ops.operator_id(), from_beginning=from_beginning)
        except ops.Refused as exc:
            common.fail(str(exc.args[0]), common.EXIT_REFUSED, exc.hint)
    if new_name not in cfg.pollers:
        plan.notes.append(f"add [pollers.{new_name}] to {cfg.path} (same source) before it can run")
    _write(plan, cfg, target, yes=yes, dry_run=dry_run, json_out=json_out)


def _write(plan: ops.Plan, cfg: Config, store: Any, *, yes: bool, dry_run: bool, json_out: bool) -> None:
    if not json_out:
        _show(plan)
    if dry_run:
        if json_out:
            common.print_json({**plan.to_json(), "dry_run": True, "written": False})
        else:
            common.console.print("[dim]dry run: nothing was written[/]")
        return
    common.confirm_or_refuse(yes, f"Write this {plan.action} of poller {plan.poller}?")
    with common.reporting_errors():
        try:
            ops.apply(plan, store, cfg.app.name, now=_now)
        except ops.Refused as exc:
            common.fail(str(exc.args[0]), common.EXIT_REFUSED, exc.hint)
    if json_out:
        common.print_json({**plan.to_json(), "dry_run": False, "written": True})
    else:
        backup = f"; previous state saved as {plan.backup_blob}" if plan.backup_blob else ""
        common.console.print(
            f"[green]{plan.action} written[/] to {plan.blob_name}{backup}; audit: audit/{cfg.app.name}.jsonl"
        )


def _describe(doc: StateDoc | None) -> dict[str, str]:
    if doc is None:
        return {"cursor": "(no state)", "pk": "", "batch": "", "fingerprint": "", "lease": ""}
    cursor = encode_position(doc.checkpoint.position)
    lease = doc.lease
    return {
        "cursor": "(beginning)" if cursor is None else f"{cursor['value']!s} ({cursor['kind']})",
        "pk": "" if cursor is None else dumps(cursor["tiebreaker"]).decode(),
        "batch": doc.checkpoint.last_successful_batch_id or "-",
        "fingerprint": doc.source_fingerprint,
        "lease": f"{lease.owner_id or 'free'} (token {lease.fencing_token})",
    }


def _show(plan: ops.Plan) -> None:
    table = Table(title=f"{plan.action} {plan.poller} ({plan.blob_name})")
    table.add_column("")
    table.add_column("before", overflow="fold")
    table.add_column("after", overflow="fold")
    before, after = _describe(plan.before), _describe(plan.after)
    for key in before:
        table.add_row(key, before[key], after[key])
    common.console.print(table)
    for note in plan.notes:
        common.console.print(f"[yellow]note:[/] {note}")


__all__ = ["register"]
