"""The range lock (engine/range_lock.py) on a real target: who holds it is named, and a holder
whose session is ending is not taken for another catch-up."""

from __future__ import annotations

import psycopg
import pytest

from pgcdc_dagster.engine.range_lock import (
    APPLICATION_PREFIX,
    RangeBusyError,
    _try_lock,
    lock_key,
    range_lock,
)


def _holding(target_dsn: str, slot: str, holder: str) -> psycopg.Connection:
    """A session holding the range lock of ``slot`` as ``holder`` names itself."""
    conn = psycopg.connect(
        target_dsn, autocommit=True, application_name=APPLICATION_PREFIX + holder
    )
    conn.execute("SELECT pg_advisory_lock(%s)", (lock_key(slot),))
    return conn


def test_a_live_holder_is_named_at_once(target_dsn):
    with (
        _holding(target_dsn, "s1", "run other"),
        pytest.raises(RangeBusyError, match=r"\(run other\)") as busy,
        range_lock(target_dsn, "s1", "run mine"),
    ):
        pass
    assert "\n" not in str(busy.value)


def test_a_holder_whose_session_was_just_ended_gives_the_lock_up(target_dsn):
    """``pg_terminate_backend`` only signals: a try right after it can find the lock still
    held and, a moment later, no session holding it (by hand, 16 tries in 200 did). Such a
    holder is waited for, so every try takes the lock."""
    key = lock_key("s2")
    with (
        psycopg.connect(target_dsn, autocommit=True) as admin,
        psycopg.connect(target_dsn, autocommit=True) as taker,
    ):
        for attempt in range(100):
            with _holding(target_dsn, "s2", f"run ending {attempt}") as holder:
                admin.execute("SELECT pg_terminate_backend(%s)", (holder.info.backend_pid,))
                assert _try_lock(taker, key) is None, attempt
                taker.execute("SELECT pg_advisory_unlock(%s)", (key,))
