"""The blob state store against a storage account that is down, stalled or refusing us (Azurite).

Destructive tests use their own Azurite (``own_azurite``, ``doomed_azurite``), never the session one.
"""

from __future__ import annotations

import datetime as dt
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from azure.identity import DefaultAzureCredential
from azure.storage.blob import BlobServiceClient

import poller.state.blob as state_blob
from poller.lease.keeper import LeaseKeeper
from poller.sources.keyset.source import SqlSource
from poller.state.blob import BlobStateStore, open_state_store
from poller.tick.lifecycle import run_tick
from shared.errors import (
    CommitAmbiguousError,
    CommitError,
    LostLeaseError,
    StateUnavailableError,
)
from shared.models import Checkpoint, Position
from shared.settings import StorageConnection
from tests.poller.conftest import APP, FINGERPRINT, FakeClock
from tests.poller.tick_support import RecordingSink, SourceTable, make_poller
from tests.support.azurite import KEY, Azurite, start_azurite
from tests.support.faultproxy import FaultProxy
from tests.support.ports import wait_until

pytestmark = pytest.mark.integration

TTL = dt.timedelta(seconds=30)
TIMEOUT = 1.0  # per-request timeout under test; every failure must come within a few of these
BOUND = 6.0  # 1 s connect/read timeout, one retry with up to 2 s backoff for loads, plus slack


@pytest.fixture(scope="module")
def own_azurite() -> Iterator[Azurite]:
    """An Azurite these tests may pause; always resumed and stopped afterwards."""
    server = start_azurite()
    try:
        yield server
    finally:
        server.resume()
        server.stop()


@pytest.fixture
def doomed_azurite() -> Iterator[Azurite]:
    """An Azurite a test stops."""
    server = start_azurite()
    try:
        yield server
    finally:
        server.stop()


def _store(server: Azurite, clock: FakeClock, **kw: Any) -> BlobStateStore:
    conn = StorageConnection(connection_string=server.connection_string)
    container, poller = f"f-{uuid.uuid4().hex[:16]}", f"p-{uuid.uuid4().hex[:8]}"
    return open_state_store(conn, container, APP, poller, clock=clock, request_timeout=TIMEOUT, **kw)


def _cp(n: int) -> Checkpoint:
    return Checkpoint(Position(cursor=n, pk={"id": n}), last_successful_batch_id=f"batch_{n}")


def _elapsed(fn: Any) -> tuple[BaseException, float]:
    start = time.monotonic()
    try:
        fn()
    except BaseException as exc:  # returned for the test to inspect
        return exc, time.monotonic() - start
    raise AssertionError("expected an error")


def test_stopped_storage_makes_load_and_acquire_unavailable_quickly_and_commit_a_plain_failure(
    doomed_azurite: Azurite, clock: FakeClock
) -> None:
    # Given a store holding the lease, and then the storage goes away
    store = _store(doomed_azurite, clock)
    snap = store.try_acquire("A", TTL, FINGERPRINT)
    assert snap is not None
    doomed_azurite.stop()
    # When loading or acquiring, Then StateUnavailableError (retryable), within the bound
    for call in (store.load, lambda: store.try_acquire("B", TTL, FINGERPRINT)):
        exc, took = _elapsed(call)
        assert isinstance(exc, StateUnavailableError) and exc.retryable
        assert took < BOUND
        assert KEY not in str(exc) and "AccountKey" not in str(exc)
    # When committing, Then CommitError (W1): the request never reached a server, nothing landed
    exc, took = _elapsed(lambda: store.commit(snap, _cp(1), ttl=TTL))
    assert type(exc) is CommitError and exc.window == "W1" and took < BOUND
    # And opening a store against it fails the same way
    exc, took = _elapsed(lambda: _store(doomed_azurite, clock))
    assert isinstance(exc, StateUnavailableError) and took < BOUND


def test_stalled_storage_makes_load_and_acquire_unavailable_within_the_timeout(
    own_azurite: Azurite, clock: FakeClock
) -> None:
    # Given a store, and a storage that stops answering (SIGSTOP)
    store = _store(own_azurite, clock)
    assert store.try_acquire("A", TTL, FINGERPRINT) is not None
    own_azurite.pause()
    try:
        # When loading or acquiring, Then StateUnavailableError, bounded by the request timeout
        for call in (store.load, lambda: store.try_acquire("B", TTL, FINGERPRINT)):
            exc, took = _elapsed(call)
            assert isinstance(exc, StateUnavailableError)
            assert took < BOUND
    finally:
        own_azurite.resume()


