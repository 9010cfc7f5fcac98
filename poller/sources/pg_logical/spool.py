"""A read of a replication slot kept on local temporary storage: a huge transaction decoded once.

Why: the slot's confirmed position cannot pass a transaction that is not delivered whole, so every
peek starts before it and the server decodes (and spills) all of it again: a one-transaction
backfill of N rows cost O(N²) server work when read a page-sized peek at a time (issue 33).
Instead, the peek that meets a transaction larger than the source's in-memory cap reads on to
that transaction's Commit, writing the raw ``pgoutput`` messages here as they stream in, and the
pages that follow are decoded from this file until the transaction is delivered and the slot
moved past it. The server decodes the transaction once per spool.

What is kept: the messages of one peek from its first one (the slot's position) through the
Commit of the transaction it stopped in, length-prefixed, in an unnamed temporary file (Linux
``O_TMPFILE``: nothing is left behind by a killed process, so a restart never reads a stale
spool; it peeks again). Seek points every :data:`MARK_EVERY` changes keep a page's read short:
each holds the transaction's Begin and the Relation messages in effect there, which is all the
decoder needs to resume mid-transaction. Memory stays bounded: only the seek points (a few
hundred bytes per :data:`MARK_EVERY` changes) and one page of decoded changes are held.
"""

from __future__ import annotations

import bisect
import os
import struct
import tempfile
from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass

from poller.sources.pg_logical.pgoutput import Change, Decoder, Loader
from shared.models import Lsn

__all__ = ["MARK_EVERY", "Spool"]

#: Changes between seek points (a page's read starts at most this many changes before its first).
MARK_EVERY = 1000
_LEN = struct.Struct(">I")
_U32_AT_1 = struct.Struct(">xI")
_BEGIN = struct.Struct(">xQ")  # Begin: the transaction's commit LSN first
_COMMIT_END = struct.Struct(">xxQQ")  # Commit: flags, commit LSN, end LSN
_BLOCK = 1 << 20  # bytes read from the file at a time
_CHANGES = frozenset(b"IUDT")


@dataclass(frozen=True, slots=True)
class _Mark:
    """Where a change message starts, and what the decoder needs to resume there."""

    key: tuple[int, int]  # the change's (commit LSN, seq)
    offset: int
    begin: bytes
    relations: tuple[bytes, ...]


