"""``dbfanout init``: make the current folder an app with one poller on your table.

Takes (or asks for) a database URL and a table, reads the table's key, a usable cursor, the
index the keyset query needs and whether the server's log allows a log source; writes the
poller into ``dbfanout.toml``, a handler stub, ``local.settings.json``, ``function_app.py`` and
``host.json`` where missing; enables the driver in ``requirements-drivers.txt``; runs
``validate`` against the services ``dbfanout run`` would use and prints the next command.
Without a database every unknown is a marked placeholder (``TODO-dbfanout-init``).
"""

from __future__ import annotations

import os
import re
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Annotated

import sqlalchemy as sa
import typer

from dbfanout.commands.common import EXIT_OK, EXIT_USAGE, YesOption, console, fail
from dbfanout.commands.init_files import (
    PLACEHOLDER,
    PollerPlan,
    copy_entry_points,
    enable_drivers,
    handler_stub,
    merge_local_settings,
    poller_toml,
    write_config,
)
from dbfanout.commands.init_table import TableShape, inspect_table, split_table_name

__all__ = ["init_command", "register"]

KINDS = ("auto", "keyset", "pg_logical", "mysql_binlog")


def register(app: typer.Typer) -> None:
    """Mount ``dbfanout init`` on the CLI root."""
    app.command("init")(init_command)


def init_command(
    url: Annotated[str | None, typer.Option("--url", help="SQLAlchemy URL of the source database")] = None,
    table: Annotated[str | None, typer.Option("--table", help="The table to watch (schema.table allowed)")] = None,
    poller: Annotated[str | None, typer.Option("--poller", help="Poller name (default: from the table)")] = None,
    queue: Annotated[str | None, typer.Option("--queue", help="Queue name (default: <poller>-changes)")] = None,
    kind: Annotated[
        str, typer.Option("--kind", help="auto (keyset; a log source when no cursor), keyset, pg_logical, mysql_binlog")
    ] = "auto",
    create_index: Annotated[
        bool, typer.Option("--create-index", help="Create the (cursor, pk) index the keyset query needs")
    ] = False,
    app_root: Annotated[Path | None, typer.Option("--app-root", help="The app folder (default: .)")] = None,
    validate: Annotated[bool, typer.Option("--validate/--no-validate", help="Run validate at the end")] = True,
    yes: YesOption = False,
) -> None:
    """Write a poller for your table (dbfanout.toml, a handler, local.settings.json), then validate it."""
    if kind not in KINDS:
        raise typer.BadParameter(f"{kind!r}: use {', '.join(KINDS)}", param_hint="--kind")
    root = (app_root or Path.cwd()).resolve()
    root.mkdir(parents=True, exist_ok=True)
    interactive = not yes and sys.stdin.isatty()
    if interactive and url is None:
        url = typer.prompt("Database URL (SQLAlchemy; empty: placeholders)", default="", show_default=False) or None
    if interactive and table is None:
        table = typer.prompt("Table", default="", show_default=False) or None
    shape = _inspect(url, table, create_index) if url and table else None
    if url and not table:
        fail("--table is required with --url", EXIT_USAGE, hint=_tables_hint(url))
    plan = _plan(table or f"{PLACEHOLDER}_table", url, shape, poller, queue, kind)
    _write(root, plan, url)
    placeholders = shape is None
    if validate and not placeholders:
        code = _validate(root, plan.name)
        if code != EXIT_OK:
            console.print("[yellow]validate found problems (above): fix them, then `dbfanout validate`[/]")
    _next_steps(root, plan, placeholders)


def _inspect(url: str, table: str, create_index: bool) -> TableShape:
    try:
        engine = sa.create_engine(url)
    except (sa.exc.ArgumentError, ModuleNotFoundError) as exc:
        fail(f"--url: {exc}", EXIT_USAGE, hint="a SQLAlchemy URL, e.g. postgresql+psycopg://user@host:5432/db")
    try:
        shape = inspect_table(engine, table)
        if shape.index_sql and create_index:
            with engine.begin() as conn:
                conn.exec_driver_sql(shape.index_sql)
            console.print(f"created the keyset index: {shape.index_sql}")
            shape = inspect_table(engine, table)
        return shape
    except LookupError as exc:
        fail(f"--table: {exc.args[0]}", EXIT_USAGE)
    except sa.exc.SQLAlchemyError as exc:
        fail(f"cannot read {_safe(url)}: {type(exc).__name__}: {str(exc).splitlines()[0]}", EXIT_USAGE)
    finally:
        engine.dispose()


def _tables_hint(url: str) -> str:
    try:
        engine = sa.create_engine(url)
        try:
            names = sorted(sa.inspect(engine).get_table_names())[:20]
        finally:
            engine.dispose()
    except Exception:  # only a hint: the URL itself is reported elsewhere
        return "pass --table NAME"
    return f"pass --table NAME (tables here: {', '.join(names) or 'none'})"


def _safe(url: str) -> str:
    return sa.engine.make_url(url).render_as_string(hide_password=True)


