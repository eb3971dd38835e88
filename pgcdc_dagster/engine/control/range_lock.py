"""The range lock: one catch-up of a slot at a time, whoever starts it, and who is running now.

A session-level advisory lock on the target, taken by whatever receives or applies ranges of a
slot (a Dagster run holds it for its whole life, the snapshot too) and released by the server
the moment the holder's connection goes: a process that dies, however it dies, never leaves it
taken. That makes the lock the one honest answer to "is a catch-up running?": Dagster's run
records are a view that goes stale when a worker is SIGKILLed, the lock does not.

The holder names itself in its connection's ``application_name`` (``pgcdc lock run <id>``), so
:func:`lock_holders` can say which run holds it. TCP keepalives are set on the session so the
server also frees the lock when the holder's machine vanishes (about 25 s), not only when its
process exits.

The lock is an orchestration aid, not what keeps data correct: two appliers are excluded by
the replication origin's session (:mod:`..apply.origin`), two receivers by the slot being in use,
and two writers of one range by the store's atomic rename.

**Making way.** ``pgcdc add-table`` and ``pgcdc cutover`` need the range to themselves for a
while, and a follow holds the lock for days. So a follow makes way instead of being stopped,
with two more advisory locks of the slot (:func:`lock_key`'s kinds), both session-level so a
process that dies drops them:

* the command asking holds :data:`ASKING` from before it asks until it has ended (one at a
  time), and notifies the follow (:func:`listen_for_askers`);
* a follow that sees it (:func:`askers`) ends its session at a range boundary, nothing queued
  left unapplied, and holds :data:`MADE_WAY` while it runs no session; the command goes on
  under the follow's lock once it sees that (:func:`range_lock_or_way`), and the follow starts
  its next session once :data:`ASKING` is gone.

What must hold: the command never works while a follow runs a session. The command takes
:data:`ASKING` and only then looks for :data:`MADE_WAY`; the follow releases :data:`MADE_WAY`
and only then looks for :data:`ASKING` (taking it again if it is there). The server's lock table
orders the four steps, so either the follow sees the command or the command sees no way made.
A follow that dies meanwhile frees the range lock; a catch-up that takes it then (a new follow
makes way too) finds the store's chain saying tables are being added and holds their changes
back (:mod:`..apply.transaction`), as every apply does while an add copies them. A follow run by the
command itself (the cutover's catch-up) runs under the asking session and does not make way for
it.
"""

from __future__ import annotations

import os
import re
import threading
import time
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from ..connect import ServerGoneError, connect, server_errors
from ..errors import PgcdcError
from ..processes import pid_running

APPLICATION_PREFIX = "pgcdc lock "
_KEEPALIVES = "-c tcp_keepalives_idle=10 -c tcp_keepalives_interval=5 -c tcp_keepalives_count=3"


class RangeBusyError(PgcdcError):
    """Another catch-up of the same slot holds the range lock: :attr:`holders` (as the failed
    try found them, so a caller names them without asking the server again)."""

    def __init__(self, message: str, holders: Sequence[LockHolder] = ()) -> None:
        super().__init__(message)
        self.holders = list(holders)


@dataclass(frozen=True)
class LockHolder:
    """A server session holding the range lock."""

    holder: str
    """What the holder called itself: ``run <run id>``, or ``pid <pid>`` outside Dagster."""
    backend_pid: int
    client_addr: str | None


RANGE, ASKING, MADE_WAY, TABLES = 0, 1, 2, 3
"""The kinds of lock a slot has: the range lock, a command asking for the range, a follow that
made way for it (see the module docstring), and a command changing the replicated tables
(:func:`tables_lock`)."""


def lock_key(slot: str, kind: int = RANGE) -> int:
    """The advisory lock key of ``slot``'s lock of ``kind``: the kind in the high 32 bits, a
    hash of the slot in the low 32, so they read back from ``pg_locks.classid`` and ``objid``."""
    return (kind << 32) | zlib.crc32(f"pgcdc:{slot}".encode())


