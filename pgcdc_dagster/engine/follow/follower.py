"""Follow the source: receive and apply continuously in one process, range after range.

Data flow::

    receiver thread ──(stored range, lag)──▶ bounded queue ──▶ applier thread ──▶ done queue
    (peek or stream, store, confirm the slot)   (2 ranges)     (one target txn     │
                                                                with the origin)    ▼
                                                                   caller: yields each range

Ranges are cut at commit boundaries by construction (a range holds the transactions whose
COMMIT ends in it, see :mod:`..source.peek`): while changes flow, the receiver cuts one when the
applier is ready for it (reading by stream; at the latest every ``follow_cut_ms``, and every
``follow_cut_ms`` reading by peeks) and caps each at ``follow_range_bytes`` of WAL, so on a
backlog the applier works on range N while the receiver reads range N+1. A backlog of one to
two ranges is shaped by :func:`backlog_range_bytes`: small first (the applier starts after a
fraction of a second, not after a whole capped range), doubling, and halving towards the end
of the backlog (the last range's apply overlaps nothing). Its first two ranges are a peek
each; the rest is one more, cut into ranges at COMMITs as its rows stream
(:func:`~..source.peek.receive_in_cuts`), since every peek decodes the WAL again from the
slot's restart point; that peek's first range does not grow (the applier waits for it while
the source decodes the whole peek).

Every range goes through the same store, the same slot advance (only once it is durable) and
the same apply (one target transaction that also moves the replication origin) as a range run
on its own: follow adds no durable state and no new invariant, so a follower killed anywhere is
resumed by anything that asks :mod:`..control.next_step` (another follower, a per-range run,
``pgcdc catchup``).

Reading by stream: a follow without an endpos that keeps up (not in a backlog, at most
:data:`STREAM_WITHIN_BYTES` behind the source's flush) reads the slot by a ``START_REPLICATION``
stream (:mod:`..source.stream`, ``follow_read``), which decodes each WAL record once where every
peek decodes again from the slot's restart point: after a big insert into an unpublished table,
a peek loop stays seconds behind until the restart point passes it, the stream only for its one
decode (see ``benchmarks/HISTORY.md``, ``benchmarks/freshness.py``: the follow's stream against
its peek loop). Its ranges go through the same store and the same applier; the slot is
confirmed by the stream's status update once a range is stored. Once the source's WAL runs more
than ``follow_range_bytes`` ahead of the stream, the stream ends and the peeks read the backlog,
faster (``benchmarks/slot_reading.py``); the stream comes back once they have caught up. Not
when the range behind holds no transaction, or the stream holds one sent before its COMMIT
(:mod:`..source.streamed`): the walsender is then busy with a transaction still open (or WAL
the publication does not hold), which every peek would decode again from its start.

The receiver reads its own cuts only :data:`CUT_LOOKAHEAD_BYTES` past their end, the endpos
range the full lookahead of :mod:`..source.peek` (a cut inside one peek looks at the rows after it,
:data:`~..source.peek.CUT_LOOKAHEAD_ROWS`). That is safe for any lookahead: the peek decodes
the WAL record that crosses its limit, so a COMMIT record containing the cut is seen and the
slot stops at its start (tested without any lookahead in ``test_receive``). The lookahead only
lets the report see a transaction still open across the cut (``mid_transaction``); a cut at the
flushed position, as every live range is, has none.

Idle source: a poll that finds no committed published change stores nothing and leaves the slot
where it is; an empty range is still stored (and the slot moved) every ``follow_idle_s`` or once
16 MiB of WAL went by, so retained WAL stays bounded while the published tables are idle.

Riding through an outage: a follow without an endpos that loses its source or target (a restart,
a failover, a network failure) or cannot reach it again waits (0.5 s, then every second) and
starts over from the durable state, as a new follow would: ranges stored and not applied are
applied, then streaming goes on from the chain's end. Nothing needs undoing, since every range
is stored, applied and the slot moved whole or not at all. Before it goes on, it makes sure it
still runs under the range lock: a target that restarted freed it, so the follower takes it
again, or ends (:class:`RangeTakenError`) if another catch-up took it meanwhile. It gives up
after ``follow_retry`` seconds of outage; a follow that never reached its servers, or with an
endpos (``catchup``), fails at once, as does any error that is not an outage.

Making way for ``pgcdc add-table`` and ``pgcdc cutover``: the follower looks for a command asking
for the range when one notifies it (at the latest every :data:`ASK_POLL_S`); then its session
ends at a range boundary as for a stop, it runs none while the command has the range
(:mod:`..control.range_lock`'s docstring says what must hold), and a new session starts from the
durable state (with the tables an add added). A follower running under the asking session itself
(the cutover's own catch-up) does not make way for it. An add asks for the range only once its
tables are copied (to apply their changes held back meanwhile): while they copy, and after an
add that ended before finishing, the follow goes on applying the other tables' changes and
holds theirs back (:func:`~..apply.transaction.apply_range`).

Stopping: at ``endpos`` (its last range ends exactly there, stored even when empty, so its
endpos outcome is classified as for any range), or on :meth:`Follower.stop` (the CLI's SIGTERM
or SIGINT, a Dagster termination, the caller closing the generator). A stop lets the range being
received be stored and every queued range be applied, then returns: nothing is left half done,
and the position is wherever the last range ended.

Why the state machine is one module: :class:`Follower` (its threads, the queue between them,
peek or stream, the outage retries, the lock taken again, making way) shares its stop, its
sessions and its summary across those parts; cut apart, each would reach into the others'
state. What is not state lives beside it: the range-sizing policy (:mod:`.range_sizing`),
what a follow yields and reports (:mod:`.results`), the followers of this process
(:mod:`.registry`).
"""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import select
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import psycopg

