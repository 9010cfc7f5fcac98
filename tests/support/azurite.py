"""Start Azurite (the npm package pinned in package.json) on free ports, in memory, offline."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.support.ports import free_port, port_open, wait_until

ROOT = Path(__file__).resolve().parents[2]
ACCOUNT = "devstoreaccount1"
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def azurite_binary() -> str | None:
    local = ROOT / "node_modules" / ".bin" / "azurite"
    if local.exists():
        return str(local)
    return shutil.which("azurite")


@dataclass
class Azurite:
    blob_port: int
    queue_port: int
    process: subprocess.Popen[bytes] | None

    @property
    def connection_string(self) -> str:
        return (
            f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};"
            f"BlobEndpoint=http://127.0.0.1:{self.blob_port}/{ACCOUNT};"
            f"QueueEndpoint=http://127.0.0.1:{self.queue_port}/{ACCOUNT};"
        )

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): requests hang, like a storage outage or a network stall."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)


def start_azurite() -> Azurite:
    binary = azurite_binary()
    if binary is None:
        raise RuntimeError("Azurite is not installed: run `npm ci` in the project root (package.json pins it)")
    blob_port, queue_port = free_port(), free_port()
    args = [
        binary,
        "--inMemoryPersistence",
        "--disableTelemetry",
        "--skipApiVersionCheck",
        "--loose",
        "--silent",
        "--blobHost",
        "127.0.0.1",
        "--blobPort",
        str(blob_port),
        "--queueHost",
        "127.0.0.1",
        "--queuePort",
        str(queue_port),
        "--tableHost",
        "127.0.0.1",
        "--tablePort",
        str(free_port()),
    ]
    process = subprocess.Popen(
        args,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=os.environ.get("TMPDIR", "/tmp"),
        start_new_session=True,
    )
    azurite = Azurite(blob_port, queue_port, process)
    try:
        wait_until(lambda: port_open(blob_port) and port_open(queue_port), 60, "Azurite to listen")
    except TimeoutError:
        azurite.stop()
        raise
    return azurite
