"""App settings: environment first, then ``local.settings.json`` ``Values`` (like ``func start``).

Connections follow the Azure Functions convention: a setting ``NAME`` holding a connection
string, or identity-based settings ``NAME__blobServiceUri`` / ``NAME__fullyQualifiedNamespace``
with optional ``NAME__credential`` and ``NAME__clientId``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from shared.errors import ConfigError
from shared.scrub import scrub

__all__ = [
    "ServiceBusConnection",
    "Settings",
    "StorageConnection",
    "fingerprint_url",
    "load_settings",
    "redact_url",
]

Settings = Mapping[str, str]


def load_settings(app_root: Path | None = None, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Merge ``local.settings.json`` Values (if present) under the environment."""
    merged: dict[str, str] = {}
    root = app_root if app_root is not None else Path.cwd()
    local = root / "local.settings.json"
    if local.is_file():
        try:
            values = json.loads(local.read_text(encoding="utf-8")).get("Values", {})
        except (OSError, ValueError, AttributeError) as exc:
            raise ConfigError(str(local), f"cannot read local settings: {exc}") from exc
        merged.update({str(k): str(v) for k, v in values.items()})
    merged.update(os.environ if environ is None else environ)
    return merged


@dataclass(frozen=True, slots=True)
class StorageConnection:
    """How to reach a storage account: a connection string, or a URI plus an Entra identity."""

    connection_string: str | None = None
    blob_service_uri: str | None = None
    queue_service_uri: str | None = None
    client_id: str | None = None

    def __repr__(self) -> str:  # never print the account key
        where = self.blob_service_uri or "connection-string"
        return f"StorageConnection({where})"


@dataclass(frozen=True, slots=True)
class ServiceBusConnection:
    """How to reach a Service Bus namespace: a connection string, or a namespace plus an identity."""

    connection_string: str | None = None
    fully_qualified_namespace: str | None = None
    client_id: str | None = None

    def __repr__(self) -> str:
        where = self.fully_qualified_namespace or "connection-string"
        return f"ServiceBusConnection({where})"


_DEV_STORAGE = "UseDevelopmentStorage=true"


def storage_connection(settings: Settings, name: str) -> StorageConnection:
    value = settings.get(name)
    if value:
        return StorageConnection(connection_string=value)
    blob = settings.get(f"{name}__blobServiceUri") or settings.get(f"{name}__serviceUri")
    if blob:
        return StorageConnection(
            blob_service_uri=blob,
            queue_service_uri=settings.get(f"{name}__queueServiceUri"),
            client_id=settings.get(f"{name}__clientId"),
        )
    raise ConfigError(
        name,
        "no storage connection: the app setting is not set",
        hint=f"set {name} to a connection string ({_DEV_STORAGE} for Azurite), or "
        f"{name}__blobServiceUri (+ {name}__credential=managedidentity, {name}__clientId) for an identity",
    )


def servicebus_connection(settings: Settings, name: str) -> ServiceBusConnection:
    value = settings.get(name)
    if value:
        return ServiceBusConnection(connection_string=value)
    fqns = settings.get(f"{name}__fullyQualifiedNamespace")
    if fqns:
        return ServiceBusConnection(fully_qualified_namespace=fqns, client_id=settings.get(f"{name}__clientId"))
    raise ConfigError(
        name,
        "no Service Bus connection: the app setting is not set",
        hint=f"set {name} to a connection string (the emulator's, locally), or "
        f"{name}__fullyQualifiedNamespace (+ {name}__credential=managedidentity, {name}__clientId)",
    )


def redact_url(url: str) -> str:
    """A database URL (or any text) safe to log: its secrets masked by :func:`shared.scrub.scrub`,
    the one pattern set every log line, error text and failure record goes through."""
    return scrub(url)


# Frozen: what a source fingerprint hashes. Changing it would change every existing fingerprint,
# and a changed fingerprint stops a poller until an operator accepts it; it is not a scrubber (the
# fingerprint is a hash and never shown): what is shown goes through redact_url.
# The password as SQLAlchemy's URL parser reads it (``[^@]*``: quotes, spaces and '/' included);
# wherever the form before issue 39 (``[^@/]*``) matched, this gives the same text.
_FP_URL_PASSWORD = re.compile(r"(?P<head>://[^/:@]*:)(?P<pw>[^@]*)(?P<tail>@)")
_FP_SECRET_PARAM = re.compile(r"(?i)((?:password|pwd|secret|token|key|sig)=)[^&;]*")


def fingerprint_url(url: str) -> str:
    """The form of a database URL that source fingerprints hash (stable across versions)."""
    url = _FP_URL_PASSWORD.sub(r"\g<head>***\g<tail>", url)
    return _FP_SECRET_PARAM.sub(r"\1***", url)