def test_commit_to_stalled_storage_is_ambiguous_and_resolved_after_resume__case_G_W5(
    own_azurite: Azurite, clock: FakeClock
) -> None:
    # Given a lease keeper holding the lease, and storage that stalls during the commit
    store = _store(own_azurite, clock)
    snap = store.try_acquire("A", TTL, FINGERPRINT)
    assert snap is not None
    keeper = LeaseKeeper(store, snap, TTL, clock=clock)
    own_azurite.pause()
    try:
        # When committing, Then CommitAmbiguousError (W5) within the timeout: it may have landed
        exc, took = _elapsed(lambda: keeper.commit(_cp(1)))
        assert isinstance(exc, CommitAmbiguousError) and exc.window == "W5"
        assert took < TIMEOUT + 1.5
        # And no further commit goes out until the doubt is resolved
        with pytest.raises(CommitError):
            keeper.commit(_cp(2))
    finally:
        own_azurite.resume()
    # When storage is back and the keeper reloads
    wait_until(lambda: _reachable(store), 10, "Azurite to answer again")
    landed = keeper.resolve_ambiguous(_cp(1))
    # Then its answer matches what is stored, it adopted the stored ETag, and commits go on
    stored = store.load()
    assert stored is not None
    assert landed == (stored.doc.checkpoint == _cp(1))
    assert keeper.snapshot == stored
    keeper.commit(_cp(2))
    after = store.load()
    assert after is not None and after.doc.checkpoint == _cp(2) and after.doc.lease.fencing_token == 1


def _reachable(store: BlobStateStore) -> bool:
    try:
        store.load()
    except StateUnavailableError:
        return False
    return True


def test_wrong_account_key_is_unavailable_on_load_and_a_commit_error_on_commit(
    azurite: Azurite, clock: FakeClock
) -> None:
    # Given a working store, and a second one whose key is wrong (403 from the service)
    good = _store(azurite, clock)
    snap = good.try_acquire("A", TTL, FINGERPRINT)
    assert snap is not None
    bad_key = "A" * 86 + "=="
    conn = StorageConnection(connection_string=azurite.connection_string.replace(KEY, bad_key))
    client = state_blob.blob_service_client(conn, request_timeout=TIMEOUT, retry_total=0)
    bad = BlobStateStore(client.get_container_client(good.container_client.container_name), APP, good.poller_name)
    # When it loads, Then StateUnavailableError (auth: retryable, may be RBAC propagation), no key in it
    with pytest.raises(StateUnavailableError) as info:
        bad.load()
    assert bad_key not in str(info.value) and KEY not in str(info.value)
    # When it commits, Then CommitError (W1), not ambiguous, and the stored state is untouched
    with pytest.raises(CommitError) as commit_info:
        bad.commit(snap, _cp(1))
    assert type(commit_info.value) is CommitError
    assert good.load() == snap


def test_a_missing_container_is_unavailable_not_a_lost_lease(azurite: Azurite, clock: FakeClock) -> None:
    # Given a store whose container does not exist (not created by the factory)
    conn = StorageConnection(connection_string=azurite.connection_string)
    store = open_state_store(conn, f"nope-{uuid.uuid4().hex[:8]}", APP, "p", clock=clock, ensure_container=False)
    # When it tries to acquire, Then load sees no blob, and the create says the container is missing
    assert store.load() is None
    with pytest.raises(StateUnavailableError, match="container"):
        store.try_acquire("A", TTL, FINGERPRINT)


def test_a_deleted_blob_under_a_held_lease_is_a_lost_lease__W4(azurite: Azurite, clock: FakeClock) -> None:
    # Given A holds the lease, and an operator deletes the state blob
    store = _store(azurite, clock)
    snap = store.try_acquire("A", TTL, FINGERPRINT)
    assert snap is not None
    store.blob_client.delete_blob()
    # When A commits, Then LostLeaseError: the state it held is gone
    with pytest.raises(LostLeaseError):
        store.commit(snap, _cp(1))


# --------------------------------------------------------------------------------------------
# Identity (no network: only the client construction is checked)