def _plan(
    table: str, url: str | None, shape: TableShape | None, poller: str | None, queue: str | None, kind: str
) -> PollerPlan:
    base = split_table_name(table)[1]
    name = poller or re.sub(r"[^a-z0-9_]", "_", base.lower()).strip("_") or "changes"
    if not name[0].isalpha():
        name = f"t_{name}"
    if kind == "auto":
        kind = "keyset"
        if shape is not None and shape.cursor is None and shape.log_kind is not None:
            kind = shape.log_kind  # no cursor to poll, but the server's log has every change
    if shape is not None and kind != "keyset" and shape.log_kind != kind:
        fail(f"--kind {kind}: {shape.log_detail}", EXIT_USAGE, hint="use --kind keyset, or change the server")
    return PollerPlan(
        name=name,
        kind=kind,
        table=table,
        url_setting=f"{name.upper()}_DB_URL",
        queue=queue or f"{name.replace('_', '-')}-changes",
        shape=shape,
    )


def _write(root: Path, plan: PollerPlan, url: str | None) -> None:
    config = root / "dbfanout.toml"
    if config.exists() and re.search(rf"^\[pollers\.{re.escape(plan.name)}\]", config.read_text(), re.MULTILINE):
        fail(f"{config} already has [pollers.{plan.name}]", EXIT_USAGE, hint="pick another name with --poller NAME")
    app_name = re.sub(r"[^A-Za-z0-9_-]", "-", root.name).strip("-_") or "app"
    done = [write_config(config, app_name if app_name[0].isalpha() else f"app-{app_name}", poller_toml(plan))]
    handlers = root / "handlers"
    handlers.mkdir(exist_ok=True)
    (handlers / "__init__.py").touch()
    stub = handlers / f"{plan.handler_module}.py"
    if stub.exists():
        done.append(f"handlers/{stub.name}: kept (it exists)")
    else:
        stub.write_text(handler_stub(plan), encoding="utf-8")
        done.append(f"handlers/{stub.name}: written (a stub that logs each change)")
    done.append(merge_local_settings(root / "local.settings.json", plan.url_setting, url))
    from dbfanout.demo.services import project_root

    done.extend(copy_entry_points(root, project_root()))
    done.extend(enable_drivers(root / "requirements-drivers.txt", url, plan.kind))
    for line in done:
        console.print(f"  {line}")
    _report_shape(plan)
    if not all((root / p).is_dir() for p in ("poller", "worker", "shared")):
        console.print(
            "[yellow]note:[/] this folder is not a clone of the dbfanout template (no poller/, worker/, shared/): "
            "`dbfanout run` works here with the installed dbfanout, but a deployment needs them "
            "(docs/functions-app.md, the app model)"
        )


def _report_shape(plan: PollerPlan) -> None:
    shape = plan.shape
    if shape is None:
        console.print(f"[yellow]no database given: every {PLACEHOLDER} value in dbfanout.toml and "
                      "local.settings.json is a placeholder to replace[/]")  # fmt: skip
        return
    console.print(f"poller {plan.name} ({plan.kind}) on {shape.table}: pk {', '.join(shape.pk) or 'NONE'}, "
                  f"cursor {shape.cursor or 'NONE'}")  # fmt: skip
    if not shape.pk:
        console.print("[yellow]the table has no primary key: set pk = [...] to a unique, not-null key[/]")
    if shape.index_sql and plan.kind == "keyset":
        console.print(
            f"[yellow]the keyset query needs this index (or rerun with --create-index):[/]\n  {shape.index_sql}"
        )
    if shape.log_kind and plan.kind == "keyset":
        console.print(
            f"a log source is possible here and better ({shape.log_detail}): every change, hard deletes "
            f"included, no cursor column or index needed: rerun with --kind {shape.log_kind} --poller NAME"
        )
    elif not shape.log_kind:
        console.print(f"log source: not possible ({shape.log_detail})")


def _validate(root: Path, poller: str) -> int:
    """``dbfanout validate POLLER`` against the services ``dbfanout run`` would start."""
    from dbfanout.commands.validate import validate_command
    from dbfanout.host.devservices import start_dev_services
    from shared.config import load_config
    from shared.settings import load_settings

    settings = load_settings(root)
    with ExitStack() as stack:
        try:
            cfg = load_config(root / "dbfanout.toml", app_root=root, settings=settings, lenient_settings=True)
            services = start_dev_services(root, cfg, settings)
        except Exception as exc:  # validate below reports the same problem, named
            console.print(f"[yellow]local services not started: {exc}[/]")
        else:
            stack.callback(services.close)
            saved = {k: os.environ.get(k) for k in services.settings}
            stack.callback(_restore, saved)
            os.environ.update(services.settings)
        try:
            validate_command(poller=poller, json_out=False, config=root / "dbfanout.toml", fix=False)
        except typer.Exit as exit_:
            return exit_.exit_code
    return EXIT_OK


def _restore(saved: dict[str, str | None]) -> None:
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _next_steps(root: Path, plan: PollerPlan, placeholders: bool) -> None:
    where = "" if root == Path.cwd().resolve() else f" --app-root {root}"
    if placeholders:
        config = "" if not where else f" -c {root / 'dbfanout.toml'}"
        steps = f"replace the {PLACEHOLDER} values, then `dbfanout validate{config}` and `dbfanout run{where}`"
    elif plan.kind == "pg_logical":
        steps = f"`dbfanout validate --fix` (creates the publication and slot), then `dbfanout run{where}`"
    else:
        steps = f"`dbfanout run{where}`, then change a row of {plan.table}: handlers/{plan.handler_module}.py logs it"
    console.print(f"next: {steps}")
    raise typer.Exit(EXIT_OK)
