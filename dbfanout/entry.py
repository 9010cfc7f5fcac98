"""The console script's entry point: a clear message when the operator extra is not installed."""

from __future__ import annotations

import sys


def main() -> None:
    try:
        from dbfanout.cli import main as cli_main
    except ModuleNotFoundError as exc:
        if exc.name in {"typer", "rich", "croniter", "proton", "cproton"}:
            sys.stderr.write(
                f"error: the dbfanout command needs the operator tools ({exc.name} is missing)\n"
                "hint: pip install 'dbfanout[cli]'\n"
            )
            raise SystemExit(2) from exc
        raise
    cli_main()
