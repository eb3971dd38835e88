"""Range-lock holders made by hand, for tests that need another catch-up's lock in the way."""

import psycopg

from pgcdc_dagster.engine.control.range_lock import APPLICATION_PREFIX, lock_key


def holder_session(target_dsn: str, holder: str) -> psycopg.Connection:
    """A target session named as :func:`~pgcdc_dagster.engine.control.range_lock.range_lock` names
    its holder, so ``lock_holders`` and error messages name it ``holder``."""
    return psycopg.connect(
        target_dsn, autocommit=True, application_name=APPLICATION_PREFIX + holder
    )


def take_lock(conn: psycopg.Connection, slot: str) -> None:
    """Take the range lock of ``slot`` on ``conn``, waiting for it as long as it is held (the
    product never waits on a live holder; a test's intruder may)."""
    conn.execute("SELECT pg_advisory_lock(%s)", (lock_key(slot),))
