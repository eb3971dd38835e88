"""Pure decoding of pgoutput protocol version 1 messages: bytes in, typed messages out.

No I/O happens here, so every message kind is tested with byte strings. The format is
PostgreSQL's "Logical Replication Message Formats" chapter; the parts that matter for
correctness:

* ``Begin`` carries the transaction's *final* LSN (where its COMMIT record starts), its commit
  time and xid; ``Commit`` carries that same commit LSN and the ``end_lsn`` just past the
  COMMIT record, which equals the next transaction's first LSN (the "collision").
* ``Relation`` describes a table before its first change in a decoding session and again after
  any DDL on it: a newer one always replaces the cached one. An empty namespace means
  ``pg_catalog``.
* Tuple data columns are ``n`` (NULL), ``u`` (unchanged TOASTed value: not sent, the old value
  stays; it can appear in the old tuple of a REPLICA IDENTITY FULL table too), ``t`` (text) or
  ``b`` (binary). Values are kept as the raw ``bytes`` the server sent: turning them into ``str``
  per value would cost more than the rest of decoding, and Arrow validates UTF-8 in bulk later.
* ``Update`` and ``Delete`` carry an old tuple flagged ``K`` (replica-identity key columns; the
  others are NULL) or ``O`` (the whole old row, REPLICA IDENTITY FULL), or none (an update that
  did not change the key).

* Protocol version 2 with ``streaming`` adds what :func:`decode_stream_control` reads: a
  transaction too big for the walsender's ``logical_decoding_work_mem`` is sent before its
  COMMIT, in blocks between ``Stream Start`` and ``Stream Stop``, each change (and Relation,
  Type, Truncate, Message) carrying its (sub)transaction's xid after the kind byte
  (:func:`~.pgoutput_batch.without_stream_xids` takes it out), and ends with ``Stream Commit``
  or ``Stream Abort`` (of the whole transaction, or of one subtransaction). Every other message
  is as in version 1.

Timestamps are microseconds since 2000-01-01 (PostgreSQL's epoch); :data:`PG_EPOCH_OFFSET_US`
converts them to the Unix epoch.
"""

from __future__ import annotations

from dataclasses import dataclass
from struct import Struct
from struct import error as StructError

PG_EPOCH_OFFSET_US = 946_684_800_000_000
"""Microseconds from 1970-01-01 to 2000-01-01."""

TRUNCATE_CASCADE = 1
TRUNCATE_RESTART_IDENTITY = 2

_BEGIN = Struct("!QqI")
_COMMIT = Struct("!BQQq")
_U32 = Struct("!I")
_I32 = Struct("!i")
_U16 = Struct("!H")
_Q = Struct("!Q")
_RELATION_COLUMN_TAIL = Struct("!Ii")
_MESSAGE_HEAD = Struct("!BQ")
_STREAM_START = Struct("!IB")
_STREAM_COMMIT = Struct("!IBQQq")
_STREAM_ABORT = Struct("!II")


class PgOutputError(ValueError):
    """Bytes that are not a pgoutput v1 message we can decode."""


@dataclass(frozen=True, slots=True)
class Begin:
    final_lsn: int
    commit_ts_us: int
    """Microseconds since the Unix epoch."""
    xid: int


@dataclass(frozen=True, slots=True)
class Commit:
    flags: int
    commit_lsn: int
    end_lsn: int
    commit_ts_us: int


@dataclass(frozen=True, slots=True)
class Origin:
    origin_lsn: int
    name: str


@dataclass(frozen=True, slots=True)
class Column:
    name: str
    type_oid: int
    typmod: int
    is_key: bool


@dataclass(frozen=True, slots=True)
class Relation:
    relid: int
    namespace: str
    name: str
    replica_identity: str
    """``d`` default (primary key), ``n`` nothing, ``f`` full, ``i`` index."""
    columns: tuple[Column, ...]

    @property
    def key_indexes(self) -> tuple[int, ...]:
        return tuple(i for i, c in enumerate(self.columns) if c.is_key)


@dataclass(frozen=True, slots=True)
class Type:
    oid: int
    namespace: str
    name: str


@dataclass(frozen=True, slots=True)
class TupleData:
    values: list[bytes | None]
    """Raw value per column; ``None`` for NULL and for unchanged TOAST."""
    unchanged_toast: tuple[int, ...] = ()
    """Indexes of columns sent as ``u``: their value was not sent and must be left as it is."""
    binary: bool = False
    """Some column came in binary (``b``) format rather than text."""


