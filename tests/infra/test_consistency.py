"""infra/ agrees with the code and the config: app settings, queues, windows, roles, outputs.

Pure standard library (infra/consistency.py): runs in the main venv, no Bicep tools needed.
Every check is shown passing on the repository's templates and failing on a broken copy.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.infra.conftest import FIXTURE_CONFIG, INFRA, REPO, replace_once, sample_configs

# Built-in role definition ids as documented (learn.microsoft.com, Azure built-in roles; also
# ../shared/AZURE_FACTS.md). Written here independently of infra/consistency.py on purpose.
DOCUMENTED = {
    "storageBlobDataOwner": "b7e6dc6d-f1e8-4753-8033-0f276bb0955b",
    "storageBlobDataContributor": "ba92f5b4-2d11-453d-a403-e96b0029c9fe",
    "storageQueueDataContributor": "974c5e8b-45b9-4653-ba55-5f855dd0fb88",
    "serviceBusDataSender": "69a216fc-b8fb-44d8-bc22-1f3c2cd27a39",
    "serviceBusDataReceiver": "4f6d3b9b-027b-4f4c-9142-0e5a2a2247e0",
    "monitoringMetricsPublisher": "3913510d-42f4-4e42-8a64-420c390055eb",
    "keyVaultSecretsUser": "4633458b-17de-408a-b874-0445c86b69e6",
    "keyVaultSecretsOfficer": "b86a8fe4-44ce-4948-aee5-eccb2c155cd7",
}
OWNER = "8e3af657-a8ff-443c-a75c-2fe8c4bcb635"

APP_SETTINGS_THE_CODE_READS = [
    "AzureWebJobsStorage__blobServiceUri",
    "AzureWebJobsStorage__queueServiceUri",
    "AzureWebJobsStorage__credential",
    "AzureWebJobsStorage__clientId",
    "DBFANOUT_STATE__blobServiceUri",
    "DBFANOUT_STATE__credential",
    "DBFANOUT_STATE__clientId",
    "DBFANOUT_SERVICEBUS__fullyQualifiedNamespace",
    "DBFANOUT_SERVICEBUS__credential",
    "DBFANOUT_SERVICEBUS__clientId",
    "DBFANOUT_CONFIG",
    "APPLICATIONINSIGHTS_AUTHENTICATION_STRING",
    "APPLICATIONINSIGHTS_CONNECTION_STRING",
]


def checks_of(problems: list[Any]) -> set[str]:
    return {p.check for p in problems}


def write_config(tmp_path: Path, extra: str) -> Path:
    path = tmp_path / "dbfanout.toml"
    path.write_text(FIXTURE_CONFIG.read_text(encoding="utf-8") + "\n" + extra, encoding="utf-8")
    return path


def edit_parameters(infra: Path, **values: object) -> None:
    path = infra / "main.parameters.json"
    doc = json.loads(path.read_text(encoding="utf-8"))
    for name, value in values.items():
        if value is None:
            doc["parameters"].pop(name)
        else:
            doc["parameters"][name] = {"value": value}
    path.write_text(json.dumps(doc, indent=2), encoding="utf-8")


# ------------------------------------------------------------------------ the repository passes


@pytest.mark.parametrize(("config", "infra"), sample_configs(), ids=lambda p: p.name)
def test_repository_templates_serve_the_sample_config(consistency: ModuleType, config: Path, infra: Path) -> None:
    # Given the committed templates, with the parameters generated from a sample config
    # When checked against that config; Then nothing is inconsistent
    assert [str(p) for p in consistency.check_all(infra, [config])] == []


def test_the_checked_setting_names_are_the_contract(consistency: ModuleType) -> None:
    # The list the module checks is the one the code reads (DESIGN §3.3) - no more, no less.
    assert sorted(consistency.REQUIRED_APP_SETTINGS) == sorted(APP_SETTINGS_THE_CODE_READS)


def test_role_ids_in_the_templates_are_the_documented_built_in_ones() -> None:
    text = (INFRA / "modules" / "rbac.bicep").read_text(encoding="utf-8")
    declared = dict(re.findall(r"^\s*(\w+):\s*'([0-9a-f-]{36})'", text, re.MULTILINE))
    assert declared == DOCUMENTED


def test_azure_yaml_deploys_the_repo_root_as_a_python_function_app() -> None:
    text = (REPO / "azure.yaml").read_text(encoding="utf-8")
    service = text.split("services:", 1)[1]
    assert re.search(r"^  api:\n(    \S.*\n)+", service, re.MULTILINE)
    for line in ("project: .", "language: python", "host: function"):
        assert f"    {line}\n" in service
    assert "path: infra" in text and "module: main" in text


# ------------------------------------------------------------------------- each check can fail


def test_a_missing_app_setting_is_named(consistency: ModuleType, infra_copy: Path) -> None:
    replace_once(
        infra_copy / "modules" / "function-app.bicep",
        "name: 'DBFANOUT_STATE__clientId'",
        "name: 'DBFANOUT_STATE_CLIENT'",
    )
    problems = consistency.check_app_settings(infra_copy)
    assert any("DBFANOUT_STATE__clientId" in p.message for p in problems), problems


def test_a_key_based_credential_is_rejected(consistency: ModuleType, infra_copy: Path) -> None:
    path = infra_copy / "modules" / "function-app.bicep"
    text = path.read_text(encoding="utf-8")
    path.write_text(
        text.replace(
            "name: 'DBFANOUT_SERVICEBUS__credential'\n    value: 'managedidentity'",
            "name: 'DBFANOUT_SERVICEBUS__credential'\n    value: 'connectionstring'",
        ),
        encoding="utf-8",
    )
    problems = consistency.check_app_settings(infra_copy)
    assert any("DBFANOUT_SERVICEBUS__credential" in p.message for p in problems), problems


def test_fetching_a_key_is_rejected(consistency: ModuleType, infra_copy: Path) -> None:
    replace_once(
        infra_copy / "modules" / "storage.bicep",
        "output name string = storage.name",
        "output name string = storage.name\noutput key string = storage.listKeys().keys[0].value",
    )
    assert "keys" in checks_of(consistency.check_app_settings(infra_copy))


def test_a_poller_without_a_queue_parameter_is_named(consistency: ModuleType, infra_copy: Path) -> None:
    edit_parameters(infra_copy, queues=[{"name": "orders-changes"}])
    problems = consistency.check_config(infra_copy, FIXTURE_CONFIG)
    assert [p.message for p in problems if p.check == "queues"] == [
        "pollers.customers.queue = 'customers-changes' has no entry in the queues parameter of main.parameters.json"
    ]


def test_a_new_poller_needs_its_queue(consistency: ModuleType, tmp_path: Path) -> None:
    config = write_config(
        tmp_path,
        '[pollers.invoices]\nsource_url = "${ORDERS_DB_URL}"\ntable = "invoices"\n'
        'cursor = "updated_at"\npk = ["id"]\nqueue = "invoices-changes"\n',
    )
    problems = consistency.check_config(INFRA, config)
    assert checks_of(problems) == {"queues"} and "invoices-changes" in problems[0].message


def test_sessions_must_match_the_queue(consistency: ModuleType, tmp_path: Path) -> None:
    config = (
        write_config(tmp_path, "")
        .read_text(encoding="utf-8")
        .replace('queue = "orders-changes"', 'queue = "orders-changes"\nsessions = true')
    )
    (tmp_path / "s.toml").write_text(config, encoding="utf-8")
    assert checks_of(consistency.check_config(INFRA, tmp_path / "s.toml")) == {"sessions"}


def test_a_storage_queue_poller_needs_use_storage_queues(consistency: ModuleType, tmp_path: Path) -> None:
    config = write_config(
        tmp_path,
        '[pollers.audit]\nsource_url = "${ORDERS_DB_URL}"\ntable = "audit"\n'
        'cursor = "id"\npk = ["id"]\nqueue = "audit"\ntransport = "storage-queue"\n',
    )
    assert checks_of(consistency.check_config(INFRA, config)) == {"storage-queues"}


def test_an_unprovided_database_url_reference_is_named(consistency: ModuleType, tmp_path: Path) -> None:
    config = write_config(tmp_path, "").read_text(encoding="utf-8").replace("${CUSTOMERS_DB_URL}", "${CRM_DB_URL}")
    (tmp_path / "u.toml").write_text(config, encoding="utf-8")
    problems = consistency.check_config(INFRA, tmp_path / "u.toml")
    assert checks_of(problems) == {"db-urls"} and "CRM_DB_URL" in problems[0].message


def test_a_duplicate_window_shorter_than_the_redelivery_horizon_fails(
    consistency: ModuleType, infra_copy: Path
) -> None:
    # Given orders: lease 120 s, every 5 s, budget 80 s -> horizon 205 s, x2 = 410 s
    edit_parameters(infra_copy, duplicateDetectionHistoryTimeWindow="PT5M")
    problems = consistency.check_config(infra_copy, FIXTURE_CONFIG)
    assert checks_of(problems) == {"dup-window"}
    # Then every queue and the topic (the default window applies to both) is named
    assert {p.message.split("'")[1] for p in problems} == {"orders-changes", "customers-changes", "products-changes"}


def test_a_longer_lease_needs_a_longer_window(consistency: ModuleType, tmp_path: Path) -> None:
    config = (
        write_config(tmp_path, "")
        .read_text(encoding="utf-8")
        .replace(
            "lease_ttl_seconds = 120\nsettle_seconds = 2\nsoft", "lease_ttl_seconds = 600\nsettle_seconds = 2\nsoft"
        )
    )
    (tmp_path / "l.toml").write_text(config, encoding="utf-8")
    problems = consistency.check_config(INFRA, tmp_path / "l.toml")
    assert checks_of(problems) == {"dup-window"} and "pollers.orders" in problems[0].message


def test_a_per_queue_window_overrides_the_default(consistency: ModuleType, infra_copy: Path, tmp_path: Path) -> None:
    config = (
        write_config(tmp_path, "")
        .read_text(encoding="utf-8")
        .replace(
            "lease_ttl_seconds = 120\nsettle_seconds = 2\nsoft", "lease_ttl_seconds = 600\nsettle_seconds = 2\nsoft"
        )
    )
    (tmp_path / "l.toml").write_text(config, encoding="utf-8")
    edit_parameters(
        infra_copy,
        queues=[
            {"name": "orders-changes", "duplicateDetectionHistoryTimeWindow": "PT45M"},
            {"name": "customers-changes"},
        ],
    )
    assert consistency.check_config(infra_copy, tmp_path / "l.toml") == []


def test_state_container_and_connection_prefixes_must_match(consistency: ModuleType, tmp_path: Path) -> None:
    config = write_config(tmp_path, "").read_text(encoding="utf-8")
    config = config.replace('state_container = "db-state"', 'state_container = "state"').replace(
        'servicebus_connection = "DBFANOUT_SERVICEBUS"', 'servicebus_connection = "SB"'
    )
    (tmp_path / "c.toml").write_text(config, encoding="utf-8")
    assert checks_of(consistency.check_config(INFRA, tmp_path / "c.toml")) == {"state-container", "connections"}


def test_python_versions_the_code_does_not_support_are_rejected(consistency: ModuleType, infra_copy: Path) -> None:
    # Given a template that offers Python 3.10 again (the code needs tomllib, 3.11+)
    replace_once(infra_copy / "main.bicep", "@allowed([\n  '3.11'", "@allowed([\n  '3.10'\n  '3.11'")
    # Then the gate names it
    problems = consistency.check_python_version(infra_copy)
    assert [p.where for p in problems] == ["infra/main.bicep"] and "3.10" in problems[0].message


def test_the_minimum_python_is_the_projects(consistency: ModuleType) -> None:
    requires = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["requires-python"]
    minimum = tuple(int(x) for x in requires.removeprefix(">=").split("."))
    assert minimum == consistency.MIN_PYTHON


def test_an_undeclared_or_missing_parameter_is_named(consistency: ModuleType, infra_copy: Path) -> None:
    edit_parameters(infra_copy, queues=None, queueNames=["x"])
    messages = [p.message for p in consistency.check_parameters(infra_copy)]
    assert sorted(messages) == [
        "main.bicep parameter queues has no default and no value",
        "parameter queueNames is not declared in main.bicep",
    ]


def test_an_owner_role_id_is_rejected(consistency: ModuleType, infra_copy: Path) -> None:
    replace_once(infra_copy / "modules" / "rbac.bicep", DOCUMENTED["storageBlobDataOwner"], OWNER)
    messages = [p.message for p in consistency.check_roles(infra_copy)]
    assert f"grants Owner ({OWNER})" in messages


def test_a_mistyped_role_id_is_rejected(consistency: ModuleType, infra_copy: Path) -> None:
    typo = "69a216fc-b8fb-44d8-bc22-1f3c2cd27a3a"
    replace_once(infra_copy / "modules" / "rbac.bicep", DOCUMENTED["serviceBusDataSender"], typo)
    messages = " ".join(p.message for p in consistency.check_roles(infra_copy))
    assert typo in messages and "not a documented built-in role" in messages


def test_a_declared_role_that_is_never_assigned_is_named(consistency: ModuleType, infra_copy: Path) -> None:
    replace_once(
        infra_copy / "modules" / "rbac.bicep",
        "'Microsoft.Authorization/roleDefinitions', roles.monitoringMetricsPublisher)",
        "'Microsoft.Authorization/roleDefinitions', roles.keyVaultSecretsUser)",
    )
    messages = [p.message for p in consistency.check_roles(infra_copy)]
    assert "role monitoringMetricsPublisher is declared but never assigned" in messages


def test_an_output_reading_a_secure_parameter_is_rejected(consistency: ModuleType, infra_copy: Path) -> None:
    replace_once(
        infra_copy / "modules" / "function-app.bicep",
        "output name string = site.name",
        "output name string = site.name\noutput urls object = databaseUrlValues",
    )
    problems = consistency.check_outputs(infra_copy)
    assert [p.message for p in problems] == ["output urls reads the @secure() parameter databaseUrlValues"]


# ------------------------------------------------------------------------------------ helpers


@pytest.mark.parametrize(
    ("schedule", "seconds"),
    [
        ("*/5 * * * * *", 5),
        ("0 * * * * *", 60),
        ("0 */15 * * * *", 900),
        ("0 0 9 * * 1-5", 3 * 86400),
        ("0,30 * * * * *", 30),
        ("10 0 * * * *", 3600),
    ],
)
def test_ncrontab_max_interval(consistency: ModuleType, schedule: str, seconds: int) -> None:
    assert consistency.ncrontab_max_interval_seconds(schedule) == seconds


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("PT10M", 600), ("PT20S", 20), ("P1DT1H", 90000), ("P7D", 604800), ("10m", None), ("PT", None)],
)
def test_iso_duration(consistency: ModuleType, text: str, seconds: float | None) -> None:
    assert consistency.iso_duration_seconds(text) == seconds


def test_the_default_window_covers_the_design_defaults(consistency: ModuleType) -> None:
    # lease_ttl 120 s, default schedule every 5 s, default budget 2/3 of the lease: PT10M suffices.
    horizon = consistency.redelivery_horizon_seconds({})
    assert horizon == 205
    assert consistency.WINDOW_MARGIN * horizon <= consistency.iso_duration_seconds("PT10M")


def test_a_storage_queue_poller_needs_its_queue_in_storage_queue_names(
    consistency: ModuleType, infra_copy: Path, tmp_path: Path
) -> None:
    config = write_config(
        tmp_path,
        '[pollers.audit]\nsource_url = "${ORDERS_DB_URL}"\ntable = "audit"\n'
        'cursor = "id"\npk = ["id"]\nqueue = "audit"\ntransport = "storage-queue"\n',
    )
    # Given the transport is switched on but the queue is not listed: named
    edit_parameters(infra_copy, useStorageQueues=True)
    problems = consistency.check_config(infra_copy, config)
    assert checks_of(problems) == {"storage-queues"} and "storageQueueNames" in problems[0].message
    # When the queue is listed: clean
    edit_parameters(infra_copy, useStorageQueues=True, storageQueueNames=["audit"])
    assert consistency.check_config(infra_copy, config) == []
