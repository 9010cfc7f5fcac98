"""validate and status against a real SQLite source, Azurite and the emulator."""

from __future__ import annotations

import datetime as dt
import json
import uuid
from dataclasses import replace

import pytest
import sqlalchemy as sa
from azure.servicebus import ServiceBusClient

from dbfanout.ops.checks import max_delivery_check, needed_window_seconds, schedule_interval_seconds
from poller.sources.factory import open_source
from poller.sources.keyset.source import SqlSource
from poller.tick.backoff import SinkRefusals
from poller.tick.lifecycle import run_tick
from shared.config import PollerConfig
from tests.cli.conftest import said
from tests.support.ports import wait_until

pytestmark = pytest.mark.integration


def checks_of(result) -> dict[str, str]:
    return {c["name"]: c["status"] for c in json.loads(result.stdout)["checks"]}


def test_validate_passes_on_a_sound_setup_and_skips_queue_properties_on_the_emulator(workspace):
    workspace.source.upsert(range(1, 5))
    result = workspace.run("validate", "--json")
    assert result.exit_code == 0, result.stdout + result.stderr
    checks = checks_of(result)
    assert checks["source"] == checks["index"] == checks["queue"] == checks["state"] == "ok"
    assert checks["queue properties"] == "skip"
    assert "SharedAccessKey" not in result.stdout


def test_validate_fails_on_a_missing_index_and_a_missing_queue(workspace):
    workspace.source.upsert([1])
    with workspace.source.engine.begin() as conn:
        conn.execute(sa.text("DROP INDEX ix_orders_keyset"))
    workspace.config_path.write_text(workspace.config_path.read_text().replace(workspace.queue, "no-such-queue"))
    result = workspace.run("validate", "orders", "--json")
    assert result.exit_code == 1
    checks = checks_of(result)
    assert checks["index"] == "fail" and checks["queue"] == "fail"


def test_validate_reports_a_fingerprint_mismatch(workspace):
    workspace.source.upsert([1])
    workspace.drain()
    workspace.config_path.write_text(
        workspace.config_path.read_text().replace('pk = ["id"]', 'pk = ["id"]\nfilter = "1=1"', 1)
    )
    result = workspace.run("validate", "--json")
    assert result.exit_code == 1 and checks_of(result)["fingerprint"] == "fail"


def test_validate_reports_a_pollers_missing_setting_and_still_checks_the_others(workspace):
    # Given a second poller whose source_url names an app setting that is not set
    workspace.source.upsert([1])
    workspace.config_path.write_text(
        workspace.config_path.read_text()
        + '\n[pollers.unset]\nsource_url = "${DBFANOUT_TEST_UNSET_DB_URL}"\ntable = "orders"\n'
        + f'cursor = "version"\npk = ["id"]\nqueue = "{workspace.queue}"\n'
    )
    # When validate runs
    result = workspace.run("validate", "--json")
    # Then it fails on that poller's source, naming the setting, and the other poller's checks still ran
    assert result.exit_code == 1, result.stdout + result.stderr
    checks = {(c["poller"], c["name"]): c for c in json.loads(result.stdout)["checks"]}
    unset = checks[("unset", "source")]
    assert unset["status"] == "fail" and "DBFANOUT_TEST_UNSET_DB_URL is not set" in unset["detail"]
    assert checks[("orders", "source")]["status"] == "ok" and checks[("orders", "queue")]["status"] == "ok"


def _with_handler(workspace, spec: str) -> None:
    text = workspace.config_path.read_text()
    workspace.config_path.write_text(text.replace('pk = ["id"]', f'pk = ["id"]\nhandler = "{spec}"', 1))


def _handler_check(result) -> dict[str, str]:
    checks: list[dict[str, str]] = json.loads(result.stdout)["checks"]
    [check] = [c for c in checks if c["name"] == "handler"]
    return check


def test_validate_imports_the_handler_from_the_app_root_like_the_worker(workspace):
    # Given a handler module beside dbfanout.toml (the app root)
    module = f"h_{uuid.uuid4().hex[:10]}"
    (workspace.root / f"{module}.py").write_text("def handle(events, context):\n    pass\n")
    _with_handler(workspace, f"{module}:handle")
    workspace.source.upsert([1])
    # When validate runs; Then the handler check holds
    result = workspace.run("validate", "--json")
    assert result.exit_code == 0, result.stdout + result.stderr
    assert _handler_check(result)["status"] == "ok"


