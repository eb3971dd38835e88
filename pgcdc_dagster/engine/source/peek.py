"""Receive one LSN range from the source slot into the output store.

Data flow::

    source slot ──peek (SQL, binary cursor, batches)──▶ pgoutput decode ──▶ per-column buffers
         ▲                                                                  │ whole transactions
         │ advance to the safe point, only after ──── fsync + rename ◀── Parquet (+ spill for
         │ the range is durably stored                                     huge transactions)

Which transactions a range holds
    Range ``(start, endpos]`` holds exactly the transactions whose COMMIT ``end_lsn`` lies in
    it (see :class:`~pgcdc_dagster.engine.lsn.LsnRange`). A transaction whose COMMIT ends after
    ``endpos`` is deferred, whole, to the next range, wherever ``endpos`` falls inside it.

Why the peek looks past endpos
    PostgreSQL emits a transaction only at its COMMIT, and ``upto_lsn`` stops decoding at the
    record that contains it. To tell "between transactions" from "mid-transaction" we must see
    transactions that began before ``endpos`` but commit after it, so the peek decodes up to
    ``min(flush, endpos + lookahead)`` and keeps, server side, only rows at or before
    ``endpos``. A transaction whose Begin (at its first LSN) is kept but whose Commit (at its
    end_lsn) is not is a *straddler*. Straddlers always come last: the output is in commit
    order and their commits end after every stored one.

The safe point (what the slot may be advanced to)
    PostgreSQL skips, for ever, every transaction whose COMMIT record *starts* before the
    slot's confirmed position. So the slot may move to P only when every transaction with a
    COMMIT record starting before P is durably stored. The peek returned every transaction
    whose COMMIT starts before ``endpos`` (``endpos`` is never past the flushed WAL, checked
    first), so::

        P = endpos, lowered to the commit LSN (start of the COMMIT record) of any straddler
            whose COMMIT record contains endpos

    A straddler that commits at or after ``endpos`` does not lower P: its COMMIT starts at or
    after P, and PostgreSQL keeps ``restart_lsn`` before the first record of every transaction
    still open, so it is decoded whole again. On an idle or filtered source (no published
    change, WAL moving elsewhere) the range is empty and P = ``endpos``: the slot keeps moving
    and retained WAL stays bounded. P is never below the last stored commit's ``end_lsn``
    and the slot is never moved backwards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg

from ..connect import connect
from ..decode.pgoutput import Begin, decode
from ..decode.pgoutput_batch import KIND_BEGIN, KIND_COMMIT
from ..decode.range_decoder import RangeDecoder, Straddler
from ..errors import PgcdcError, server_message
from ..failpoints import failpoint
from ..lsn import Lsn, LsnRange
from ..store.output_store import OutputStore, RangeResult
from .slot import advance_slot, current_flush_lsn, released
from .streamed import discard_left
from .walsender import PublicationWatch

DEFAULT_LOOKAHEAD_BYTES = 16 * 1024 * 1024

_PEEK = """
SELECT (lsn - '0/0'::pg_lsn)::int8, data
FROM pg_logical_slot_peek_binary_changes(
    %(slot)s, %(upto)s::pg_lsn, NULL,
    'proto_version', '1', 'publication_names', %(publications)s)
