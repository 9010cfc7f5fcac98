"""The operator's side of the story, done with the real CLI: replay the dead-letter queue; with
``--source pg-logical``, re-snapshot the table (``dbfanout snapshot``).

``python -m dbfanout.cli dlq replay QUEUE[/SUBSCRIPTION] --all --yes --json --config dbfanout.toml`` runs as a
child process, exactly as an operator would type it; the demo polls it, so the live view keeps
moving while it runs.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping
from typing import Any

from dbfanout.demo.appdir import DemoApp
from dbfanout.demo.services import ChildProcess

__all__ = ["ReplayRun", "SnapshotRun", "replay_command", "snapshot_command"]


def replay_command(app: DemoApp, entity: str | None = None) -> list[str]:
    """The operator's command line: replay the queue's DLQ (or ``topic/subscription``'s)."""
    return [sys.executable, "-m", "dbfanout.cli", "dlq", "replay", entity or app.queue, "--all", "--yes", "--json",
            "--config", str(app.config_file)]  # fmt: skip


class _CommandRun:
    """A CLI command in a child process, its stdout (``--json``) and log in the app folder; polled."""

    #: What ``error`` says when the command ran past its time limit and was stopped.
    overdue = "the command did not finish in time"

    def __init__(self, app: DemoApp, env: Mapping[str, str], command: list[str], name: str, timeout: float) -> None:
        self._out = app.root / f"{name}.json"
        self._log = app.root / f"{name}.log"
        self._deadline = time.monotonic() + timeout
        self._child = ChildProcess(command, cwd=app.root, env=env, log=self._log, stdout=self._out)
        self.exit_code: int | None = None
        self.error: str | None = None

    def poll(self) -> bool:
        """Whether the run has finished (a run over its time limit is stopped and fails)."""
        if self.exit_code is not None:
            return True
        code = self._child.proc.poll()
        if code is None and time.monotonic() < self._deadline:
            return False
        if code is None:
            self._child.stop(grace=5)
            self.exit_code, self.error = -1, self.overdue
            return True
        self.exit_code = code
        self._read_report(self._report())
        return True

    def stop(self) -> None:
        self._child.stop(grace=5)

    def _report(self) -> dict[str, Any]:
        try:
            report = json.loads(self._out.read_text() or "{}")
        except (OSError, ValueError):
            report = {}
        return report if isinstance(report, dict) else {}

    def _read_report(self, report: dict[str, Any]) -> None:
        raise NotImplementedError

    def _failed(self, said: str | None = None) -> None:
        tail = self._log.read_text(errors="replace").strip().splitlines()[-3:] if self._log.exists() else []
        self.error = said or " / ".join(tail) or f"exit code {self.exit_code}"


class ReplayRun(_CommandRun):
    """One replay run in a child process."""

    overdue = "the replay did not finish in time"

    def __init__(self, app: DemoApp, env: Mapping[str, str], entity: str | None = None, timeout: float = 120.0) -> None:
        super().__init__(app, env, replay_command(app, entity), "replay", timeout)
        self.replayed = 0

    def _read_report(self, report: dict[str, Any]) -> None:
        self.replayed = int(report.get("replayed", 0))
        if self.exit_code != 0:
            self._failed(report.get("error"))


def snapshot_command(app: DemoApp, poller: str, chunk_size: int) -> list[str]:
    """The operator's command line: a snapshot of the poller's tables, beside its stream."""
    return [sys.executable, "-m", "dbfanout.cli", "snapshot", poller, "--chunk-size", str(chunk_size), "--json",
            "--config", str(app.config_file)]  # fmt: skip


class SnapshotRun(_CommandRun):
    """``dbfanout snapshot`` in a child process: it only queues the request (the poller reads it)."""

    overdue = "dbfanout snapshot did not finish in time"

    def __init__(
        self, app: DemoApp, env: Mapping[str, str], poller: str, chunk_size: int, timeout: float = 60.0
    ) -> None:
        self.request: str | None = None  # the request's id: the snapshot's id in the state blob
        super().__init__(app, env, snapshot_command(app, poller, chunk_size), "snapshot", timeout)

    def _read_report(self, report: dict[str, Any]) -> None:
        request = report.get("request")
        self.request = str(request) if request is not None else None
        if self.exit_code != 0 or self.request is None:
            self._failed()
