"""Receive consecutive ranges from a slot stream, for a follow that keeps up with its source.

The stream (:mod:`.walsender`) delivers a transaction a few milliseconds after its COMMIT is
flushed, where a peek loop polls (every ``follow_cut_ms``) and then decodes again from the
slot's restart point. Ranges are stored exactly as :mod:`.peek` stores them: the same
decoder, the same writer, the same durable store; only where they end differs. A range ends at
a point the stream vouched for (the furthest of the last COMMIT's ``end_lsn`` and the last
keepalive's ``walEnd``, outside a transaction), so it never holds part of a transaction, its
endpos outcome is ``at_commit_boundary`` or ``between_transactions`` (``empty`` on an idle
source; ``mid_transaction`` while a transaction streamed ahead of its COMMIT is held, see
below) and its safe point is its end. The slot is confirmed there, by the stream's status
update, only once the range is stored: a process killed anywhere leaves the slot at or before
the store's last range, the state every reader finishes first (``pipeline.confirm_stored``).

When a range is cut
    at the first point outside a transaction once the taker is ``ready`` for it (the
    follower's applier idle, nothing queued: the COMMIT at hand waits for nothing), or once
    ``cut_s`` went by since the last cut, or once the range received ``cap`` bytes of
    messages; an empty range every ``idle_s``, or once ``idle_bytes`` of WAL went by, so the
    slot keeps moving while the published tables are idle. Cut when the applier is ready, a
    range holds what came in while the one before was stored and applied: at a low rate a
    COMMIT is stored as it arrives, under load ranges grow with the applier's time, and a
    COMMIT never waits for a clock (see ``benchmarks/HISTORY.md``, "The cut when the applier
    is ready").
A big transaction
    (on PostgreSQL 14 and later) comes in blocks while it is written, each spooled to disk
    (:mod:`.streamed`), and enters the range of its Stream Commit, whole, in commit order. The
    stream is not left for a backlog while one is held: a peek, or a new stream, would decode
    and send it again from its start.
When the stream is left
    at a stop (a range whose transactions are all at hand is stored first; a transaction half
    received is read again by whoever reads next), or when ``on_stored`` says so (the follower
    does once the source's WAL is far ahead of the stream: a backlog, which peeks read faster,
    see ``benchmarks/slot_reading.py``). While the taker has no room for a range, the stream
    waits: the source keeps what is not read, and the walsender is told the session is alive.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable

from ..decode.pgoutput import (
    KIND_STREAM_ABORT,
    KIND_STREAM_COMMIT,
    KIND_STREAM_START,
    KIND_STREAM_STOP,
    StreamAbort,
    StreamCommit,
    StreamStart,
    decode_stream_control,
)
from ..decode.pgoutput_batch import KIND_BEGIN, KIND_COMMIT
from ..decode.range_decoder import RangeDecoder
from ..failpoints import failpoint
from ..lsn import _MAX, Lsn, LsnRange
from ..store.output_store import OutputStore, RangeResult
from .peek import reading_errors
from .streamed import StreamedTransactions
from .walsender import Keepalive, Message, SlotStream

POLL_S = 0.1
"""The longest the stream waits for a message before it looks at the clock and the stop."""
READY_POLL_S = 0.002
"""With transactions at hand, how often the stream looks whether the taker became ready (a
look is a function call: at 500 a second, about a millisecond of CPU)."""
FEED_ROWS = 20_000
"""Messages decoded at a time (as a peek's fetch)."""
OPEN_END = Lsn(_MAX)
"""The end of a range still being received (its writer's bound until it is cut)."""


def receive_streaming(
    dsn: str,
    slot: str,
    publication: str,
    store: OutputStore,
    start: Lsn,
    *,
    cut_s: float,
    cap: int,
    idle_s: float,
    idle_bytes: int,
    on_stored: Callable[[RangeResult, bool], bool | None],
    stop: threading.Event,
    on_busy: Callable[[float, float], None] = lambda began, ended: None,
    ready: Callable[[], bool] = lambda: False,
    spill_rows: int = 100_000,
    work_mem: int = 0,
) -> Lsn:
    """Stream the slot from ``start`` (its confirmed position, where the store's chain ends)
    and store ranges (see the module's docstring) until ``stop`` is set or ``on_stored``
    returns ``False``. ``on_stored(result, holding)`` hands each stored range on (``holding``:
    a transaction is held, received ahead of its COMMIT, that leaving now would have sent
    again from its start): ``True``, taken, go on; ``False``, taken, leave the stream;
    ``None``, no room yet: it is called again (the stream meanwhile tells the walsender it is
    alive, so a slow taker does not get the session cut off by ``wal_sender_timeout``).
    ``on_busy(began, ended)`` gets each interval of work (decoding, storing; not the waits for
    messages), in order. ``ready()``: whether the taker would start on a range at once (cut
    then, not at ``cut_s``). ``work_mem``: the walsender's ``logical_decoding_work_mem`` (see
    :class:`~.walsender.SlotStream`). Returns where the last stored range ends; the stream is
    closed."""
    writer = store.writer(LsnRange(start, OPEN_END))
    decoder = RangeDecoder(LsnRange(start, OPEN_END), writer, spill_rows)
    rows: list[Message] = []
    streamed = StreamedTransactions(store.streaming_dir)
    block: list[Message] = []  # the stream block being received
    block_xid: int | None = None  # whose block it is; None: outside a block
    inside = False  # between a BEGIN and its COMMIT
    boundary = int(start)  # the furthest point outside a transaction the stream vouched for
    commits = received = 0
    began = time.monotonic()

    def cut_due() -> bool:
        """Whether the range is to be cut at the COMMIT at hand (see the module docstring)."""
        return time.monotonic() - began >= cut_s or received >= cap or ready()

    gc_was_enabled = gc.isenabled()
    gc.disable()  # as receive's peek: many short-lived objects, no cycles
    try:
        with (
            reading_errors(slot, publication),
            SlotStream(dsn, slot, publication, start, work_mem) as stream,
        ):
            while True:
                # Transactions at hand wait for the cut no longer than its deadline, and look
                # again at the taker every READY_POLL_S (not at all once it is ready).
                wait = (
                    POLL_S
                    if inside or not commits
                    else 0.0
                    if ready()
                    else min(READY_POLL_S, began + cut_s - time.monotonic())
                )
                for item in stream.messages(min(POLL_S, max(0.0, wait))):
                    if isinstance(item, Keepalive):
                        if not inside:
                            boundary = max(boundary, item.wal_end)
                        continue
                    data = item[1]
                    kind = data[0]
                    if block_xid is not None:  # a transaction streamed ahead of its COMMIT
                        if kind != KIND_STREAM_STOP:
                            block.append(item)
                            if len(block) < FEED_ROWS:
                                continue
                        spooled = time.monotonic()
                        streamed.add(block_xid, block)
                        block = []
                        on_busy(spooled, time.monotonic())
                        if kind == KIND_STREAM_STOP:
                            block_xid = None
                        continue
                    if kind in _STREAM_CONTROL:
                        control = decode_stream_control(data)
                        if isinstance(control, StreamStart):
                            streamed.begin(control.xid, item[0])
                            block_xid = control.xid
                        elif isinstance(control, StreamAbort):
                            streamed.abort(control.xid, control.subxid)
                        elif isinstance(control, StreamCommit):
                            fed = time.monotonic()
                            if rows:
                                decoder.feed(rows)
                                rows = []
                            received += streamed.spooled_bytes(control.xid) + len(data)
                            decoder.feed_streamed(
                                control.xid,
                                control.commit_lsn,
                                control.end_lsn,
                                control.commit_ts_us,
                                stream.alive_through(streamed.commit(control.xid)),
                            )
                            on_busy(fed, time.monotonic())
                            commits += 1
                            boundary = max(boundary, control.end_lsn)
                            if cut_due():
                                break
                        continue
                    rows.append(item)
                    received += len(data)
                    if kind == KIND_BEGIN:
                        inside = True
                    elif kind == KIND_COMMIT:
                        inside = False
                        commits += 1
                        boundary = max(boundary, item[0])
                        if cut_due():
                            break
                    if len(rows) >= FEED_ROWS:
                        fed = time.monotonic()
                        decoder.feed(rows)
                        rows = []
                        on_busy(fed, time.monotonic())
                if stop.is_set() and (inside or not commits):
                    return start
                now = time.monotonic()
                due = commits and (cut_due() or stop.is_set())
                idle = (
                    not commits
                    and boundary > start
                    and (now - began >= idle_s or boundary - start >= idle_bytes)
                )
                if inside or not (due or idle):
                    stream.feedback(int(start))
                    continue
                if rows:
                    decoder.feed(rows)
                    rows = []
                result = decoder.close_at(boundary, now - began, streamed.straddlers(boundary))
                stored = writer.commit(decoder.manifest(result))
                on_busy(now, time.monotonic())
                failpoint("receive.after_store")
                start = Lsn(boundary)
                stream.feedback(int(start))
                while (go_on := on_stored(stored.manifest.result, bool(streamed))) is None:
                    stream.feedback(int(start), force=True)  # the walsender's timeout
                if not go_on or stop.is_set():
                    return start
                writer = store.writer(LsnRange(start, OPEN_END))
                decoder = decoder.successor(LsnRange(start, OPEN_END), writer)
                commits = received = 0
                began = time.monotonic()
    finally:
        streamed.close()
        if writer.tmp.exists():
            writer.abort()
        if gc_was_enabled:
            gc.enable()


_STREAM_CONTROL = frozenset(
    (KIND_STREAM_START, KIND_STREAM_STOP, KIND_STREAM_COMMIT, KIND_STREAM_ABORT)
)