@dataclass(frozen=True, slots=True)
class Insert:
    relid: int
    new: TupleData


@dataclass(frozen=True, slots=True)
class Update:
    relid: int
    old_kind: str | None
    """``K`` key only, ``O`` full old row, ``None`` when the key did not change."""
    old: TupleData | None
    new: TupleData


@dataclass(frozen=True, slots=True)
class Delete:
    relid: int
    old_kind: str
    old: TupleData


@dataclass(frozen=True, slots=True)
class Truncate:
    options: int
    """Bit 1: CASCADE, bit 2: RESTART IDENTITY."""
    relids: tuple[int, ...]

    @property
    def cascade(self) -> bool:
        return bool(self.options & TRUNCATE_CASCADE)

    @property
    def restart_identity(self) -> bool:
        return bool(self.options & TRUNCATE_RESTART_IDENTITY)


@dataclass(frozen=True, slots=True)
class Message:
    transactional: bool
    lsn: int
    prefix: str
    content: bytes


@dataclass(frozen=True)
class StreamStart:
    """A block of a transaction streamed before its COMMIT begins (``first``: its first)."""

    xid: int
    first: bool


@dataclass(frozen=True)
class StreamStop:
    """The block ends; messages outside blocks are whole transactions again."""


@dataclass(frozen=True)
class StreamCommit:
    """A streamed transaction committed: the fields of its Commit, and its xid."""

    xid: int
    flags: int
    commit_lsn: int
    end_lsn: int
    commit_ts_us: int
    """Unix microseconds."""


@dataclass(frozen=True)
class StreamAbort:
    """A streamed transaction aborted (``subxid == xid``), or one of its subtransactions."""

    xid: int
    subxid: int


StreamControl = StreamStart | StreamStop | StreamCommit | StreamAbort

KIND_STREAM_START, KIND_STREAM_STOP = ord("S"), ord("E")
KIND_STREAM_COMMIT, KIND_STREAM_ABORT = ord("c"), ord("A")


def decode_stream_control(data: bytes) -> StreamControl:
    """Decode one of protocol version 2's stream control messages (Stream Start, Stop, Commit,
    Abort). Version 4's longer Stream Abort (with the abort's LSN and time) reads the same."""
    kind = data[0] if data else 0
    try:
        if kind == KIND_STREAM_START:
            xid, first = _STREAM_START.unpack_from(data, 1)
            return StreamStart(xid, bool(first))
        if kind == KIND_STREAM_STOP:
            return StreamStop()
        if kind == KIND_STREAM_COMMIT:
            xid, flags, commit_lsn, end_lsn, ts = _STREAM_COMMIT.unpack_from(data, 1)
            return StreamCommit(xid, flags, commit_lsn, end_lsn, ts + PG_EPOCH_OFFSET_US)
        if kind == KIND_STREAM_ABORT:
            return StreamAbort(*_STREAM_ABORT.unpack_from(data, 1))
    except StructError as exc:
        raise PgOutputError(f"truncated {chr(kind)!r} stream message: {exc}") from exc
    raise PgOutputError(f"not a stream control message: {chr(kind)!r} ({kind:#x})")


PgOutputMessage = (
    Begin | Commit | Origin | Relation | Type | Insert | Update | Delete | Truncate | Message
)


def _cstring(data: bytes, offset: int) -> tuple[str, int]:
    end = data.index(0, offset)
    return data[offset:end].decode("utf-8"), end + 1


def parse_tuple(data: bytes, offset: int) -> tuple[TupleData, int]:
    """Parse TupleData at ``offset``; returns it and the offset just past it."""
    (ncols,) = _U16.unpack_from(data, offset)
    offset += 2
    values: list[bytes | None] = []
    append = values.append
    unchanged: list[int] = []
    binary = False
    for index in range(ncols):
        kind = data[offset]
        offset += 1
        if kind == 0x74 or kind == 0x62:  # 't' text, 'b' binary
            length = int.from_bytes(data[offset : offset + 4], "big")
            offset += 4
            append(data[offset : offset + length])
            offset += length
            if kind == 0x62:
                binary = True
        elif kind == 0x6E:  # 'n' NULL
            append(None)
        elif kind == 0x75:  # 'u' unchanged TOAST
            append(None)
            unchanged.append(index)
        else:
            raise PgOutputError(f"unknown tuple column kind {chr(kind)!r} at byte {offset - 1}")
    return TupleData(values, tuple(unchanged), binary), offset


