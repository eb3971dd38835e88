"""Transactions the walsender streams before their COMMIT, held on disk until it comes.

Why: with pgoutput protocol 2 and ``streaming`` (PostgreSQL 14 and later), a transaction that
outgrows the walsender's ``logical_decoding_work_mem`` is sent while it is being written, in
blocks, instead of after its COMMIT from the walsender's spill files. Received as it is
decoded, a big transaction is mostly in hand when it commits: only its last block and the
range's apply are left (``benchmarks/big_transaction.py``). A peek cannot do this: it returns
nothing of a transaction before its COMMIT is decoded.

What must hold:

- A streamed transaction enters the range holding its COMMIT, whole and in commit order: its
  changes are handed to the range's decoder only at its Stream Commit
  (:meth:`~..decode.range_decoder.RangeDecoder.feed_streamed`). A range cut while one is open
  reports it as a straddler; the slot may be confirmed at such a cut, since the transaction's
  COMMIT lies after it.
- Nothing here outlives its stream session. A new session (after a crash, a stop, or a peek in
  between) is sent again, from its start, every transaction whose COMMIT is after the slot's
  confirmed position, streamed ones included: the spool is emptied when a session starts and
  when it ends, and what a killed process left is never read.
- A subtransaction's abort drops its changes and every change after its first: while a
  subtransaction is open, every change of the transaction is its own or its children's, as
  PostgreSQL's own apply assumes (it truncates its spool file the same way).
- Memory: a block is written as it comes, a chunk (at most the stream's feed size) at a time;
  a commit reads it back a chunk at a time.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from pathlib import Path

import numpy as np

from ..decode.pgoutput_batch import MessageBatch, without_stream_xids
from ..decode.range_decoder import Straddler
from ..failpoints import failpoint

_first, _second = itemgetter(0), itemgetter(1)
_PAD = bytes(16)  # MessageBatch's readers may look a few bytes past a message's end


@dataclass
class _Chunk:
    first: int
    """The index, in its transaction, of the chunk's first message."""
    count: int
    path: Path


@dataclass
class _Spooled:
    first_lsn: int
    chunks: list[_Chunk] = field(default_factory=list)
    count: int = 0
    subxacts: dict[int, int] = field(default_factory=dict)
    """Each (sub)transaction's xid: the index of its first message."""
    bytes: int = 0


def discard_left(folder: Path) -> None:
    """Remove what a stream session left in ``folder`` (a process killed while it held a
    transaction): every reader of the slot calls this first, a peek as well as a new stream,
    since no reader ever reads it (see the module's docstring). One ``stat`` when none."""
    if folder.exists():
        shutil.rmtree(folder, ignore_errors=True)