from .. import progress
from ..connect import ServerGoneError, connect, server_errors, unavailable
from ..control.next_step import ApplyStored, CaughtUp
from ..control.pipeline import (
    CatchUpStalledError,
    RangeDone,
    SparkProvider,
    apply_stored_range,
    confirm_stored,
    decoding_session,
    next_step,
    store_of,
)
from ..control.range_lock import (
    LockHolder,
    RangeBusyError,
    askers,
    command_holder,
    listen_for_askers,
    lock_holders,
    make_way,
    range_lock,
    who_holds,
)
from ..errors import PgcdcError
from ..failpoints import failpoint
from ..lsn import Lsn, LsnRange
from ..settings import MiB, ReplicationSettings
from ..source.peek import receive, receive_in_cuts
from ..source.slot import current_flush_lsn, released
from ..source.stream import receive_streaming
from ..store.output_store import OutputStore, RangeResult
from . import range_sizing
from .backlog import Backlog
from .outage_clock import OutageClock
from .range_sizing import (
    DECODED_AGAIN_BYTES,
    PEEK_MAX_RANGES,
    STREAM_WITHIN_BYTES,
    backlog_range_bytes,
    decoded_again,
)
from .registry import active_lock, stop_all, track, untrack
from .results import (
    APPLYING,
    END,
    RECEIVING,
    FinishedError,
    Followed,
    Following,
    FollowSummary,
    Idle,
    RangeTakenError,
    done_ranges,
)

__all__ = [
    "END",
    "FinishedError",
    "FollowSummary",
    "Followed",
    "Follower",
    "Following",
    "Idle",
    "RangeTakenError",
    "backlog_range_bytes",
    "done_ranges",
    "stop_all",
    "track",
    "untrack",
]

if TYPE_CHECKING:
    from ..apply.results import ApplyResult

IDLE_WAL_BYTES = 16 * MiB
"""On an idle source, store an empty range (and move the slot) once this much WAL went by."""
POLL_S = 0.05
"""How often the receiver looks at the source's flushed WAL position when nothing moved."""
QUEUE_RANGES = 2
"""Stored ranges waiting for the applier: the receiver is at most this far ahead."""
STREAM_WAIT_S = 1.0
"""How long the stream waits at a time for the applier to take a range (then it tells the
walsender it is alive and waits again)."""
PEEK_WAIT_S = 2.0
"""How long a peek read in cuts waits, its transaction open, for the applier to take a range;
then it ends there (see :meth:`Follower._receive_rest`). On the backlog of
``benchmarks/catchup_cli.py`` each wait is shorter than this (see ``benchmarks/HISTORY.md``,
"The follow's first ranges")."""
ASK_POLL_S = 1.0
"""How often a follower looks for a command asking for the range (one query on a target
connection of its own) when no notification woke it first: the command waits about the range
being received and those queued, at most this long more, for the follow to make way."""
WATCHING = "pgcdc follow (asked for the range?)"
"""The ``application_name`` of a follower's sessions that look for a command asking for the
range: named apart from its applying and receiving sessions."""
MAKE_WAY_POLL_S = 0.2
"""How often a follower that made way looks whether the add has ended."""
CUT_LOOKAHEAD_BYTES = 1 * MiB
"""How far past its own cuts the receiver decodes, to report transactions open across them.
The endpos range keeps :mod:`..source.peek`'s default: its outcome is what the user asked about."""


