"""Azurite for the tests: the demo's start (free ports, in memory, offline), plus pause and resume."""

from __future__ import annotations

import signal
import tempfile
from pathlib import Path

from dbfanout.demo import services

ROOT = Path(__file__).resolve().parents[2]
ACCOUNT = services.AZURITE_ACCOUNT
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


class Azurite(services.Azurite):
    """The demo's Azurite; fault tests may also freeze it."""

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): requests hang, like a storage outage or a network stall."""
        self.child.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.child.proc.send_signal(signal.SIGCONT)


def start_azurite() -> Azurite:
    """Start Azurite as the demo does, in a fresh folder of its own (its log goes there)."""
    started = services.start_azurite(Path(tempfile.mkdtemp(prefix="azurite-")))
    return Azurite(started.child, started.blob_port, started.queue_port)