class RangeLock:
    """A held range lock (a target that restarts releases it: see :attr:`session_pid`)."""

    def __init__(
        self, conn: psycopg.Connection[Any], slot: str, holder: str, target_dsn: str
    ) -> None:
        self._conn = conn
        self.session_pid: int = conn.info.backend_pid
        """The server process of the session that holds the lock (how a follower that lost
        its servers for a while tells whether the lock it runs under is still held)."""
        self.slot = slot
        self.holder = holder
        self._target_dsn = target_dsn
        self.made_way_by: str | None = None
        """The follow holding the range lock that made way for this session (see
        :func:`range_lock_or_way`); ``None``: this session holds it."""

    def rename(self, holder: str) -> None:
        """Hold on under another name (a run taking over the lock its command lent it). A
        target that went away took the lock with it: that fails here, in one line."""
        with server_errors("target", self._target_dsn):
            self._conn.execute(
                "SELECT set_config('application_name', %s, false)",
                ((APPLICATION_PREFIX + holder)[:63],),
            )
        self.holder = holder


_lent: dict[tuple[str, str], RangeLock] = {}
_lent_lock = threading.Lock()


@contextmanager
def range_lock(
    target_dsn: str, slot: str, holder: str, *, lend: bool = False, own: bool = False
) -> Iterator[RangeLock]:
    """Hold the range lock of ``slot`` as ``holder``, or raise :class:`RangeBusyError` naming
    who holds it. Never waits on a live holder: a run that cannot run now fails at once and
    says why (it waits only for a holder that is ending, see :func:`_try_lock`).

    ``lend``: a run started by this process while the lock is held takes it over
    (:func:`lent_lock`) instead of failing on it: the CLI's head start (see :mod:`.head_start`)
    holds the lock before its run exists. While a lent lock is held, this function called
    again in the same process for the same slot hands out that lock (the head-started work
    takes the lock as it always does, and finds it held for it). ``own``: take it anew
    whatever is lent (a follower whose lent lock went with a target that restarted)."""
    if not lend and not own and (held := lent_lock(target_dsn, slot)) is not None:
        yield held
        return
    with _lock_session(target_dsn, holder) as conn:
        others = _try_lock(conn, lock_key(slot))
        if others is not None:
            raise RangeBusyError(
                f"another catch-up of slot {slot} is running ({who_holds(others)}): wait for "
                "it to finish (pgcdc status shows it); ranges of one slot run one at a time",
                others,
            )
        with _lending(RangeLock(conn, slot, holder, target_dsn), lend) as lock:
            yield lock


@contextmanager
def _lock_session(target_dsn: str, holder: str) -> Iterator[psycopg.Connection[Any]]:
    """A target session named for ``holder``, whose locks go with it: the server releases
    them when the session ends, however the holder ends.

    A holder that ends normally releases them itself first (``pg_advisory_unlock_all``):
    closing a connection only asks the server to end the session, and the locks stay taken
    until its backend has exited, tens of milliseconds on a loaded machine. Whoever takes the
    lock next in that moment (the next step of the same process, the sensor's next run) would
    find it held by a live-looking holder and fail. A holder ending on an error only closes:
    its server may be the thing that went away, and a round trip to it could hang."""
    conn = connect(
        target_dsn,
        role="target",
        autocommit=True,
        application_name=(APPLICATION_PREFIX + holder)[:63],
        options=_KEEPALIVES,
    )
    try:
        yield conn
        _release_all(conn)
    finally:
        conn.close()


def _release_all(conn: psycopg.Connection[Any]) -> None:
    """Release every advisory lock of ``conn``'s session now; a session already gone (its
    server restarted, or it was terminated) has released them."""
    if conn.closed:
        return
    with suppress(psycopg.Error):
        conn.execute("SELECT pg_advisory_unlock_all()")


@contextmanager
def _lending(lock: RangeLock, lend: bool) -> Iterator[RangeLock]:
    """``lock``, lent to the runs this process starts while inside, when ``lend``."""
    key = (lock._target_dsn, lock.slot)
    if lend:
        with _lent_lock:
            _lent[key] = lock
    try:
        yield lock
    finally:
        if lend:
            with _lent_lock:
                _lent.pop(key, None)


def who_holds(holders: Sequence[LockHolder]) -> str:
    """The holders' names for a message (none listed: the holder's session had just ended)."""
    return ", ".join(h.holder for h in holders) or "a session that just ended"


_ENDING_HOLDER_WAIT = 1.0
"""Seconds to try again while the lock is held by no session in ``pg_stat_activity``, or only
by the session of a local command whose process is gone (:func:`_client_gone`): a holder whose
session is ending (terminated, or its client gone) still holds it for a moment."""


