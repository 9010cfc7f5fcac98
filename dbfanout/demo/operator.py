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

from dbfanout.demo.appdir import DemoApp
from dbfanout.demo.services import ChildProcess

__all__ = ["ReplayRun", "SnapshotRun", "replay_command", "snapshot_command"]


def replay_command(app: DemoApp, entity: str | None = None) -> list[str]:
    """The operator's command line: replay the queue's DLQ (or ``topic/subscription``'s)."""
    return [sys.executable, "-m", "dbfanout.cli", "dlq", "replay", entity or app.queue, "--all", "--yes", "--json",
            "--config", str(app.config_file)]  # fmt: skip


class ReplayRun:
    """One replay run in a child process."""

    def __init__(self, app: DemoApp, env: Mapping[str, str], entity: str | None = None, timeout: float = 120.0) -> None:
        self._out = app.root / "replay.json"
        self._log = app.root / "replay.log"
        self._deadline = time.monotonic() + timeout
        self._child = ChildProcess(replay_command(app, entity), cwd=app.root, env=env, log=self._log, stdout=self._out)
        self.exit_code: int | None = None
        self.replayed = 0
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
            self.exit_code, self.error = -1, "the replay did not finish in time"
            return True
        self.exit_code = code
        self._read_report()
        return True

    def _read_report(self) -> None:
        try:
            report = json.loads(self._out.read_text() or "{}")
        except (OSError, ValueError):
            report = {}
        self.replayed = int(report.get("replayed", 0))
        if self.exit_code != 0:
            tail = self._log.read_text(errors="replace").strip().splitlines()[-3:] if self._log.exists() else []
            self.error = report.get("error") or " / ".join(tail) or f"exit code {self.exit_code}"

    def stop(self) -> None:
        self._child.stop(grace=5)


def snapshot_command(app: DemoApp, poller: str, chunk_size: int) -> list[str]:
    """The operator's command line: a snapshot of the poller's tables, beside its stream."""
    return [sys.executable, "-m", "dbfanout.cli", "snapshot", poller, "--chunk-size", str(chunk_size), "--json",
            "--config", str(app.config_file)]  # fmt: skip


class SnapshotRun:
    """``dbfanout snapshot`` in a child process: it only queues the request (the poller reads it)."""

    def __init__(
        self, app: DemoApp, env: Mapping[str, str], poller: str, chunk_size: int, timeout: float = 60.0
    ) -> None:
        self._out = app.root / "snapshot.json"
        self._log = app.root / "snapshot.log"
        self._deadline = time.monotonic() + timeout
        self._child = ChildProcess(
            snapshot_command(app, poller, chunk_size), cwd=app.root, env=env, log=self._log, stdout=self._out
        )
        self.exit_code: int | None = None
        self.request: str | None = None  # the request's id: the snapshot's id in the state blob
        self.error: str | None = None

    def poll(self) -> bool:
        """Whether the command has finished (one over its time limit is stopped and fails)."""
        if self.exit_code is not None:
            return True
        code = self._child.proc.poll()
        if code is None and time.monotonic() < self._deadline:
            return False
        if code is None:
            self._child.stop(grace=5)
            self.exit_code, self.error = -1, "dbfanout snapshot did not finish in time"
            return True
        self.exit_code = code
        try:
            self.request = json.loads(self._out.read_text() or "{}").get("request")
        except (OSError, ValueError):
            self.request = None
        if code != 0 or self.request is None:
            tail = self._log.read_text(errors="replace").strip().splitlines()[-3:] if self._log.exists() else []
            self.error = " / ".join(tail) or f"exit code {code}"
        return True

    def stop(self) -> None:
        self._child.stop(grace=5)