def test_validate_fails_on_a_handler_module_that_does_not_exist(workspace):
    # Given a poller whose handler module is not in the app
    module = f"missing_{uuid.uuid4().hex[:10]}"
    _with_handler(workspace, f"{module}:handle")
    workspace.source.upsert([1])
    # When validate runs; Then it fails, naming the poller, the key and the module
    result = workspace.run("validate", "--json")
    assert result.exit_code == 1, result.stdout + result.stderr
    check = _handler_check(result)
    assert check["status"] == "fail" and check["poller"] == "orders"
    assert "pollers.orders.handler" in check["detail"] and module in check["detail"]
    # And the table output says it too
    table = workspace.run("validate")
    assert table.exit_code == 1 and "1 check(s) failed" in table.stdout


def test_validate_fails_on_a_handler_function_that_does_not_exist(workspace):
    # Given a module that exists but has no such function
    module = f"h_{uuid.uuid4().hex[:10]}"
    (workspace.root / f"{module}.py").write_text("def other(events, context):\n    pass\n")
    _with_handler(workspace, f"{module}:handle")
    # When validate runs; Then it fails, naming the function
    result = workspace.run("validate", "--json")
    assert result.exit_code == 1
    check = _handler_check(result)
    assert check["status"] == "fail" and check["poller"] == "orders" and "'handle'" in check["detail"]


def test_validate_of_an_unknown_poller_or_a_broken_config_is_a_usage_error(workspace):
    assert workspace.run("validate", "nosuch").exit_code == 2
    workspace.config_path.write_text("[app]\nname = 'x'\n")
    broken = workspace.run("validate")
    assert broken.exit_code == 2 and "pollers" in said(broken)


def test_duplicate_detection_window_covers_ttl_interval_and_tick():
    assert schedule_interval_seconds("*/5 * * * * *") == 5
    assert schedule_interval_seconds("0 */2 * * * *") == 120
    cfg = PollerConfig(
        name="p", source_url="sqlite://", cursor="v", pk=("id",), queue="q", table="t", lease_ttl_seconds=120
    )
    assert needed_window_seconds(cfg) == 120 + 5 + 80
    lingering = replace(cfg, lease_ttl_seconds=30, linger_seconds=4.0)
    assert needed_window_seconds(lingering) == 30 + 5 + 20 + 4


def test_status_shows_checkpoint_lease_lag_and_queue_depth(workspace, bus):
    # Given a poller that delivered 5 rows to Service Bus, with 3 more rows pending
    workspace.source.upsert(range(1, 6))
    workspace.tick(sink=workspace.bus_sink(bus))
    workspace.source.upsert(range(6, 9))
    # When the operator asks for the status
    result = workspace.run("status", "orders", "--json")
    # Then it shows where the checkpoint is, a free lease, the lag and the queue depth
    assert result.exit_code == 0, result.stderr
    (row,) = json.loads(result.stdout)
    assert row["checkpoint"]["cursor"]["tiebreaker"] == {"id": 5}
    assert row["lease"]["state"] == "free" and row["fingerprint_match"] is True
    assert row["source"]["pending_rows"] == 3 and row["source"]["lag"] == 3
    assert row["queue_depth"]["active"] >= 1 and row["queue_depth"]["dead_lettered"] == 0
    table = workspace.run("status")
    assert table.exit_code == 0 and "orders" in table.stdout


def test_status_shows_a_live_lease_and_fails_on_a_fingerprint_mismatch(workspace):
    workspace.source.upsert([1])
    workspace.drain()
    store = workspace.store()
    store.try_acquire("tick-7", dt.timedelta(seconds=60), SqlSource(workspace.config.poller("orders")).fingerprint)
    live = json.loads(workspace.run("status", "--json").stdout)[0]["lease"]
    assert live["state"] == "live" and live["owner"] == "tick-7" and live["expires_in_seconds"] > 0
    held = store.load()
    assert held is not None and held.doc.lease.acquired_at is not None
    assert live["held_since"] == held.doc.lease.acquired_at.isoformat()
    workspace.config_path.write_text(
        workspace.config_path.read_text().replace('pk = ["id"]', 'pk = ["id"]\nfilter = "1=1"', 1)
    )
    mismatch = workspace.run("status", "--json")
    assert mismatch.exit_code == 1 and json.loads(mismatch.stdout)[0]["fingerprint_match"] is False


