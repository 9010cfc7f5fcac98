"""Consistency between infra/ and dbfanout's code and config (standard library only).

What the templates must agree on with the rest of the project:

* app settings: every setting the code reads (DESIGN §3.3) is set by a template, with
  identity-based values (credential = managedidentity, the identity's client id), and no key or
  connection string is fetched anywhere (no listKeys, no SharedAccessKey, no AccountKey);
* parameters: main.parameters.json only names parameters that main.bicep declares, and gives
  every parameter that has no default;
* config: every Service Bus queue poller in dbfanout.toml has its queue in the parameters
  (sessions matching); every topic poller has its topic in the ``topics`` parameter, with every
  configured subscription and each subscription's maxDeliveryCount, requiresSession and filter
  matching the config (a subscription the config does not name is a warning: it gets a copy of
  every message and dbfanout does not consume it); a storage-queue poller turns useStorageQueues
  on and lists its queue in storageQueueNames, every ``${NAME}`` the config references is
  provided as an app setting, the state container and connection prefixes match, and each queue's
  and topic's duplicate detection window covers the poller's redelivery horizon;
* topics parameter: each topic has a name and a non-empty list of named subscriptions, and no
  name is both a queue and a topic (they share the namespace);
* roles: every role GUID written in a template is the documented built-in one, none is a
  privileged role, every role declared is assigned, and every Service Bus data role is scoped to a
  queue, topic or subscription (never the namespace or the resource group);
* outputs: no output reads a @secure() parameter.

Used by ``infra/validate.py --config`` (the gate) and by tests/infra; ``python infra/consistency.py``
runs these checks alone, with any Python 3.11+ (no checkov or tree-sitter needed). ``unused``: every
queue, topic, subscription, alert entry and setting in the parameters is one a config names
(``infra/params.py`` generates them from the config; an entry no poller uses would still deploy). Each problem names the
check, the file and what to change. Problems are errors unless ``severity`` is ``"warning"``
(reported, but the gate still passes).
"""

from __future__ import annotations

import itertools
import json
import re
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

# What the code reads (DESIGN §3.3, shared/settings.py, shared/config.py): name -> required value
# (None: any value). Connection prefixes follow [app] state_connection / servicebus_connection.
REQUIRED_APP_SETTINGS: dict[str, str | None] = {
    "AzureWebJobsStorage__blobServiceUri": None,
    "AzureWebJobsStorage__queueServiceUri": None,
    "AzureWebJobsStorage__credential": "managedidentity",
    "AzureWebJobsStorage__clientId": None,
    "DBFANOUT_STATE__blobServiceUri": None,
    "DBFANOUT_STATE__credential": "managedidentity",
    "DBFANOUT_STATE__clientId": None,
    "DBFANOUT_SERVICEBUS__fullyQualifiedNamespace": None,
    "DBFANOUT_SERVICEBUS__credential": "managedidentity",
    "DBFANOUT_SERVICEBUS__clientId": None,
    "DBFANOUT_CONFIG": None,
    "APPLICATIONINSIGHTS_CONNECTION_STRING": None,
    "APPLICATIONINSIGHTS_AUTHENTICATION_STRING": None,
}
STATE_CONNECTION = "DBFANOUT_STATE"
SERVICEBUS_CONNECTION = "DBFANOUT_SERVICEBUS"

# Documented built-in role definition ids (learn.microsoft.com "Azure built-in roles").
DOCUMENTED_ROLES: dict[str, str] = {
    "storageBlobDataOwner": "b7e6dc6d-f1e8-4753-8033-0f276bb0955b",
    "storageBlobDataContributor": "ba92f5b4-2d11-453d-a403-e96b0029c9fe",
    "storageQueueDataContributor": "974c5e8b-45b9-4653-ba55-5f855dd0fb88",
    "serviceBusDataSender": "69a216fc-b8fb-44d8-bc22-1f3c2cd27a39",
    "serviceBusDataReceiver": "4f6d3b9b-027b-4f4c-9142-0e5a2a2247e0",
    "monitoringMetricsPublisher": "3913510d-42f4-4e42-8a64-420c390055eb",
    "keyVaultSecretsUser": "4633458b-17de-408a-b874-0445c86b69e6",
    "keyVaultSecretsOfficer": "b86a8fe4-44ce-4948-aee5-eccb2c155cd7",
}
FORBIDDEN_ROLES: dict[str, str] = {
    "8e3af657-a8ff-443c-a75c-2fe8c4bcb635": "Owner",
    "b24988ac-6210-42ed-a3a3-c4c7c3b5d7ae": "Contributor",
    "090c5cfd-751d-490a-894a-3ce6f1109419": "Azure Service Bus Data Owner",
}

_GUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
_SETTING = re.compile(r"name:\s*'(?P<name>[^'$]+)'\s*\n\s*value:\s*(?P<value>[^\n]+)")
_PARAM = re.compile(r"^param\s+(?P<name>\w+)\s+(?P<type>\w+)(?P<default>\s*=)?", re.MULTILINE)
_SECURE_PARAM = re.compile(r"^@secure\(\)\s*\n(?:@[^\n]*\n)*param\s+(?P<name>\w+)", re.MULTILINE)
_OUTPUT = re.compile(r"^output\s+(?P<name>\w+)\s+\w+\s*=\s*(?P<expr>[^\n]+)", re.MULTILINE)
_ROLE_ENTRY = re.compile(r"^\s*(?P<key>\w+):\s*'(?P<guid>" + _GUID.pattern + r")'", re.MULTILINE)
_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_DURATION = re.compile(r"^P(?:(?P<d>\d+)D)?(?:T(?:(?P<h>\d+)H)?(?:(?P<m>\d+)M)?(?:(?P<s>\d+(?:\.\d+)?)S)?)?$")
_KEY_MATERIAL = re.compile(r"listKeys\(|listConnectionStrings\(|SharedAccessKey|AccountKey=|primaryKey", re.I)


@dataclass(frozen=True)
class Problem:
    check: str
    where: str
    message: str
    severity: str = "error"  # or "warning": reported, does not fail the gate

    def __str__(self) -> str:
        prefix = "WARNING " if self.severity == "warning" else ""
        return f"{prefix}CONSISTENCY {self.check}: {self.where}: {self.message}"


# ---------------------------------------------------------------------------------------- helpers


def iso_duration_seconds(text: str) -> float | None:
    """Seconds in an ISO 8601 duration such as PT10M or P1DT2H; None if not one."""
    m = _DURATION.match(text or "")
    if not m or text in ("P", "PT"):
        return None
    d, h, mi, s = (float(m.group(g) or 0) for g in ("d", "h", "m", "s"))
    return d * 86400 + h * 3600 + mi * 60 + s


def _cron_field(field: str, low: int, high: int) -> set[int]:
    values: set[int] = set()
    for part in field.split(","):
        step = 1
        if "/" in part:
            part, step_text = part.split("/", 1)
            step = int(step_text)
        if part in ("*", "?"):
            start, end = low, high
        elif "-" in part:
            a, b = part.split("-", 1)
            start, end = int(a), int(b)
        else:
            start = int(part)
            end = high if step > 1 else start
        values.update(range(start, end + 1, step))
    return {v % 7 if high == 7 else v for v in values}  # day of week: 7 is Sunday too


def ncrontab_max_interval_seconds(schedule: str) -> float:
    """Longest gap between two firings of a six-field NCRONTAB (sec min hour day month dow)."""
    fields = schedule.split()
    if len(fields) != 6:
        raise ValueError(f"NCRONTAB needs six fields, got {schedule!r}")
    secs = sorted(_cron_field(fields[0], 0, 59))
    mins = sorted(_cron_field(fields[1], 0, 59))
    hours = sorted(_cron_field(fields[2], 0, 23))
    days = _cron_field(fields[3], 1, 31)
    months = _cron_field(fields[4], 1, 12)
    dows = _cron_field(fields[5], 0, 7)
    day_any, dow_any = fields[3] in ("*", "?"), fields[5] in ("*", "?")
    start = datetime(2024, 1, 1)  # a leap year: every month length is visited
    fires: list[datetime] = []
    for offset in range(366 + 31):
        day = start + timedelta(days=offset)
        dom_ok, dow_ok = day.day in days, (day.isoweekday() % 7) in dows
        on = dom_ok and dow_ok if (day_any or dow_any) else dom_ok or dow_ok
        if day.month not in months or not on:
            continue
        fires.extend(day.replace(hour=h, minute=m, second=s) for h in hours for m in mins for s in secs)
        if len(fires) > 200_000:  # dense schedule: a few days are plenty
            break
    if len(fires) < 2:
        raise ValueError(f"schedule {schedule!r} fires less than twice a year")
    return max((b - a).total_seconds() for a, b in itertools.pairwise(fires))


def redelivery_horizon_seconds(poller: dict[str, Any]) -> float:
    """Latest re-send of a batch whose commit failed (W1) or was ambiguous (W5), from its first send:
    the lease must expire, the next tick must fire, and that tick may run its whole budget."""
    lease = float(poller.get("lease_ttl_seconds", 120))
    budget = float(poller.get("tick_budget_seconds") or lease * 2 / 3)
    interval = ncrontab_max_interval_seconds(str(poller.get("schedule", "*/5 * * * * *")))
    return lease + interval + budget


