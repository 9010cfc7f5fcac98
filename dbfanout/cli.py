"""The ``dbfanout`` console script.

Commands live in their own modules and are mounted here; each reads the same ``dbfanout.toml``
(``--config`` or ``DBFANOUT_CONFIG``) and the same settings (environment, then
``local.settings.json`` Values). Exit codes: 0 ok, 1 a check failed or work remains,
2 bad usage or configuration, 3 refused by a guardrail.
"""

from __future__ import annotations

import logging
import sys

import typer

from dbfanout.ops.entities import emulator_entities
from sbemulator.cli import build_app as build_emulator_app
from shared.logs import console_handler

app = typer.Typer(
    help="dbfanout: a database change trigger for Azure Functions, as a Service Bus fan-out pipeline.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.add_typer(build_emulator_app(emulator_entities), name="emulator", help="Start a local emulator (Service Bus).")


#: Modules exposing ``register(app)``, mounted in this order (a bare name is in dbfanout.commands).
COMMAND_MODULES = (
    "init", "run", "demo", "validate", "status", "checkpoint", "dbfanout.dlq.command", "snapshot", "notify",
)  # fmt: skip


def _register_commands() -> None:
    import importlib

    for name in COMMAND_MODULES:
        module_name = name if "." in name else f"dbfanout.commands.{name}"
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:  # a missing dependency is a real error, not an absent command
                raise
            continue
        module.register(app)


_register_commands()


def main() -> None:
    logging.basicConfig(level=logging.WARNING, handlers=[console_handler(sys.stderr)])
    app()


if __name__ == "__main__":
    main()
