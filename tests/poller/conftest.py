from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
from azure.core.exceptions import ResourceNotFoundError
from azure.storage.blob import ContainerClient

from poller.ports import StateStore
from poller.state.blob import BlobStateStore, open_state_store, state_blob_name
from poller.state.memory import MemoryStateStore
from shared.settings import StorageConnection
from tests.support.azurite import Azurite

# ============================================================================================
# State store fixtures (state store contract, blob faults, lease keeper)
# ============================================================================================

APP = "testapp"
FINGERPRINT = "sha256:source-under-test"
T0 = dt.datetime(2026, 4, 7, 1, 23, 0, tzinfo=dt.UTC)


class FakeClock:
    """A settable clock: ``clock()`` is now; ``advance(seconds)`` moves it."""

    def __init__(self, start: dt.datetime = T0) -> None:
        self.now = start

    def __call__(self) -> dt.datetime:
        return self.now

    def advance(self, seconds: float) -> dt.datetime:
        self.now += dt.timedelta(seconds=seconds)
        return self.now


@dataclass
class StoreHarness:
    """Stores of one kind on one fresh state blob, plus raw access to the blob's bytes."""

    kind: str
    poller_name: str
    make: Callable[..., StateStore]  # make(clock, skew_margin=None): another instance, same blob
    raw: Callable[[], bytes | None]
    put_raw: Callable[[bytes], None]


def memory_harness(poller_name: str) -> StoreHarness:
    base = MemoryStateStore(poller_name)

    def make(clock: Callable[[], dt.datetime], skew_margin: dt.timedelta | None = None) -> StateStore:
        return MemoryStateStore(poller_name, clock=clock, skew_margin=skew_margin, blob=base.blob)

    return StoreHarness("memory", poller_name, make, base.raw, base.put_raw)


def azurite_harness(server: Azurite, poller_name: str, *, request_timeout: float = 5.0) -> StoreHarness:
    container = f"t-{uuid.uuid4().hex[:20]}"
    conn = StorageConnection(connection_string=server.connection_string)
    first = open_state_store(conn, container, APP, poller_name, request_timeout=request_timeout)
    container_client: ContainerClient = first.container_client
    blob = container_client.get_blob_client(state_blob_name(APP, poller_name))

    def make(clock: Callable[[], dt.datetime], skew_margin: dt.timedelta | None = None) -> StateStore:
        return BlobStateStore(
            container_client, APP, poller_name, clock=clock, skew_margin=skew_margin, request_timeout=request_timeout
        )

    def raw() -> bytes | None:
        try:
            return blob.download_blob().readall()
        except ResourceNotFoundError:
            return None

    def put_raw(data: bytes) -> None:
        blob.upload_blob(data, overwrite=True)

    return StoreHarness("azurite", poller_name, make, raw, put_raw)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(params=["memory", pytest.param("azurite", marks=pytest.mark.integration)])
def harness(request: pytest.FixtureRequest) -> Iterator[StoreHarness]:
    """R8: every contract test runs against the in-memory fake and the blob store on Azurite."""
    poller_name = f"p-{uuid.uuid4().hex[:10]}"
    if request.param == "memory":
        yield memory_harness(poller_name)
    else:
        yield azurite_harness(request.getfixturevalue("azurite"), poller_name)


@pytest.fixture
def store(harness: StoreHarness, clock: FakeClock) -> StateStore:
    return harness.make(clock)


# ============================================================================================
