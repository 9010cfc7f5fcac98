"""Fixtures: one emulator for the whole suite, shared SDK clients, a fresh queue per test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from azure.servicebus import ServiceBusClient

from sbemulator import Emulator, EmulatorConfig
from sbemulator.testing import running_emulator, unique_queue


@pytest.fixture(scope="session")
def emulator() -> Iterator[Emulator]:
    with running_emulator(EmulatorConfig(), http_port=0) as emu:
        yield emu


@pytest.fixture(scope="session")
def client(emulator: Emulator) -> Iterator[ServiceBusClient]:
    # retry_total=0: refusals surface at once as the SDK's exception instead of after retries.
    with ServiceBusClient.from_connection_string(emulator.connection_string, retry_total=0) as sb:
        yield sb


@pytest.fixture
def make_queue(emulator: Emulator) -> Callable[..., str]:
    def make(**props: Any) -> str:
        return unique_queue(emulator, **props)

    return make


@pytest.fixture
def queue(make_queue: Callable[..., str]) -> str:
    return make_queue()
