"""Vectorised pgoutput decoding: a whole batch of messages in a few NumPy passes.

:mod:`pgcdc_dagster.engine.decode.pgoutput` decodes one message at a time and is the reference; this
module decodes the hot message kinds (Begin, Commit, Insert, Update, Delete) of a batch at once,
because a per-message Python loop costs more per message than the server's decoding and
sending of it, and so caps receive at a fraction of what the server sends (see
``benchmarks/HISTORY.md``, "Decoding pgoutput in batches"; ``benchmarks/receive.py`` measures
the receive). Rare kinds (Relation, Type, Truncate, Message, Origin) are left to the scalar
decoder. Tests check both decoders agree.

How: the batch's messages are concatenated into one byte buffer with per-message offsets. Every
field at a fixed offset is a gather. Tuple data is walked column by column across all rows at
once: column j's kind byte sits at a per-row position that the previous column's length moved
on. Text values are never copied into Python objects: their (start, length) pairs become Arrow
string arrays through one copy of each value (see :func:`gather_values`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from .pgoutput import PG_EPOCH_OFFSET_US, PgOutputError

KIND_BEGIN = ord("B")
KIND_COMMIT = ord("C")
KIND_INSERT = ord("I")
KIND_UPDATE = ord("U")
KIND_DELETE = ord("D")
_T, _B, _N, _U = ord("t"), ord("b"), ord("n"), ord("u")
_PAD = 16


@dataclass
class MessageBatch:
    """A batch of raw messages as one padded buffer."""

    buf: np.ndarray
    starts: np.ndarray
    ends: np.ndarray
    kinds: np.ndarray

    @classmethod
    def from_messages(cls, messages: Sequence[bytes]) -> MessageBatch:
        lengths = np.fromiter(map(len, messages), dtype=np.int64, count=len(messages))
        ends = np.cumsum(lengths)
        starts = ends - lengths
        buf = np.frombuffer(b"".join(messages) + bytes(_PAD), dtype=np.uint8)
        if len(messages) and lengths.min() == 0:
            raise PgOutputError("empty pgoutput message in batch")
        kinds = buf[starts] if len(messages) else np.zeros(0, np.uint8)
        return cls(buf, starts, ends, kinds)

    def u16(self, pos: np.ndarray) -> np.ndarray:
        b = self.buf
        return (b[pos].astype(np.int64) << 8) | b[pos + 1]

    def u32(self, pos: np.ndarray) -> np.ndarray:
        b = self.buf
        return (
            (b[pos].astype(np.int64) << 24)
            | (b[pos + 1].astype(np.int64) << 16)
            | (b[pos + 2].astype(np.int64) << 8)
            | b[pos + 3]
        )

    def u64(self, pos: np.ndarray) -> np.ndarray:
        """Big-endian 64-bit values (as int64: LSNs and timestamps fit)."""
        return (self.u32(pos) << 32) | self.u32(pos + 4)


_WITH_STREAM_XID = np.array([ord(k) for k in "RYIUDTM"], np.uint8)
"""The kinds that carry their (sub)transaction's xid after the kind byte inside a stream block
(Origin does not)."""


def without_stream_xids(batch: MessageBatch) -> tuple[MessageBatch, np.ndarray]:
    """A stream block's messages (protocol 2, see :mod:`.pgoutput`) in protocol 1's layout,
    which every decoder here reads, and the xid each carried (-1 for a kind without one). One
    gather over the batch: per-message slicing in Python would cost more than the receive."""
    starts, lengths = batch.starts, batch.ends - batch.starts
    has = np.isin(batch.kinds, _WITH_STREAM_XID)
    if (lengths[has] < 5).any():
        raise PgOutputError("streamed message too short to carry its xid")
    xids = np.full(len(starts), -1, np.int64)
    xids[has] = batch.u32(starts[has] + 1)
    keep = np.ones(len(batch.buf), bool)
    keep[(starts[has][:, None] + np.arange(1, 5)).ravel()] = False
    lengths = lengths - 4 * has
    ends = np.cumsum(lengths)
    return MessageBatch(batch.buf[keep], ends - lengths, ends, batch.kinds), xids


@dataclass
class TupleBlock:
    """Tuple data of ``m`` rows as ``m × width`` arrays of value starts, lengths and kinds."""

    ncols: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    kinds: np.ndarray
    end: np.ndarray

    @classmethod
    def empty(cls, m: int, width: int) -> TupleBlock:
        return cls(
            np.zeros(m, np.int64),
            np.zeros((m, width), np.int64),
            np.zeros((m, width), np.int64),
            np.zeros((m, width), np.uint8),
            np.zeros(m, np.int64),
        )


def parse_tuples(batch: MessageBatch, pos: np.ndarray) -> TupleBlock:
    """Parse the TupleData starting at each position of ``pos``."""
    m = len(pos)
    if m == 0:
        return TupleBlock.empty(0, 0)
    ncols = batch.u16(pos)
    width = int(ncols.max())
    block = TupleBlock.empty(m, width)
    block.ncols = ncols
    pos = pos + 2
    limit = len(batch.buf) - _PAD
    for j in range(width):
        active = j < ncols
        kind = np.where(active, batch.buf[np.minimum(pos, limit)], 0)
        has_value = (kind == _T) | (kind == _B)
        bad = active & ~has_value & (kind != _N) & (kind != _U)
        if bad.any():
            raise PgOutputError(f"unknown tuple column kind {chr(int(kind[bad][0]))!r}")
        length = np.where(has_value, batch.u32(np.minimum(pos + 1, limit)), 0)
        block.starts[:, j] = pos + 5
        block.lengths[:, j] = length
        block.kinds[:, j] = kind
        pos = pos + np.where(active, np.where(has_value, 5 + length, 1), 0)
    block.end = pos
    return block


@dataclass
class ChangeBlock:
    """The Insert/Update/Delete messages of a batch, decoded."""

    index: np.ndarray
    """Position of each change in the batch."""
    action: np.ndarray
    """Kind byte (I/U/D) per change."""
    relid: np.ndarray
    key_source: TupleBlock
    """The tuple the replica-identity key is read from: the old tuple when one was sent."""
    new: TupleBlock
    has_new: np.ndarray
    has_old: np.ndarray
    old_kinds: np.ndarray
    """Old tuple column kinds (to find unchanged TOAST there too); zeros where no old tuple."""


def decode_changes(batch: MessageBatch) -> ChangeBlock:
    kinds = batch.kinds
    index = np.flatnonzero((kinds == KIND_INSERT) | (kinds == KIND_UPDATE) | (kinds == KIND_DELETE))
    s = batch.starts[index]
    action = kinds[index]
    relid = batch.u32(s + 1)
    marker = batch.buf[s + 5]
    has_old = ((action == KIND_UPDATE) | (action == KIND_DELETE)) & (
        (marker == ord("K")) | (marker == ord("O"))
    )
    if ((action == KIND_DELETE) & ~has_old).any():
        raise PgOutputError("Delete without old tuple marker 'K'/'O'")
    old_rows = np.flatnonzero(has_old)
    old = parse_tuples(batch, s[old_rows] + 6)
    new_pos = s + 6
    has_new = action != KIND_DELETE
    if len(old_rows):
        after_old = old.end
        new_pos[old_rows] = after_old + 1
        upd = action[old_rows] == KIND_UPDATE
        if (batch.buf[after_old[upd]] != ord("N")).any():
            raise PgOutputError("Update without new tuple marker 'N' after its old tuple")
    no_old_new = has_new & ~has_old
    if (marker[no_old_new] != ord("N")).any():
        raise PgOutputError("Insert/Update without new tuple marker 'N'")
    new_rows = np.flatnonzero(has_new)
    new_sub = parse_tuples(batch, new_pos[new_rows])
    ends = batch.ends[index]
    tuple_end = np.where(has_new, 0, 0)
    if len(new_rows):
        tuple_end[new_rows] = new_sub.end
    if len(old_rows):
        deletes = action[old_rows] == KIND_DELETE
        tuple_end[old_rows[deletes]] = old.end[deletes]
    if (tuple_end != ends).any():
        raise PgOutputError("malformed change message: tuple data does not end with the message")
    n = len(index)
    width = max(old.starts.shape[1], new_sub.starts.shape[1])
    new = _scatter(new_sub, new_rows, n, width)
    old_full = _scatter(old, old_rows, n, width)
    key_source = _scatter(new_sub, new_rows, n, width)
    if len(old_rows):
        w = old.starts.shape[1]
        key_source.ncols[old_rows] = old.ncols
        for name in ("starts", "lengths", "kinds"):
            getattr(key_source, name)[old_rows, :w] = getattr(old, name)
    return ChangeBlock(index, action, relid, key_source, new, has_new, has_old, old_full.kinds)


def _scatter(block: TupleBlock, rows: np.ndarray, n: int, width: int) -> TupleBlock:
    full = TupleBlock.empty(n, width)
    w = block.starts.shape[1]
    if len(rows):
        full.ncols[rows] = block.ncols
        full.starts[rows, :w] = block.starts
        full.lengths[rows, :w] = block.lengths
        full.kinds[rows, :w] = block.kinds
        full.end[rows] = block.end
    return full


def text_lists(
    batch: MessageBatch,
    starts: np.ndarray,
    lengths: np.ndarray,
    kinds: np.ndarray,
    widths: np.ndarray,
    row_valid: np.ndarray | None = None,
) -> pa.Array:
    """``list<string>`` of the first ``widths[r]`` values of each row (NULL for ``n``/``u``).

    ``row_valid`` False makes the whole list NULL (a delete's new row). UTF-8 is validated in
    bulk: the session that reads the slot asks for UTF8 (:data:`~..connect.CLIENT_ENCODING`), so
    the server converts from any encoding but ``SQL_ASCII``, whose bytes it passes unchecked.
    """
    m, width = starts.shape
    entry_mask = np.arange(width)[None, :] < widths[:, None]
    flat_starts = starts[entry_mask]
    flat_lengths = lengths[entry_mask]
    flat_kinds = kinds[entry_mask]
    value_offsets, data = gather_values(batch.buf, flat_starts, flat_lengths)
    total = int(value_offsets[-1])
    is_value = (flat_kinds == _T) | (flat_kinds == _B)
    offsets_type = pa.int32() if total < 2**31 else pa.int64()
    string_type = pa.string() if offsets_type == pa.int32() else pa.large_string()
    values = pa.Array.from_buffers(
        string_type,
        len(flat_starts),
        [
            pa.array(is_value, pa.bool_()).buffers()[1] if not is_value.all() else None,
            pa.py_buffer(value_offsets.astype(np.int32 if total < 2**31 else np.int64)),
            data,
        ],
    )
    try:
        values.validate(full=True)
    except pa.ArrowInvalid as exc:
        raise PgOutputError(
            f"a decoded value is not valid UTF-8 ({exc}): the source database must be in "
            "SQL_ASCII, whose bytes PostgreSQL never converts; correct the values that are not "
            "UTF-8 on the source"
        ) from None
    if string_type != pa.string():
        values = values.cast(pa.string())
    list_offsets = np.zeros(m + 1, np.int32)
    np.cumsum(widths, out=list_offsets[1:])
    mask = None if row_valid is None else pa.array(~row_valid, pa.bool_())
    return pa.ListArray.from_arrays(pa.array(list_offsets, pa.int32()), values, mask=mask)


def one_byte_strings(codes: np.ndarray) -> pa.Array:
    """A string array of one-character values from their bytes (the change kinds ``I``/``U``/
    ``D``), built on those bytes directly: NumPy's unicode arrays are slow for it (see
    ``benchmarks/HISTORY.md``, "Decoding pgoutput in batches")."""
    offsets = np.arange(len(codes) + 1, dtype=np.int32)
    data = np.ascontiguousarray(codes, dtype=np.uint8)
    return pa.Array.from_buffers(
        pa.string(), len(codes), [None, pa.py_buffer(offsets), pa.py_buffer(data)]
    )


def gather_values(
    buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray
) -> tuple[np.ndarray, pa.Buffer]:
    """The values ``buf[starts[i] : starts[i] + lengths[i]]`` laid end to end: their offsets
    (``len + 1``, from 0) and the bytes.

    Values of a batch lie in ``buf`` in order, one after the other with gaps (kind bytes and
    lengths) between them. So ``buf`` itself is the data of a binary array whose elements
    alternate value, gap, value...; Arrow's ``take`` of every other element then copies each
    value with one ``memcpy``, far faster than a NumPy gather of every byte. Zero-length values
    (NULL, unchanged TOAST, empty strings) are placed at the previous value's end so the bounds
    never go back; bounds that still go back (values not in buffer order) take the byte gather.
    """
    n = len(starts)
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    total = int(offsets[-1])
    if not total:
        return offsets, pa.py_buffer(b"")
    ends = starts + lengths
    empty = lengths == 0
    if empty.any():
        reached = np.maximum.accumulate(np.where(empty, 0, ends))
        before = np.concatenate(([0], reached[:-1]))
        starts = np.where(empty, before, starts)
        ends = np.where(empty, before, ends)
    if not (starts[1:] >= ends[:-1]).all():
        gather = np.arange(total, dtype=np.int64) - np.repeat(offsets[:-1] - starts, lengths)
        return offsets, pa.py_buffer(buf[gather])
    bounds = np.empty(2 * n, np.int64)
    bounds[0::2] = starts
    bounds[1::2] = ends
    whole = pa.Array.from_buffers(
        pa.large_binary(), 2 * n - 1, [None, pa.py_buffer(bounds), pa.py_buffer(buf)]
    )
    values = whole.take(pa.array(np.arange(0, 2 * n, 2, dtype=np.int64)))
    return offsets, values.buffers()[2]


@dataclass
class BeginCommitFields:
    """Begin and Commit fields of a batch, in batch order, for the transaction bookkeeping."""

    index: np.ndarray
    kind: np.ndarray
    final_or_commit_lsn: np.ndarray
    end_lsn: np.ndarray
    """Commit's end_lsn; 0 for Begin."""
    ts_us: np.ndarray
    """Unix microseconds."""
    xid: np.ndarray
    """Begin's xid; 0 for Commit."""


def decode_begin_commit(batch: MessageBatch) -> BeginCommitFields:
    kinds = batch.kinds
    index = np.flatnonzero((kinds == KIND_BEGIN) | (kinds == KIND_COMMIT))
    s = batch.starts[index]
    kind = kinds[index]
    is_commit = kind == KIND_COMMIT
    expected = np.where(is_commit, 26, 21)
    if ((batch.ends[index] - s) != expected).any():
        raise PgOutputError("malformed Begin/Commit message length")
    base = s + 1 + is_commit  # Commit has a flags byte first
    lsn = batch.u64(base)
    end_lsn = np.where(is_commit, batch.u64(base + 8), 0)
    ts = np.where(is_commit, batch.u64(base + 16), batch.u64(base + 8)) + PG_EPOCH_OFFSET_US
    xid = np.where(is_commit, 0, batch.u32(base + 16))
    return BeginCommitFields(index, kind, lsn, end_lsn, ts, xid)
