#!/usr/bin/env python3
"""Write infra/main.parameters.json from dbfanout.toml, so the deployment cannot disagree with the config.

    python infra/params.py                     # dbfanout.toml (or $DBFANOUT_CONFIG) -> infra/main.parameters.json
    python infra/params.py --config F --out P  # another config or output
    python infra/params.py --check             # exit 1 when the file is not what the config generates

azure.yaml runs it as the ``preprovision`` hook, so every ``azd provision`` / ``azd up`` deploys
exactly the config's entities. Standard library only (Python 3.11+): it runs before any virtualenv.

Generated from the config (each run replaces them): ``queues``, ``topics`` with their
subscriptions, ``pollers`` (one alert entry per poller), ``databaseUrlSettings`` (one Key Vault
reference per ``${NAME}`` a poller reads), ``useStorageQueues``, ``storageQueueNames`` and
``stateContainerName``; ``duplicateDetectionHistoryTimeWindow`` is raised when a poller's
redelivery horizon needs more. Everything else in the file (sku, instance size, alert email,
``lagThresholdSeconds`` or ``lockDuration`` of an entry, parameters you add) is yours and kept.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tomllib
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import consistency  # noqa: E402

__all__ = ["DERIVED", "derive", "generate", "main"]

#: The parameters this script owns: any value the file has for them is replaced.
DERIVED = (
    "queues",
    "topics",
    "pollers",
    "databaseUrlSettings",
    "useStorageQueues",
    "storageQueueNames",
    "stateContainerName",
)
DEFAULT_LOCK = "PT1M"
DEFAULT_WINDOW = "PT10M"
DEFAULT_SCHEDULE_SECONDS = 300  # a schedule read from an app setting (%NAME%): its interval is unknown here
#: What a new file starts with (azd fills ${...} from its environment; unset is empty).
BASE: dict[str, Any] = {
    "environmentName": "${AZURE_ENV_NAME}",
    "location": "${AZURE_LOCATION}",
    "principalId": "${AZURE_PRINCIPAL_ID}",
    "alertEmail": "${DBFANOUT_ALERT_EMAIL}",
    "keyVaultNameSuffix": "${DBFANOUT_KEY_VAULT_SUFFIX}",
    "duplicateDetectionHistoryTimeWindow": DEFAULT_WINDOW,
    "serviceBusSku": "Standard",
    "instanceMemoryMB": 2048,
    "maximumInstanceCount": 40,
}
SCHEMA = "https://schema.management.azure.com/schemas/2019-04-01/deploymentParameters.json#"
_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def _deliveries(owner: dict[str, Any], poller: dict[str, Any]) -> int:
    return int(owner.get("max_delivery_count") or poller.get("max_delivery_count") or 10)


def _keep(previous: dict[str, dict[str, Any]], name: str, made: dict[str, Any]) -> dict[str, Any]:
    """``made`` over what the previous entry of that name had (hand-set fields such as lockDuration stay)."""
    entry = dict(made)
    for key, value in previous.get(name, {}).items():
        entry.setdefault(key, value)
    entry.setdefault("lockDuration", DEFAULT_LOCK)
    return entry


def _by_name(entries: Any) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in entries or [] if isinstance(e, dict) and isinstance(e.get("name"), str)}


def _queues(pollers: dict[str, Any], previous: dict[str, Any]) -> list[dict[str, Any]]:
    before, out = _by_name(previous.get("queues")), {}
    for poller in pollers.values():
        if "topic" in poller or poller.get("transport") == "storage-queue" or poller["queue"] in out:
            continue
        made = {
            "name": poller["queue"],
            "maxDeliveryCount": _deliveries(poller, poller),
            "requiresSession": bool(poller.get("sessions", False)),
        }
        out[poller["queue"]] = _keep(before, poller["queue"], made)
    return list(out.values())


def _topics(pollers: dict[str, Any], previous: dict[str, Any]) -> list[dict[str, Any]]:
    before, out = _by_name(previous.get("topics")), []
    for poller in pollers.values():
        if "topic" not in poller:
            continue
        old_subs = _by_name(before.get(poller["topic"], {}).get("subscriptions"))
        subs = []
        for name, sub in (poller.get("subscriptions") or {}).items():
            sub = sub if isinstance(sub, dict) else {}
            made = {
                "name": name,
                "maxDeliveryCount": _deliveries(sub, poller),
                "requiresSession": bool(poller.get("sessions", False)),
            }
            entry = _keep(old_subs, name, made)
            entry.pop("filter", None)  # the config's filter, exactly, or none
            if sub.get("filter"):
                entry["filter"] = sub["filter"]
            subs.append(entry)
        topic = {k: v for k, v in before.get(poller["topic"], {}).items() if k != "subscriptions"}
        out.append({**topic, "name": poller["topic"], "subscriptions": subs})
    return out


def _alerts(pollers: dict[str, Any], previous: dict[str, Any]) -> list[dict[str, Any]]:
    before, out = _by_name(previous.get("pollers")), []
    for name, poller in pollers.items():
        schedule = str(poller.get("schedule", "*/5 * * * * *"))
        old = before.get(name, {})
        if schedule.startswith("%"):
            seconds = old.get("scheduleSeconds", DEFAULT_SCHEDULE_SECONDS)
        else:
            seconds = math.ceil(consistency.ncrontab_max_interval_seconds(schedule))
        out.append({**old, "name": name, "scheduleSeconds": seconds, "kind": poller.get("kind", "keyset")})
    return out


def _database_urls(pollers: dict[str, Any], previous: dict[str, Any]) -> list[dict[str, str]]:
    """One Key Vault reference per ``${NAME}`` a poller reads: secret ``name-in-kebab-case`` in the
    deployed vault, or the file's entry when it names a secret of another vault (``keyVaultSecretUri``).
    A name set through ``additionalAppSettings`` needs none."""
    before, own = _by_name(previous.get("databaseUrlSettings")), previous.get("additionalAppSettings") or {}
    names: list[str] = []
    for poller in pollers.values():
        for value in poller.values():
            for ref in _REF.findall(value) if isinstance(value, str) else ():
                if ref not in consistency.REQUIRED_APP_SETTINGS and ref not in own and ref not in names:
                    names.append(ref)
    return [
        before[n]
        if "keyVaultSecretUri" in before.get(n, {})
        else {"name": n, "secretName": n.lower().replace("_", "-")}
        for n in names
    ]


def _window(pollers: dict[str, Any], current: str) -> str:
    """``current``, or whole minutes enough for the longest redelivery horizon (consistency's dup-window check)."""
    need = max(
        (consistency.WINDOW_MARGIN * consistency.redelivery_horizon_seconds(p) for p in pollers.values()), default=0
    )
    have = consistency.iso_duration_seconds(current)
    return current if have is not None and have >= need else f"PT{math.ceil(need / 60)}M"


def derive(config: dict[str, Any], previous: dict[str, Any] | None = None) -> dict[str, Any]:
    """The parameter values the parsed ``config`` (a dbfanout.toml as a dict) determines, with the
    hand-set fields of ``previous`` (the values the file had) kept where an entry has the same name."""
    previous = previous or {}
    pollers: dict[str, Any] = config.get("pollers", {})
    storage = sorted({p["queue"] for p in pollers.values() if p.get("transport") == "storage-queue"})
    return {
        "queues": _queues(pollers, previous),
        "topics": _topics(pollers, previous),
        "pollers": _alerts(pollers, previous),
        "databaseUrlSettings": _database_urls(pollers, previous),
        "useStorageQueues": bool(storage),
        "storageQueueNames": storage,
        "stateContainerName": config.get("app", {}).get("state_container", "db-state"),
        "duplicateDetectionHistoryTimeWindow": _window(
            pollers, str(previous.get("duplicateDetectionHistoryTimeWindow") or DEFAULT_WINDOW)
        ),
    }


def generate(config_path: Path, existing: dict[str, Any] | None = None) -> dict[str, Any]:
    """The whole parameters document: :data:`BASE`, ``existing``'s values over it, the config's over both."""
    config = tomllib.loads(config_path.read_text(encoding="utf-8"))
    given = {name: {"value": value} for name, value in BASE.items()}
    given.update((existing or {}).get("parameters") or {})  # the file's own values win over the defaults
    values = {name: entry.get("value") for name, entry in given.items() if isinstance(entry, dict)}
    made = derive(config, values)
    parameters = {name: entry for name, entry in given.items() if name not in made}
    parameters.update({name: {"value": value} for name, value in made.items()})
    return {"$schema": SCHEMA, "contentVersion": "1.0.0.0", "parameters": parameters}


def _default_config() -> Path:
    named = os.environ.get("DBFANOUT_CONFIG")
    return Path(named) if named else HERE.parent / "dbfanout.toml"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=None, help="dbfanout.toml (default: $DBFANOUT_CONFIG, else ./)")
    ap.add_argument("--out", type=Path, default=HERE / "main.parameters.json", help="the parameters file to write")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when the file is out of date")
    args = ap.parse_args(argv)
    config = args.config or _default_config()
    if not config.is_file():
        print(
            f"params.py: no {config}: the deployment is generated from your config "
            "(cp dbfanout.toml.sample dbfanout.toml and edit it, or set DBFANOUT_CONFIG)",
            file=sys.stderr,
        )
        return 2
    existing = json.loads(args.out.read_text(encoding="utf-8")) if args.out.is_file() else None
    try:
        doc = generate(config, existing)
    except (tomllib.TOMLDecodeError, KeyError, ValueError) as exc:
        print(f"params.py: cannot read {config}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(doc, indent=2) + "\n"
    if args.check:
        if existing != doc:
            print(f"{args.out} is not what {config} generates: run python infra/params.py", file=sys.stderr)
            return 1
        print(f"{args.out}: up to date with {config}")
        return 0
    args.out.write_text(text, encoding="utf-8")
    print(f"{args.out}: written from {config} ({', '.join(DERIVED)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
