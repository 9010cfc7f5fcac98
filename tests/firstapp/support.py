"""What a user of docs/first-app.md does, as processes: a clone of the template, ``dbfanout`` commands
run in it, ``dbfanout run`` in the background with its log in a file.

Step 1's ``make bootstrap`` is this test environment itself: its virtual environment (dbfanout's
dependencies; ``python -m dbfanout.cli`` in the clone runs the clone's own code) and the Azurite
this checkout's bootstrap installed, linked into the clone.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from tests.support.ports import wait_until

REPO = Path(__file__).resolve().parents[2]
# Not needed by the app and slow to copy; a clone has them, the steps never read them.
SKIPPED = ("tests/", "benchmarks/", "docs/")
# The settings a user's shell does not have: local.settings.json decides, as on a laptop.
APP_SETTINGS = ("AzureWebJobsStorage", "DBFANOUT_", "ORDERS_DB_URL", "TARGET_DB_URL", "FUNCTIONS_WORKER_RUNTIME")


def template_clone(dest: Path) -> Path:
    """``git clone`` of this repository into ``dest``, as the working tree has it (uncommitted work
    included): every tracked or new, not ignored file."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for rel in filter(None, listed):
        source = REPO / rel
        if rel.startswith(SKIPPED) or not source.is_file():
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)
    # Step 1's `make bootstrap` runs `npm ci` in the clone; this checkout's bootstrap already did.
    (dest / "node_modules").symlink_to(REPO / "node_modules", target_is_directory=True)
    return dest


def user_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(APP_SETTINGS)}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def dbfanout(app: Path, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    """``dbfanout ARGS`` in the app folder, output captured."""
    return subprocess.run(
        [sys.executable, "-m", "dbfanout.cli", *args],
        cwd=app, env=user_env(), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
    )  # fmt: skip


class Run:
    """``dbfanout run`` in the app folder, in the background (its own process group: Azurite too)."""

    def __init__(self, app: Path) -> None:
        self.log = app / "run.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "dbfanout.cli", "run"],
                cwd=app, env=user_env(), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, needle: str, timeout: float, what: str) -> None:
        """Until the log shows ``needle``; fails at once (with the log) when the run exits."""
        try:
            wait_until(lambda: needle in self.text() or self.proc.poll() is not None, timeout, what, 0.2)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\n{self.text()[-4000:]}") from None
        assert needle in self.text(), (
            f"dbfanout run exited ({self.proc.returncode}) before {what}:\n{self.text()[-4000:]}"
        )

    def stop(self) -> int | None:
        """Ctrl-C as a user would (SIGINT to the run), then make sure nothing is left."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(60)
        code = self.proc.poll()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever of its group outlived it
        self.proc.wait(10)
        return code
