"""infra/ alerts and the workbook (issue 24): every configured poller gets its alerts, and what
the alert queries read is what the code emits (shared/telemetry.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import ModuleType

import shared.telemetry
import shared.tracing
from tests.infra.conftest import FIXTURE_CONFIG, INFRA, REPO
from tests.infra.test_consistency import checks_of, edit_parameters, write_config

ALERTS = INFRA / "modules" / "alerts.bicep"


def _pollers(infra: Path = INFRA) -> list[dict[str, object]]:
    doc = json.loads((infra / "main.parameters.json").read_text(encoding="utf-8"))
    value: list[dict[str, object]] = doc["parameters"]["pollers"]["value"]
    return value


def test_the_repository_gives_every_fixture_poller_its_alerts(consistency: ModuleType) -> None:
    assert consistency.check_alerts(INFRA, FIXTURE_CONFIG) == []
    assert {p["name"] for p in _pollers()} == {"orders", "customers", "products"}


def test_a_poller_without_a_pollers_entry_is_named(consistency: ModuleType, tmp_path: Path) -> None:
    # Given a new poller the parameters do not list; Then the gate says it gets no alerts and what to add
    config = write_config(
        tmp_path,
        '[pollers.invoices]\nsource_url = "${ORDERS_DB_URL}"\ntable = "invoices"\ncursor = "updated_at"\n'
        'pk = ["id"]\nqueue = "orders-changes"\n',
    )
    (problem,) = consistency.check_alerts(INFRA, config)
    assert problem.check == "alerts" and "pollers.invoices" in problem.message and "scheduleSeconds" in problem.message


def test_a_pg_logical_poller_listed_as_keyset_misses_its_wal_alert(
    consistency: ModuleType, infra_copy: Path, tmp_path: Path
) -> None:
    config = write_config(
        tmp_path,
        '[pollers.ledger]\nkind = "pg_logical"\nsource_url = "${ORDERS_DB_URL}"\ntable = "ledger"\n'
        'queue = "orders-changes"\nslot = "dbfanout_ledger"\n',
    )
    edit_parameters(infra_copy, pollers=[*_pollers(), {"name": "ledger", "scheduleSeconds": 5, "kind": "keyset"}])
    (problem,) = consistency.check_alerts(infra_copy, config)
    assert "retained-WAL" in problem.message
    edit_parameters(infra_copy, pollers=[*_pollers(), {"name": "ledger", "scheduleSeconds": 5, "kind": "pg_logical"}])
    assert consistency.check_alerts(infra_copy, config) == []


def test_a_wrong_schedule_interval_is_named(consistency: ModuleType, infra_copy: Path) -> None:
    # Given customers fires every minute but its entry says 5 s; Then the stall alert would count wrong
    pollers = [{**p, "scheduleSeconds": 5} if p["name"] == "customers" else p for p in _pollers()]
    edit_parameters(infra_copy, pollers=pollers)
    (problem,) = consistency.check_alerts(infra_copy, FIXTURE_CONFIG)
    assert "every 60 s" in problem.message and "scheduleSeconds = 5" in problem.message


def test_alerts_not_deployed_by_main_is_named(consistency: ModuleType, infra_copy: Path) -> None:
    main = infra_copy / "main.bicep"
    main.write_text(main.read_text(encoding="utf-8").replace("    pollers: pollers\n", "    pollers: []\n"))
    assert checks_of(consistency.check_alerts(infra_copy, FIXTURE_CONFIG)) == {"alerts"}


def test_the_alert_and_workbook_queries_read_metrics_the_code_emits() -> None:
    # Given every metric name the alerts and the workbook query
    text = ALERTS.read_text(encoding="utf-8")
    queried = set(re.findall(r'name (?:==|in \() ?"(dbfanout\.[\w.]+)"', text))
    queried |= set(re.findall(r'"(dbfanout\.[\w.]+)"', text))
    # Then each is an instrument of shared/telemetry.py, or a span name or span attribute of
    # shared/tracing.py and the worker (names are a contract: renaming one breaks them)
    # (the worker's hooks each emit their own: worker/*.py)
    emitters = (Path(shared.telemetry.__file__), Path(shared.tracing.__file__), *sorted((REPO / "worker").glob("*.py")))
    emitted = {name for path in emitters for name in re.findall(r'"(dbfanout\.[\w.]+)"', path.read_text("utf-8"))}
    assert queried and queried <= emitted, queried - emitted
    for needed in (
        "dbfanout.last_success_timestamp",
        "dbfanout.lag",
        "dbfanout.pg_logical.retained_wal",
        "dbfanout.pg_logical.wal_headroom",
        "dbfanout.truncates",  # a TRUNCATE is never delivered as an event (issue 42)
        "dbfanout.sink_refusing",  # the broker refuses a poller's sends (queue full, throttled, unreachable)
        "dbfanout.sends_refused",
        "dbfanout.events.dead_lettered",
        "dbfanout.commit_to_handler",
        "dbfanout.events_handled",
        "dbfanout.deliveries.failed",
        "dbfanout.deliver",  # the failed delivery spans, joined to their exceptions: why each failed
    ):
        assert needed in queried


def test_every_alert_goes_to_the_one_action_group_with_the_parameters_receivers() -> None:
    text = ALERTS.read_text(encoding="utf-8")
    rules = re.findall(r"^resource (\w+) '(Microsoft\.Insights/(?:scheduledQueryRules|metricAlerts))@", text, re.M)
    assert {name for name, _ in rules} == {
        "stallAlert",
        "lagAlert",
        "refusingAlert",
        "walAlert",
        "walHeadroomAlert",
        "truncateAlert",
        "entityDlqAlert",
        "appDlqAlert",
    }
    assert text.count("actionGroup.id") == len(rules) + 1  # each rule, and the output
    assert "emailAddress: alertEmail" in text and "serviceUri: alertWebhookUri" in text
    assert "if (p.kind == 'pg_logical')" in text  # the WAL alert only for pg_logical pollers
    assert "'Microsoft.Insights/workbooks@" in text


def test_a_pg_logical_slot_nearing_max_slot_wal_keep_size_alerts() -> None:
    # Given the headroom alert (issue 32): PostgreSQL invalidates a slot at max_slot_wal_keep_size
    text = ALERTS.read_text(encoding="utf-8")
    block = text[text.index("resource walHeadroomAlert") :]
    block = block[: block.index("\n}]")]
    # Then it is per pg_logical poller, severity 1, and fires on the share of the limit the slot holds
    # back (retained / (retained + headroom)) above walKeepUsedPercent, which main.bicep passes through
    assert "if (p.kind == 'pg_logical')" in block and "severity: 1" in block
    assert "dbfanout.pg_logical.wal_headroom" in block and "dbfanout.pg_logical.retained_wal" in block
    assert "100.0 * retained / (retained + headroom) > {1}" in block and "walKeepUsedPercent)" in block
    main = (INFRA / "main.bicep").read_text(encoding="utf-8")
    assert "walKeepUsedPercent: walKeepUsedPercent" in main and "param walKeepUsedPercent int = 80" in main