WINDOW_MARGIN = 2.0


def _bicep_files(infra: Path) -> list[Path]:
    return sorted(p for p in infra.rglob("*.bicep") if p.is_file())


def _rel(path: Path, infra: Path) -> str:
    try:
        return str(path.relative_to(infra.parent))
    except ValueError:
        return str(path)


def _param_default(main_text: str, name: str) -> str | None:
    m = re.search(rf"^param\s+{name}\s+\w+\s*=\s*'([^']*)'", main_text, re.MULTILINE)
    return m.group(1) if m else None


# ----------------------------------------------------------------------------------------- checks


def check_app_settings(infra: Path) -> list[Problem]:
    problems: list[Problem] = []
    settings: dict[str, str] = {}
    for path in _bicep_files(infra):
        for m in _SETTING.finditer(path.read_text(encoding="utf-8")):
            settings.setdefault(m.group("name"), m.group("value").strip())
    for name, required in REQUIRED_APP_SETTINGS.items():
        if name not in settings:
            problems.append(Problem("app-settings", "infra/", f"no template sets the app setting {name}"))
        elif required is not None and settings[name] != f"'{required}'":
            problems.append(Problem("app-settings", "infra/", f"{name} = {settings[name]}, expected '{required}'"))
    for name, value in settings.items():
        if name.endswith("__clientId") and "ClientId" not in value and "clientId" not in value:
            problems.append(Problem("app-settings", "infra/", f"{name} = {value}: not the identity's client id"))
    auth = settings.get("APPLICATIONINSIGHTS_AUTHENTICATION_STRING", "")
    if auth and ("Authorization=AAD" not in auth or "ClientId=" not in auth):
        problems.append(
            Problem(
                "app-settings",
                "infra/",
                "APPLICATIONINSIGHTS_AUTHENTICATION_STRING must be 'ClientId=<identity client id>;Authorization=AAD'",
            )
        )
    for path in _bicep_files(infra):
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.lstrip().startswith("//") and _KEY_MATERIAL.search(line):
                problems.append(
                    Problem("keys", f"{_rel(path, infra)}:{n}", "reads key material; use identity-based settings")
                )
    return problems


def check_parameters(infra: Path) -> list[Problem]:
    main = infra / "main.bicep"
    params_file = infra / "main.parameters.json"
    text = main.read_text(encoding="utf-8")
    declared = {m.group("name"): bool(m.group("default")) for m in _PARAM.finditer(text)}
    try:
        given = json.loads(params_file.read_text(encoding="utf-8"))["parameters"]
    except (OSError, ValueError, KeyError) as exc:
        return [Problem("parameters", _rel(params_file, infra), f"cannot read parameters: {exc}")]
    problems = [
        Problem("parameters", _rel(params_file, infra), f"parameter {name} is not declared in main.bicep")
        for name in given
        if name not in declared
    ]
    problems += [
        Problem("parameters", _rel(params_file, infra), f"main.bicep parameter {name} has no default and no value")
        for name, has_default in declared.items()
        if not has_default and name not in given
    ]
    return problems


# The oldest Python the code runs on (pyproject.toml requires-python; it needs tomllib), and the
# newest the templates may offer (Flex Consumption's Python stacks that the code was checked on).
MIN_PYTHON = (3, 11)
_PYTHON_PARAM = re.compile(
    r"@allowed\(\[(?P<allowed>[^\]]*)\]\)\s*param\s+pythonVersion\s+string\s*=\s*'(?P<default>[^']*)'"
)


def check_python_version(infra: Path) -> list[Problem]:
    """Every template's ``pythonVersion`` offers only versions the code supports."""
    problems: list[Problem] = []
    for path in _bicep_files(infra):
        for m in _PYTHON_PARAM.finditer(path.read_text(encoding="utf-8")):
            allowed = re.findall(r"'([^']*)'", m.group("allowed"))
            too_old = [v for v in allowed if tuple(int(x) for x in v.split(".")) < MIN_PYTHON]
            if too_old:
                problems.append(
                    Problem(
                        "python",
                        _rel(path, infra),
                        f"pythonVersion allows {', '.join(too_old)}; the code needs Python "
                        f"{'.'.join(map(str, MIN_PYTHON))} or later",
                    )
                )
            if m.group("default") not in allowed:
                problems.append(Problem("python", _rel(path, infra), "pythonVersion's default is not allowed"))
    return problems