def test_validate_tells_a_poller_whose_max_delivery_count_differs_from_its_queue() -> None:
    poller = PollerConfig(name="orders", source_url="sqlite://", cursor="version", pk=("id",), queue="q")
    assert max_delivery_check(poller, 10).status == "ok"
    assert max_delivery_check(poller, 2).status == "fail"  # split_after_deliveries (2) would never split
    check = max_delivery_check(poller, 3)
    assert check.status == "warn" and "set max_delivery_count = 3" in check.detail
    assert max_delivery_check(replace(poller, max_delivery_count=3), 3).status == "ok"


def test_status_shows_a_refusing_broker_and_fails_until_it_accepts_again(workspace, servicebus):
    # Given a poller whose namespace throttles every send (the emulator's test knob)
    workspace.source.upsert(range(1, 6))
    cfg = workspace.config.poller("orders")
    refusals = SinkRefusals("orders")
    servicebus.faults.throttle(workspace.queue)
    with ServiceBusClient.from_connection_string(servicebus.connection_string, retry_total=0) as client:
        sink = workspace.bus_sink(client)
        try:
            tick = run_tick(cfg, open_source(cfg), workspace.store(), sink, owner_id="p-1", refusals=refusals)
            assert tick.stop_reason == "sink_refusing"
            # When the operator asks for the status
            result = workspace.run("status", "orders", "--json")
            table = workspace.run("status")
            # Then it names the refusal and its reason, and exits 1; the checkpoint did not move
            assert result.exit_code == 1, result.stdout
            (row,) = json.loads(result.stdout)
            assert row["sink_refusing"]["reason"] == "throttled" and row["sink_refusing"]["for_seconds"] >= 0
            assert "entity is being throttled" in row["sink_refusing"]["error"]
            assert row["checkpoint"]["cursor"] is None
            assert table.exit_code == 1 and "broker refusing (throttled)" in table.stdout
            # When the broker accepts again and a tick delivers
            servicebus.faults.unthrottle()
            wait_until(lambda: refusals.wait_seconds() == 0, 5, "the backoff window to pass")
            tick = run_tick(cfg, open_source(cfg), workspace.store(), sink, owner_id="p-1", refusals=refusals)
            assert tick.stop_reason == "caught_up" and tick.rows == 5
        finally:
            servicebus.faults.unthrottle()
            sink.close()
    # Then status is healthy again
    healthy = workspace.run("status", "orders", "--json")
    assert healthy.exit_code == 0 and json.loads(healthy.stdout)[0]["sink_refusing"] is None


def test_validate_shows_the_lease_margins_and_refuses_a_storage_timeout_two_heartbeats_do_not_fit(workspace):
    # Given the default timing (lease_ttl_seconds = 30, the storage timeout it implies)
    result = workspace.run("validate", "--json")
    margins = next(c for c in json.loads(result.stdout)["checks"] if c["name"] == "lease margins")
    # Then validate shows when the lease renews and that two storage timeouts fit before expiry
    assert margins["status"] == "ok"
    assert "renewed at 15 s left" in margins["detail"] and "2 storage timeouts of 6 s fit" in margins["detail"]
    # When the storage timeout is set to the old 10 s, a third of the TTL: one slow heartbeat lapses the lease
    config = workspace.config_path.read_text()
    workspace.config_path.write_text(
        config.replace("lease_ttl_seconds = 30\n", "lease_ttl_seconds = 30\nstate_timeout_seconds = 10\n")
    )
    refused = workspace.run("validate")
    # Then validate refuses the config, naming the key and what to set
    assert refused.exit_code == 2
    text = said(refused)
    assert "pollers.orders.state_timeout_seconds" in text
    assert "set lease_ttl_seconds >= 50, or state_timeout_seconds <= 6" in text
