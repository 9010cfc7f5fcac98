"""host.json is valid against the published host.json schema, and the local host agrees with it (issue 13).

The schema cannot be downloaded at test time, so the part of it that covers what our host.json
sets is encoded below, copied from SchemaStore's ``src/schemas/json/host.json`` (draft-04),
``definitions["version-2-ext-5"]`` (the shape for extension bundles with Service Bus 5.x):
``version``, ``extensionBundle``, ``extensions.serviceBus`` (the Service Bus 5.x keys, with
``additionalProperties: false``) and ``extensions.queues`` (``queues-extension-v2``). Enum values
there are lower-case: ``clientRetryOptions.mode`` is ``exponential`` or ``fixed``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from dbfanout.host.hostjson import load_host_json
from shared.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
_HMS = r"^(?:[01]\d|2[0-3]):[0-5]\d:[0-5]\d$"
_HMS_FRACTION = r"^[0-9][0-9]:[0-9][0-9]:[0-9][0-9](?:\.[0-9]+)?$"

SERVICE_BUS_5: dict[str, Any] = {
    "type": "object",
    "properties": {
        "clientRetryOptions": {
            "type": "object",
            "properties": {
                "mode": {"type": "string", "enum": ["exponential", "fixed"]},
                "tryTimeout": {"type": "string", "pattern": _HMS},
                "delay": {"type": "string", "pattern": r"^(?:[01]\d|2[0-3]):[0-5]\d:[0-5]\d\.\d\d$"},
                "maxDelay": {"type": "string", "pattern": _HMS},
                "maxRetries": {"type": "integer"},
            },
        },
        "prefetchCount": {"type": "integer"},
        "transportType": {"type": "string", "enum": ["amqpTcp", "amqpWebSockets"]},
        "webProxy": {"type": "string"},
        "autoCompleteMessages": {"type": "boolean"},
        "maxAutoLockRenewalDuration": {"type": "string", "pattern": _HMS},
        "maxConcurrentCalls": {"type": "integer"},
        "maxConcurrentSessions": {"type": "integer"},
        "maxMessageBatchSize": {"type": "integer"},
        "maxBatchWaitTime": {"type": "string", "pattern": _HMS},
        "sessionIdleTimeout": {"type": "string", "pattern": _HMS},
        "enableCrossEntityTransactions": {"type": "boolean"},
    },
    "additionalProperties": False,
}
QUEUES_V2: dict[str, Any] = {
    "type": "object",
    "properties": {
        "maxPollingInterval": {"type": "string", "pattern": _HMS_FRACTION},
        "visibilityTimeout": {"type": "string", "pattern": _HMS_FRACTION},
        "batchSize": {"type": "integer", "minimum": 1, "maximum": 32},
        "maxDequeueCount": {"type": "integer"},
        "newBatchThreshold": {"type": "integer"},
        "messageEncoding": {"type": "string", "enum": ["base64", "none"]},
    },
    "additionalProperties": False,
}
HOST_JSON_V2_EXT_5: dict[str, Any] = {
    "$schema": "http://json-schema.org/draft-04/schema#",
    "type": "object",
    "required": ["version"],
    "properties": {
        "version": {"enum": ["2.0"]},
        "extensionBundle": {
            "type": "object",
            "properties": {"id": {"type": "string"}, "version": {"type": "string"}},
        },
        "extensions": {"type": "object", "properties": {"serviceBus": SERVICE_BUS_5, "queues": QUEUES_V2}},
    },
}


def _errors(doc: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft4Validator(HOST_JSON_V2_EXT_5)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def test_the_committed_host_json_is_valid_against_the_schema() -> None:
    doc = json.loads((REPO / "host.json").read_text())
    assert _errors(doc) == []


def test_the_schema_part_rejects_what_the_published_schema_rejects() -> None:
    # A capitalised enum value (the old host.json) and an unknown Service Bus key both fail
    doc = json.loads((REPO / "host.json").read_text())
    doc["extensions"]["serviceBus"]["clientRetryOptions"]["mode"] = "Exponential"
    doc["extensions"]["serviceBus"]["maxConcurrentCallz"] = 1
    errors = _errors(doc)
    assert any("clientRetryOptions/mode" in e for e in errors) and any("maxConcurrentCallz" in e for e in errors)


@pytest.mark.parametrize("mode", ["exponential", "fixed"])
def test_the_local_host_accepts_the_schemas_retry_modes(tmp_path: Path, mode: str) -> None:
    (tmp_path / "host.json").write_text(
        json.dumps({"extensions": {"serviceBus": {"clientRetryOptions": {"mode": mode}}}})
    )
    assert load_host_json(tmp_path).service_bus.client_retry_mode == mode


def test_the_local_host_rejects_a_retry_mode_the_schema_rejects(tmp_path: Path) -> None:
    (tmp_path / "host.json").write_text(
        json.dumps({"extensions": {"serviceBus": {"clientRetryOptions": {"mode": "Exponential"}}}})
    )
    with pytest.raises(ConfigError, match=r"clientRetryOptions\.mode.*lower-case"):
        load_host_json(tmp_path)


def test_session_settings_are_read_with_the_extensions_defaults(tmp_path: Path) -> None:
    # The committed host.json sets them; without them the extension's defaults apply
    committed = load_host_json(REPO).service_bus
    assert (committed.max_concurrent_sessions, committed.session_idle_timeout_seconds) == (8, 1.0)
    (tmp_path / "host.json").write_text(json.dumps({"version": "2.0"}))
    default = load_host_json(tmp_path).service_bus
    assert (default.max_concurrent_sessions, default.session_idle_timeout_seconds) == (8, 60.0)
    retry = {"clientRetryOptions": {"tryTimeout": "00:00:30"}}
    (tmp_path / "host.json").write_text(json.dumps({"version": "2.0", "extensions": {"serviceBus": retry}}))
    assert load_host_json(tmp_path).service_bus.session_idle_timeout_seconds == 30.0