class StreamedTransactions:
    """The transactions of one stream session received ahead of their COMMIT, by xid."""

    def __init__(self, folder: Path) -> None:
        discard_left(folder)
        folder.mkdir(parents=True)
        self.folder = folder
        self._open: dict[int, _Spooled] = {}
        self._files = 0

    def __bool__(self) -> bool:
        """Whether a transaction is held (a session left now has it sent again, whole)."""
        return bool(self._open)

    def begin(self, xid: int, first_lsn: int) -> None:
        """A block of ``xid`` starts at ``first_lsn`` (its first block: the transaction's
        first LSN)."""
        if xid not in self._open:
            self._open[xid] = _Spooled(first_lsn)

    def add(self, xid: int, rows: Sequence[tuple[int, bytes]]) -> None:
        """Spool a block's ``(lsn, message)`` rows, as the stream received them."""
        spooled = self._open.get(xid)
        if spooled is None:
            raise ValueError(f"changes of streamed transaction {xid} before its Stream Start")
        if not rows:
            return
        failpoint("receive.streamed")
        lsns = np.fromiter(map(_first, rows), np.int64, len(rows))
        batch, xids = without_stream_xids(MessageBatch.from_messages(list(map(_second, rows))))
        carried = np.flatnonzero(xids >= 0)
        subxids, first = np.unique(xids[carried], return_index=True)
        for subxid, at in zip(subxids.tolist(), carried[first].tolist(), strict=True):
            spooled.subxacts.setdefault(subxid, spooled.count + at)
        self._files += 1
        path = self.folder / f"{xid}-{self._files:08d}"
        size = int(batch.ends[-1])
        _write(path, lsns, batch.ends - batch.starts, batch.buf[:size])
        spooled.chunks.append(_Chunk(spooled.count, len(rows), path))
        spooled.count += len(rows)
        spooled.bytes += size

    def abort(self, xid: int, subxid: int) -> None:
        """Drop the transaction (``subxid == xid``), or a subtransaction's changes and all that
        came after its first (see the module's docstring)."""
        spooled = self._open.get(xid)
        if spooled is None:
            return
        if subxid == xid:
            self._drop(self._open.pop(xid))
            return
        at = spooled.subxacts.get(subxid)
        if at is None:  # nothing of it was streamed
            return
        kept: list[_Chunk] = []
        for chunk in spooled.chunks:
            if chunk.first + chunk.count <= at:
                kept.append(chunk)
            elif chunk.first < at:
                lsns, batch = _read(chunk.path)
                keep = at - chunk.first
                lengths = (batch.ends - batch.starts)[:keep]
                _write(chunk.path, lsns[:keep], lengths, batch.buf[: int(batch.ends[keep - 1])])
                kept.append(_Chunk(chunk.first, keep, chunk.path))
            else:
                chunk.path.unlink(missing_ok=True)
        spooled.chunks = kept
        spooled.count = at
        spooled.subxacts = {x: i for x, i in spooled.subxacts.items() if i < at}

    def commit(self, xid: int) -> Iterator[tuple[np.ndarray, MessageBatch]]:
        """The committed transaction's messages, chunk by chunk (each file gone once read):
        what :meth:`~..decode.range_decoder.RangeDecoder.feed_streamed` takes. A transaction
        never streamed (everything came in its last block, added before) gives its chunks
        the same way; one never begun gives none."""
        spooled = self._open.pop(xid, None)
        if spooled is None:
            return
        try:
            for chunk in spooled.chunks:
                failpoint("receive.streamed_commit")
                yield _read(chunk.path)
                chunk.path.unlink()
        finally:
            self._drop(spooled)

    def spooled_bytes(self, xid: int) -> int:
        """Bytes of messages held for ``xid`` (0 when none)."""
        spooled = self._open.get(xid)
        return 0 if spooled is None else spooled.bytes

    def straddlers(self, end: int) -> list[Straddler]:
        """The transactions held, for a range cut at ``end``
        (:meth:`~..decode.range_decoder.RangeDecoder.close_at`)."""
        return [Straddler(xid, s.first_lsn, end) for xid, s in self._open.items()]

    def close(self) -> None:
        """The session ended: nothing held is read again (see the module's docstring)."""
        self._open.clear()
        shutil.rmtree(self.folder, ignore_errors=True)

    @staticmethod
    def _drop(spooled: _Spooled) -> None:
        for chunk in spooled.chunks:
            chunk.path.unlink(missing_ok=True)


def _write(path: Path, lsns: np.ndarray, lengths: np.ndarray, buf: np.ndarray) -> None:
    """A chunk file: its message count and byte size, the LSNs, the lengths, the messages."""
    with path.open("wb") as out:
        out.write(np.array([len(lsns), len(buf)], np.int64).tobytes())
        out.write(lsns.astype(np.int64).tobytes())
        out.write(lengths.astype(np.int64).tobytes())
        out.write(buf.tobytes())


def _read(path: Path) -> tuple[np.ndarray, MessageBatch]:
    data = path.read_bytes()
    count, size = np.frombuffer(data, np.int64, 2).tolist()
    lsns = np.frombuffer(data, np.int64, count, 16)
    lengths = np.frombuffer(data, np.int64, count, 16 + 8 * count)
    offset = 16 + 16 * count
    buf = np.frombuffer(data[offset : offset + size] + _PAD, np.uint8)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    kinds = buf[starts] if count else np.zeros(0, np.uint8)
    return lsns, MessageBatch(buf, starts, ends, kinds)
