"""Read a logical slot by the streaming protocol: ``START_REPLICATION`` on a walsender session.

Why a stream as well as the peek (:mod:`.peek`): every peek decodes the WAL again from the
slot's restart point, which PostgreSQL 15 moves only at running-xacts records (about every 15 s
of the WAL's writing time). A follow that keeps up peeks five times a second, so a big
transaction just behind the restart point is decoded again by every peek until the next
running-xacts record, which costs seconds of freshness after a big insert, even into a table
that is not published (see ``benchmarks/HISTORY.md``, ``benchmarks/freshness.py``: the follow's
stream against its peek loop). A walsender decodes each record once and sends a transaction as
soon as its COMMIT is decoded. The peek stays for backlogs: psycopg 3 has no replication API
above libpq, so each message costs a Python call here, and a backlog is read faster by peek
(see ``benchmarks/slot_reading.py``).

What must hold for the positions this module reports (see :mod:`.peek` for the safe point):
an XLogData message's ``dataStart`` is the LSN the peek shows for the same message (a COMMIT's
is its ``end_lsn``), and the walsender sends a transaction's messages together, at its COMMIT,
so between a COMMIT message and the next BEGIN no transaction is open in the stream. A
keepalive's ``walEnd`` is the end of the last WAL record the walsender decoded: every
transaction whose COMMIT ends at or before it was sent before the keepalive. So outside a
transaction, the furthest of the last COMMIT's ``end_lsn`` and the last keepalive's ``walEnd``
is a point no record straddles and before which every transaction was received: a range may end
there, and once it is stored the slot may be confirmed there (the standby status update's flush
position, the only way to move a slot a walsender holds).
"""

from __future__ import annotations

import select
import struct
import time
from collections.abc import Iterable, Iterator
from typing import NamedTuple, TypeVar

import psycopg
from psycopg import pq, sql

from ..connect import connect
from ..decode.pgoutput import PG_EPOCH_OFFSET_US
from ..lsn import Lsn
from ..settings import work_mem_setting

T = TypeVar("T")

_XLOG_DATA_SIZE = struct.calcsize(">cQQq")  # 'w', dataStart, walEnd, sendTime; the message
_unpack_lsn = struct.Struct(">Q").unpack_from  # an XLogData's dataStart, at offset 1
_KEEPALIVE = struct.Struct(">cQqB")  # 'k', walEnd, sendTime, replyRequested
_STATUS = struct.Struct(">cQQQqB")  # 'r', written, flushed, applied, sendTime, replyRequested

FEEDBACK_S = 5.0
"""How often the stream tells the walsender where the store is, even with nothing new: well
inside the default ``wal_sender_timeout`` (60 s), after which a silent client is cut off; a
quarter of the session's ``wal_sender_timeout`` when that is shorter."""


class Message(NamedTuple):
    """One XLogData message: its LSN (as the peek shows it) and the pgoutput message; a row as
    :class:`~..decode.range_decoder.RangeDecoder` takes it. (A tuple: one is made per message.)"""

    lsn: int
    data: bytes


class Keepalive(NamedTuple):
    """The walsender has decoded the WAL up to ``wal_end``."""

    wal_end: int


SKIPPED_PUBLICATION = "skipped loading publication"
"""How PostgreSQL 18's pgoutput begins the WARNING it sends for a publication of
``publication_names`` that does not exist (older servers end the stream with an error)."""


class PublicationWatch:
    """Whether the server skipped our publication while decoding: PostgreSQL 18's pgoutput
    sends a WARNING for a publication of ``publication_names`` that does not exist (dropped
    under a stream or between a peek's check and the peek) and sends nothing of the changes it
    skips, where older servers end the read with an error. The reader installs :meth:`notice`
    on its connection and calls :meth:`refuse` before it stores or confirms anything read
    after the warning; a range cut past the skipped changes would lose them."""

    def __init__(self, publication: str) -> None:
        self.publication = publication
        self.skipped: str | None = None

    def notice(self, diagnostic: psycopg.errors.Diagnostic) -> None:
        primary = diagnostic.message_primary or ""
        if primary.startswith(SKIPPED_PUBLICATION) and self.skipped is None:
            self.skipped = primary

    def refuse(self) -> None:
        """Raise, when the publication was skipped, what an older server raises."""
        if self.skipped is not None:
            raise psycopg.errors.UndefinedObject(
                f'publication "{self.publication}" does not exist (the source says: {self.skipped})'
            )


STREAMING_SINCE = 140000
"""The first server version whose pgoutput streams transactions before their COMMIT."""