class Follower:
    """One follow of the slot. Use :meth:`run` once; :meth:`stop` from any thread or a signal
    handler. The caller must hold the range lock (a Dagster run does, for its whole life)."""

    def __init__(
        self,
        settings: ReplicationSettings,
        endpos: Lsn | None = None,
        *,
        spark: SparkProvider = None,
        interrupts: tuple[type[BaseException], ...] = (KeyboardInterrupt,),
        lock_session: int | None = None,
        lock_holder: str | None = None,
    ) -> None:
        self.settings = settings
        self.endpos = endpos
        self.spark = spark
        self.interrupts = interrupts
        self.lock_session = lock_session
        """The server process of the session holding the range lock this follower runs under
        (``None``: not known, not checked after an outage)."""
        self.lock_holder = lock_holder
        """What that session calls itself (``run <id>``), the name under which the lock is
        taken again after an outage; ``None``: ``follow pid <this process> (after an
        outage)``."""
        self.summary = FollowSummary()
        self._stop = threading.Event()
        """Set to end the current session: by :meth:`stop`, or by a session's own failure."""
        self._stop_requested = False
        self._stop_reason = ""
        self._to_apply: queue.Queue[tuple[RangeResult, int] | None] = queue.Queue(QUEUE_RANGES)
        self._done = Backlog()
        self._applier_waits = threading.Event()
        """Set while the applier waits for a range (see :meth:`_applier_ready`)."""
        self._min_cut_s = 0.0  # see pace()
        self._cut_at = 0.0  # when the stream last stored a range (time.monotonic())
        self._errors: list[BaseException] = []
        self._session_errors: list[BaseException] = []
        self._reached_servers = False
        self._outages = OutageClock(settings.follow_retry)
        """The source's and target's outages; :attr:`summary` reports them once closed."""
        self._relocked = contextlib.ExitStack()
        """A range lock taken again after an outage, held until the follower ends."""
        self._reached_endpos = False
        self._asked = False
        """A command asked for the range: the session ends at a boundary, and :meth:`_make_way`."""
        self._ended = threading.Event()
        """Set once the follower is closing: the watcher of askers ends (woken by
        :attr:`_wake`)."""
        self._wake: tuple[int, int] | None = None
        self._peek_ranges = 0  # the next peek's span in capped ranges; 0: PEEK_MAX_RANGES
        self._sessions = 0  # sessions begun; each range's Followed says in which
        self._started = time.monotonic()
        self._lead: threading.Thread | None = None
        self._threads: list[threading.Thread] = []
        self._rates: collections.deque[tuple[float, int]] = collections.deque([(self._started, 0)])

    def stop(self, reason: str) -> None:
        """Stop at the next range boundary. Safe from a signal handler: no lock, a flag and
        then the event (:meth:`_reset_stop` reads them in the other order)."""
        if not self._stop_requested:
            self._stop_reason = reason
            self._stop_requested = True
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop_requested

    def _reset_stop(self) -> None:
        """Clear a session's own stop, never one :meth:`stop` asked for."""
        self._stop.clear()
        if self._stop_requested:
            self._stop.set()

    def start(self) -> Follower:
        """Start working in the background (idempotent): ranges an earlier run stored are
        applied first, then receive and apply run on their own threads. :meth:`run` takes the
        ranges as they are done; they wait for it in a :class:`~.backlog.Backlog` (on disk past
        the first thousand), so a follower started before its consumer exists (the CLI's
        head start, see :func:`~.process.head_start`) loses none, and one whose run
        cannot record (Dagster's storage away) is not held back, in bounded memory."""
        with active_lock:
            if self._lead is not None:
                return self
            track(self)
            self._started = time.monotonic()
            self._lead = threading.Thread(target=self._lead_loop, name="pgcdc-follow", daemon=True)
            watcher = threading.Thread(target=self._watch_askers, name="pgcdc-askers", daemon=True)
            self._threads.append(watcher)
            self._wake = os.pipe()
        self._lead.start()
        watcher.start()
        return self

    def run(self, idle_s: float | None = None) -> Iterator[Any]:
        """Yield every range as it is applied, until ``endpos`` or a stop (and, with
        ``idle_s``, an :class:`Idle` each time that long went by without one). An interrupt
        (one of ``interrupts``) raised while waiting is taken as a stop; an error of the
        follower's threads is raised here once they have all ended."""
        self.start()
        try:
            yield from done_ranges(self._done, self.interrupts, self.stop, idle_s)
        finally:
            self.close(self._stop_reason or "closed")
            self._done.close()
        if self._errors:
            raise self._errors[0]

    def close(self, reason: str) -> None:
        """Stop at the next range boundary and wait for the threads to get there."""
        self.stop(reason)
        self._ended.set()
        if self._wake is not None:
            os.write(self._wake[1], b"x")
        for thread in [self._lead, *self._threads]:
            while thread is not None and thread.is_alive():
                try:
                    thread.join(timeout=0.2)
                except self.interrupts:
                    continue  # already stopping: finish the boundary
        self._relocked.close()
        if self._wake is not None:
            for fd in self._wake:
                os.close(fd)
            self._wake = None
        untrack(self)
        self._outages.ended()  # stopped while it waited: that outage counts too
        self.summary.outages, self.summary.outage_s = self._outages.count, self._outages.total_s
        if not self.summary.stopped_by:
            self.summary.stopped_by = "endpos" if self._reached_endpos else self._stop_reason
            self.summary.close(self._started)

    def _lead_loop(self) -> None:
        """Run sessions (:meth:`_session`) until the endpos, a stop or an error; after an
        outage another session starts once the servers are back (:meth:`_wait_out`). Every way
        out ends the queue of done ranges with ``END``."""
        try:
            while True:
                try:
                    self._make_way()
                    if self._stop_requested:
                        return
                    self._session()
                    if not self._asked or self._stop_requested or self._reached_endpos:
                        return
                except BaseException as exc:
                    if not self._wait_out(exc):
                        raise
                    if self._stop_requested:
                        return
        except BaseException as exc:  # handed to the consumer by run()
            self._errors.append(exc)
            self.stop("error")
        finally:
            self._done.put(END)

    def _session(self) -> None:
        """Finish what is stored and not applied, then receive here while an applier thread
        applies; an error of either ends the session once the applier has applied what was
        queued, and is raised here."""
        self._reset_stop()
        self._sessions += 1
        self._session_errors = []
        self._to_apply = queue.Queue(QUEUE_RANGES)
        if self._outages.under_way:
            self._hold_lock_again()
        for followed in self._finish_stored():
            self._done.put(followed)
        if self._caught_up():
            self._reached_endpos = True
            return
        if self._stop.is_set():
            return
        applier = threading.Thread(target=self._apply_loop, name="pgcdc-follow-apply", daemon=True)
        self._threads.append(applier)
        applier.start()
        try:
            self._receive_loop()
        finally:
            self._put_to_apply(None)  # the applier applies what is queued, then ends
            applier.join()
        if self._session_errors:
            raise self._session_errors[0]

    # -- outages -------------------------------------------------------------------------------

    def _wait_out(self, exc: BaseException) -> bool:
        """Whether the session ended by ``exc`` is to be followed by another: ``exc`` says a
        server is away, this follow has no endpos, reached its servers before and was not
        stopped, and the outage is younger than ``follow_retry``. Then it waits (growing
        pauses, cut short by a stop) and returns True. A spent budget raises ``exc`` again,
        saying so."""
        if (
            not unavailable(exc)
            or self.endpos is not None
            or not self._reached_servers
            or self.settings.follow_retry == 0
            or self._stop_requested
        ):
            return False
        away, pause = self._outages.failed()
        if self._outages.spent(away):
            raise type(exc)(
                f"{exc} (a follow retried for {away:.0f} s: PGCDC_FOLLOW_RETRY)"
            ) from exc
        what = (str(exc).split(": check that", 1)[0].strip().splitlines() or ["away"])[0]
        note = f"{what}; trying again in {pause:g} s ({away:.0f} s away)"
        self._report(None, note=note, retrying=True)
        self._reset_stop()
        self._stop.wait(pause)
        return True

    def _servers_reached(self) -> None:
        """The receiver is connected again: both servers answered this session."""
        self._reached_servers = True
        away = self._outages.ended()
        if away is not None:
            self._report(None, note=f"the servers are back after {away:.1f} s")

    def _hold_lock_again(self) -> None:
        """After an outage or a lost target connection, go on only under the range lock. A
        target that restarted freed it with its sessions (so did a terminated lock session);
        then take it here (held until this follower ends), unless another catch-up took it
        meanwhile (the sensor's next follow run, a command): that one goes on, and this one
        ends. Called by the lead thread between sessions and by the applier thread within one,
        never both at once."""
        if self.lock_session is None:
            return
        settings = self.settings
        holders = lock_holders(settings.target_dsn, settings.slot)
        if any(h.backend_pid == self.lock_session for h in holders):
            return
        if not holders:
            try:
                lock = self._relocked.enter_context(
                    range_lock(
                        settings.target_dsn,
                        settings.slot,
                        self.lock_holder or f"{command_holder('follow')} (after an outage)",
                        own=True,
                    )
                )
            except RangeBusyError as busy:
                holders = busy.holders
            else:
                self.lock_session = lock.session_pid
                return
        raise RangeTakenError(
            f"while its servers were away, another catch-up of slot {settings.slot} took the "
            f"range lock ({who_holds(holders)}): this follow ends here and that one goes on "
            "(pgcdc status shows it)"
        )

    # -- making way for pgcdc add-table (see range_lock's docstring) ---------------------------

    def _watch_askers(self) -> None:
        """Look for a command asking for the range when it notifies, else every
        :data:`ASK_POLL_S`, and end the session at the next range boundary when one does. A
        failed look is left to the session (a server away is its business): the next one
        connects again."""
        assert self._wake is not None
        conn: psycopg.Connection[Any] | None = None
        try:
            while not self._ended.is_set():
                try:
                    if conn is None or conn.closed:
                        conn = connect(
                            self.settings.target_dsn,
                            role="target",
                            autocommit=True,
                            connect_timeout=5,
                            application_name=WATCHING,
                        )
                        listen_for_askers(conn, self.settings.slot)
                    select.select([conn.fileno(), self._wake[0]], [], [], ASK_POLL_S)
                    if self._ended.is_set():
                        return
                    if self._askers(conn):
                        self._asked = True
                        self._stop.set()
                except (psycopg.Error, PgcdcError):
                    if conn is not None:
                        conn.close()
                    conn = None
                    self._ended.wait(ASK_POLL_S)
        finally:
            if conn is not None:
                conn.close()

    def _askers(self, conn: psycopg.Connection[Any]) -> list[LockHolder]:
        """The command asking for the range, unless it is the one this follower runs under."""
        return [h for h in askers(conn, self.settings.slot) if h.backend_pid != self.lock_session]

    def _make_way(self) -> None:
        """Between sessions: run none while a command that asked for the range has it (an
        add, a cutover). Returns at once otherwise, and on a stop.
        Stops the follower when the replication was ended (:mod:`..control.finish`): nothing is left
        to follow (a catch-up, with an endpos, fails saying so)."""
        settings = self.settings
        store = store_of(settings)
        began, said, made = time.monotonic(), "", False
        with connect(
            settings.target_dsn, role="target", autocommit=True, application_name=WATCHING
        ) as conn:
            while not self._stop_requested:
                self._asked = False
                asking = self._askers(conn)
                if asking and not made:
                    make_way(conn, settings.slot, True)
                    made = True
                elif made and not asking:
                    make_way(conn, settings.slot, False)
                    made = False
                    continue  # looked for again with the way closed: one may have just asked
                if not asking:
                    break
                note = (
                    f"made way for {who_holds(asking)}, which asked for the range: it has it "
                    "until it ends"
                )
                if note != said:
                    self._report(None, note=note, waiting_for=note)
                    said = note
                time.sleep(MAKE_WAY_POLL_S)
        waited = time.monotonic() - began
        if said:
            self.summary.made_way += 1
            self.summary.made_way_s = round(self.summary.made_way_s + waited, 3)
        chain = store.chain()
        if chain is not None and chain.finished:  # pgcdc finish ended it
            if self.endpos is not None:  # a catch-up wants an answer: this is it
                raise FinishedError(chain.finished)
            self.stop(chain.finished)
        elif said:
            self._report(None, note=f"going on after {waited:.1f} s without a session")

    # -- before streaming: ranges an earlier run stored and did not apply ------------------

    def _finish_stored(self) -> Iterator[Followed]:
        confirm_stored(self.settings, lambda line: self._report(None, note=line))
        store = store_of(self.settings)
        previous = None
        while not self._stop.is_set():
            step = next_step(self.settings, store.chain_end())
            if not isinstance(step, ApplyStored):
                return
            if step == previous:
                raise CatchUpStalledError(f"{step.describe()} was applied but made no progress")
            applied = apply_stored_range(self.settings, step.range, self.spark)
            self._note_applied(applied)
            self._count(step.stored.manifest.result)
            yield Followed(
                RangeDone(step.stored.manifest.result, applied),
                None,
                time.monotonic(),
                self._sessions,
            )
            previous = step

    def _note_applied(self, applied: ApplyResult) -> None:
        """Count how a range was staged: by Spark's executors, or on the driver because they
        could not read it (its warning shown at once, whatever the run records)."""
        if applied.spark_app is not None:
            self.summary.note_spark(applied)
        for warning in applied.warnings:
            self.summary.driver_staged += 1
            self.summary.driver_staged_why = warning
            self._report(None, note=f"warning: {warning}")

    def _caught_up(self) -> bool:
        if self.endpos is None:
            return False
        return isinstance(next_step(self.settings, self.endpos), CaughtUp)

    # -- streaming -----------------------------------------------------------------------------

    def _receive_loop(self) -> None:
        cpu = time.thread_time()
        try:
            self._receive_ranges()
        finally:
            self.summary.receive_cpu_s = round(
                self.summary.receive_cpu_s + time.thread_time() - cpu, 3
            )

    def _receive_ranges(self) -> None:
        settings = self.settings
        store = store_of(settings)
        start = store.chain_end()
        cap = settings.follow_range_bytes
        cut_s = settings.follow_cut_ms / 1000
        last_kept = time.monotonic()
        previous: int | None = None  # the last range's size, while cut by size
        with (
            server_errors("source", settings.source_dsn),
            decoding_session(settings) as conn,
        ):
            self._servers_reached()
            while not self._stop.is_set():
                cycle = time.monotonic()
                flush = current_flush_lsn(conn)
                conn.commit()
                goal = flush if self.endpos is None else min(flush, self.endpos)
                if self._streams(previous, goal - start):
                    streamed = self._stream(conn, store, start)
                    if streamed is not None:
                        start, last_kept = streamed, time.monotonic()
                        continue
                if previous is not None and (
                    previous == cap or previous >= 2 * range_sizing.FIRST_RANGE_BYTES
                ):
                    # The rest of a backlog, after its first range (its first two when cut
                    # small): peeks of a few ranges, cut as they stream. (A peek's decode,
                    # before its first row comes, runs while the applier applies the range
                    # before; after the first small range alone, the applier would sit idle
                    # and receive and apply overlap less: see benchmarks/HISTORY.md,
                    # benchmarks/catchup_cli.py.)
                    start, sized = self._receive_rest(conn, store, start, goal, previous, flush)
                    if start == self.endpos:
                        self._reached_endpos = True
                        break
                    # Short of the goal: the applier was behind (or a stop); go on from there.
                    previous = sized if start < goal else None
                    continue
                size = backlog_range_bytes(previous, goal - start, cap)
                end = Lsn(min(goal, start + size))
                if end <= start:
                    time.sleep(POLL_S)
                    continue
                final = self.endpos is not None and end == self.endpos
                capped = end == start + size
                due = (
                    final
                    or capped
                    or end - start >= IDLE_WAL_BYTES
                    or cycle - last_kept >= settings.follow_idle_s
                )
                result = receive(
                    settings.source_dsn,
                    settings.slot,
                    settings.publication,
                    store,
                    start,
                    end,
                    conn=conn,
                    keep_empty=due,
                    **({} if final else {"lookahead_bytes": CUT_LOOKAHEAD_BYTES}),
                )
                self.summary.busy.add(RECEIVING, cycle, time.monotonic())
                if result is not None:
                    last_kept = time.monotonic()
                    self._put_to_apply((result, int(flush - end)))
                    start = end
                    if final:
                        self._reached_endpos = True
                        break
                    previous = size if capped and end < goal else None
                    if previous is not None:
                        continue  # a backlog: the next range right away
                self._stop.wait(max(0.0, cycle + cut_s - time.monotonic()))

    def _streams(self, previous: int | None, behind: int) -> bool:
        """Whether to read by stream now: a follow without an endpos that keeps up (not in a
        backlog, at most :data:`STREAM_WITHIN_BYTES` behind the source's flush)."""
        return (
            self.settings.follow_read == "stream"
            and self.endpos is None
            and previous is None
            and behind <= STREAM_WITHIN_BYTES
        )

    def _stream(self, conn: psycopg.Connection[Any], store: OutputStore, start: Lsn) -> Lsn | None:
        """Receive by stream (:mod:`..source.stream`) until a stop, or until the source's WAL
        is more than ``follow_range_bytes`` ahead of a range stored with transactions (a
        backlog: the peeks take it from there; see the module's docstring for when it stays).
        A range the applier has no room for waits, as the peeks' do. Returns where the last
        stored range ends; ``None``: not streamed, the slot's confirmed position is not where
        the store's chain ends (a crash between a store and its confirmation: the next peek
        finishes it first)."""
        settings = self.settings
        if released(conn, settings.slot).confirmed_flush_lsn != start:
            return None

        def stored(result: RangeResult, holding: bool) -> bool | None:
            self._cut_at = time.monotonic()
            lag = max(0, int(current_flush_lsn(conn) - Lsn(result.endpos)))
            conn.commit()
            try:
                self._to_apply.put((result, lag), timeout=STREAM_WAIT_S)
            except queue.Full:
                return False if self._session_errors else None  # the applier failed: end
            # Behind with no transaction to show for it (the walsender is decoding one still
            # open, or WAL the publication does not hold), or holding one streamed ahead of
            # its COMMIT: stay. A peek would decode the same WAL, and again at every peek.
            return lag <= settings.follow_range_bytes or holding or not result.transactions

        self.summary.streams += 1
        try:
            end = receive_streaming(
                settings.source_dsn,
                settings.slot,
                settings.publication,
                store,
                start,
                cut_s=settings.follow_cut_ms / 1000,
                cap=settings.follow_range_bytes,
                idle_s=settings.follow_idle_s,
                idle_bytes=IDLE_WAL_BYTES,
                on_stored=stored,
                stop=self._stop,
                on_busy=lambda began, ended: self.summary.busy.add(RECEIVING, began, ended),
                ready=self._applier_ready,
                work_mem=settings.decoding_work_mem,
            )
        finally:
            released(conn, settings.slot)  # its walsender has let the slot go
        return end

    def _receive_rest(
        self,
        conn: psycopg.Connection[Any],
        store: OutputStore,
        start: Lsn,
        goal: Lsn,
        previous: int,
        flush: Lsn,
    ) -> tuple[Lsn, int]:
        """Receive ``(start, goal]``, or its first :data:`PEEK_MAX_RANGES` capped ranges, by
        one peek (:func:`~..source.peek.receive_in_cuts`), in ranges sized by
        :func:`backlog_range_bytes` from ``previous`` on (towards ``goal``, not the peek's
        end), each handed to the applier as soon as it is stored. Returns where the last
        stored range ends (``goal``, the peek's end, or an earlier cut) and the size planned
        for it.

        The peek's transaction stays open while its rows are consumed, so a range the applier
        has no room for must not be waited for inside it: a source with
        ``idle_in_transaction_session_timeout`` would end the session, and every retry would
        end the same way behind a slow applier. After :data:`PEEK_WAIT_S` the peek ends at that
        cut, the range is queued outside it, and the caller goes on with the next peek.

        The peek's first range is ``previous`` again, not double: the source decodes the whole
        peek before its first row comes back, and the applier, done with the range before,
        waits for that first range; the doubling goes on from the next. A doubled first range
        keeps the applier waiting longer and the whole catch-up takes longer (see
        ``benchmarks/HISTORY.md``, "The follow's first ranges")."""
        cap = self.settings.follow_range_bytes
        span = self._peek_ranges or PEEK_MAX_RANGES
        again = decoded_again(conn, self.settings.slot, start)
        conn.commit()
        if again > max(span * cap, DECODED_AGAIN_BYTES):
            # A transaction open for a long stretch of WAL (a table rewrite, a backfill) holds
            # the slot's restart point before it: every peek decodes it again from there. A
            # peek at least as long as that stretch keeps the total to about twice the WAL,
            # where fixed spans make it grow with the square of the transaction.
            span = -(-again // cap)
        peek_end = Lsn(min(goal, start + span * cap))
        sized = previous // 2  # planned up to previous by its first cut
        began = time.monotonic()
        held: list[tuple[RangeResult, int]] = []

        def next_bytes(remaining: int) -> int:
            nonlocal sized
            sized = backlog_range_bytes(sized, remaining + (goal - peek_end), cap)
            return sized

        def stored(result: RangeResult) -> bool:
            nonlocal began
            now = time.monotonic()
            self.summary.busy.add(RECEIVING, began, now)
            began = now
            item = (result, int(flush - Lsn(result.endpos)))
            try:
                self._to_apply.put(item, timeout=PEEK_WAIT_S)
            except queue.Full:
                held.append(item)
                return False
            return True

        final = self.endpos is not None and peek_end == self.endpos
        end = receive_in_cuts(
            conn,
            self.settings.slot,
            self.settings.publication,
            store,
            start,
            peek_end,
            next_bytes=next_bytes,
            on_stored=stored,
            stop=self._stop,
            **({} if final else {"lookahead_bytes": CUT_LOOKAHEAD_BYTES}),
        )
        for item in held:
            self._put_to_apply(item)
        # A peek that ended because the applier was behind had decoded WAL it did not hand
        # over, which the next peek decodes again: behind a slow applier (a range applied in
        # more than PEEK_WAIT_S) every peek would decode 4 ranges to hand over 1. So the next
        # spans one range, as a peek per range did, and the span doubles back while the
        # applier keeps up.
        self._peek_ranges = 1 if held else min(PEEK_MAX_RANGES, 2 * span)
        return end, sized

    def _applier_ready(self) -> bool:
        """Whether the applier would start on a range at once: it waits, nothing queued. The
        stream cuts its range then (see :mod:`..source.stream`): a COMMIT at hand waits for the
        applier, never for a clock. Paced (:meth:`pace`), not before ``min_cut_s`` went by
        since the last cut."""
        return (
            self._applier_waits.is_set()
            and self._to_apply.empty()
            and time.monotonic() - self._cut_at >= self._min_cut_s
        )

    def pace(self, min_cut_s: float) -> None:
        """Cut a range when the applier is ready only once ``min_cut_s`` went by since the
        last cut (0: at once; never later than ``follow_cut_ms`` still). Why: each range costs
        its run some events; a run whose records trail the applies (its process short of CPU)
        asks for fewer, bigger ranges until they catch up, so the trail stays bounded."""
        self._min_cut_s = max(0.0, min_cut_s)

    def _put_to_apply(self, item: tuple[RangeResult, int] | None) -> None:
        """Blocks while the applier is ``QUEUE_RANGES`` behind (the bound on how far receive
        runs ahead), unless the applier has failed."""
        while not self._session_errors or item is None:
            try:
                self._to_apply.put(item, timeout=0.2)
                return
            except queue.Full:
                if self._session_errors:
                    return

    def _apply_loop(self) -> None:
        """Apply each range received, on one target connection for the whole follow (a new
        one per range would add a connection's set-up to every apply, and cost the server a
        backend; see ``benchmarks/HISTORY.md``, "Sessions: their settings and set-up")."""
        cpu = time.thread_time()
        target: psycopg.Connection[Any] | None = None
        try:
            while True:
                self._applier_waits.set()
                item = self._to_apply.get()
                self._applier_waits.clear()
                if item is None:
                    break
                received, lag = item
                failpoint("catchup.before_apply")
                began = time.monotonic()
                rng = LsnRange.from_key(received.range_key)
                kept = target is not None
                if target is None:
                    target = self._connect_target()
                try:
                    applied = apply_stored_range(self.settings, rng, self.spark, target)
                except ServerGoneError:
                    target.close()
                    target = None
                    if not kept:
                        raise
                    # The kept connection died between ranges (a target restart, an idle
                    # timeout): once more on a new one, as a connection per range would
                    # have. Safe whatever the first try did: an apply ends with its COMMIT or
                    # without a trace, and a range already applied is found so. A target that
                    # restarted took the range lock with it: held again first, or this ends.
                    target = self._connect_target()
                    self._hold_lock_again()
                    self.summary.target_reconnects += 1
                    applied = apply_stored_range(self.settings, rng, self.spark, target)
                self.summary.busy.add(APPLYING, began, time.monotonic())
                self._note_applied(applied)
                self._count(received, lag)
                done = RangeDone(received, applied)
                self._done.put(Followed(done, lag, time.monotonic(), self._sessions))
        except BaseException as exc:  # raised by the session once the receiver has stopped
            self._session_errors.append(exc)
            self._stop.set()
        finally:
            if target is not None:
                target.close()
        self.summary.apply_cpu_s = round(self.summary.apply_cpu_s + time.thread_time() - cpu, 3)

    def _connect_target(self) -> psycopg.Connection[Any]:
        return connect(self.settings.target_dsn, role="target", autocommit=True)

    def _count(self, received: RangeResult, lag_bytes: int | None = None) -> None:
        summary = self.summary
        summary.ranges += 1
        summary.transactions += received.transactions
        summary.changes += received.changes
        summary.last = received
        self._report(lag_bytes, received.range_key)

    def _report(
        self,
        lag_bytes: int | None,
        range_key: str | None = None,
        note: str = "",
        retrying: bool = False,
        waiting_for: str = "",
    ) -> None:
        if not progress.active():
            return
        summary = self.summary
        now = time.monotonic()
        self._rates.append((now, summary.changes))
        while len(self._rates) > 2 and now - self._rates[0][0] > 5:
            self._rates.popleft()
        t0, c0 = self._rates[0]
        rate = (summary.changes - c0) / (now - t0) if now > t0 else 0.0
        progress.publish(
            progress.FollowProgress(
                summary.ranges,
                summary.transactions,
                summary.changes,
                now - self._started,
                rate,
                lag_bytes,
                range_key,
                note,
                retrying,
                waiting_for,
            )
        )
