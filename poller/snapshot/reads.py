"""Reading a snapshot's chunks: refusals retried with backoff and smaller chunks, failing
statements tried again then stopped, and the next chunk read ahead on a thread.

The coordinator (:mod:`poller.snapshot.coordinator`) decides which chunk is due; this module reads
it through the database's :class:`~poller.snapshot.contracts.ChunkSource` and keeps, in memory, what
the reads of one snapshot learnt (the chunk size after refusals, the refusals in a row).
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import sqlalchemy as sa

from poller.snapshot.chunks import Chunk, within
from poller.snapshot.contracts import ChunkSource
from poller.snapshot.where import WhereRefused
from shared.logs import get_logger, ids
from shared.models import SnapshotState
from shared.telemetry import metrics

__all__ = ["Ahead", "ChunkReads", "ChunkStopped"]

log = get_logger("poller.snapshot")

_REFUSED_RETRIES = 6  # refused chunk reads retried within one fetch (backoff 5 ms doubling: ~0.3 s in all)
_REFUSED_BACKOFF, _REFUSED_BACKOFF_MAX = 0.005, 0.2
_REFUSALS_WARN = 20  # refused reads in a row that make a WARNING
_MAX_CHUNK_FAILURES = 3  # a failing chunk statement is tried this often, then its snapshot stops


class ChunkStopped(Exception):
    """A snapshot's chunk cannot be read (its condition is refused, its statement kept failing)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(slots=True)
class Ahead:
    """The next chunk, read on a thread while the tick sends the current one's rows.

    Its window opens at ``start`` (where the scan stood when it was launched: every change up to
    there was read before its select began); until it is taken up, the scan keeps what it reads of
    the chunk's table (``seen``) for its drop rule, and its watermark (``ready_at``).
    """

    future: Future[Chunk | None]
    basis: SnapshotState  # the state it was read for (its table, last key, condition, size)
    chunk_id: str
    start: Any
    scanned_to: Any
    seen: list[tuple[Any, str | None, list[tuple[Any, ...]]]] = field(default_factory=list)
    ready_at: dt.datetime | None = None

    def covers(self, position: Any) -> bool:
        return within(self.start, self.scanned_to, position)

    def reads_for(self, state: SnapshotState | None) -> bool:
        """Whether it is the chunk ``state`` wants next (a request or a cancel since: no)."""
        b = self.basis
        return state is not None and state.active and (state.id, state.tables[0], state.last_key, state.where,
                                                       state.chunk_size) == (b.id, b.tables[0], b.last_key, b.where,
                                                                             b.chunk_size)  # fmt: skip


class ChunkReads:
    """The chunk reads of one poller's snapshots (fetches are serial; the read-ahead is one thread)."""

    def __init__(self, poller: str, warn_once: Callable[..., None]) -> None:
        self._name = poller
        self._warn_once = warn_once  # (key, message, *args): a WARNING once per key
        self._limits: dict[str, int] = {}  # rows the next chunk of a snapshot reads (smaller after refusals)
        self._refused_in_a_row: dict[str, int] = {}
        self._thread: ThreadPoolExecutor | None = None  # reads the next chunk ahead (one thread, lazily)

    def read(
        self, chunks: ChunkSource, conn: sa.Connection, state: SnapshotState, start: Any
    ) -> tuple[Chunk | None, SnapshotState]:
        """The next chunk of ``state`` read now, and the snapshot's state it is valid for.

        A refused read (a committed transaction not visible yet: a synchronous standby's wait,
        a busy server) is retried at once with backoff and half the rows, up to
        :data:`_REFUSED_RETRIES` times in this fetch; the refusals are counted in the state
        (``status``), the metric ``dbfanout.snapshot_chunks_refused`` and, after
        :data:`_REFUSALS_WARN` in a row, a WARNING. A statement that fails (a timeout, a
        permission) is tried again on later fetches, :data:`_MAX_CHUNK_FAILURES` times in all,
        then raises :class:`ChunkStopped`; so does a condition outside the grammar, at once.
        None: read it on a later fetch.
        """
        name, refused = self._name, 0
        for attempt in range(_REFUSED_RETRIES):
            basis = replace(state, refused=state.refused + refused, failures=0)
            limit = self._limits.get(state.id, state.chunk_size)
            try:
                chunk = chunks.read(conn, basis, start, limit=limit)
            except WhereRefused as exc:
                raise ChunkStopped(f"where refused: {exc}") from exc
            except sa.exc.DBAPIError as exc:
                if exc.connection_invalidated:  # the source is down: the tick fails, as for the stream
                    raise
                problem = str(exc.orig or exc).splitlines()[0]
                failures = state.failures + 1  # counted in the state: a restart does not reset it
                if failures >= _MAX_CHUNK_FAILURES:
                    raise ChunkStopped(f"{problem} ({failures} tries)") from exc
                log.warning("poller %s: snapshot %s: chunk of %s failed (%s); tried again on the next fetch (%d of %d)",
                            name, state.id, state.tables[0], problem, failures, _MAX_CHUNK_FAILURES,
                            extra=ids(poller=name))  # fmt: skip
                return None, replace(basis, failures=failures)
            if chunk is not None:
                self.grow(state)
                return chunk, basis
            refused += 1
            metrics.snapshot_chunks_refused.add(1, {"poller": name})
            self._limits[state.id] = max(1, limit // 2)
            in_a_row = self._refused_in_a_row[state.id] = self._refused_in_a_row.get(state.id, 0) + 1
            if in_a_row >= _REFUSALS_WARN:
                self._warn_once(f"refused-{state.id}", "snapshot %s: %d chunk reads of %s refused in a row: a "
                                "transaction committed but not visible yet (a synchronous standby, a busy server); "
                                "retrying with backoff and smaller chunks (see `dbfanout status`, metric "
                                "dbfanout.snapshot_chunks_refused)", state.id, in_a_row, state.tables[0])  # fmt: skip
            log.debug("poller %s: snapshot chunk refused (a commit not yet visible)", name)
            time.sleep(min(_REFUSED_BACKOFF * 2**attempt, _REFUSED_BACKOFF_MAX))
        return None, replace(state, refused=state.refused + refused, failures=0)

    def grow(self, state: SnapshotState) -> None:
        """A chunk was read: the next one reads twice as many rows, back to the full size step by step."""
        self._refused_in_a_row.pop(state.id, None)
        if state.id in self._limits:
            self._limits[state.id] = min(self._limits[state.id] * 2, state.chunk_size)

    def submit(self, chunks: ChunkSource, basis: SnapshotState, start: Any, chunk_id: str) -> Future[Chunk | None]:
        """Read the chunk of ``basis`` on the read-ahead thread, its window opening at ``start``."""
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"snapshot-{self._name}")
        return self._thread.submit(chunks.read_ahead, basis, start, chunk_id, self._limits.get(basis.id))

    def close(self) -> None:
        """Stop the read-ahead thread (a read in flight ends first)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.shutdown(wait=True)
