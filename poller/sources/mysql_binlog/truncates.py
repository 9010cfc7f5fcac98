"""TRUNCATE in the binlog: a statement, with no row to deliver, so never silent.

Each TRUNCATE of a polled table the reader meets is logged as a WARNING naming the table, counted
in ``dbfanout.truncates`` (attribute ``table``), and kept in the checkpoint's source notes (the last
:data:`KEEP` of them, ``checkpoint.metadata["source"]["truncates"]``: :attr:`poller.ports.Page.notes`),
which ``dbfanout status`` shows. Targets keep
the truncated rows: reload them with ``dbfanout snapshot`` (docs/operations.md).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

from poller.ports import Page
from poller.sources.mysql_binlog.position import BinlogPosition
from shared.logs import get_logger
from shared.telemetry import metrics

__all__ = ["KEEP", "METADATA_KEY", "TruncateLog", "merged"]

log = get_logger("poller.mysql_binlog")

#: The key of the TRUNCATEs read in the checkpoint's source notes, and how many are kept there.
METADATA_KEY, KEEP = "truncates", 10


class TruncateLog:
    """The TRUNCATEs one poller read: ``{"table", "at" (binlog position), "seen_at"}`` each."""

    def __init__(self, poller: str) -> None:
        self._poller = poller
        self._seen: list[dict[str, Any]] = []

    def note(self, truncated: list[tuple[str, BinlogPosition]]) -> None:
        """Warn about and count each TRUNCATE not seen before (a stream may read one again); empties ``truncated``."""
        for table, at in truncated:
            where = str(at)
            if any(t.get("at") == where for t in self._seen):
                continue
            log.warning(
                "poller %s: TRUNCATE of %s at %s is not delivered (the binlog holds no rows for it): targets keep "
                "the truncated rows; reload them with `dbfanout snapshot` (docs/operations.md)",
                self._poller, table, where,
            )  # fmt: skip
            metrics.truncates.add(1, {"poller": self._poller, "table": table})
            seen = dt.datetime.now(dt.UTC).isoformat()
            self._seen = [*self._seen, {"table": table, "at": where, "seen_at": seen}][-KEEP:]
        truncated.clear()

    def attach(self, page: Page) -> None:
        """Give ``page`` the TRUNCATEs read so far: every checkpoint from it on records them (a pure
        merge by binlog position, so a page read again records nothing twice)."""
        if not self._seen:
            return
        seen = list(self._seen)
        page.notes = lambda notes: merged(notes, seen)


def merged(notes: Mapping[str, Any], seen: list[dict[str, Any]]) -> Mapping[str, Any]:
    """``notes`` with ``seen`` added to its TRUNCATEs (the last :data:`KEEP`, each position once)."""
    found = notes.get(METADATA_KEY)
    kept = [t for t in found if isinstance(t, dict)] if isinstance(found, list) else []
    known = {t.get("at") for t in kept}
    new = [t for t in seen if t.get("at") not in known]
    if not new:
        return notes
    return {**notes, METADATA_KEY: [*kept, *new][-KEEP:]}
