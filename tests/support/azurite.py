"""Azurite for the tests: the demo's start (free ports, in memory, offline), plus pause and resume."""

from __future__ import annotations

import shutil
import signal
import tempfile
from pathlib import Path

from dbfanout.demo import services

ROOT = Path(__file__).resolve().parents[2]
ACCOUNT = services.AZURITE_ACCOUNT
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


class Azurite(services.Azurite):
    """The demo's Azurite; fault tests may also freeze it. Its folder (the log) goes with it."""

    folder: Path | None = None

    def stop(self) -> None:
        super().stop()
        if self.folder is not None:  # a test run starts many: none is left in the temp folder
            shutil.rmtree(self.folder, ignore_errors=True)

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): requests hang, like a storage outage or a network stall."""
        self.child.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.child.proc.send_signal(signal.SIGCONT)


def start_azurite() -> Azurite:
    """Start Azurite as the demo does, in a fresh folder of its own (its log goes there)."""
    folder = Path(tempfile.mkdtemp(prefix="azurite-"))
    try:
        started = services.start_azurite(folder)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    azurite = Azurite(started.child, started.blob_port, started.queue_port)
    azurite.folder = folder
    return azurite
