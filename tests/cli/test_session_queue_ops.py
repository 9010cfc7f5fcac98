"""validate, status and dlq on a session-enabled poller (its queue refuses non-session receivers)."""

from __future__ import annotations

import json

import pytest
from azure.servicebus import ServiceBusMessage

from sbemulator.testing import unique_queue
from tests.cli.conftest import Workspace, said

pytestmark = pytest.mark.integration

SESSIONS = "sessions = true\n"


def _session_queue(workspace: Workspace) -> str:
    return unique_queue(
        workspace.emulator,
        "orders-s",
        requires_session=True,
        requires_duplicate_detection=True,
        lock_duration=5,
        max_delivery_count=3,
    )


def _use(workspace: Workspace, queue: str, *, sessions: bool) -> None:
    """Point the ``orders`` poller at ``queue``, with or without ``sessions = true``."""
    text = workspace.config_path.read_text().replace(workspace.queue, queue)
    if sessions:
        text = text.replace('soft_delete_column = "deleted_at"\n', f'soft_delete_column = "deleted_at"\n{SESSIONS}', 1)
    workspace.config_path.write_text(text)
    workspace.queue = queue


@pytest.fixture
def session_workspace(workspace: Workspace) -> Workspace:
    _use(workspace, _session_queue(workspace), sessions=True)
    assert workspace.config.poller("orders").sessions
    return workspace


def checks_of(result) -> dict[str, dict[str, str]]:
    return {c["name"]: c for c in json.loads(result.stdout)["checks"]}


def test_validate_passes_a_session_poller_on_its_session_queue(session_workspace):
    session_workspace.source.upsert(range(1, 4))
    result = session_workspace.run("validate", "--json")
    assert result.exit_code == 0, result.stdout + result.stderr
    checks = checks_of(result)
    assert checks["queue"]["status"] == "ok" and "session-enabled" in checks["queue"]["detail"]
    assert checks["sessions"]["status"] == "ok"
    text = session_workspace.run("validate")
    assert text.exit_code == 0 and "session-enabled" in said(text) and "cannot check" not in said(text)


@pytest.mark.parametrize(
    ("session_queue", "sessions", "says"),
    [(True, False, "set sessions = true"), (False, True, "does not require sessions")],
    ids=["plain-poller-on-session-queue", "session-poller-on-plain-queue"],
)
def test_validate_fails_a_poller_whose_sessions_setting_does_not_match_its_queue(
    workspace, session_queue: bool, sessions: bool, says: str
):
    workspace.source.upsert([1])
    _use(workspace, _session_queue(workspace) if session_queue else workspace.queue, sessions=sessions)
    result = workspace.run("validate", "--json")
    assert result.exit_code == 1
    checks = checks_of(result)
    assert checks["queue"]["status"] == "ok"
    assert checks["sessions"]["status"] == "fail" and says in checks["sessions"]["detail"]


def test_validate_passes_a_poller_without_sessions_on_a_plain_queue(workspace):
    workspace.source.upsert([1])
    result = workspace.run("validate", "--json")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert checks_of(result)["sessions"]["status"] == "ok"


def test_status_reports_the_active_depth_of_a_session_queue_as_unknown_and_still_counts_its_dlq(session_workspace, bus):
    # Given a session poller that sent its rows (one session per key) and one dead-lettered message
    ws = session_workspace
    ws.source.upsert(range(1, 4))
    assert ws.tick(sink=ws.bus_sink(bus)).rows == 3
    with bus.get_queue_receiver(ws.queue, session_id="id=1", max_wait_time=5) as receiver:
        (message,) = receiver.receive_messages(max_message_count=1, max_wait_time=5)
        receiver.dead_letter_message(message, reason="HandlerFailed", error_description="test")
    # When the operator asks for the status
    result = ws.run("status", "orders", "--json")
    # Then the active depth is unknown, with the reason, and the DLQ count is there (no error; exit 1
    # for the dead letter)
    assert result.exit_code == 1, result.stdout + result.stderr
    (row,) = json.loads(result.stdout)
    depth = row["queue_depth"]
    assert "error" not in depth, depth
    assert depth["active"] is None and "session queue" in depth["active_unknown"]
    assert depth["dead_lettered"] == 1 and depth["requires_session"] is True
    table = ws.run("status", "--wide")
    # (exit 1: the dead letter is a problem)
    assert table.exit_code == 1 and "n/a: session queue" in said(table) and "1 DLQ" in said(table)


def test_dlq_peek_and_replay_on_a_session_queue_keep_the_session_id(session_workspace, bus):
    # Given two messages of two sessions dead-lettered from a session queue
    ws = session_workspace
    with bus.get_queue_sender(ws.queue) as sender:
        sender.send_messages(
            [ServiceBusMessage(f'{{"k": "{k}"}}', message_id=f"m-{k}", session_id=k) for k in ("a", "b")]
        )
    for key in ("a", "b"):
        with bus.get_queue_receiver(ws.queue, session_id=key, max_wait_time=5) as receiver:
            (message,) = receiver.receive_messages(max_message_count=1, max_wait_time=5)
            receiver.dead_letter_message(message, reason="HandlerFailed", error_description="test")
    # When the operator peeks and replays the DLQ
    peek = ws.run("dlq", "peek", ws.queue, "--json")
    assert peek.exit_code == 0, peek.stdout + peek.stderr
    assert {(v["message_id"], v["session_id"]) for v in json.loads(peek.stdout)} == {("m-a", "a"), ("m-b", "b")}
    result = ws.run("dlq", "replay", ws.queue, "--all", "--yes", "--json")
    # Then each copy is back in its own session, where a session worker receives it
    assert result.exit_code == 0, result.stdout + result.stderr
    assert json.loads(result.stdout)["replayed"] == 2
    for key in ("a", "b"):
        with bus.get_queue_receiver(ws.queue, session_id=key, max_wait_time=5) as receiver:
            (copy,) = receiver.receive_messages(max_message_count=1, max_wait_time=5)
            assert copy.session_id == key and copy.body and b"".join(copy.body) == f'{{"k": "{key}"}}'.encode()
            receiver.complete_message(copy)
    assert ws.emulator.queue_stats(ws.queue)["dead_lettered"] == 0
