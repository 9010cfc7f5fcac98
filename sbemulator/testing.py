"""Helpers for test suites that need a running emulator (no pytest import needed).

from sbemulator.testing import running_emulator

@pytest.fixture(scope="session")
def servicebus():
    with running_emulator(EmulatorConfig.with_queues("orders")) as emu:
        yield emu
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from sbemulator.config import EmulatorConfig
from sbemulator.emulator import Emulator


@contextlib.contextmanager
def running_emulator(
    config: EmulatorConfig | None = None,
    *,
    data_dir: str | Path | None = None,
    http_port: int | None = None,
) -> Iterator[Emulator]:
    """Start an emulator on free ports for the duration of the block."""
    emulator = Emulator(config or EmulatorConfig(), port=0, http_port=http_port, data_dir=data_dir)
    emulator.start()
    try:
        yield emulator
    finally:
        emulator.stop()


def unique_queue(emulator: Emulator, prefix: str = "q", **props: Any) -> str:
    """Create a fresh queue with the given properties and return its name (isolates tests)."""
    name = f"{prefix}-{uuid.uuid4().hex[:10]}"
    emulator.create_queue(name, **props)
    return name


def unique_topic(emulator: Emulator, *subscriptions: Mapping[str, Any] | str, prefix: str = "t", **props: Any) -> str:
    """Create a fresh topic and return its name; each subscription is a name or a Config.json
    subscription object (``{"Name": "eu", "Properties": {...}, "Rules": [...]}``); ``props`` are
    the topic's Config.json Properties (``RequiresDuplicateDetection=True``)."""
    name = f"{prefix}-{uuid.uuid4().hex[:10]}"
    subs = [{"Name": s} if isinstance(s, str) else dict(s) for s in subscriptions]
    emulator.create_topic({"Name": name, "Properties": props, "Subscriptions": subs})
    return name


def wait_until(condition: Callable[[], bool], timeout: float = 10.0, interval: float = 0.02) -> None:
    """Poll ``condition`` until true; TimeoutError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"condition not met within {timeout}s")
        time.sleep(interval)