def _parameter_values(infra: Path) -> dict[str, Any]:
    try:
        given = json.loads((infra / "main.parameters.json").read_text(encoding="utf-8"))["parameters"]
    except (OSError, ValueError, KeyError):
        return {}
    return {k: v.get("value") for k, v in given.items() if isinstance(v, dict)}


def check_config(infra: Path, config_path: Path) -> list[Problem]:
    """The parameters serve every poller in one dbfanout.toml."""
    where = str(config_path)
    try:
        cfg = tomllib.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        return [Problem("config", where, f"cannot read config: {exc}")]
    main_text = (infra / "main.bicep").read_text(encoding="utf-8")
    values = _parameter_values(infra)
    app = cfg.get("app", {})
    pollers: dict[str, dict[str, Any]] = cfg.get("pollers", {})
    default_window = values.get("duplicateDetectionHistoryTimeWindow") or _param_default(
        main_text, "duplicateDetectionHistoryTimeWindow"
    )
    provided = {s.get("name") for s in values.get("databaseUrlSettings") or [] if isinstance(s, dict)}
    provided |= set((values.get("additionalAppSettings") or {}).keys())
    provided |= set(REQUIRED_APP_SETTINGS)
    problems: list[Problem] = []

    state_container = values.get("stateContainerName") or _param_default(main_text, "stateContainerName")
    if app.get("state_container", "db-state") != state_container:
        problems.append(
            Problem(
                "state-container",
                where,
                f"[app] state_container = "
                f"{app.get('state_container', 'db-state')!r} but the template creates {state_container!r}",
            )
        )
    for key, prefix in (("state_connection", STATE_CONNECTION), ("servicebus_connection", SERVICEBUS_CONNECTION)):
        if app.get(key, prefix) != prefix:
            problems.append(
                Problem(
                    "connections",
                    where,
                    f"[app] {key} = {app.get(key)!r}; the template sets {prefix}__* settings: use {prefix!r}",
                )
            )

    for name, poller in pollers.items():
        key = f"pollers.{name}"
        problems += _check_entity(where, key, poller, values, default_window)
        for field, value in poller.items():
            for ref in _REF.findall(value) if isinstance(value, str) else ():
                if ref not in provided:
                    problems.append(
                        Problem(
                            "db-urls",
                            where,
                            f"{key}.{field} references ${{{ref}}} but no app "
                            f"setting {ref} is provided: add {{name: '{ref}', secretName: ...}} "
                            "to databaseUrlSettings",
                        )
                    )
    return problems


def _check_alerts(where: str, pollers: dict[str, Any], values: dict[str, Any], main_text: str) -> list[Problem]:
    """Every configured poller gets its alerts: an entry in the ``pollers`` parameter whose kind and
    schedule interval are the config's (a pg_logical poller gets its retained-WAL alert, the stall
    alert counts the right intervals), and main.bicep deploys modules/alerts.bicep with them."""
    problems: list[Problem] = []
    if "'./modules/alerts.bicep'" not in main_text or not re.search(r"^\s*pollers:\s*pollers\s*$", main_text, re.M):
        problems.append(Problem("alerts", "main.bicep", "modules/alerts.bicep is not deployed with pollers: pollers"))
    entries = {e.get("name"): e for e in values.get("pollers") or [] if isinstance(e, dict)}
    for name, poller in pollers.items():
        entry = entries.get(name)
        if entry is None:
            problems.append(
                Problem(
                    "alerts",
                    where,
                    f"pollers.{name} has no entry in the pollers parameter of main.parameters.json, so it gets no "
                    f"stall, lag or WAL alert: add {{name: '{name}', scheduleSeconds: ..., kind: "
                    f"'{poller.get('kind', 'keyset')}'}}",
                )
            )
            continue
        kind = poller.get("kind", "keyset")
        if entry.get("kind", "keyset") != kind:
            problems.append(
                Problem(
                    "alerts",
                    where,
                    f"pollers.{name} is kind {kind!r} but its pollers entry says {entry.get('kind')!r}"
                    + (
                        " (a pg_logical poller needs its retained-WAL alert)"
                        if "pg_logical" in (kind, entry.get("kind"))
                        else ""
                    ),
                )
            )
        schedule = str(poller.get("schedule", "*/5 * * * * *"))
        given = entry.get("scheduleSeconds")
        if not isinstance(given, int | float) or given <= 0:
            problems.append(Problem("alerts", where, f"the pollers entry of {name} needs scheduleSeconds > 0"))
        elif not schedule.startswith("%"):
            interval = ncrontab_max_interval_seconds(schedule)
            if abs(float(given) - interval) > 0.5:
                problems.append(
                    Problem(
                        "alerts",
                        where,
                        f"pollers.{name}.schedule = {schedule!r} fires every {interval:g} s at most, but its "
                        f"pollers entry says scheduleSeconds = {given}: the stall alert would count wrong intervals",
                    )
                )
    return problems


