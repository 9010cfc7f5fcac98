"""``dbfanout emulator servicebus`` / ``python -m sbemulator``: run the emulator until stopped."""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from types import FrameType
from typing import Annotated

import typer

from sbemulator.config import EmulatorConfig
from sbemulator.emulator import Emulator
from sbemulator.errors import ConfigError

app = typer.Typer(help="Local emulators.", no_args_is_help=True)


@app.callback()
def _group() -> None:
    """Local emulators (keeps `servicebus` a sub-command even while it is the only one)."""


@app.command()
def servicebus(
    config: Annotated[Path | None, typer.Option("--config", help="Official-format Config.json")] = None,
    app_config: Annotated[
        Path | None,
        typer.Option("--app-config", help="A dbfanout.toml: declare its queues, topics and subscriptions"),
    ] = None,
    host: Annotated[str, typer.Option(help="Interface to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="AMQP port; 0 picks a free one")] = 5672,
    http_port: Annotated[int, typer.Option("--http-port", help="GET /health port; 0 picks a free one")] = 5300,
    data_dir: Annotated[Path | None, typer.Option("--data-dir", help="Persist messages in this folder")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log connections and closes")] = False,
) -> None:
    """Run a local Service Bus (AMQP) emulator until Ctrl-C or SIGTERM."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # Set on our logger, not the root: under `dbfanout` the root logger is configured already
    # (basicConfig above is then a no-op) and would otherwise swallow -v.
    logging.getLogger("sbemulator").setLevel(logging.DEBUG if verbose else logging.INFO)
    try:
        cfg = EmulatorConfig.from_file(config) if config else EmulatorConfig()
        if app_config is not None:
            cfg = _with_app_entities(cfg, app_config)
        emulator = Emulator(cfg, host=host, port=port, http_port=http_port, data_dir=data_dir)
        emulator.start()
    except (ConfigError, OSError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    stop = threading.Event()

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    names = ", ".join(q.name for q in cfg.queues) or "(none; create them in Config.json)"
    topics = ", ".join(f"{t.name} [{', '.join(s.name for s in t.subscriptions)}]" for t in cfg.topics) or "(none)"
    typer.echo(f"AMQP port: {emulator.port}")
    typer.echo(f"Health: http://{host}:{emulator.http_port}/health")
    typer.echo(f"Queues: {names}")
    typer.echo(f"Connection string: {emulator.connection_string}", color=False)
    typer.echo(f"Topics: {topics}")  # after the connection string: scripts read the first four lines
    try:
        while not stop.wait(0.5):
            pass
    finally:
        emulator.stop()
        typer.echo("stopped")


def _with_app_entities(cfg: EmulatorConfig, app_config: Path) -> EmulatorConfig:
    """``cfg`` plus the entities a dbfanout app needs (its pollers' queues, topics, subscriptions)."""
    # dbfanout's own packages, imported only for --app-config: the emulator runs without them.
    from dbfanout.ops.entities import emulator_config_for
    from shared.config import load_config
    from shared.errors import DbFanoutError
    from shared.settings import load_settings

    root = app_config.resolve().parent
    try:
        app = emulator_config_for(load_config(app_config, settings=load_settings(root), lenient_settings=True))
    except DbFanoutError as exc:
        raise ConfigError(f"--app-config {app_config}: {exc}") from exc
    merged = EmulatorConfig(cfg.namespace, cfg.queues + app.queues, cfg.topics + app.topics)
    merged.validate()
    return merged


def main() -> None:
    """Entry point of ``python -m sbemulator``."""
    app()
