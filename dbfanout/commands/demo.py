"""``dbfanout demo``: run the whole pipeline locally and check the result (see ``dbfanout.demo``)."""

from __future__ import annotations

import signal
import sys
from types import FrameType
from typing import Annotated

import typer
from rich.console import Console

from dbfanout.commands.common import EXIT_CHECK_FAILED, EXIT_OK, EXIT_USAGE, JsonOption, fail, print_json

__all__ = ["EXIT_INTERRUPTED", "demo", "register"]

EXIT_INTERRUPTED = 130  # the shell convention for Ctrl-C


def _interrupt(signum: int, frame: FrameType | None) -> None:
    # SIGTERM takes the same clean path as Ctrl-C: unwind, stopping every child on the way out.
    raise KeyboardInterrupt


def demo(
    duration: Annotated[float, typer.Option("--duration", min=10, help="Seconds the writer runs")] = 60.0,
    rate: Annotated[float, typer.Option("--rate", min=1, max=2000, help="Source changes per second")] = 50.0,
    keep: Annotated[bool, typer.Option("--keep", help="Keep the temporary app folder (its path is printed)")] = False,
    source: Annotated[
        str,
        typer.Option(
            "--source",
            help="keyset: poll the orders table (soft deletes); outbox: hard deletes, every change through an "
            "outbox table (docs/outbox.md); pg-logical: hard deletes, every change from a PostgreSQL "
            "replication slot (needs a reachable PostgreSQL with wal_level = logical: --pg-url); mysql-binlog: hard "
            "deletes, every change from a MariaDB/MySQL binlog (needs a reachable server with log_bin on, "
            "binlog_format = ROW and full row images and metadata: --mysql-url)",
        ),
    ] = "keyset",
    pg_url: Annotated[
        str | None,
        typer.Option(
            "--pg-url",
            envvar="DBFANOUT_DEMO_PG_URL",
            help="--source pg-logical: SQLAlchemy URL of the PostgreSQL to use "
            "(default postgresql+psycopg://postgres@127.0.0.1:5432/postgres)",
        ),
    ] = None,
    mysql_url: Annotated[
        str | None,
        typer.Option(
            "--mysql-url",
            envvar="DBFANOUT_DEMO_MYSQL_URL",
            help="--source mysql-binlog: SQLAlchemy URL of the MariaDB/MySQL to use "
            "(default mysql+pymysql://root@127.0.0.1:3306/)",
        ),
    ] = None,
    topic: Annotated[
        bool,
        typer.Option(
            "--topic",
            help="Fan out through a Service Bus topic with two subscriptions: replica (replicates, has the "
            "poison bug, its DLQ is replayed) and audit (records every event; must see each exactly once)",
        ),
    ] = False,
    json_out: JsonOption = False,
) -> None:
    """Run the whole pipeline locally: writer, poller, Service Bus, workers, a poison row, DLQ replay.

    Exits 0 only when the target table matches the source exactly.
    """
    # Loaded here, not at import: the demo pulls in the emulator, the SDKs and the host.
    if source not in ("keyset", "outbox", "pg-logical", "mysql-binlog"):
        fail(f"--source must be keyset, outbox, pg-logical or mysql-binlog (got {source!r})", EXIT_USAGE)
    if topic and source != "keyset":
        fail("--topic runs with --source keyset (the default)", EXIT_USAGE)
    from dbfanout.demo import DemoOptions, run_demo
    from dbfanout.demo.services import ServiceError
    from dbfanout.demo.view import LiveView, render_summary

    stderr = Console(stderr=True)
    view = LiveView(stderr, live=stderr.is_terminal and not json_out, hard_deletes=source != "keyset")
    previous = signal.signal(signal.SIGTERM, _interrupt)
    # A shell that started us in the background may have set SIGINT to "ignore": Ctrl-C (or
    # kill -INT) must still stop the demo cleanly.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with view:
            options = DemoOptions(duration=duration, rate=rate, keep=keep, source=source, pg_url=pg_url,
                                  mysql_url=mysql_url, topic=topic)  # fmt: skip
            summary = run_demo(options, view.show)
    except KeyboardInterrupt:
        stderr.print("[yellow]interrupted: every process the demo started has been stopped[/]")
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except (ServiceError, TimeoutError) as exc:
        fail(str(exc), EXIT_USAGE if isinstance(exc, ServiceError) else EXIT_CHECK_FAILED)
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if json_out:
        print_json(summary)
    else:
        render_summary(summary, Console())
    sys.stdout.flush()
    raise typer.Exit(EXIT_OK if summary["ok"] else EXIT_CHECK_FAILED)


def register(app: typer.Typer) -> None:
    """Mount ``dbfanout demo`` on the CLI root."""
    app.command("demo")(demo)
