"""``dbfanout run``: run the Functions app locally, without the Functions host.

Like ``func start``: settings come from ``local.settings.json`` Values and the environment
(the environment wins), ``host.json`` is honoured, every timer fires on its NCRONTAB schedule
and every Service Bus queue trigger gets a peek-lock receiver. Ctrl-C or SIGTERM stops
receiving, lets running calls finish and releases what the app holds.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Annotated, cast

import typer

from dbfanout.commands.common import EXIT_CHECK_FAILED, EXIT_OK, ConfigOption, reporting_errors
from shared.config import CONFIG_SETTING

__all__ = ["LOG_FORMAT_SETTING", "register", "run"]

DEFAULT_APP = "function_app:app"  # the same default as dbfanout.host.app_loader (imported lazily)
LOG_FORMAT_SETTING = "DBFANOUT_LOG_FORMAT"  # the environment variable behind --log-format


def run(
    config: ConfigOption = None,
    app: Annotated[str, typer.Option("--app", help="module:attribute of the FunctionApp")] = DEFAULT_APP,
    app_root: Annotated[
        Path | None, typer.Option("--app-root", help="Folder holding function_app.py and host.json (default: .)")
    ] = None,
    duration: Annotated[
        float | None, typer.Option("--duration", help="Stop after this many seconds (default: until Ctrl-C)")
    ] = None,
    grace: Annotated[float, typer.Option("--grace", help="Seconds running calls get to finish at shutdown")] = 30.0,
    log_level: Annotated[str, typer.Option("--log-level", help="DEBUG, INFO, WARNING or ERROR")] = "INFO",
    log_format: Annotated[
        str,
        typer.Option(
            "--log-format",
            envvar=LOG_FORMAT_SETTING,
            help="text (message, then key=value fields) or json (one object per line)",
        ),
    ] = "text",
    otel: Annotated[
        str | None,
        typer.Option(
            "--otel",
            help="Export dbfanout's spans and metrics: console (to stdout), otlp, azure-monitor, or none; "
            "default: what the settings ask for (OTEL_EXPORTER_OTLP_ENDPOINT, APPLICATIONINSIGHTS_CONNECTION_STRING)",
        ),
    ] = None,
) -> None:
    """Run function_app.py locally: fire its timers, feed its queue triggers."""
    if log_format not in ("text", "json"):
        raise typer.BadParameter(f"{log_format!r}: use text or json", param_hint="--log-format")
    if otel not in (None, "console", "otlp", "azure-monitor", "none"):
        raise typer.BadParameter(f"{otel!r}: use console, otlp, azure-monitor or none", param_hint="--otel")
    root = (app_root or Path.cwd()).resolve()
    extra = {CONFIG_SETTING: str(config.resolve())} if config is not None else {}
    logging.getLogger().setLevel(logging.WARNING)
    # The host (azure.functions, croniter, the SDKs) loads only when this command runs, so that
    # every other dbfanout command starts fast.
    from dbfanout.host import LocalHost
    from dbfanout.host.host import configure_logging

    configure_logging(getattr(logging, log_level.upper(), logging.INFO), "json" if log_format == "json" else "text")
    if otel is not None:  # before the app loads: its own configure_telemetry() then keeps this choice
        from shared.otel_setup import Exporter, configure_telemetry

        configure_telemetry(override=cast(Exporter, otel))
    stop = threading.Event()
    host = LocalHost(root, app, extra_settings=extra, grace_seconds=grace)
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with reporting_errors():
            host.start()
            print(f"dbfanout host running {len(host.timers)} timer(s), {len(host.queues)} queue trigger(s)", flush=True)
            host.wait(stop, duration)
    finally:
        host.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    sys.stdout.flush()
    sys.stderr.flush()
    if not host.clean_stop:
        # A call outlived --grace. Its thread would block interpreter exit (pool threads are
        # joined at exit), so leave now: its message is unsettled and comes back after the lock.
        os._exit(EXIT_CHECK_FAILED)
    raise typer.Exit(EXIT_OK)


def register(app: typer.Typer) -> None:
    """Mount ``dbfanout run`` on the CLI root."""
    app.command("run")(run)
