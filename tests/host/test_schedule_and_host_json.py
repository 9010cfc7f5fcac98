"""Schedules (six-field NCRONTAB, seconds first, %SETTING%) and host.json defaults (issue 5)."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
from pathlib import Path

import pytest

from dbfanout.host.hostjson import HostJson, ServiceBusOptions, load_host_json, parse_timespan
from dbfanout.host.schedule import parse_schedule
from shared.errors import ConfigError

T = dt.datetime(2026, 4, 7, 10, 0, 3, 250_000, tzinfo=dt.UTC)
REPO = Path(__file__).resolve().parents[2]


def test_every_five_seconds_fires_on_multiples_of_five() -> None:
    schedule = parse_schedule("*/5 * * * * *", {})
    first = schedule.next_after(T)
    assert first == T.replace(second=5, microsecond=0)
    assert schedule.next_after(first) == T.replace(second=10, microsecond=0)


def test_seconds_come_first_so_every_two_minutes_fires_at_second_zero() -> None:
    schedule = parse_schedule("0 */2 * * * *", {})
    assert schedule.next_after(T) == T.replace(minute=2, second=0, microsecond=0)
    assert schedule.previous_before(T) == T.replace(second=0, microsecond=0)


def test_percent_setting_is_read_from_the_app_settings() -> None:
    schedule = parse_schedule("%ORDERS_SCHEDULE%", {"ORDERS_SCHEDULE": "*/1 * * * * *"})
    assert schedule.expression == "*/1 * * * * *"
    assert schedule.next_after(T) == T.replace(second=4, microsecond=0)


def test_a_missing_percent_setting_names_it() -> None:
    with pytest.raises(ConfigError, match="ORDERS_SCHEDULE"):
        parse_schedule("%ORDERS_SCHEDULE%", {}, key="poll_orders.schedule")


@pytest.mark.parametrize("bad", ["*/5 * * * *", "61 * * * * *", "a b c d e f", ""])
def test_a_bad_expression_fails_with_the_key_and_an_example(bad: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_schedule(bad, {}, key="poll_orders.schedule")
    assert info.value.key == "poll_orders.schedule"
    assert "six" in str(info.value) or "NCRONTAB" in str(info.value)


def test_a_timespan_schedule_is_a_fixed_interval() -> None:
    assert parse_schedule("00:00:10", {}).next_after(T) == T + dt.timedelta(seconds=10)


def test_host_json_defaults_are_the_official_ones(tmp_path: Path) -> None:
    # Given no host.json, and one without a serviceBus section
    assert load_host_json(tmp_path) == HostJson()
    (tmp_path / "host.json").write_text(json.dumps({"version": "2.0"}))
    options = load_host_json(tmp_path).service_bus
    # Then Service Bus extension 5.x defaults apply
    assert options == ServiceBusOptions(
        auto_complete_messages=True,
        max_auto_lock_renewal_seconds=300.0,
        max_concurrent_calls=16,
        prefetch_count=0,
        max_message_batch_size=1000,
    )


def test_the_committed_host_json_is_read_as_documented() -> None:
    doc = json.loads((REPO / "host.json").read_text())
    assert doc["version"] == "2.0"
    assert doc["extensionBundle"] == {"id": "Microsoft.Azure.Functions.ExtensionBundle", "version": "[4.*, 5.0.0)"}
    options = load_host_json(REPO).service_bus
    assert options.auto_complete_messages is True
    assert options.prefetch_count == 0
    assert options.max_auto_lock_renewal_seconds >= 60
    assert 1 <= options.max_concurrent_calls <= 16
    assert options.max_message_batch_size < 1000


def test_timespans_and_bad_values() -> None:
    assert parse_timespan("00:05:00", "k") == 300
    assert parse_timespan("1.00:00:01.5", "k") == 86401.5
    with pytest.raises(ConfigError, match="TimeSpan"):
        parse_timespan("5m", "k")


def test_bad_host_json_values_name_the_setting(tmp_path: Path) -> None:
    (tmp_path / "host.json").write_text(json.dumps({"extensions": {"serviceBus": {"maxConcurrentCalls": 0}}}))
    with pytest.raises(ConfigError, match="maxConcurrentCalls"):
        load_host_json(tmp_path)


def test_requirements_txt_is_generated_from_pyproject_and_in_sync() -> None:
    # Given the committed file; When the generator checks it; Then it is current
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gen_requirements.py"), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    lines = [ln for ln in (REPO / "requirements.txt").read_text().splitlines() if not ln.startswith("#")]
    assert not any(ln.startswith("azure-functions-worker") for ln in lines)
    assert any(ln.startswith("azure-functions>=") for ln in lines)


def test_local_settings_sample_and_funcignore_follow_the_conventions() -> None:
    values = json.loads((REPO / "local.settings.sample.json").read_text())["Values"]
    assert values["AzureWebJobsStorage"] == "UseDevelopmentStorage=true"
    assert values["FUNCTIONS_WORKER_RUNTIME"] == "python"
    assert "UseDevelopmentEmulator=true" in values["DBFANOUT_SERVICEBUS"]
    ignored = (REPO / ".funcignore").read_text().split()
    for entry in (".venv", "local.settings.json", "tests", "node_modules", "benchmarks", "infra", "docs"):
        assert entry in ignored