class SlotStream:
    """A ``START_REPLICATION`` stream of one logical slot, from ``start`` (the slot's confirmed
    position: the walsender skips every transaction whose COMMIT starts before it, as the peek
    does). Close it (or leave the ``with``) to let the slot go.

    On PostgreSQL 14 and later, pgoutput protocol 2 with ``streaming`` (``self.streaming``): a
    transaction bigger than the walsender's ``logical_decoding_work_mem`` comes in blocks while
    it is written (:mod:`.streamed` holds them); on older servers, protocol 1."""

    def __init__(
        self, dsn: str, slot: str, publication: str, start: Lsn, work_mem: int = 0
    ) -> None:
        """``work_mem``: the session's ``logical_decoding_work_mem`` in bytes (0: the
        server's), past which the walsender streams a transaction before its COMMIT."""
        self.conn = connect(dsn, role="source", replication=True, application_name=STREAMING)
        self.pg = self.conn.pgconn
        self.watch = PublicationWatch(publication)
        self.conn.add_notice_handler(self.watch.notice)
        self.flushed = int(start)
        self._fed_back = 0.0
        self.streaming = self.conn.info.server_version >= STREAMING_SINCE
        protocol = "proto_version '2', streaming 'on'" if self.streaming else "proto_version '1'"
        command = sql.SQL("START_REPLICATION SLOT {} LOGICAL {} ({}, publication_names {})").format(
            sql.Identifier(slot),
            sql.SQL(str(Lsn(start))),
            sql.SQL(protocol),
            # pgoutput splits this option as a list of identifiers: quote the name.
            sql.Literal(str(sql.Identifier(publication).as_string(self.conn))),
        )
        try:
            if work_mem:
                setting = f"SET logical_decoding_work_mem = '{work_mem_setting(work_mem)}'"
                done = self.pg.exec_(setting.encode())
                if done.status != pq.ExecStatus.COMMAND_OK:
                    self._raise(done)
            self.feedback_s = self._feedback_interval()
            self.pg.send_query(command.as_bytes(self.conn))
            self._flush()
            while True:
                self.pg.consume_input()
                if not self.pg.is_busy():
                    break
                select.select([self.pg.socket], [], [], 1.0)
            result = self.pg.get_result()
            if result is None or result.status != pq.ExecStatus.COPY_BOTH:
                self._raise(result)
        except BaseException:
            self.conn.close()  # no ``with`` holds it yet
            raise

    def _feedback_interval(self) -> float:
        """:data:`FEEDBACK_S`, or a quarter of this session's ``wal_sender_timeout`` (in ms;
        0: none) when that is shorter: a role or database may set it low."""
        done = self.pg.exec_(b"SELECT setting FROM pg_settings WHERE name = 'wal_sender_timeout'")
        if done.status != pq.ExecStatus.TUPLES_OK:
            self._raise(done)
        value = done.get_value(0, 0)
        timeout_ms = int(value) if value is not None else 0
        return FEEDBACK_S if timeout_ms <= 0 else min(FEEDBACK_S, timeout_ms / 4000)

    def __enter__(self) -> SlotStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def alive_through(self, chunks: Iterable[T]) -> Iterator[T]:
        """``chunks``, telling the walsender this session is alive between them: work between
        two reads of the stream can last minutes (a transaction of 50M rows written into its
        range), longer than ``wal_sender_timeout``, past which the walsender cuts the session
        off and the transaction is sent again."""
        for chunk in chunks:
            self.feedback(self.flushed)
            yield chunk
        self.feedback(self.flushed)

    def close(self) -> None:
        """Close the session: its walsender lets the slot go once it sees the socket closed
        (:func:`~.slot.released` waits for that)."""
        self.conn.close()

    def messages(self, timeout: float) -> Iterator[Message | Keepalive]:
        """What has arrived, waiting at most ``timeout`` for the first; ends once nothing more
        is at hand (an empty iteration: nothing came in ``timeout``)."""
        get = self.pg.get_copy_data
        waited = False
        while True:
            n, data = get(1)
            if self.watch.skipped is not None:
                self.watch.refuse()
            if n == 0:
                if waited or not select.select([self.pg.socket], [], [], timeout)[0]:
                    return
                waited = True
                self.pg.consume_input()
                continue
            if n < 0:
                self._raise(self.pg.get_result())
            waited = True
            kind = data[0]
            if kind == 0x77:  # 'w'
                yield Message(_unpack_lsn(data, 1)[0], bytes(data[_XLOG_DATA_SIZE:]))
            elif kind == 0x6B:  # 'k'
                _, wal_end, _, reply = _KEEPALIVE.unpack_from(data)
                if reply:
                    self.feedback(self.flushed, force=True)
                yield Keepalive(wal_end)

    def feedback(self, flushed: int, *, force: bool = False) -> None:
        """Tell the walsender that everything before ``flushed`` is stored (the slot's confirmed
        position moves there); sent at once when it moved, else every :attr:`feedback_s`. Between
        reads too: the walsender takes it whether or not what it sent was read."""
        now = time.monotonic()
        if flushed == self.flushed and not force and now - self._fed_back < self.feedback_s:
            return
        self.flushed = max(self.flushed, flushed)
        sent = int(time.time() * 1_000_000) - PG_EPOCH_OFFSET_US
        self.pg.put_copy_data(_STATUS.pack(b"r", self.flushed, self.flushed, self.flushed, sent, 0))
        self._flush()
        self._fed_back = now

    def _flush(self) -> None:
        while self.pg.flush() == 1:
            select.select([], [self.pg.socket], [], 1.0)

    def _raise(self, result: pq.abc.PGresult | None) -> None:
        """The stream ended: an error the server sent (a terminated walsender, a publication
        that went away) is raised as psycopg raises it, so a lost server is an outage to
        :func:`~..connect.server_errors` and anything else is not."""
        if result is not None and result.status == pq.ExecStatus.FATAL_ERROR:
            state = (result.error_field(pq.DiagnosticField.SQLSTATE) or b"").decode()
            primary = result.error_field(pq.DiagnosticField.MESSAGE_PRIMARY)
            message = (primary or result.error_message or b"").decode(errors="replace").strip()
            error = psycopg.errors.lookup(state) if state else psycopg.OperationalError
            raise error(message)
        raise psycopg.OperationalError(
            self.pg.error_message.decode(errors="replace").strip() or "the stream ended"
        )


STREAMING = "pgcdc follow (streaming)"
"""The ``application_name`` of a follower's walsender session."""
