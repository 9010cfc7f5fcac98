"""The offline Bicep gate (infra/validate.py) passes on the repository and fails on broken copies.

Runs the gate's own tools from .venv-infra (tree-sitter-bicep, checkov), which `make test`
installs (scripts/bootstrap.sh --infra-gate); skipped with that command when they are absent.
checkov is slow to start, so every broken copy is checked in
one gate run, and each test reads its copy's problems from the JSON report.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.infra.conftest import FIXTURE_CONFIG, INFRA, REPO_INFRA, replace_once

VALIDATE = REPO_INFRA / "validate.py"
OWNER = "8e3af657-a8ff-443c-a75c-2fe8c4bcb635"
CONTRIBUTOR = "b24988ac-6210-42ed-a3a3-c4c7c3b5d7ae"
SERVICE_BUS_DATA_OWNER = "090c5cfd-751d-490a-894a-3ce6f1109419"


def role_assignment(name: str, role: str, condition: str = "") -> str:
    """A role assignment on the namespace, appended to servicebus.bicep."""
    return f"""
resource {name} 'Microsoft.Authorization/roleAssignments@2022-04-01' = {condition}{{
  scope: namespace
  name: guid(namespace.id, 'someone', '{name}')
  properties: {{
    roleDefinitionId: subscriptionResourceId('Microsoft.Authorization/roleDefinitions', {role})
    principalId: 'someone'
    principalType: 'ServicePrincipal'
  }}
}}
"""


# name -> (file under infra/, old text, new text, expected {(gate, check)}, text the report names)
# old "" means append new to the file.
BROKEN: dict[str, tuple[str, str, str, set[tuple[str, str]], str]] = {
    "syntax_error": (
        "modules/servicebus.bicep",
        "    disableLocalAuth: true\n",
        "    disableLocalAuth: \n",
        {("syntax", "tree-sitter-bicep")},
        "servicebus.bicep:72",
    ),
    "servicebus_local_auth_on": (
        "modules/servicebus.bicep",
        "disableLocalAuth: true",
        "disableLocalAuth: false",
        {("checkov", "CKV_DBF_1")},
        "Microsoft.ServiceBus/namespaces.namespace",
    ),
    "servicebus_local_auth_from_expression": (
        "modules/servicebus.bicep",
        "disableLocalAuth: true",
        "disableLocalAuth: sku == 'Premium'",
        {("checkov", "CKV_DBF_1")},
        "Microsoft.ServiceBus/namespaces.namespace",
    ),
    "servicebus_namespace_behind_condition": (
        "modules/servicebus.bicep",
        "@2024-01-01' = {\n  name: name\n  location: location\n  tags: tags\n  sku: skuSettings\n"
        "  properties: {\n    disableLocalAuth: true",
        "@2024-01-01' = if (!empty(name)) {\n  name: name\n  location: location\n  tags: tags\n"
        "  sku: skuSettings\n  properties: {\n    disableLocalAuth: false",
        {("checkov", "CKV_DBF_1")},
        "Microsoft.ServiceBus/namespaces.namespace",
    ),
    "queue_without_duplicate_detection": (
        "modules/servicebus.bicep",
        "requiresDuplicateDetection: true",
        "requiresDuplicateDetection: false",
        {("checkov", "CKV_DBF_3")},
        "Microsoft.ServiceBus/namespaces/queues.queue",
    ),
    "topic_without_duplicate_detection": (
        "modules/servicebus-topic.bicep",
        "requiresDuplicateDetection: true",
        "requiresDuplicateDetection: false",
        {("checkov", "CKV_DBF_6")},
        "Microsoft.ServiceBus/namespaces/topics.topic",
    ),
    "topic_duplicate_detection_from_a_parameter": (
        "modules/servicebus-topic.bicep",
        "requiresDuplicateDetection: true",
        "requiresDuplicateDetection: !empty(topicName)",
        {("checkov", "CKV_DBF_6")},
        "Microsoft.ServiceBus/namespaces/topics.topic",
    ),
    "sender_on_the_namespace": (
        "modules/rbac-topic.bicep",
        "  scope: topic\n",
        "  scope: namespace\n",
        {("consistency", "role-scope")},
        "senderOnTopic",
    ),
    "subscription_missing_from_parameters": (
        "main.parameters.json",
        '"name": "cache",',
        '"name": "caches",',
        {("consistency", "subscriptions")},
        "pollers.products.subscriptions.cache",
    ),
    "storage_shared_key_on": (
        "modules/storage.bicep",
        "allowSharedKeyAccess: false",
        "allowSharedKeyAccess: true",
        {("checkov", "CKV_DBF_2")},
        "Microsoft.Storage/storageAccounts.storage",
    ),
    "appinsights_local_auth_on": (
        "modules/monitoring.bicep",
        "DisableLocalAuth: true",
        "DisableLocalAuth: false",
        {("checkov", "CKV_DBF_4")},
        "Microsoft.Insights/components.appInsights",
    ),
    "appinsights_local_auth_unset": (
        "modules/monitoring.bicep",
        "    DisableLocalAuth: true\n",
        "",
        {("checkov", "CKV_DBF_4")},
        "Microsoft.Insights/components.appInsights",
    ),
    "owner_role_in_rbac_module": (
        "modules/rbac.bicep",
        "storageBlobDataOwner: 'b7e6dc6d-f1e8-4753-8033-0f276bb0955b'",
        f"storageBlobDataOwner: '{OWNER}'",
        {("checkov", "CKV_DBF_5"), ("consistency", "roles")},
        "roleAssignments.blobOwnerOnAccount",
    ),
    "contributor_role": (
        "modules/servicebus.bicep",
        "",
        role_assignment("contributorOnNamespace", f"'{CONTRIBUTOR}'"),
        {("checkov", "CKV_DBF_5"), ("consistency", "roles")},
        "roleAssignments.contributorOnNamespace",
    ),
    "servicebus_data_owner_behind_condition": (
        "modules/servicebus.bicep",
        "",
        role_assignment("dataOwnerOnNamespace", f"'{SERVICE_BUS_DATA_OWNER}'", "if (sku == 'Premium') "),
        {("checkov", "CKV_DBF_5"), ("consistency", "roles")},
        "roleAssignments.dataOwnerOnNamespace",
    ),
    "role_id_from_a_parameter": (
        "modules/servicebus.bicep",
        "",
        "\nparam anyRole string = ''\n" + role_assignment("opaqueRole", "anyRole"),
        {("checkov", "CKV_DBF_5")},
        "roleAssignments.opaqueRole",
    ),
    "unsuppressed_builtin_check": (
        "modules/storage.bicep",
        "  // checkov:skip=CKV_AZURE_35: the template has no VNet integration",
        "  // CKV_AZURE_35 was here",
        {("checkov", "CKV_AZURE_35")},
        "Microsoft.Storage/storageAccounts.storage",
    ),
    "suppression_without_reason": (
        "modules/storage.bicep",
        "// checkov:skip=CKV_AZURE_206: dbfanout state",
        "// checkov:skip=CKV_AZURE_206\n// dbfanout state",
        {("suppression", "CKV_AZURE_206")},
        "storage.bicep:33",
    ),
    "syntax_checkov_cannot_read": (
        "main.bicep",
        "",
        "\nimport * as shared from 'shared.bicep'\n",
        {("checkov", "parse-error")},
        "main.bicep",
    ),
    "poller_queue_missing_from_parameters": (
        "main.parameters.json",
        '"name": "customers-changes",',
        '"name": "customer-changes",',
        {("consistency", "queues"), ("consistency", "unused")},  # the config's queue missing, the other unused
        "customers-changes",
    ),
}


# Copies of infra/, each broken in several independent places (different resources or lines), so
# that checkov starts 5 times instead of 20. A syntax error stops the parse, so it gets its own copy.
GROUPS: dict[str, list[str]] = {
    "auth_and_roles": [
        "servicebus_local_auth_on",
        "storage_shared_key_on",
        "appinsights_local_auth_on",
        "owner_role_in_rbac_module",
        "suppression_without_reason",
        "topic_without_duplicate_detection",
    ],
    "queues_and_suppressions": [
        "queue_without_duplicate_detection",
        "appinsights_local_auth_unset",
        "contributor_role",
        "unsuppressed_builtin_check",
        "poller_queue_missing_from_parameters",
        "sender_on_the_namespace",
    ],
    "conditions_and_parameters": [
        "servicebus_namespace_behind_condition",
        "servicebus_data_owner_behind_condition",
        "role_id_from_a_parameter",
        "subscription_missing_from_parameters",
    ],
    "expressions_and_new_syntax": [
        "servicebus_local_auth_from_expression",
        "syntax_checkov_cannot_read",
        "topic_duplicate_detection_from_a_parameter",
    ],
    "syntax": ["syntax_error"],
}
GROUP_OF = {name: group for group, names in GROUPS.items() for name in names}


def run_gate(*dirs: Path, python: Path) -> tuple[int, dict[str, list[dict[str, Any]]]]:
    proc = subprocess.run(
        [str(python), str(VALIDATE), "--json", "--config", str(FIXTURE_CONFIG), *map(str, dirs)],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def break_copy(dest: Path, names: list[str]) -> None:
    shutil.copytree(INFRA, dest, ignore=shutil.ignore_patterns("__pycache__"))
    for name in names:
        rel, old, new, _, _ = BROKEN[name]
        target = dest / rel
        if old:
            replace_once(target, old, new)
        else:
            target.write_text(target.read_text(encoding="utf-8") + new, encoding="utf-8")


@pytest.fixture(scope="module")
def broken_reports(infra_python: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Each broken copy's problems, from one gate run over all of them."""
    root = tmp_path_factory.mktemp("broken")
    dirs = {group: root / group / "infra" for group in GROUPS}
    for group, dest in dirs.items():
        break_copy(dest, GROUPS[group])
    code, report = run_gate(*dirs.values(), python=infra_python)
    assert code == 1
    return {group: report[str(d.resolve())] for group, d in dirs.items()}


