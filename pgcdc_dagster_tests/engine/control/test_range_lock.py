"""The range lock (engine/control/range_lock.py) on a real target: who holds it is named, and a
holder whose session is ending is not taken for another catch-up."""

from __future__ import annotations

import os
import subprocess
import threading
import time

import psycopg
import pytest

from pgcdc_dagster.engine.connect import ServerGoneError
from pgcdc_dagster.engine.control import range_lock as range_lock_module
from pgcdc_dagster.engine.control.range_lock import (
    LockHolder,
    RangeBusyError,
    lock_holders,
    range_lock,
    take_over,
)
from pgcdc_dagster_tests.support.locks import holder_session, take_lock


def _holding(target_dsn: str, slot: str, holder: str) -> psycopg.Connection:
    """A session holding the range lock of ``slot`` as ``holder``."""
    conn = holder_session(target_dsn, holder)
    take_lock(conn, slot)
    return conn


def test_a_live_holder_is_named_at_once(target_dsn):
    with (
        _holding(target_dsn, "s1", "run other"),
        pytest.raises(RangeBusyError, match=r"\(run other\)") as busy,
        range_lock(target_dsn, "s1", "run mine"),
    ):
        pass
    assert "\n" not in str(busy.value)


def test_a_holder_whose_session_ends_between_the_try_and_the_look_gives_the_lock_up(
    target_dsn, monkeypatch
):
    """``pg_terminate_backend`` only signals: a try right after it can find the lock still held
    and, a moment later, no session holding it (a raw try then look meets that race now and
    then). Here the holder's session is ended, and waited out, exactly between the failed try
    and the look at who holds the lock: the ending holder is waited for and the lock taken,
    instead of "a session that just ended" being reported."""
    holder = _holding(target_dsn, "s2", "run ending")
    real_holders = range_lock_module._holders
    looked: list[list[LockHolder]] = []

    def look_once_the_holder_ended(conn: psycopg.Connection, key: int) -> list[LockHolder]:
        if not looked:
            conn.execute("SELECT pg_terminate_backend(%s, 10000)", (holder.info.backend_pid,))
        looked.append(seen := real_holders(conn, key))
        return seen

    monkeypatch.setattr(range_lock_module, "_holders", look_once_the_holder_ended)
    try:
        with range_lock(target_dsn, "s2", "run next") as lock:
            monkeypatch.setattr(range_lock_module, "_holders", real_holders)
            (now,) = lock_holders(target_dsn, "s2")
            assert now.backend_pid == lock.session_pid
    finally:
        holder.close()
    assert looked == [[]]  # the race: the try failed, then nobody held the lock


def test_a_holder_whose_local_process_is_gone_is_waited_for_and_a_live_one_is_not(target_dsn):
    """A command killed (SIGKILL, OOM) holds the lock until the server sees its socket closed.
    The next command, started at once, waits for that session to end (here 0.3 s later)
    instead of reporting a catch-up by a process that no longer runs; a holder whose process
    runs is still named at once."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    holder = _holding(target_dsn, "s3", f"pid {gone.pid}")
    ending = threading.Timer(0.3, holder.close)
    ending.start()
    began = time.monotonic()
    try:
        with range_lock(target_dsn, "s3", "run next"):
            waited = time.monotonic() - began
    finally:
        ending.join()
    assert 0.2 < waited < range_lock_module._ENDING_HOLDER_WAIT
    with (
        _holding(target_dsn, "s3", f"pid {os.getpid()}"),
        pytest.raises(RangeBusyError, match=rf"\(pid {os.getpid()}\)"),
        range_lock(target_dsn, "s3", "run next"),
    ):
        pass


def test_a_holder_that_ends_normally_leaves_the_lock_free_at_once(target_dsn):
    """A holder that ends without an error releases the lock before its session closes: the
    next taker, right after (the next step of the same process, a run the sensor starts next),
    never finds it held. A close alone leaves it to the server's backend exit, a moment later,
    and a taker in that moment saw a live holder (``pid`` of this very process) and failed.
    Here the holder's backend is slow to exit (it drops 300 temporary tables first, as a busy
    server's can be slow), and the look is from a session opened beforehand."""
    key = range_lock_module.lock_key("s4")
    with psycopg.connect(target_dsn, autocommit=True) as looker:
        with range_lock(target_dsn, "s4", f"pid {os.getpid()}") as lock:
            lock._conn.execute(
                "DO $$ BEGIN FOR i IN 1..300 LOOP "
                "EXECUTE format('CREATE TEMP TABLE slow_exit_%s (a int)', i); END LOOP; END $$"
            )
        assert range_lock_module._holders(looker, key) == []
        with range_lock(target_dsn, "s4", "run next"):
            pass


def test_a_lent_lock_gone_with_its_session_is_handed_over_only_to_a_run_that_rides_it(target_dsn):
    """A command lends its lock to the run it starts; Dagster may start that run seconds later,
    after the target went away and took the lock's session with it. A follow run (its command's
    follower takes the lock again itself) gets the lock as lent; any other run fails, naming the
    target, rather than work under a lock nobody holds."""
    with range_lock(target_dsn, "s5", f"pid {os.getpid()}", lend=True) as lent:
        with psycopg.connect(target_dsn, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s, 10000)", (lent.session_pid,))
        with pytest.raises(ServerGoneError, match="target PostgreSQL"):
            take_over(target_dsn, "s5", "run other")
        assert take_over(target_dsn, "s5", "run follow", gone_ok=True) is lent
        assert lock_holders(target_dsn, "s5") == []
    assert take_over(target_dsn, "s5", "run later") is None