WHERE lsn <= %(endpos)s::pg_lsn
"""


class ReceiveError(PgcdcError):
    """A range cannot be received as asked; the message says why and what to do."""


def receive(
    source_dsn: str,
    slot_name: str,
    publication: str,
    store: OutputStore,
    range_start: Lsn | int | str,
    endpos: Lsn | int | str,
    *,
    lookahead_bytes: int = DEFAULT_LOOKAHEAD_BYTES,
    fetch_rows: int = 20_000,
    spill_rows: int = 100_000,
    conn: psycopg.Connection[Any] | None = None,
    keep_empty: bool = True,
) -> RangeResult | None:
    """Store every transaction of ``(range_start, endpos]`` and advance the slot past them.

    Idempotent: a range already stored is returned from the store (and the slot advanced to
    its safe point if a crash came between the store and the advance); it is never
    overwritten, even once the slot has moved past its changes.

    ``conn`` is a source connection to reuse (a follower keeps one); otherwise one is opened.
    With ``keep_empty=False`` a range that would hold no transaction is not stored and the slot
    is not moved (``None`` is returned): a follower polling an idle source stores an empty
    range only now and then, to keep the slot moving, not every poll.
    """
    opened = connect(source_dsn, role="source") if conn is None else contextlib.nullcontext(conn)
    with opened as source:
        return _receive(
            source,
            slot_name,
            publication,
            store,
            LsnRange(range_start, endpos),
            lookahead_bytes,
            fetch_rows,
            spill_rows,
            keep_empty,
        )


def _receive(
    conn: psycopg.Connection[Any],
    slot_name: str,
    publication: str,
    store: OutputStore,
    rng: LsnRange,
    lookahead_bytes: int,
    fetch_rows: int,
    spill_rows: int,
    keep_empty: bool,
) -> RangeResult | None:
    started = time.monotonic()
    stored = store.get(rng)
    if stored is not None:
        advance_slot(conn, slot_name, stored.safe_point)
        conn.commit()
        return dataclasses.replace(stored.manifest.result, already_stored=True)
    discard_left(store.streaming_dir)
    upto = _peek_limit(conn, slot_name, publication, store, rng, lookahead_bytes)
    with store.writer(rng) as writer:
        decoder = RangeDecoder(rng, writer, spill_rows)
        _stream_peek(conn, slot_name, publication, rng.end, upto, decoder.feed, fetch_rows)
        conn.commit()
        result = decoder.finish(time.monotonic() - started)
        if not keep_empty and result.transactions == 0:
            return None  # the writer's exit removes its temporary folder
        stored = writer.commit(decoder.manifest(result))
    result = stored.manifest.result
    failpoint("receive.after_store")
    advance_slot(conn, slot_name, Lsn(result.safe_point))
    conn.commit()
    result.seconds = round(time.monotonic() - started, 4)
    return result


CUT_LOOKAHEAD_ROWS = 10_000
""":func:`receive_in_cuts` cuts only where this many of the peek's rows follow the cut in the
batch at hand (or in the peek's last batch): the transactions among them that began before the
cut are its reported straddlers (about 1 MiB of pgbench's WAL)."""


def receive_in_cuts(
    conn: psycopg.Connection[Any],
    slot_name: str,
    publication: str,
    store: OutputStore,
    range_start: Lsn,
    goal: Lsn,
    *,
    next_bytes: Callable[[int], int],
    on_stored: Callable[[RangeResult], bool],
    stop: threading.Event,
    lookahead_bytes: int = DEFAULT_LOOKAHEAD_BYTES,
    fetch_rows: int = 20_000,
    spill_rows: int = 100_000,
) -> Lsn:
    """Store ``(range_start, goal]`` as consecutive ranges read by one peek, cut at COMMITs.

    Why one peek: every peek, and every slot advance, decodes the WAL again from the slot's
    restart point, which PostgreSQL 15 moves only at running-xacts records (about every 15 s of
    the WAL's writing time), so N peeks over a backlog decode its head N times: one peek and
    one advance cost the source's backend much less time and CPU than a peek and an advance
    per range (see ``benchmarks/HISTORY.md``, "Reading the slot: peeks and advances").

    ``next_bytes(remaining)`` sizes each range as it begins (``remaining``: WAL bytes from its
    start to ``goal``). A range is cut just after the first COMMIT that ends at or past its
    start plus that size and is followed by :data:`CUT_LOOKAHEAD_ROWS` rows, at that COMMIT's
    ``end_lsn``: no record straddles that point, so it is the range's safe point, and the next
    range starts there (the collision: the next transaction's first LSN). The last range ends
    at ``goal`` exactly, under :func:`receive`'s rules (lookahead, straddlers, safe point,
    outcome); the peek reads ``lookahead_bytes`` past ``goal`` for it.

    Each range is stored durably, then handed to ``on_stored`` while the peek goes on. The slot
    is advanced once, to the last stored range's safe point, when the peek ends, or at a cut
    after which ``stop`` is set or ``on_stored`` returned ``False`` (the rest is left unread:
    a caller that cannot take a range at once should not hold the peek's transaction open
    waiting, see ``follow.Follower._receive_rest``). Until then the slot lags
    stored ranges, the state a crash between a store and its advance leaves, which every reader
    finishes first (:func:`_check_position`, ``pipeline.confirm_stored``). Returns where the
    last stored range ends.
    """
    whole = LsnRange(range_start, goal)
    discard_left(store.streaming_dir)
    upto = _peek_limit(conn, slot_name, publication, store, whole, lookahead_bytes)
    halt = threading.Event()
    cutter = _Cutter(store, whole, next_bytes, on_stored, stop, halt, fetch_rows, spill_rows)
    try:
        _stream_peek(conn, slot_name, publication, goal, upto, cutter.consume, fetch_rows, halt)
        conn.commit()
        if not halt.is_set():
            cutter.store_last()
    finally:
        cutter.close()
    if cutter.safe_point is not None:
        advance_slot(conn, slot_name, cutter.safe_point)
        conn.commit()
    return cutter.end


class _Cutter:
    """Consumes one peek's batches for :func:`receive_in_cuts`: one writer and decoder per
    range, the next one taking over the relations the peek announced so far."""

    def __init__(
        self,
        store: OutputStore,
        whole: LsnRange,
        next_bytes: Callable[[int], int],
        on_stored: Callable[[RangeResult], bool],
        stop: threading.Event,
        halt: threading.Event,
        fetch_rows: int,
        spill_rows: int,
    ) -> None:
        self.store = store
        self.goal = whole.end
        self.next_bytes = next_bytes
        self.on_stored = on_stored
        self.stop = stop
        self.halt = halt
        self.fetch_rows = fetch_rows
        self.end = whole.start
        """Where the last stored range ends."""
        self.safe_point: Lsn | None = None
        self.writer = store.writer(whole)
        self.decoder = RangeDecoder(whole, self.writer, spill_rows)
        self.began = time.monotonic()
        self.target = self._target()

    def _target(self) -> int | None:
        """The LSN at or past which the current range is cut; ``None``: it runs to the goal."""
        remaining = self.goal - self.end
        size = self.next_bytes(remaining)
        return None if size >= remaining else int(self.end) + size

    def consume(self, rows: list[Any]) -> None:
        if self.halt.is_set():
            return  # stopped at a cut: the producer's last fetch is not wanted
        offset = 0
        while self.target is not None:
            at = _cut_index(rows, offset, self.target, self.goal, len(rows) < self.fetch_rows)
            if at is None:
                break
            self.decoder.feed(rows[offset : at + 1])
            end = Lsn(rows[at][0])
            straddlers = _straddlers(rows, at + 1, end)
            taken = self._store(self.decoder.cut(end, straddlers, time.monotonic() - self.began))
            offset = at + 1
            if not taken or self.stop.is_set():
                self.halt.set()
                return
            rng = LsnRange(end, self.goal)
            self.writer = self.store.writer(rng)
            self.decoder = self.decoder.successor(rng, self.writer)
            self.began = time.monotonic()
            self.target = self._target()
        if offset < len(rows):
            self.decoder.feed(rows[offset:] if offset else rows)

    def store_last(self) -> None:
        """The peek has ended: the last range, to the goal."""
        self._store(self.decoder.finish(time.monotonic() - self.began))

    def _store(self, result: RangeResult) -> bool:
        """Store the range durably and hand it on; ``False``: the taker wants the peek ended."""
        stored = self.writer.commit(self.decoder.manifest(result))
        failpoint("receive.after_store")
        self.end = Lsn(result.endpos)
        self.safe_point = Lsn(result.safe_point)
        return self.on_stored(stored.manifest.result)

    def close(self) -> None:
        """Remove the writer's folder of a range that was not stored (a stop, an error)."""
        if self.writer.tmp.exists():
            self.writer.abort()


def _cut_index(rows: list[Any], offset: int, target: int, goal: int, last: bool) -> int | None:
    """The row of the first COMMIT from ``offset`` on that ends at or past ``target`` (and
    before ``goal``) with :data:`CUT_LOOKAHEAD_ROWS` rows after it, unless this is the last
    batch; ``None`` if there is none. A COMMIT row's LSN is its ``end_lsn``; COMMITs come in
    WAL order, so the batch's last one says whether any reaches ``target``."""
    for lsn, data in reversed(rows):
        if data[0] == KIND_COMMIT:
            if lsn < target:
                return None
            break
    else:
        return None
    until = len(rows) if last else len(rows) - CUT_LOOKAHEAD_ROWS
    for at in range(offset, until):
        lsn, data = rows[at]
        if data[0] == KIND_COMMIT and lsn >= target:
            return at if lsn < goal else None
    return None


def _straddlers(rows: list[Any], after: int, end: Lsn) -> list[Straddler]:
    """Transactions shown after a cut at ``end`` that began before it (their Begin row's LSN
    is their first LSN; its ``final_lsn`` is the start of their COMMIT record)."""
    found = []
    for lsn, data in rows[after : after + CUT_LOOKAHEAD_ROWS]:
        if data[0] == KIND_BEGIN and lsn < end:
            begin = decode(data)
            assert isinstance(begin, Begin)
            found.append(Straddler(begin.xid, lsn, begin.final_lsn))
    return found


def _peek_limit(
    conn: psycopg.Connection[Any],
    slot: str,
    publication: str,
    store: OutputStore,
    rng: LsnRange,
    lookahead_bytes: int,
) -> Lsn:
    """Check that ``rng`` may be received now (:func:`_check_publication`,
    :func:`_check_position`); returns how far its peek decodes: ``lookahead_bytes`` past its
    end, but not past the source's flushed WAL."""
    _check_publication(conn, publication)
    flush = _check_position(conn, slot, store, rng)
    return Lsn(max(int(rng.end), min(int(flush), int(rng.end) + lookahead_bytes)))


def _check_publication(conn: psycopg.Connection[Any], publication: str) -> None:
    """pgoutput looks the publication up only when it decodes a change: without this check an
    idle range would pass and the next busy one fail midway."""
    found = conn.execute("SELECT FROM pg_publication WHERE pubname = %s", (publication,))
    if found.fetchone() is None:
        conn.rollback()
        raise ReceiveError(
            f"publication {publication} does not exist on the source: create the publication "
            "(pgcdc snapshot does) or set PGCDC_PUBLICATION to an existing one"
        )
    conn.commit()


def _check_position(
    conn: psycopg.Connection[Any], slot: str, store: OutputStore, rng: LsnRange
) -> Lsn:
    """Refuse ranges that would lose or duplicate data, before reading anything; returns the
    source's flushed WAL position that ``endpos`` was checked against."""
    info = released(conn, slot)
    confirmed = info.confirmed_flush_lsn
    if confirmed is None:
        raise ReceiveError(f"slot {slot} has no confirmed position yet; re-create it")
    flush = current_flush_lsn(conn)
    if rng.end > flush:
        raise ReceiveError(
            f"endpos {rng.end} is beyond the source's flushed WAL {flush}: transactions "
            "could still commit before it; choose an endpos at or before the flush position "
            "(pg_current_wal_flush_lsn()) or wait"
        )
    if confirmed > rng.start:
        raise ReceiveError(
            f"range {rng.key} starts at {rng.start}, before slot {slot}'s confirmed position "
            f"{confirmed}, and is not in the store: its changes were consumed elsewhere (another "
            "consumer of the slot, or a store that was deleted). The data between them is lost "
            "to this slot: run pgcdc recover, which compares the target with the source and "
            "copies what differs"
        )
    if confirmed < rng.start:
        previous = store.range_ending_at(rng.start)
        if previous is None:
            raise ReceiveError(
                f"range {rng.key} starts at {rng.start} but the slot {slot} is at {confirmed} and "
                f"no stored range ends at {rng.start}: receive the range starting at {confirmed} "
                "first (ranges must be received in LSN order, without gaps)"
            )
        # A crash between storing the previous range and advancing the slot: finish it now.
        advance_slot(conn, slot, previous.safe_point)
        conn.commit()
    return flush


def _stream_peek(
    conn: psycopg.Connection[Any],
    slot: str,
    publication: str,
    endpos: Lsn,
    upto: Lsn,
    consume: Callable[[list[Any]], None],
    fetch_rows: int,
    halt: threading.Event | None = None,
) -> None:
    params = {
        "slot": slot,
        "upto": str(upto),
        "endpos": str(endpos),
        # pgoutput splits this option as a list of identifiers: quote the name.
        "publications": '"' + publication.replace('"', '""') + '"',
    }
    gc_was_enabled = gc.isenabled()
    gc.disable()  # millions of short-lived objects, no cycles: the collector only costs time
    try:
        watch = PublicationWatch(publication)
        conn.add_notice_handler(watch.notice)
        try:
            with conn.cursor(name="pgcdc_receive", binary=True) as cur:
                with reading_errors(slot, publication):
                    cur.execute(_PEEK, params)
                _overlap(lambda: cur.fetchmany(fetch_rows), consume, halt)
            with reading_errors(slot, publication):
                watch.refuse()
        finally:
            conn.remove_notice_handler(watch.notice)
    finally:
        if gc_was_enabled:
            gc.enable()


@contextlib.contextmanager
def reading_errors(slot: str, publication: str) -> Iterator[None]:
    """What the source says when a slot cannot be read (by a peek or a stream), in one line
    with the fix."""
    try:
        yield
    except psycopg.errors.ObjectInUse as exc:
        raise ReceiveError(
            f"slot {slot} is in use by another process ({server_message(exc)}): "
            "only one receive may read a slot at a time; wait for it to finish"
        ) from None
    except psycopg.errors.UndefinedObject as exc:
        raise ReceiveError(
            f"{server_message(exc)}: create the publication {publication} "
            "(pgcdc snapshot does) or set PGCDC_PUBLICATION to an existing one"
        ) from None


def _overlap(
    fetch: Callable[[], list[Any]],
    consume: Callable[[list[Any]], None],
    halt: threading.Event | None = None,
) -> None:
    """Fetch the next batch on a thread while this one is decoded.

    The fetch mostly waits on the socket (GIL released) and decoding is mostly NumPy/Arrow,
    so the two overlap; serial, the receive fell well short of the raw read rate (see
    ``benchmarks/receive.py`` and ``benchmarks/HISTORY.md``).
    Once ``halt`` is set the producer fetches no more (the consumer wants no more rows).
    """
    batches: queue.Queue[list[Any] | BaseException | None] = queue.Queue(maxsize=2)

    def producer() -> None:
        try:
            while not (halt is not None and halt.is_set()) and (rows := fetch()):
                batches.put(rows)
            batches.put(None)
        except BaseException as exc:  # handed to the consumer, re-raised there
            batches.put(exc)

    thread = threading.Thread(target=producer, name="pgcdc-receive-fetch", daemon=True)
    thread.start()
    try:
        while (item := batches.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            consume(item)
    finally:
        # On a decode error, let the producer finish its current fetch and stop.
        while thread.is_alive():
            with contextlib.suppress(queue.Empty):
                batches.get(timeout=0.1)
        thread.join()