def test_every_broken_copy_is_in_one_group() -> None:
    assert sorted(GROUP_OF) == sorted(BROKEN)


def test_gate_passes_on_the_repository_templates(infra_python: Path) -> None:
    # Given infra/ as committed (its parameters generated from dbfanout.toml.sample)
    # When CI's command runs the whole gate, with its default config; Then it exits 0, all OK
    proc = subprocess.run(
        ["bash", str(REPO_INFRA / "validate.sh")],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith("OK (syntax, suppressions, consistency, checkov)"), proc.stdout


@pytest.mark.parametrize("group", list(GROUPS))
def test_a_broken_copy_fails_only_for_what_was_broken(
    group: str, broken_reports: dict[str, list[dict[str, Any]]]
) -> None:
    # Given a copy broken in these places only; Then the gate reports those checks and no others
    expected = set().union(*(BROKEN[name][3] for name in GROUPS[group]))
    found = {(p["gate"], p["check"]) for p in broken_reports[group]}
    if group == "syntax":
        assert expected <= found, broken_reports[group]  # checkov cannot parse the file either
    else:
        assert found == expected, broken_reports[group]


@pytest.mark.parametrize("name", list(BROKEN))
def test_gate_names_each_break(name: str, broken_reports: dict[str, list[dict[str, Any]]]) -> None:
    # Given a copy of infra/ with this break; When the gate runs
    # Then each expected check fails and names the file or resource that was broken
    rel, _, _, expected, named = BROKEN[name]
    problems = broken_reports[GROUP_OF[name]]
    for gate_check in expected:
        # checkov names the resource; the consistency checks name the file
        names = (named, rel) if gate_check[0] == "consistency" else (named,)
        hits = [p for p in problems if (p["gate"], p["check"]) == gate_check]
        assert any(n in p["file"] or n in p["message"] for p in hits for n in names), (gate_check, problems)