def _check_entity(
    where: str, key: str, poller: dict[str, Any], values: dict[str, Any], default_window: str | None
) -> list[Problem]:
    """The poller's queue (Service Bus or storage) or topic is in the parameters, as configured."""
    queues = {q.get("name"): q for q in values.get("queues") or [] if isinstance(q, dict)}
    topics = {t.get("name"): t for t in values.get("topics") or [] if isinstance(t, dict)}
    problems: list[Problem] = []
    transport = poller.get("transport", "servicebus")
    if transport == "storage-queue":
        problems += _check_storage_queue(where, key, poller, values)
    elif "topic" in poller:
        topic = topics.get(poller.get("topic"))
        if topic is None:
            problems.append(
                Problem(
                    "topics",
                    where,
                    f"{key}.topic = {poller.get('topic')!r} has no entry in "
                    "the topics parameter of main.parameters.json",
                )
            )
        else:
            problems += _check_topic(where, key, poller, topic, default_window)
    else:
        queue = queues.get(poller.get("queue"))
        if queue is None:
            problems.append(
                Problem(
                    "queues",
                    where,
                    f"{key}.queue = {poller.get('queue')!r} has no entry in "
                    "the queues parameter of main.parameters.json",
                )
            )
        else:
            problems += _check_queue(where, key, poller, queue, default_window)
    return problems


def _check_storage_queue(where: str, key: str, poller: dict[str, Any], values: dict[str, Any]) -> list[Problem]:
    problems: list[Problem] = []
    if values.get("useStorageQueues") is not True:
        problems.append(
            Problem(
                "storage-queues",
                where,
                f"{key} uses transport = 'storage-queue': set useStorageQueues = true in main.parameters.json",
            )
        )
    if poller.get("queue") not in (values.get("storageQueueNames") or []):
        problems.append(
            Problem(
                "storage-queues",
                where,
                f"{key}.queue = {poller.get('queue')!r} is not in the storageQueueNames parameter "
                "of main.parameters.json (the template creates it and its -poison queue)",
            )
        )
    return problems


def _check_queue(
    where: str, key: str, poller: dict[str, Any], queue: dict[str, Any], default_window: str | None
) -> list[Problem]:
    problems: list[Problem] = []
    if queue.get("requiresDuplicateDetection") is False:
        problems.append(Problem("queues", where, f"queue {queue['name']!r} turns duplicate detection off"))
    if bool(queue.get("requiresSession", False)) != bool(poller.get("sessions", False)):
        problems.append(
            Problem(
                "sessions",
                where,
                f"{key}.sessions = {bool(poller.get('sessions', False))} but "
                f"queue {queue['name']!r} has requiresSession = {queue.get('requiresSession', False)}",
            )
        )
    return problems + _check_window(where, key, poller, f"queue {queue['name']!r}", queue, default_window)


def _check_window(
    where: str, key: str, poller: dict[str, Any], entity: str, entry: dict[str, Any], default_window: str | None
) -> list[Problem]:
    """The queue's or topic's duplicate detection window covers the poller's redelivery horizon."""
    window_text = entry.get("duplicateDetectionHistoryTimeWindow") or default_window or ""
    window = iso_duration_seconds(window_text)
    try:
        need = WINDOW_MARGIN * redelivery_horizon_seconds(poller)
    except ValueError as exc:
        return [Problem("dup-window", where, f"{key}.schedule: {exc}")]
    if window is None:
        return [
            Problem(
                "dup-window",
                where,
                f"{entity}: duplicate detection window {window_text!r} is not an ISO 8601 duration",
            )
        ]
    if window < need:
        return [
            Problem(
                "dup-window",
                where,
                f"{entity}: duplicate detection window "
                f"{window_text} ({window:.0f} s) < {WINDOW_MARGIN:g} x (lease_ttl + schedule "
                f"interval + tick budget) = {need:.0f} s for {key}; raise "
                "duplicateDetectionHistoryTimeWindow",
            )
        ]
    return []


DEFAULT_MAX_DELIVERY_COUNT = 10  # Service Bus's default, and the templates' (servicebus*.bicep)