def test_blob_service_uri_builds_a_client_with_default_azure_credential(monkeypatch: pytest.MonkeyPatch) -> None:
    # Given an identity-based connection with a user-assigned identity's client id
    created: list[dict[str, Any]] = []

    class RecordingCredential(DefaultAzureCredential):
        def __init__(self, **kwargs: Any) -> None:
            created.append(kwargs)
            super().__init__(**kwargs)

    monkeypatch.setattr(state_blob, "DefaultAzureCredential", RecordingCredential)
    conn = StorageConnection(blob_service_uri="https://acct.blob.core.windows.net", client_id="1111-client")
    # When the store is opened (without touching the container)
    store = open_state_store(conn, "db-state", APP, "orders", ensure_container=False)
    # Then the client uses DefaultAzureCredential with that client id, on that account and path
    assert created == [{"managed_identity_client_id": "1111-client"}]
    assert isinstance(store.blob_client.credential, RecordingCredential)
    assert store.blob_client.url == "https://acct.blob.core.windows.net/db-state/state/testapp/orders.json"


def test_connection_string_client_never_uses_an_identity() -> None:
    # Given a connection string; When the client is built; Then it signs with the account key
    conn = StorageConnection(
        connection_string=f"DefaultEndpointsProtocol=https;AccountName=acct;AccountKey={KEY};EndpointSuffix=core.windows.net"
    )
    client = state_blob.blob_service_client(conn)
    assert isinstance(client, BlobServiceClient)
    assert not isinstance(client.credential, DefaultAzureCredential)
    assert "AccountKey" not in repr(conn) and KEY not in repr(conn)


def test_the_blob_session_reads_the_proxy_environment_once_and_still_honours_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import requests.sessions
    import requests.utils

    # Given a proxy in the environment, with the local storage host excluded from it
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    remote, local = "https://acct.blob.core.windows.net/c/b", "https://127.0.0.1:10000/devstoreaccount1/c/b"
    plain = requests.Session()
    expected = {url: plain.merge_environment_settings(url, {}, None, None, None) for url in (remote, local)}
    assert expected[remote]["proxies"]["https"] == "http://proxy.invalid:3128"
    assert "https" not in expected[local]["proxies"]
    reads = {"n": 0}
    original = requests.utils.get_environ_proxies  # what requests.sessions calls

    def counted(*args: Any, **kwargs: Any) -> Any:
        reads["n"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(requests.sessions, "get_environ_proxies", counted)
    session = state_blob._EnvOnceSession()
    # When each endpoint is asked three times; Then the answers are requests' own
    for url in (remote, local) * 3:
        assert session.merge_environment_settings(url, {}, None, None, None) == expected[url]
    # And the environment was read once per endpoint, not once per request
    assert reads["n"] == 2


# --------------------------------------------------------------------------------------------
# A write whose answer is lost after it landed (a proxy drops the response)


@pytest.fixture
def lossy(azurite: Azurite) -> Iterator[FaultProxy]:
    proxy = FaultProxy(azurite.blob_port)
    try:
        yield proxy
    finally:
        proxy.close()


def _proxied_store(azurite: Azurite, proxy: FaultProxy, poller: str) -> BlobStateStore:
    conn = StorageConnection(
        connection_string=azurite.connection_string.replace(f":{azurite.blob_port}/", f":{proxy.port}/")
    )
    return open_state_store(conn, f"l-{uuid.uuid4().hex[:16]}", APP, poller, request_timeout=TIMEOUT, retry_total=0)


def test_an_acquire_whose_answer_was_lost_is_recognised_as_ours_on_the_next_tick(
    tmp_path: Any, azurite: Azurite, lossy: FaultProxy
) -> None:
    # Given a poller whose state store talks to storage through a proxy, and rows to deliver
    table = SourceTable(f"sqlite:///{tmp_path / 'lossy.db'}")
    table.upsert(range(5))
    poller = make_poller(str(table.engine.url))
    source, sink = SqlSource(poller), RecordingSink()
    store = _proxied_store(azurite, lossy, poller.name)
    # When the acquire's write reaches storage but its answer is dropped
    lossy.drop_next_response_to(b"PUT ")
    with pytest.raises(StateUnavailableError):
        run_tick(poller, source, store, sink, owner_id="me")
    assert lossy.dropped == 1
    stored = store.load()
    assert stored is not None and stored.doc.lease.owner_id == "me"  # the write landed
    token = stored.doc.lease.fencing_token
    # Then the next tick sees its own lease: it proceeds (no lease_held) and adopts the token
    result = run_tick(poller, source, store, sink, owner_id="me")
    assert result.stop_reason == "caught_up" and result.rows == 5
    assert result.fencing_token == token
    assert sorted(i for i, _ in sink.delivered()) == [0, 1, 2, 3, 4]
