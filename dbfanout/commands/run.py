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
from typing import TYPE_CHECKING, Annotated, cast

import typer

from dbfanout.commands.common import EXIT_CHECK_FAILED, EXIT_OK, EXIT_USAGE, ConfigOption, fail, reporting_errors
from shared.config import CONFIG_SETTING

if TYPE_CHECKING:
    from dbfanout.host.devservices import DevServices

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
    emulators: Annotated[
        bool,
        typer.Option(
            "--emulators/--no-emulators",
            help="Start Azurite and the Service Bus emulator (free ports, the app's queues and topics) for "
            "the connection settings that point at no running service (default: on)",
        ),
    ] = True,
) -> None:
    """Run function_app.py locally: fire its timers, feed its queue triggers.

    Storage and Service Bus settings that are unset, or name the local emulators while none
    answers, get an Azurite and a Service Bus emulator started for this run."""
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
    with reporting_errors():
        services = _dev_services(root, config, extra) if emulators else None
    if services is not None:
        extra.update(services.settings)
    host = LocalHost(root, app, extra_settings=extra, grace_seconds=grace)
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with reporting_errors():
            host.start()
            print(f"dbfanout host running {len(host.timers)} timer(s), {len(host.queues)} queue trigger(s)", flush=True)
            host.wait(stop, duration)
    finally:
        host.stop()
        if services is not None:
            services.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    sys.stdout.flush()
    sys.stderr.flush()
    if not host.clean_stop:
        # A call outlived --grace. Its thread would block interpreter exit (pool threads are
        # joined at exit), so leave now: its message is unsettled and comes back after the lock.
        os._exit(EXIT_CHECK_FAILED)
    raise typer.Exit(EXIT_OK)


def _dev_services(root: Path, config: Path | None, extra: dict[str, str]) -> DevServices | None:
    """Start the local services the app's settings lack; None when the config does not load
    (the host then reports it, naming the key) or nothing is needed."""
    from dbfanout.demo.services import ServiceError
    from dbfanout.host.devservices import start_dev_services
    from shared.config import load_config
    from shared.errors import ConfigError
    from shared.settings import load_settings

    settings = {**load_settings(root), **extra}
    try:
        cfg = load_config(config, app_root=root, settings=settings, lenient_settings=True)
    except ConfigError:
        return None
    try:
        services = start_dev_services(root, cfg, settings)
    except ServiceError as exc:
        fail(str(exc), EXIT_USAGE)
    for line in services.started:
        print(f"dbfanout run: started {line}", flush=True)
    return services if services.started else None


def register(app: typer.Typer) -> None:
    """Mount ``dbfanout run`` on the CLI root."""
    app.command("run")(run)