def _check_topic(
    where: str, key: str, poller: dict[str, Any], topic: dict[str, Any], default_window: str | None
) -> list[Problem]:
    """A topic poller's topic: duplicate detection and window, and each subscription as configured."""
    name = topic["name"]
    problems: list[Problem] = []
    if topic.get("requiresDuplicateDetection") is False:
        problems.append(Problem("topics", where, f"topic {name!r} turns duplicate detection off"))
    problems += _check_window(where, key, poller, f"topic {name!r}", topic, default_window)
    infra_subs = {s.get("name"): s for s in topic.get("subscriptions") or [] if isinstance(s, dict)}
    configured: dict[str, Any] = poller.get("subscriptions") or {}
    sessions = bool(poller.get("sessions", False))
    for sub_name, sub in configured.items():
        sub = sub if isinstance(sub, dict) else {}
        sub_key = f"{key}.subscriptions.{sub_name}"
        entry = infra_subs.get(sub_name)
        if entry is None:
            problems.append(
                Problem(
                    "subscriptions",
                    where,
                    f"{sub_key} has no entry in the subscriptions of topic {name!r} in "
                    f'main.parameters.json: add {{"name": "{sub_name}"}} (nothing would deliver to its handler)',
                )
            )
            continue
        want = sub.get("max_delivery_count") or poller.get("max_delivery_count") or DEFAULT_MAX_DELIVERY_COUNT
        have = entry.get("maxDeliveryCount", DEFAULT_MAX_DELIVERY_COUNT)
        if want != have:
            problems.append(
                Problem(
                    "max-delivery",
                    where,
                    f"{sub_key}: the config allows {want} deliveries but subscription {sub_name!r} of topic "
                    f"{name!r} has maxDeliveryCount = {have}; the worker splits a failing batch before "
                    "its last delivery, so the two must agree (set one to the other)",
                )
            )
        if bool(entry.get("requiresSession", False)) != sessions:
            problems.append(
                Problem(
                    "sessions",
                    where,
                    f"{key}.sessions = {sessions} but subscription {sub_name!r} of topic {name!r} has "
                    f"requiresSession = {entry.get('requiresSession', False)} (every subscription of a "
                    "session poller requires sessions)",
                )
            )
        if (sub.get("filter") or "") != (entry.get("filter") or ""):
            problems.append(
                Problem(
                    "filters",
                    where,
                    f"{sub_key}.filter = {sub.get('filter')!r} but subscription {sub_name!r} of topic "
                    f"{name!r} has filter = {entry.get('filter')!r}: its $Default rule is built from "
                    "that filter, so copy the config's filter exactly",
                )
            )
    for extra in sorted(n for n in infra_subs if n not in configured):
        problems.append(
            Problem(
                "subscriptions",
                where,
                f"subscription {extra!r} of topic {name!r} in main.parameters.json has no "
                f"[{key}.subscriptions.{extra}]: it gets a copy of every message and no dbfanout handler "
                "consumes it (fine for a consumer outside dbfanout; otherwise remove it)",
                severity="warning",
            )
        )
    return problems


def check_roles(infra: Path) -> list[Problem]:
    problems: list[Problem] = []
    known = {guid: name for name, guid in DOCUMENTED_ROLES.items()}
    for path in _bicep_files(infra):
        text = path.read_text(encoding="utf-8")
        where = _rel(path, infra)
        for guid in {g.lower() for g in _GUID.findall(text)}:
            if guid in FORBIDDEN_ROLES:
                problems.append(Problem("roles", where, f"grants {FORBIDDEN_ROLES[guid]} ({guid})"))
            elif guid not in known:
                problems.append(Problem("roles", where, f"{guid} is not a documented built-in role dbfanout uses"))
        for m in _ROLE_ENTRY.finditer(text):
            key, guid = m.group("key"), m.group("guid").lower()
            if key in DOCUMENTED_ROLES and DOCUMENTED_ROLES[key] != guid:
                problems.append(Problem("roles", where, f"{key} = {guid}, documented id is {DOCUMENTED_ROLES[key]}"))
            if guid in known and not re.search(rf"roleDefinitions'\s*,\s*\w+\.{key}\)", text):
                problems.append(Problem("roles", where, f"role {key} is declared but never assigned"))
        problems += _role_scope_problems(text, where)
    return problems


