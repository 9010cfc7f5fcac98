"""What every command shares: loading config and settings, exit codes, JSON output, errors."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console

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
    "JsonOption",
    "console",
    "fail",
    "load",
    "print_json",
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

console = Console(stderr=False)
err_console = Console(stderr=True)


def load(config_path: Path | None, app_root: Path | None = None) -> Config:
    """Settings (environment over local.settings.json) and the config, as the Functions app reads them."""
    root = app_root or (config_path.resolve().parent if config_path else Path.cwd())
    return load_config(config_path, app_root=root, settings=load_settings(root))


def print_json(doc: Any) -> None:
    sys.stdout.write(dumps(doc).decode() + "\n")


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