class Spool:
    """The messages of one peek, through the Commit of the transaction it stopped in.

    Write with :meth:`write` (in log order), then :meth:`finish` at that transaction's Commit;
    read with :meth:`changes`. :meth:`close` discards it. One reader at a time (a poller's fetches
    are serial).
    """

    def __init__(self, directory: str | None = None) -> None:
        self._file = tempfile.TemporaryFile(prefix="dbfanout-spool-", dir=directory)  # noqa: SIM115 (closed by close)
        self._size = 0
        self._marks: list[_Mark] = []
        self._mark_keys: list[tuple[int, int]] = []
        self._relations: dict[int, bytes] = {}
        self._relations_now: tuple[bytes, ...] = ()
        self._begin = b""
        self._txn = 0  # the commit LSN of the transaction being written
        self._seq = 0
        self._since_mark = MARK_EVERY
        self._ends: dict[int, tuple[Lsn, int]] = {}  # commit LSN -> (end LSN, last seq), per transaction
        self.messages = 0
        self.changes_written = 0
        self.last_key: tuple[int, int] | None = None  # the last change's key, once finished
        self.end_lsn: Lsn | None = None  # past the last transaction's Commit, once finished
        # The poller's last change in it, once a read reached its end (the position past it if
        # none): a checkpoint there covers all of it the poller delivers.
        self.ours_until: tuple[int, int] | None = None

    # ------------------------------------------------------------------------------ writing

    def write(self, data: bytes) -> None:
        """Append one message (the ``data`` of a peek's row)."""
        tag = data[0]
        if tag == 0x42:  # 'B'
            self._begin, self._txn, self._seq = data, _BEGIN.unpack_from(data)[0], 0
        elif tag == 0x52:  # 'R': resent before its first change in a peek, and after a schema change
            self._relations[_U32_AT_1.unpack_from(data)[0]] = data
            self._relations_now = tuple(self._relations.values())
        elif tag in _CHANGES:
            if self._since_mark >= MARK_EVERY:
                key = (self._txn, self._seq)
                self._marks.append(_Mark(key, self._size, self._begin, self._relations_now))
                self._mark_keys.append(key)
                self._since_mark = 0
            self._since_mark += 1
            self._seq += 1
            self.changes_written += 1
        elif tag == 0x43:  # 'C'
            end = _COMMIT_END.unpack_from(data)[1]
            self._ends[self._txn] = (Lsn(end), self._seq - 1)
        self._file.write(_LEN.pack(len(data)))
        self._file.write(data)
        self._size += _LEN.size + len(data)
        self.messages += 1

    def write_all(self, messages: Iterable[bytes]) -> None:
        for data in messages:
            self.write(data)

    def finish(self) -> None:
        """The last message written was the Commit of the transaction the peek stopped in."""
        self._file.flush()
        last_seq = self._ends[self._txn][1] if self._txn in self._ends else -1
        self.end_lsn = self._ends[self._txn][0] if self._txn in self._ends else None
        self.last_key = (self._txn, last_seq) if last_seq >= 0 else None

    @property
    def in_transaction(self) -> bool:
        """Whether the last message written is inside a transaction (its Commit not written yet)."""
        return self._txn != 0 and self._txn not in self._ends

    @property
    def size(self) -> int:
        """Bytes on disk."""
        return self._size

    # ------------------------------------------------------------------------------ reading

    def covers(self, after: tuple[int, int] | None) -> bool:
        """Whether the changes after ``after`` start in this spool (its last change not yet passed)."""
        return self.last_key is not None and (after is None or after < self.last_key)

    def delivered_by(self, after: tuple[int, int] | None) -> bool:
        """Whether a fetch after ``after`` has nothing left of the poller's in it (but has not passed it)."""
        done, last = self.ours_until, self.last_key
        return done is not None and last is not None and after is not None and done <= after <= last

    def passed_by(self, checkpoint: tuple[int, int]) -> bool:
        """Whether a landed checkpoint at ``checkpoint`` covers all of it (the slot may go past its end)."""
        done, last = self.ours_until, self.last_key
        return (done is not None and checkpoint >= done) or (last is not None and checkpoint >= last)

    def changes(self, after: tuple[int, int] | None, load: Loader) -> Generator[Change, None, None]:
        """The changes after ``after``, in log order, each with its transaction's end LSN (and the
        last of each marked), decoded as they are read: a caller stops when it has enough."""
        decoder = Decoder(load, skip_through=after)
        offset = 0
        i = bisect.bisect_right(self._mark_keys, after) - 1 if after is not None else -1
        if i >= 0:
            mark = self._marks[i]
            decoder.resume(mark.begin, mark.relations, mark.key[1])
            offset = mark.offset
        ends = self._ends
        for data in self._records(offset):
            for change in decoder.feed(data):  # nothing pending at a Commit: taken below as decoded
                yield change
            if decoder.pending:
                for change in decoder.partial():
                    end_lsn, last = ends[change.commit_lsn]
                    change.end_lsn, change.last_in_txn = end_lsn, change.seq == last
                    yield change

    def _records(self, offset: int) -> Iterator[bytes]:
        fd, size, pending = self._file.fileno(), self._size, b""
        while offset < size:
            block = os.pread(fd, min(_BLOCK, size - offset), offset)
            if not block:
                return
            offset += len(block)
            buf, pos = pending + block if pending else block, 0
            while pos + _LEN.size <= len(buf):
                (n,) = _LEN.unpack_from(buf, pos)
                if pos + _LEN.size + n > len(buf):
                    break
                yield buf[pos + _LEN.size : pos + _LEN.size + n]
                pos += _LEN.size + n
            pending = buf[pos:]

    def close(self) -> None:
        """Discard it (the file's space is freed at once: it has no name)."""
        self._file.close()
