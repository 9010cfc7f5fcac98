"""infra/params.py writes the deployment's parameters from dbfanout.toml (issue 40): azd's preprovision
hook runs it, so the queues, topics, alerts and database URL settings cannot disagree with the config,
and nothing the config does not name deploys. Standard library only, like infra/consistency.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.infra.conftest import FIXTURE_CONFIG, REPO, REPO_INFRA, ROOT_SAMPLE, generated_infra, load_infra_script


@pytest.fixture(scope="module")
def params() -> ModuleType:
    return load_infra_script("params")


def values(infra: Path) -> dict[str, Any]:
    doc = json.loads((infra / "main.parameters.json").read_text(encoding="utf-8"))
    return {name: entry["value"] for name, entry in doc["parameters"].items()}


def consistency_cli(infra: Path, config: Path) -> subprocess.CompletedProcess[str]:
    """``python infra/consistency.py``: the config/parameters check alone, run by this (the app's) Python."""
    return subprocess.run(
        [sys.executable, str(REPO_INFRA / "consistency.py"), str(infra), "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_queue_changed_in_the_config_changes_the_generated_parameters(tmp_path: Path) -> None:
    # Given the fixture config and the parameters generated from it
    config = tmp_path / "dbfanout.toml"
    config.write_text(FIXTURE_CONFIG.read_text(encoding="utf-8"), encoding="utf-8")
    infra = generated_infra(config, tmp_path / "infra")
    assert [q["name"] for q in values(infra)["queues"]] == ["orders-changes", "customers-changes"]
    # When the operator renames a queue, gives it sessions and a delivery count, and regenerates
    text = config.read_text(encoding="utf-8")
    config.write_text(
        text.replace(
            'queue = "customers-changes"', 'queue = "clients-changes"\nsessions = true\nmax_delivery_count = 4'
        ),
        encoding="utf-8",
    )
    assert (
        load_infra_script("params").main(["--config", str(config), "--out", str(infra / "main.parameters.json")]) == 0
    )
    # Then the parameters follow: the new queue as configured, the old one gone, the rest unchanged
    queues = {q["name"]: q for q in values(infra)["queues"]}
    assert set(queues) == {"orders-changes", "clients-changes"}
    assert queues["clients-changes"]["requiresSession"] is True and queues["clients-changes"]["maxDeliveryCount"] == 4
    assert queues["orders-changes"] == {
        "name": "orders-changes",
        "maxDeliveryCount": 10,
        "requiresSession": False,
        "lockDuration": "PT1M",
    }
    # And the consistency check, run without checkov, passes on them
    done = consistency_cli(infra, config)
    assert done.returncode == 0, done.stdout + done.stderr


def test_hand_set_values_survive_a_regeneration(params: ModuleType, tmp_path: Path) -> None:
    # Given a parameters file with the operator's own values (sku, a lag threshold, a lock duration,
    # a database URL from a vault of theirs)
    out = tmp_path / "main.parameters.json"
    assert params.main(["--config", str(FIXTURE_CONFIG), "--out", str(out)]) == 0
    doc = json.loads(out.read_text(encoding="utf-8"))
    doc["parameters"]["serviceBusSku"] = {"value": "Premium"}
    doc["parameters"]["pollers"]["value"][1]["lagThresholdSeconds"] = 900
    doc["parameters"]["queues"]["value"][0]["lockDuration"] = "PT5M"
    own_vault = {"name": "CUSTOMERS_DB_URL", "keyVaultSecretUri": "https://kv-ours.vault.azure.net/secrets/crm"}
    doc["parameters"]["databaseUrlSettings"]["value"][1] = own_vault
    out.write_text(json.dumps(doc), encoding="utf-8")
    # When it is generated again from the same config
    assert params.main(["--config", str(FIXTURE_CONFIG), "--out", str(out)]) == 0
    # Then they are kept, and --check finds the file up to date
    again = values(tmp_path)
    assert again["serviceBusSku"] == "Premium"
    assert again["pollers"][1] == {
        "name": "customers",
        "scheduleSeconds": 60,
        "kind": "keyset",
        "lagThresholdSeconds": 900,
    }
    assert again["queues"][0]["lockDuration"] == "PT5M"
    assert again["databaseUrlSettings"] == [{"name": "ORDERS_DB_URL", "secretName": "orders-db-url"}, own_vault]
    assert params.main(["--config", str(FIXTURE_CONFIG), "--out", str(out), "--check"]) == 0


def test_the_committed_parameters_are_what_the_sample_config_generates(params: ModuleType) -> None:
    # Given the repository's sample config (one poller) and the committed parameters
    # Then the file is exactly the sample's generation: no sample entry beyond what the config names
    assert (
        params.main(["--config", str(ROOT_SAMPLE), "--out", str(REPO_INFRA / "main.parameters.json"), "--check"]) == 0
    )
    committed = values(REPO_INFRA)
    assert [q["name"] for q in committed["queues"]] == ["orders-changes"] and committed["topics"] == []
    assert [p["name"] for p in committed["pollers"]] == ["orders"]
    assert committed["databaseUrlSettings"] == [{"name": "ORDERS_DB_URL", "secretName": "orders-db-url"}]


def test_entries_no_config_names_are_errors_found_without_checkov(tmp_path: Path) -> None:
    # Given parameters generated for the fixture (three pollers) but an app whose config has one
    infra = generated_infra(FIXTURE_CONFIG, tmp_path / "infra")
    # When the consistency check runs alone with the app's Python (no checkov, no tree-sitter)
    done = consistency_cli(infra, ROOT_SAMPLE)
    # Then each entry that would deploy for nothing is named, with the command that fixes it
    assert done.returncode == 1, done.stdout
    unused = set(re.findall(r"CONSISTENCY unused: \S+: (.+?) is not named", done.stdout))
    assert unused == {
        "queue 'customers-changes'",
        "topic 'products-changes'",
        "pollers entry 'customers'",
        "pollers entry 'products'",
        "databaseUrlSettings entry 'CUSTOMERS_DB_URL'",
    }
    assert "python infra/params.py" in done.stdout


def test_a_missing_config_generates_nothing(
    params: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given no dbfanout.toml; When the hook runs; Then it fails and says what to do (no sample deploys)
    out = tmp_path / "main.parameters.json"
    assert params.main(["--config", str(tmp_path / "dbfanout.toml"), "--out", str(out)]) == 2
    assert not out.exists() and "cp dbfanout.toml.sample dbfanout.toml" in capsys.readouterr().err


def test_azd_generates_the_parameters_before_each_provision_and_names_the_vault_with_a_suffix() -> None:
    # azure.yaml's preprovision hook runs the generator on both shells
    text = (REPO / "azure.yaml").read_text(encoding="utf-8")
    hook = text.split("preprovision:", 1)[1].split("services:", 1)[0]
    assert "run: python3 infra/params.py" in hook and "run: python infra/params.py" in hook
    # The Key Vault name takes a suffix (a re-created environment's vault must not collide with its
    # soft-deleted, purge-protected predecessor), filled from the azd environment
    main = (REPO_INFRA / "main.bicep").read_text(encoding="utf-8")
    assert "var keyVaultName = toLower('kv-${resourceToken}${keyVaultNameSuffix}')" in main
    assert re.search(r"@maxLength\(8\)\nparam keyVaultNameSuffix string = ''", main)
    assert values(REPO_INFRA)["keyVaultNameSuffix"] == "${DBFANOUT_KEY_VAULT_SUFFIX}"
