"""The local services the demo starts: Azurite, the Service Bus emulator, child processes.

Every child process gets its own session (process group), so stopping it also stops whatever
it spawned (Azurite is a node process behind a shell wrapper) and a Ctrl-C in the terminal
reaches only the demo, which then shuts the children down in order.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO

from sbemulator import Emulator, EmulatorConfig

__all__ = [
    "AZURITE_ACCOUNT",
    "Azurite",
    "ChildProcess",
    "ServiceError",
    "azurite_binary",
    "free_port",
    "project_root",
    "start_azurite",
    "start_servicebus",
    "start_servicebus_for",
    "wait_for",
]

# Azurite's well-known development account (public, documented by Microsoft; not a secret).
AZURITE_ACCOUNT = "devstoreaccount1"
_AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


class ServiceError(RuntimeError):
    """A local service could not start; the message says what to do."""


def project_root() -> Path:
    """The checkout holding ``function_app.py`` (the demo runs from a source checkout)."""
    return Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def wait_for(condition: Callable[[], bool], timeout: float, what: str, interval: float = 0.1) -> None:
    """Poll ``condition`` until it holds; ``TimeoutError`` naming ``what`` otherwise."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


class ChildProcess:
    """A child in its own process group; :meth:`stop` ends the whole group."""

    def __init__(
        self,
        args: Sequence[str],
        *,
        cwd: Path,
        env: Mapping[str, str] | None = None,
        log: Path | None = None,
        stdout: Path | None = None,
    ) -> None:
        """Start ``args``; output goes to ``log`` (or only stderr, when ``stdout`` has a file of its own)."""
        err: IO[bytes] | int = log.open("ab") if log is not None else subprocess.DEVNULL
        out: IO[bytes] | int = stdout.open("wb") if stdout is not None else err
        try:
            self.proc = subprocess.Popen(
                list(args),
                cwd=cwd,
                env=dict(env) if env is not None else None,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,  # own process group: killpg reaches grandchildren too
            )
        finally:
            for f in {id(err): err, id(out): out}.values():
                if not isinstance(f, int):
                    f.close()  # the child holds its own descriptors

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace: float = 20.0) -> int | None:
        """SIGTERM the group, wait up to ``grace`` seconds, then SIGKILL it. Idempotent."""
        if self.alive():
            self._signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace)
        # The leader may be gone while a grandchild lingers: kill the group in any case.
        self._signal(signal.SIGKILL)
        try:
            return self.proc.wait(5)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL cannot be ignored
            return None

    def _signal(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)


class Azurite:
    """A running Azurite (blob and queue endpoints, in memory)."""

    def __init__(self, child: ChildProcess, blob_port: int, queue_port: int) -> None:
        self.child = child
        self.blob_port = blob_port
        self.queue_port = queue_port

    @property
    def connection_string(self) -> str:
        return (
            f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={_AZURITE_KEY};"
            f"BlobEndpoint=http://127.0.0.1:{self.blob_port}/{AZURITE_ACCOUNT};"
            f"QueueEndpoint=http://127.0.0.1:{self.queue_port}/{AZURITE_ACCOUNT};"
        )

    def stop(self) -> None:
        self.child.stop(grace=10)


def azurite_binary(root: Path | None = None) -> str | None:
    """``node_modules/.bin/azurite`` of the project (pinned in package.json), else one on PATH."""
    local = (root or project_root()) / "node_modules" / ".bin" / "azurite"
    if local.exists():
        return str(local)
    return shutil.which("azurite")


def start_azurite(workdir: Path, timeout: float = 60.0, *, binary: str | None = None) -> Azurite:
    """Start Azurite on free ports, in memory, without telemetry; wait until it listens.

    ``binary``: the Azurite to run (default: :func:`azurite_binary`)."""
    binary = binary or azurite_binary()
    if binary is None:
        raise ServiceError("Azurite is not installed: run `make bootstrap` (it installs the version package.json pins)")
    blob_port, queue_port, table_port = free_port(), free_port(), free_port()
    args = [
        binary,
        "--inMemoryPersistence",
        "--disableTelemetry",
        "--skipApiVersionCheck",
        "--loose",
        "--silent",
        "--blobHost", "127.0.0.1", "--blobPort", str(blob_port),
        "--queueHost", "127.0.0.1", "--queuePort", str(queue_port),
        "--tableHost", "127.0.0.1", "--tablePort", str(table_port),
    ]  # fmt: skip
    child = ChildProcess(args, cwd=workdir, log=workdir / "azurite.log")
    azurite = Azurite(child, blob_port, queue_port)
    try:
        wait_for(lambda: not child.alive() or (_port_open(blob_port) and _port_open(queue_port)), timeout, "Azurite")
        if not child.alive():
            raise ServiceError(f"Azurite exited at start-up (see {workdir / 'azurite.log'})")
    except BaseException:
        azurite.stop()
        raise
    return azurite


def start_servicebus(queue: str, *, max_delivery_count: int, lock_duration: str) -> Emulator:
    """The project's Service Bus emulator, in this process, with the demo queue on a free port.

    Duplicate detection is on: the poller's message id is its idempotency key, so a batch
    re-sent after a failed checkpoint commit is dropped by the broker.
    """
    config = EmulatorConfig.with_queues(
        queue,
        requires_duplicate_detection=True,
        max_delivery_count=max_delivery_count,
        lock_duration=lock_duration,
    )
    return Emulator(config, port=0, http_port=None).start()


def start_servicebus_for(config_toml: str, *, lock_duration: str) -> Emulator:
    """The emulator with the entities an app's ``dbfanout.toml`` needs (its queues, its topics with
    their subscriptions and rules, each with the config's MaxDeliveryCount), as
    ``dbfanout emulator servicebus --app-config`` declares them."""
    import tomllib

    from dbfanout.ops.entities import emulator_config_for
    from shared.config import parse_config

    config = parse_config(tomllib.loads(config_toml), {}, lenient_settings=True)
    entities = emulator_config_for(config, lock_duration=lock_duration)
    return Emulator(entities, port=0, http_port=None).start()
