"""A heartbeat that times out once does not cost the lease (shared/lease_margins.py).

The owner runs a lingering tick through :class:`~poller.runtime.PollerRuntime`, which opens the
state store with the timeout the lease margins give (lease_ttl_seconds = 10, the least config
load accepts: renewal at 5 s left, a look every second, a 2 s storage timeout). A TCP proxy in
front of Azurite holds the tick's first heartbeat back far longer than that; the owner gives up on
it, retries at the renewer's next look, and keeps the lease while a rival tries to take it all
along. (With the timing of before — renewal at a third of the TTL and a 10 s timeout — the one
stalled heartbeat let the lease lapse and the rival took it.)

Source: SQLite; state: Azurite behind tests/support/faultproxy.py; sink: a recording sink.
"""

from __future__ import annotations

import datetime as dt
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from poller.runtime import PollerRuntime
from poller.sources.keyset.source import SqlSource
from poller.state.blob import BlobStateStore, open_state_store
from shared.config import AppConfig, Config
from shared.settings import StorageConnection
from tests.poller.conftest import APP
from tests.poller.tick.test_linger import Background
from tests.poller.tick_support import RecordingSink, SourceTable, make_poller
from tests.support.azurite import Azurite
from tests.support.faultproxy import FaultProxy
from tests.support.ports import wait_until

pytestmark = pytest.mark.integration

TTL_S = 10
LINGER_S = 9.0  # long enough for the renewal (at 5-6 s), its timeout and its retry
STALL_S = 12.0  # a request held this long outlasts any storage timeout of the lease's margins


@pytest.fixture
def proxy(azurite: Azurite) -> Iterator[FaultProxy]:
    proxy = FaultProxy(azurite.blob_port)
    try:
        yield proxy
    finally:
        proxy.close()


class Rival:
    """Another instance trying to take the lease, every 0.2 s until stopped."""

    def __init__(self, store: BlobStateStore, fingerprint: str) -> None:
        self.taken_at: dt.datetime | None = None
        self._store, self._fingerprint = store, fingerprint
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        ttl = dt.timedelta(seconds=TTL_S)
        while not self._stop.wait(0.2):  # the rival's own polling rate, not a wait for the test
            if self._store.try_acquire("B", ttl, self._fingerprint) is not None:
                self.taken_at = dt.datetime.now(dt.UTC)
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def test_a_heartbeat_that_times_out_once_keeps_the_lease_and_no_other_owner_takes_it(
    azurite: Azurite, proxy: FaultProxy, tmp_path: Path
) -> None:
    # Given an owner whose state store goes through the proxy, with the timeout its margins give
    table = SourceTable(f"sqlite:///{tmp_path / 'margins.db'}")
    poller = make_poller(str(table.engine.url), lease_ttl_seconds=TTL_S, linger_seconds=LINGER_S, poll_interval_ms=200)
    container = f"m-{uuid.uuid4().hex[:16]}"
    proxied = azurite.connection_string.replace(f":{azurite.blob_port}/", f":{proxy.port}/")
    config = Config(
        AppConfig(APP, state_container=container), {poller.name: poller}, settings={"DBFANOUT_STATE": proxied}
    )
    source = SqlSource(poller)
    owner = PollerRuntime(config, poller.name, source=source, sink=RecordingSink(), owner_id="A")
    direct = StorageConnection(connection_string=azurite.connection_string)
    rival_store = open_state_store(direct, container, APP, poller.name)
    rival: Rival | None = None
    try:
        # When the owner's lingering tick holds the lease
        tick = Background(owner.tick)
        wait_until(lambda: _owner(rival_store) == "A", 10, "the owner's lease")
        token = _token(rival_store)
        # And its next write — the first heartbeat — is held in the network past any timeout
        proxy.stall_next_request_to(b"PUT ", STALL_S)
        # While another instance keeps trying to take the lease
        rival = Rival(rival_store, source.fingerprint)
        result = tick.join(LINGER_S + 15)
        # Then the heartbeat was sent, held and given up on (it never reached storage)
        assert (proxy.stalled, proxy.abandoned) == (1, 1)
        # And the tick kept its lease to its end, never lost it, and no other owner took it over
        assert result.stop_reason == "caught_up"
        assert rival.taken_at is None, f"the rival took the lease at {rival.taken_at}"
        assert _owner(rival_store) == "A" and _token(rival_store) == token
        # And the owner's next tick commits under the same fencing token
        table.upsert([1])
        soon = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=0.5)  # a short linger this time
        assert owner.tick(next_occurrence=soon).rows == 1
        assert rival.taken_at is None and _token(rival_store) == token
    finally:
        if rival is not None:
            rival.stop()
        owner.close()


def _owner(store: BlobStateStore) -> str | None:
    snap = store.load()
    return snap.doc.lease.owner_id if snap is not None else None


def _token(store: BlobStateStore) -> int:
    snap = store.load()
    assert snap is not None
    return snap.doc.lease.fencing_token
