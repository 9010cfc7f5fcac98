"""``dbfanout emulator servicebus`` / ``python -m sbemulator``: run the emulator until stopped."""

# No `from __future__ import annotations`: typer reads the options of the command that build_app
# defines at run time, and one of them depends on build_app's argument (a closure variable).

import logging
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Annotated

import typer

from sbemulator.config import EmulatorConfig
from sbemulator.emulator import Emulator
from sbemulator.errors import ConfigError

#: Reads an app's own configuration file (``--app-config``) into the entities it needs. The emulator
#: knows no app format: the operator package (``dbfanout emulator servicebus``) hands one in.
AppEntities = Callable[[Path], EmulatorConfig]


def build_app(app_entities: AppEntities | None = None) -> typer.Typer:
    """The ``emulator`` command group; ``app_entities`` enables ``servicebus --app-config``."""
    group = typer.Typer(help="Local emulators.", no_args_is_help=True)

    @group.callback()
    def _group() -> None:
        """Local emulators (keeps `servicebus` a sub-command even while it is the only one)."""

    @group.command()
    def servicebus(
        config: Annotated[Path | None, typer.Option("--config", help="Official-format Config.json")] = None,
        app_config: Annotated[
            Path | None,
            typer.Option(
                "--app-config",
                help="A dbfanout.toml: declare its queues, topics and subscriptions",
                hidden=app_entities is None,
            ),
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
                if app_entities is None:
                    raise ConfigError("--app-config is read by the operator tools: run `dbfanout emulator servicebus`")
                cfg = merged(cfg, app_entities(app_config))
            emulator = Emulator(cfg, host=host, port=port, http_port=http_port, data_dir=data_dir)
            emulator.start()
        except (ConfigError, OSError) as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from exc
        _serve(emulator, cfg, host)

    return group


def _serve(emulator: Emulator, cfg: EmulatorConfig, host: str) -> None:
    stop = threading.Event()

    def _on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    names = ", ".join(q.name for q in cfg.queues) or (
        "(none: `dbfanout emulator servicebus --app-config dbfanout.toml` declares an app's queues and topics;"
        " or list them in a Config.json given with --config)"
    )
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


def merged(cfg: EmulatorConfig, more: EmulatorConfig) -> EmulatorConfig:
    """``cfg`` plus the queues and topics of ``more`` (validated: a name declared twice is refused)."""
    result = EmulatorConfig(cfg.namespace, cfg.queues + more.queues, cfg.topics + more.topics)
    result.validate()
    return result


app = build_app()


def main() -> None:
    """Entry point of ``python -m sbemulator``."""
    app()
