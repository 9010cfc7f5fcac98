"""The local services ``dbfanout run`` starts for an app whose settings point at none.

A storage setting (``AzureWebJobsStorage``, ``app.state_connection``, a storage-queue poller's
``app.queue_connection``) that is unset or ``UseDevelopmentStorage=true`` with nothing on
Azurite's default port gets an Azurite of its own on free ports; the Service Bus setting
(``app.servicebus_connection``) unset, or an emulator connection string whose endpoint does not
answer, gets the project's emulator in this process with the app's queues, topics and
subscriptions (as ``dbfanout emulator servicebus --app-config`` declares them). Anything else
is a real service and is used as it is: an account, a namespace, a managed-identity setting
(``NAME__...``), or an emulator that is already listening.
"""

from __future__ import annotations

import contextlib
import http.client
import re
import shutil
import socket
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from shared.config import Config

__all__ = ["DevServices", "local_settings_needing_services", "start_dev_services"]

DEV_STORAGE = "UseDevelopmentStorage=true"
AZURITE_DEFAULT_BLOB_PORT = 10000  # what UseDevelopmentStorage=true means
_SB_ENDPOINT = re.compile(r"Endpoint=sb://([^:;/]+):?(\d*)", re.IGNORECASE)
_EMULATOR_MARK = "usedevelopmentemulator=true"
_AMQP_SASL_HEADER = b"AMQP\x03\x01\x00\x00"


@dataclass
class DevServices:
    """What was started: the settings that now point at it, and how to stop it."""

    settings: dict[str, str] = field(default_factory=dict)
    started: list[str] = field(default_factory=list)  # one line per service, for the console
    _stops: list[Callable[[], None]] = field(default_factory=list)

    def close(self) -> None:
        """Stop what was started, last first (idempotent)."""
        while self._stops:
            with contextlib.suppress(Exception):  # best effort: the app already stopped
                self._stops.pop()()


def _speaks_amqp(host: str, port: int) -> bool:
    """An AMQP 1.0 server answers our SASL protocol header with its own (a port that merely accepts
    connections may be anything: another broker, another developer's service)."""
    try:
        with socket.create_connection((host, port), timeout=1.0) as s:
            s.sendall(_AMQP_SASL_HEADER)
            return s.recv(8) == _AMQP_SASL_HEADER
    except OSError:
        return False


def _is_azurite(port: int) -> bool:
    """Azurite names itself in the Server header of any blob response."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1.0)
    try:
        conn.request("GET", "/devstoreaccount1?comp=list")
        return conn.getresponse().getheader("Server", "").startswith("Azurite")
    except OSError:
        return False
    finally:
        conn.close()


def _unset(settings: Mapping[str, str], name: str) -> bool:
    """Neither ``name`` nor an identity-based ``name__...`` setting is given."""
    return not settings.get(name) and not any(k.startswith(f"{name}__") for k in settings)


def _storage_is_local(settings: Mapping[str, str], name: str) -> bool:
    if _unset(settings, name):
        return True
    value = settings.get(name, "")
    return value.strip().lower() == DEV_STORAGE.lower() and not _is_azurite(AZURITE_DEFAULT_BLOB_PORT)


def _servicebus_is_local(settings: Mapping[str, str], name: str) -> bool:
    if _unset(settings, name):
        return True
    value = settings.get(name, "")
    if _EMULATOR_MARK not in value.replace(" ", "").lower():
        return False  # a real namespace
    match = _SB_ENDPOINT.search(value)
    if match is None:
        return True
    return not _speaks_amqp(match.group(1), int(match.group(2) or 5672))


def local_settings_needing_services(config: Config, settings: Mapping[str, str]) -> tuple[list[str], list[str]]:
    """The storage settings and the Service Bus settings that point at no running service."""
    storage = {"AzureWebJobsStorage", config.app.state_connection}
    pollers = list(config.pollers.values())
    if any(p.transport == "storage-queue" for p in pollers):
        storage.add(config.app.storage_queue_connection)
    servicebus = {config.app.servicebus_connection} if any(p.transport == "servicebus" for p in pollers) else set()
    return (
        sorted(n for n in storage if _storage_is_local(settings, n)),
        sorted(n for n in servicebus if _servicebus_is_local(settings, n)),
    )


def start_dev_services(app_root: Path, config: Config, settings: Mapping[str, str]) -> DevServices:
    """Start Azurite and/or the Service Bus emulator where the settings need them."""
    storage, servicebus = local_settings_needing_services(config, settings)
    services = DevServices()
    try:
        if storage:
            _start_azurite(services, app_root, storage)
        if servicebus:
            _start_servicebus(services, config, servicebus)
    except BaseException:
        services.close()
        raise
    return services


def _start_azurite(services: DevServices, app_root: Path, names: list[str]) -> None:
    from dbfanout.demo.services import ServiceError, azurite_binary, start_azurite

    if not (app_root / "node_modules" / ".bin" / "azurite").exists() and azurite_binary() is None:
        raise ServiceError(
            f"{', '.join(names)} point(s) at no storage and Azurite is not installed: run `make bootstrap` in "
            "the app folder (it installs the Azurite package.json pins), or set them to a storage account"
        )
    workdir = Path(tempfile.mkdtemp(prefix="dbfanout-azurite-"))  # its log; kept out of the app folder
    azurite = start_azurite(workdir, binary=_app_azurite(app_root))
    services._stops.append(lambda: shutil.rmtree(workdir, ignore_errors=True))
    services._stops.append(azurite.stop)
    services.settings.update(dict.fromkeys(names, azurite.connection_string))
    services.started.append(
        f"Azurite on 127.0.0.1:{azurite.blob_port} (blob), :{azurite.queue_port} (queue) for {', '.join(names)}"
    )


def _app_azurite(app_root: Path) -> str | None:
    local = app_root / "node_modules" / ".bin" / "azurite"
    return str(local) if local.exists() else None


def _start_servicebus(services: DevServices, config: Config, names: list[str]) -> None:
    from dbfanout.ops.entities import emulator_config_for
    from sbemulator import Emulator

    entities = emulator_config_for(config)
    emulator = Emulator(entities, port=0, http_port=None).start()
    services._stops.append(emulator.stop)
    services.settings.update(dict.fromkeys(names, emulator.connection_string))
    declared = [q.name for q in entities.queues] + [
        f"{t.name} [{', '.join(s.name for s in t.subscriptions)}]" for t in entities.topics
    ]
    entities_text = ", ".join(declared) or "no entities"
    services.started.append(
        f"Service Bus emulator on 127.0.0.1:{emulator.port} for {', '.join(names)}: {entities_text}"
    )