def _try_lock(conn: psycopg.Connection[Any], key: int) -> list[LockHolder] | None:
    """Take the lock on ``conn``: ``None`` once taken, else who holds it. A holder that is
    ending (``pg_terminate_backend`` only signals it) is waited for, up to
    :data:`_ENDING_HOLDER_WAIT`, instead of being reported as "a session that just ended": a
    follower whose lock session was ended would otherwise take its own dying session for
    another catch-up and stop."""
    deadline = time.monotonic() + _ENDING_HOLDER_WAIT
    while True:
        (taken,) = conn.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone()  # type: ignore[misc]
        if taken:
            return None
        others = _holders(conn, key)
        if (others and not all(map(_client_gone, others))) or time.monotonic() >= deadline:
            return others
        time.sleep(0.05)


_LOCAL_CLIENTS = (None, "127.0.0.1/32", "::1/128")
"""``pg_stat_activity.client_addr`` of a session from this machine (``None``: a Unix socket)."""


_COMMAND_PID = re.compile(r"(?:^| )pid (\d+)(?: |$)")
"""The pid in a holder name made by :func:`command_holder`."""


def command_holder(what: str = "") -> str:
    """The holder name of this process when it is a command (not a Dagster run): ``pid N``,
    or ``<what> pid N``; :func:`_client_gone` reads the pid back."""
    return f"{what} pid {os.getpid()}".lstrip()


def _client_gone(holder: LockHolder) -> bool:
    """Whether ``holder`` is a session of a command of this machine (:func:`command_holder`)
    whose process no longer runs (SIGKILL, OOM): the server ends that session only once it sees
    the socket closed, a moment later, so it is an ending holder. Anything else (a run, another
    host, a pid that runs again) counts as live."""
    named = _COMMAND_PID.search(holder.holder)
    return (
        named is not None
        and holder.client_addr in _LOCAL_CLIENTS
        and not pid_running(int(named.group(1)))
    )


def lent_lock(target_dsn: str, slot: str) -> RangeLock | None:
    """The lock of ``slot`` this process holds and lends to its runs, if any."""
    with _lent_lock:
        return _lent.get((target_dsn, slot))


def take_over(
    target_dsn: str, slot: str, holder: str, *, gone_ok: bool = False
) -> RangeLock | None:
    """The lock this process lends for ``slot``, now held under ``holder`` (a run taking over
    what its command started); ``None`` when nothing is lent.

    A lent lock whose session went with a target that went away raises
    :class:`~..connect.ServerGoneError`, unless ``gone_ok``: for a run adopting a head-started
    follower, which rides the outage and takes the lock again itself once the target is back
    (:meth:`~..follow.follower.Follower._hold_lock_again` checks the lock's session); the run
    must not fail for it, since Dagster may start it seconds after the follow began. The lock
    is then handed out under its old name."""
    lent = lent_lock(target_dsn, slot)
    if lent is not None:
        try:
            lent.rename(holder)
        except ServerGoneError:
            if not gone_ok:
                raise
    return lent


def lock_holders(target_dsn: str, slot: str) -> list[LockHolder]:
    """Who holds the range lock of ``slot`` now (at most one session)."""
    with connect(target_dsn, role="target", autocommit=True, connect_timeout=5) as conn:
        return _holders(conn, lock_key(slot))


def _holders(conn: psycopg.Connection[Any], key: int) -> list[LockHolder]:
    rows = conn.execute(
        """
        SELECT a.application_name, a.pid, a.client_addr::text
        FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
        WHERE l.locktype = 'advisory' AND l.granted AND l.classid = %s::oid
          AND l.objid = %s::oid AND l.objsubid = 1
          AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
        """,
        (key >> 32, key & 0xFFFFFFFF),
    ).fetchall()
    return [
        LockHolder(name.removeprefix(APPLICATION_PREFIX), int(pid), addr)
        for name, pid, addr in rows
    ]


# -- making way (see the module docstring) -----------------------------------------------------


def askers(conn: psycopg.Connection[Any], slot: str) -> list[LockHolder]:
    """The command asking for the range of ``slot`` now (at most one)."""
    return _holders(conn, lock_key(slot, ASKING))


def _asking_channel(slot: str) -> str:
    return f"pgcdc_ask_{lock_key(slot) & 0xFFFFFFFF:08x}"


def listen_for_askers(conn: psycopg.Connection[Any], slot: str) -> None:
    """Have ``conn``'s socket turn readable when a command asks for the range of ``slot`` (it
    notifies once it holds :data:`ASKING`), so a follow sees it at once rather than at its
    next look (:func:`askers` stays the answer: a notification is only a wake-up)."""
    conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(_asking_channel(slot))))


