"""Opening what the operator commands talk to, from the config: state stores and sources."""

from __future__ import annotations

import re

from poller.sources.factory import open_source
from poller.state.blob import BlobStateStore, open_state_store
from shared.config import Config
from shared.errors import ConfigError
from shared.models import Position
from shared.settings import storage_connection

__all__ = ["open_store", "template_position"]

_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,62}$")


def open_store(config: Config, poller: str, *, check_name: bool = False) -> BlobStateStore:
    """The poller's state blob store (the container must exist: the CLI never creates it)."""
    if check_name and not _NAME.match(poller):
        raise ConfigError("poller name", f"{poller!r} is not a valid poller name (letters, digits, '-', '_')")
    conn = storage_connection(config.settings, config.app.state_connection)
    return open_state_store(conn, config.app.state_container, config.app.name, poller, ensure_container=False)


def template_position(config: Config, poller: str) -> Position | None:
    """A position with the types the poller stores: the source's first row, else the checkpoint."""
    cfg = config.poller(poller)
    source = open_source(cfg)
    try:
        page = source.fetch(None, 1)
    finally:
        source.close()
    if page.rows:
        return page.rows[0].position
    snap = open_store(config, poller).load()
    return snap.doc.checkpoint.position if snap else None