# Service Bus data roles, and the resource types they may be assigned on: one entity, never the
# namespace (every queue and topic) or, with no `scope:`, the whole resource group.
SERVICEBUS_DATA_ROLES = {"serviceBusDataSender", "serviceBusDataReceiver"}
SERVICEBUS_ENTITY_TYPES = {
    "Microsoft.ServiceBus/namespaces/queues",
    "Microsoft.ServiceBus/namespaces/topics",
    "Microsoft.ServiceBus/namespaces/topics/subscriptions",
}
_RESOURCE = re.compile(r"^resource\s+(?P<name>\w+)\s+'(?P<type>[^'@]+)@", re.MULTILINE)
_ASSIGNMENT = re.compile(
    r"^resource\s+(?P<name>\w+)\s+'Microsoft\.Authorization/roleAssignments@[^']*'[^\n]*\n(?P<body>.*?)^\}",
    re.MULTILINE | re.DOTALL,
)
_SCOPE = re.compile(r"^\s*scope:\s*(?P<symbol>\w+)", re.MULTILINE)


def _role_scope_problems(text: str, where: str) -> list[Problem]:
    """Each Service Bus data role assignment in one template is scoped to a queue, topic or subscription."""
    types = {m.group("name"): m.group("type") for m in _RESOURCE.finditer(text)}
    guid_keys = {m.group("guid").lower(): m.group("key") for m in _ROLE_ENTRY.finditer(text)}
    guid_keys |= {guid: key for key, guid in DOCUMENTED_ROLES.items()}
    problems: list[Problem] = []
    for m in _ASSIGNMENT.finditer(text):
        body = m.group("body")
        role = re.search(r"roleDefinitionId:[^\n]*", body)
        line = role.group(0) if role else ""
        keys = {k for k in re.findall(r"\.(\w+)\)", line) if k in DOCUMENTED_ROLES}
        keys |= {guid_keys[g.lower()] for g in _GUID.findall(line) if g.lower() in guid_keys}
        if not keys & SERVICEBUS_DATA_ROLES:
            continue
        scope = _SCOPE.search(body)
        if scope is None:
            problems.append(
                Problem(
                    "role-scope",
                    where,
                    f"{m.group('name')} assigns a Service Bus data role with no scope (the whole resource "
                    "group): scope it to one queue, topic or subscription",
                )
            )
        elif types.get(scope.group("symbol")) not in SERVICEBUS_ENTITY_TYPES:
            problems.append(
                Problem(
                    "role-scope",
                    where,
                    f"{m.group('name')} assigns a Service Bus data role on {scope.group('symbol')} "
                    f"({types.get(scope.group('symbol'), 'not a resource of this file')}): scope it to one "
                    "queue, topic or subscription, never the namespace",
                )
            )
    return problems


def check_topics_parameter(infra: Path) -> list[Problem]:
    """The topics parameter has the shape the templates read, and no name is a queue and a topic."""
    where = _rel(infra / "main.parameters.json", infra)
    values = _parameter_values(infra)
    topics = values.get("topics") or []
    queues = {q.get("name") for q in values.get("queues") or [] if isinstance(q, dict)}
    problems: list[Problem] = []
    if not isinstance(topics, list):
        return [Problem("topics", where, "topics must be a list of {name, subscriptions: [...]}")]
    seen: set[str] = set()
    for n, topic in enumerate(topics):
        name = topic.get("name") if isinstance(topic, dict) else None
        if not isinstance(name, str) or not name:
            problems.append(Problem("topics", where, f"topics[{n}] has no name"))
            continue
        if name in seen:
            problems.append(Problem("topics", where, f"topic {name!r} is listed twice"))
        seen.add(name)
        if name in queues:
            problems.append(
                Problem("topics", where, f"{name!r} is both a queue and a topic: they share the namespace's names")
            )
        subs = topic.get("subscriptions")
        if not isinstance(subs, list) or not subs:
            problems.append(
                Problem("topics", where, f"topic {name!r} needs subscriptions: [{{name: ...}}, ...], one per handler")
            )
            continue
        names = [s.get("name") if isinstance(s, dict) else None for s in subs]
        if not all(isinstance(s, str) and s for s in names):
            problems.append(Problem("topics", where, f"every subscription of topic {name!r} needs a name"))
        for dup in sorted({s for s in names if isinstance(s, str) and names.count(s) > 1}):
            problems.append(Problem("topics", where, f"topic {name!r} lists subscription {dup!r} twice"))
    return problems


def check_outputs(infra: Path) -> list[Problem]:
    problems: list[Problem] = []
    for path in _bicep_files(infra):
        text = path.read_text(encoding="utf-8")
        secure = {m.group("name") for m in _SECURE_PARAM.finditer(text)}
        for m in _OUTPUT.finditer(text):
            used = {w for w in re.findall(r"\b\w+\b", m.group("expr")) if w in secure}
            if used:
                problems.append(
                    Problem(
                        "outputs",
                        _rel(path, infra),
                        f"output {m.group('name')} reads the @secure() parameter {', '.join(sorted(used))}",
                    )
                )
    return problems