def make_way(conn: psycopg.Connection[Any], slot: str, made: bool) -> None:
    """Say on ``conn`` (a follow's, running no session) that the way is made (``made``), or no
    longer: the follow must look for :func:`askers` again after taking it back."""
    statement = "SELECT pg_advisory_lock(%s)" if made else "SELECT pg_advisory_unlock(%s)"
    conn.execute(statement, (lock_key(slot, MADE_WAY),))


_ASK_POLL_S = 0.1


@contextmanager
def range_lock_or_way(
    target_dsn: str, slot: str, holder: str, wait_s: float, *, lend: bool = False
) -> Iterator[RangeLock]:
    """The range of ``slot`` for a command that needs it to itself for a while (an add, a
    cutover), as ``holder``: the range lock taken here, or a follow holding it that made way
    (see the module docstring). Yields a :class:`RangeLock` on the asking session
    (:attr:`RangeLock.made_way_by`: the follow, if one made way). ``lend``: to a run this
    process starts, as :func:`range_lock` lends. Raises :class:`RangeBusyError` after
    ``wait_s`` seconds of another such command, or of a holder that does not make way (a
    snapshot, a per-range run). While this process lends the lock (a command's head start,
    :mod:`.head_start`), that lock is the one handed out, as :func:`range_lock` does."""
    if not lend and (held := lent_lock(target_dsn, slot)) is not None:
        yield held
        return
    deadline = time.monotonic() + wait_s
    with _lock_session(target_dsn, holder) as conn:
        asking = lock_key(slot, ASKING)
        while not conn.execute("SELECT pg_try_advisory_lock(%s)", (asking,)).fetchone()[0]:  # type: ignore[index]
            if time.monotonic() > deadline:
                raise RangeBusyError(
                    f"another command needing the range of slot {slot} to itself is running "
                    f"({who_holds(_holders(conn, asking))}) after {wait_s:.0f} s: wait for it "
                    "to finish, or pass a longer --wait"
                )
            time.sleep(_ASK_POLL_S)
        conn.execute("SELECT pg_notify(%s, '')", (_asking_channel(slot),))
        while True:
            others = _try_lock(conn, lock_key(slot))
            if others is None or _holders(conn, lock_key(slot, MADE_WAY)):
                break
            if time.monotonic() > deadline:
                raise RangeBusyError(
                    f"another catch-up of slot {slot} is running ({who_holds(others)}) and did "
                    f"not make way in {wait_s:.0f} s (a follow makes way; a snapshot or a "
                    "per-range run does not): wait for it to finish, or pass a longer --wait",
                    others,
                )
            time.sleep(_ASK_POLL_S)
        lock = RangeLock(conn, slot, holder, target_dsn)
        lock.made_way_by = None if others is None else who_holds(others)
        with _lending(lock, lend) as lent:
            yield lent


# -- changing the replicated tables ----------------------------------------------------------


@contextmanager
def tables_lock(target_dsn: str, slot: str, holder: str, wait_s: float = 0.0) -> Iterator[None]:
    """Hold the lock of ``slot``'s commands that change which tables are replicated and copy
    them (``pgcdc add-table``, ``pgcdc snapshot``), one at a time, as ``holder``: waiting up to
    ``wait_s`` seconds for another, then raising :class:`RangeBusyError` naming it.

    Why apart from the range lock: an add copies its tables without the range (applies go on,
    holding back the tables' changes), so two adds of one table, or an add and a snapshot,
    would meet on the target's rows of that table with nothing else between them."""
    deadline = time.monotonic() + wait_s
    with _lock_session(target_dsn, holder) as conn:
        key = lock_key(slot, TABLES)
        while (others := _try_lock(conn, key)) is not None:
            if time.monotonic() >= deadline:
                raise RangeBusyError(
                    f"another command changing the replicated tables of slot {slot} is "
                    f"running ({who_holds(others)}): wait for it to finish (pgcdc status shows "
                    "it), or pass a longer --wait",
                    others,
                )
            time.sleep(_ASK_POLL_S)
        yield


def tables_changing(target_dsn: str, slot: str) -> list[LockHolder]:
    """Who holds ``slot``'s :func:`tables_lock` now (an add under way: its tables are being
    copied, not left unfinished); not a killed command whose session is still ending."""
    with connect(target_dsn, role="target", autocommit=True, connect_timeout=5) as conn:
        return [h for h in _holders(conn, lock_key(slot, TABLES)) if not _client_gone(h)]