def decode(data: bytes) -> PgOutputMessage:
    """Decode one pgoutput v1 message (the ``data`` of one decoding output row)."""
    if not data:
        raise PgOutputError("empty pgoutput message")
    kind = data[0]
    try:
        if kind == 0x49:  # 'I'
            (relid,) = _U32.unpack_from(data, 1)
            if data[5] != 0x4E:
                raise PgOutputError(f"Insert without new tuple marker 'N' (got {data[5]:#x})")
            new, _ = parse_tuple(data, 6)
            return Insert(relid, new)
        if kind == 0x55:  # 'U'
            (relid,) = _U32.unpack_from(data, 1)
            marker = data[5]
            old: TupleData | None = None
            old_kind: str | None = None
            offset = 6
            if marker == 0x4B or marker == 0x4F:  # 'K' / 'O'
                old_kind = chr(marker)
                old, offset = parse_tuple(data, 6)
                marker = data[offset]
                offset += 1
            if marker != 0x4E:
                raise PgOutputError(f"Update without new tuple marker 'N' (got {marker:#x})")
            new, _ = parse_tuple(data, offset)
            return Update(relid, old_kind, old, new)
        if kind == 0x44:  # 'D'
            (relid,) = _U32.unpack_from(data, 1)
            marker = data[5]
            if marker != 0x4B and marker != 0x4F:
                raise PgOutputError(f"Delete without old tuple marker 'K'/'O' (got {marker:#x})")
            old, _ = parse_tuple(data, 6)
            return Delete(relid, chr(marker), old)
        if kind == 0x42:  # 'B'
            final_lsn, ts, xid = _BEGIN.unpack_from(data, 1)
            return Begin(final_lsn, ts + PG_EPOCH_OFFSET_US, xid)
        if kind == 0x43:  # 'C'
            flags, commit_lsn, end_lsn, ts = _COMMIT.unpack_from(data, 1)
            return Commit(flags, commit_lsn, end_lsn, ts + PG_EPOCH_OFFSET_US)
        if kind == 0x52:  # 'R'
            return _relation(data)
        if kind == 0x59:  # 'Y'
            (oid,) = _U32.unpack_from(data, 1)
            namespace, offset = _cstring(data, 5)
            name, _ = _cstring(data, offset)
            return Type(oid, namespace or "pg_catalog", name)
        if kind == 0x54:  # 'T'
            (count,) = _U32.unpack_from(data, 1)
            options = data[5]
            relids = tuple(_U32.unpack_from(data, 6 + 4 * i)[0] for i in range(count))
            return Truncate(options, relids)
        if kind == 0x4F:  # 'O'
            (origin_lsn,) = _Q.unpack_from(data, 1)
            name, _ = _cstring(data, 9)
            return Origin(origin_lsn, name)
        if kind == 0x4D:  # 'M'
            flags, lsn = _MESSAGE_HEAD.unpack_from(data, 1)
            prefix, offset = _cstring(data, 10)
            (length,) = _U32.unpack_from(data, offset)
            content = data[offset + 4 : offset + 4 + length]
            return Message(bool(flags & 1), lsn, prefix, content)
    except (IndexError, ValueError, StructError) as exc:
        if isinstance(exc, PgOutputError):
            raise
        raise PgOutputError(f"truncated or malformed {chr(kind)!r} message: {exc}") from exc
    if chr(kind) in "SEcAbPKrp":
        raise PgOutputError(
            f"pgoutput message {chr(kind)!r} belongs to streamed or two-phase transactions, "
            "which protocol version 1 without 'streaming'/'two_phase' never sends"
        )
    raise PgOutputError(f"unknown pgoutput message type {chr(kind)!r} ({kind:#x})")


def _relation(data: bytes) -> Relation:
    (relid,) = _U32.unpack_from(data, 1)
    namespace, offset = _cstring(data, 5)
    name, offset = _cstring(data, offset)
    identity = chr(data[offset])
    (ncols,) = _U16.unpack_from(data, offset + 1)
    offset += 3
    columns = []
    for _ in range(ncols):
        flags = data[offset]
        col_name, offset = _cstring(data, offset + 1)
        type_oid, typmod = _RELATION_COLUMN_TAIL.unpack_from(data, offset)
        offset += 8
        columns.append(Column(col_name, type_oid, typmod, bool(flags & 1)))
    return Relation(relid, namespace or "pg_catalog", name, identity, tuple(columns))