def check_alerts(infra: Path, config_path: Path) -> list[Problem]:
    """Every poller of one dbfanout.toml gets its alerts (modules/alerts.bicep, the pollers parameter)."""
    try:
        cfg = tomllib.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        return [Problem("config", str(config_path), f"cannot read config: {exc}")]
    main_text = (infra / "main.bicep").read_text(encoding="utf-8")
    return _check_alerts(str(config_path), cfg.get("pollers", {}), _parameter_values(infra), main_text)


def _named_by(configs: Iterable[Path]) -> dict[str, set[str]] | None:
    """What the configs name, per parameter: queues, topics, pollers,
    settings referenced as ``${NAME}``, storage queues. None when a config cannot be read."""
    named: dict[str, set[str]] = {k: set() for k in ("queues", "topics", "pollers", "settings", "storage")}
    for path in configs:
        try:
            cfg = tomllib.loads(path.read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError):
            return None  # check_config names it
        for name, poller in cfg.get("pollers", {}).items():
            named["pollers"].add(name)
            if "topic" in poller:
                named["topics"].add(str(poller["topic"]))
            elif poller.get("transport") == "storage-queue":
                named["storage"].add(str(poller.get("queue")))
            else:
                named["queues"].add(str(poller.get("queue")))
            named["settings"] |= {r for v in poller.values() if isinstance(v, str) for r in _REF.findall(v)}
    return named


def check_unused(infra: Path, configs: Iterable[Path]) -> list[Problem]:
    """Every queue, topic, alert entry, database URL setting and storage queue in the
    parameters is one a config names: an entry no poller uses still deploys (a sample left in, a
    poller renamed). ``python infra/params.py`` writes the file from the config."""
    named = _named_by(configs)
    if named is None:
        return []
    values = _parameter_values(infra)
    where = _rel(infra / "main.parameters.json", infra)
    found = [("queue", q["name"], "queues") for q in _entries(values, "queues")]
    for topic in _entries(values, "topics"):
        found.append(("topic", topic["name"], "topics"))  # its extra subscriptions: check_config's warning
    found += [("pollers entry", p["name"], "pollers") for p in _entries(values, "pollers")]
    found += [("databaseUrlSettings entry", d["name"], "settings") for d in _entries(values, "databaseUrlSettings")]
    found += [("storage queue", str(q), "storage") for q in values.get("storageQueueNames") or []]
    return [
        Problem(
            "unused",
            where,
            f"{what} {name!r} is not named by {', '.join(str(c) for c in configs)}, and deploys anyway: "
            "regenerate the file from the config with `python infra/params.py` (or remove the entry)",
        )
        for what, name, kind in found
        if name not in named[kind]
    ]


def _entries(values: dict[str, Any], key: str) -> list[dict[str, Any]]:
    return [e for e in values.get(key) or [] if isinstance(e, dict) and isinstance(e.get("name"), str)]


def check_all(infra: Path, configs: Iterable[Path] = ()) -> list[Problem]:
    configs = list(configs)
    problems = check_app_settings(infra) + check_parameters(infra) + check_roles(infra) + check_outputs(infra)
    problems += check_python_version(infra) + check_topics_parameter(infra)
    for config in configs:
        problems += check_config(infra, config) + check_alerts(infra, config)
    if configs:
        problems += check_unused(infra, configs)
    return problems


def default_configs(repo: Path) -> list[Path]:
    """The app's dbfanout.toml; the repository's sample when there is none yet."""
    for name in ("dbfanout.toml", "dbfanout.toml.sample"):
        if (repo / name).is_file():
            return [repo / name]
    return []


def main(argv: list[str] | None = None) -> int:
    """``python infra/consistency.py [DIR] [--config F ...]``: these checks alone, with any Python 3.11+
    (no checkov, no tree-sitter). Exit 0 clean (warnings allowed), 1 problems found."""
    import argparse

    here = Path(__file__).resolve().parent
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("infra", nargs="?", type=Path, default=here, help="infra directory (default: this script's)")
    ap.add_argument("--config", action="append", type=Path, default=None, help="dbfanout.toml (repeatable)")
    args = ap.parse_args(argv)
    configs = args.config if args.config is not None else default_configs(here.parent)
    problems = check_all(args.infra.resolve(), configs)
    for problem in problems:
        print(problem)
    errors = [p for p in problems if p.severity != "warning"]
    print(f"{args.infra}: {'FAILED, ' + str(len(errors)) + ' problem(s)' if errors else 'OK'} (consistency, "
          f"config: {', '.join(map(str, configs)) or 'none'})")  # fmt: skip
    return 1 if errors else 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
