"""The ``[app]`` section and the whole config: the pollers by name, by queue, by topic, and the
app's connections (one lookup for all of them: :meth:`Config.connection`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, overload

from shared.config.poller import PollerConfig, Transport
from shared.errors import ConfigError
from shared.settings import ServiceBusConnection, StorageConnection, servicebus_connection, storage_connection

__all__ = ["AppConfig", "Config", "ConnectionRole"]

#: The app's connections: the state container's account, the storage-queue transport's account
#: (the state account unless ``queue_connection`` is set) and the Service Bus namespace.
ConnectionRole = Literal["state", "queue", "servicebus"]


@dataclass(frozen=True, slots=True)
class AppConfig:
    name: str
    state_container: str = "db-state"
    state_connection: str = "DBFANOUT_STATE"
    servicebus_connection: str = "DBFANOUT_SERVICEBUS"
    # storage-queue transport: the setting (or prefix) of its storage account; default: state_connection
    queue_connection: str | None = None

    @property
    def storage_queue_connection(self) -> str:
        return self.queue_connection or self.state_connection

    def connection_setting(self, role: ConnectionRole) -> str:
        """The app setting (or identity-settings prefix) that holds the connection of ``role``."""
        if role == "state":
            return self.state_connection
        return self.storage_queue_connection if role == "queue" else self.servicebus_connection


@dataclass(frozen=True, slots=True)
class Config:
    app: AppConfig
    pollers: Mapping[str, PollerConfig]
    path: Path | None = None
    settings: Mapping[str, str] = field(default_factory=dict, repr=False)

    def poller(self, name: str) -> PollerConfig:
        try:
            return self.pollers[name]
        except KeyError:
            known = ", ".join(sorted(self.pollers)) or "none"
            raise ConfigError(f"pollers.{name}", f"no such poller (configured: {known})") from None

    def queues(self) -> dict[str, list[PollerConfig]]:
        """Pollers grouped by queue name (topic pollers are not listed: see :meth:`topics`)."""
        grouped: dict[str, list[PollerConfig]] = {}
        for p in self.pollers.values():
            if not p.is_topic:
                grouped.setdefault(p.queue, []).append(p)
        return grouped

    def topics(self) -> dict[str, PollerConfig]:
        """Topic name → the one poller that sends to it."""
        return {p.queue: p for p in self.pollers.values() if p.is_topic}

    def queue_transport(self, queue: str) -> Transport:
        """The transport of a queue; pollers sharing a queue must agree on it (a :class:`ConfigError`)."""
        pollers = self.queues()[queue]
        transports = {p.transport for p in pollers}
        if len(transports) > 1:
            names = ", ".join(sorted(p.name for p in pollers))
            raise ConfigError(
                f"pollers.{pollers[0].name}.transport", f"pollers {names} share queue {queue} but not its transport"
            )
        return transports.pop()

    @overload
    def connection(self, role: Literal["state", "queue"]) -> StorageConnection: ...
    @overload
    def connection(self, role: Literal["servicebus"]) -> ServiceBusConnection: ...
    def connection(self, role: ConnectionRole) -> StorageConnection | ServiceBusConnection:
        """How to reach the app's storage account (``state``, ``queue``) or namespace (``servicebus``),
        from the app settings :meth:`AppConfig.connection_setting` names (a :class:`ConfigError` if unset)."""
        name = self.app.connection_setting(role)
        if role == "servicebus":
            return servicebus_connection(self.settings, name)
        return storage_connection(self.settings, name)

    def connection_string(self, role: ConnectionRole) -> str:
        """The connection string of ``role`` as set ("" when unset or an identity-based connection)."""
        return self.settings.get(self.app.connection_setting(role)) or ""
