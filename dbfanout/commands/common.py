"""What every command shares: loading config and settings, exit codes, JSON output, errors."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.table import Table

from shared.codec import dumps
from shared.config import Config, load_config
from shared.errors import ConfigError, DbFanoutError
from shared.settings import load_settings

__all__ = [
    "EXIT_CHECK_FAILED",
    "EXIT_OK",
    "EXIT_REFUSED",
    "EXIT_USAGE",
    "ConfigOption",
    "DryRunOption",
    "JsonOption",
    "YesOption",
    "app_root_of",
    "console",
    "fail",
    "load",
    "mount_group",
    "print_json",
    "print_table",
    "reporting_errors",
]

EXIT_OK = 0
EXIT_CHECK_FAILED = 1  # a check failed, or work remains
EXIT_USAGE = 2  # bad usage or configuration
EXIT_REFUSED = 3  # a guardrail refused (live lease, missing --yes, fingerprint mismatch)

ConfigOption = Annotated[
    Path | None,
    typer.Option("--config", "-c", help="dbfanout.toml to use (default: DBFANOUT_CONFIG, else ./dbfanout.toml)"),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Machine-readable output on stdout")]
YesOption = Annotated[bool, typer.Option("--yes", "-y", help="Do it without asking")]
DryRunOption = Annotated[bool, typer.Option("--dry-run", help="Show what would happen; change nothing")]

console = Console(stderr=False)
err_console = Console(stderr=True)


def mount_group(app: typer.Typer, name: str, help: str, commands: dict[str, Callable[..., None]]) -> None:
    """Mount ``dbfanout NAME SUBCOMMAND`` for each of ``commands`` (a command group)."""
    group = typer.Typer(help=help, no_args_is_help=True)
    for command, function in commands.items():
        group.command(command)(function)
    app.add_typer(group, name=name)


def app_root_of(config_path: Path | None) -> Path:
    """The app root a command works from: the config file's folder, else the current directory."""
    return config_path.resolve().parent if config_path else Path.cwd()


def load(config_path: Path | None, app_root: Path | None = None, *, lenient_settings: bool = False) -> Config:
    """Settings (environment over local.settings.json) and the config, as the Functions app reads them.

    ``lenient_settings``: a poller whose ``source_url`` setting is missing is marked instead of
    failing the load (``validate`` reports it per poller, as the deployed app fails its ticks).
    """
    root = app_root or app_root_of(config_path)
    return load_config(config_path, app_root=root, settings=load_settings(root), lenient_settings=lenient_settings)


def print_json(doc: Any) -> None:
    sys.stdout.write(dumps(doc).decode() + "\n")


def print_table(table: Table, empty: str) -> None:
    """Print ``table``, or the line ``empty`` when it has no rows (an empty grid of headers says less)."""
    if table.row_count:
        console.print(table)
    else:
        console.print(f"{table.title}: {empty}" if table.title else empty)


def fail(message: str, code: int = EXIT_CHECK_FAILED, hint: str | None = None) -> NoReturn:
    err_console.print(f"[bold red]error:[/] {message}")
    if hint:
        err_console.print(f"[dim]hint: {hint}[/]")
    raise typer.Exit(code)


@contextmanager
def reporting_errors() -> Iterator[None]:
    """Turn dbfanout errors into a one-line message, its hint and an exit code (no traceback)."""
    try:
        yield
    except ConfigError as exc:
        fail(f"{exc.key}: {exc.problem}", EXIT_USAGE, exc.hint)
    except DbFanoutError as exc:
        fail(str(exc.args[0]) if exc.args else type(exc).__name__, EXIT_CHECK_FAILED, exc.hint)


# --------------------------------------------------------------------------------------------
# Added for the operator commands (validate, status, checkpoint, dlq).


def confirm_or_refuse(yes: bool, question: str, *, always_refuse: bool = False) -> None:
    """Go on with ``--yes``; else ask on a terminal; refuse (exit 3) without one or on "no".

    ``always_refuse`` is for irreversible deletes: those need ``--yes`` even on a terminal.
    """
    if yes:
        return
    if always_refuse or not sys.stdin.isatty():
        fail(f"refused: {question.rstrip('?')} needs confirmation", EXIT_REFUSED, "re-run with --yes")
    if not typer.confirm(question, default=False):
        fail("refused: not confirmed; nothing was changed", EXIT_REFUSED)


@contextmanager
def progress_bar(description: str, *, enabled: bool = True) -> Iterator[Callable[[int, int], None]]:
    """A rich progress bar on stderr (only on a terminal); yields ``advance(done, total)``."""
    if not (enabled and err_console.is_terminal):
        yield lambda _done, _total: None
        return
    from rich.progress import Progress

    with Progress(console=err_console, transient=True) as progress:
        task = progress.add_task(description, total=None)

        def advance(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        yield advance
