"""The target's replication origin: the one durable record of what the target has applied.

Origin ``pgcdc_<slot>`` is created by the base snapshot at the slot's consistent point and
advanced only inside the transaction that writes a range's rows (:mod:`.transaction`), through the
session origin: ``pg_replication_origin_session_setup`` before, ``xact_setup(lsn, ts)`` and
COMMIT in one message at its end (:func:`marked_commit`). The commit record then carries the
new progress, so rows and progress become durable together or not at all. Every other module
asks this one where the target stands.

Invariants kept here:

- progress moves backwards only through :func:`set_origin`, which only the base snapshot calls
  (a re-snapshot restarts the chain at a new consistent point), or by a crash of the target,
  to its durable progress and with the rows of the ranges it loses (an apply's COMMIT does not
  wait for the disk, see :func:`read_progress`): those are applied again from the store, whose
  retention only removes ranges behind the durable progress;
- a session that holds the origin excludes every other session from advancing it: two applies
  of the same origin can never interleave, whatever the orchestration believes.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import time
from typing import Any

import psycopg
from psycopg import sql

from ..connect import connect
from ..errors import OriginError, server_message
from ..lsn import Lsn


def read_progress(conn: psycopg.Connection[Any], name: str, *, durable: bool = False) -> Lsn | None:
    """The origin's progress: what the target's tables hold, as every reader of them sees it;
    ``None`` when the origin does not exist.

    An apply commits without waiting for its WAL to reach the disk (``synchronous_commit``,
    :func:`~.merge.apply_transaction`), as PostgreSQL's own apply does: a crash of the target
    loses its last fraction of a second of applied ranges, the origin's progress with their
    rows, and they are applied again from the store. ``durable``: the progress that survives
    such a crash (the server flushes its WAL up to the origin's last commit first). A caller
    that discards what the target would then need again (the store's retention) reads that.

    :class:`OriginError` when it exists without progress: it was created but never set to the
    consistent point, so the base snapshot that created it did not finish.
    """
    row = conn.execute(
        "SELECT pg_replication_origin_progress(roname, %s)::text "
        "FROM pg_replication_origin WHERE roname = %s",
        (durable, name),
    ).fetchone()
    if row is None:
        return None
    if row[0] is None:
        raise OriginError(
            f"replication origin {name} has no progress: it was created but never set to the "
            "slot's consistent point, so the base snapshot did not finish; run pgcdc snapshot, "
            "which resumes it, keeping what it copied, or else takes it again"
        )
    return Lsn.parse(row[0])


def require_progress(conn: psycopg.Connection[Any], name: str) -> Lsn:
    """The origin's progress, or :class:`OriginError` naming the fix when it is missing."""
    progress = read_progress(conn, name)
    if progress is None:
        raise OriginError(
            f"replication origin {name} does not exist on the target: the base snapshot creates "
            "it at the slot's consistent point; take the base snapshot first "
            "(pgcdc snapshot, or materialise base_snapshot)"
        )
    return progress


def progress_of(target_dsn: str, name: str, *, durable: bool = False) -> Lsn | None:
    """:func:`read_progress` on a connection of its own."""
    with connect(target_dsn, role="target", autocommit=True) as conn:
        return read_progress(conn, name, durable=durable)


ORIGIN_FUNCTIONS = (
    "pg_replication_origin_create(text)",
    "pg_replication_origin_drop(text)",
    "pg_replication_origin_advance(text, pg_lsn)",
    "pg_replication_origin_progress(text, boolean)",
    "pg_replication_origin_session_setup(text)",
    "pg_replication_origin_session_reset()",
    "pg_replication_origin_xact_setup(pg_lsn, timestamp with time zone)",
    "pg_show_replication_origin_status()",
)
"""What the snapshot and the apply call on the target: superuser-only unless granted."""


def check_origin_rights(conn: psycopg.Connection[Any]) -> None:
    """Refuse, before a base snapshot changes anything, a target role that could not keep the
    origin or apply a range, naming every grant it lacks (the snapshot would otherwise copy
    everything and fail at its end, or at the first range, on "permission denied"): EXECUTE
    on the origin functions and SELECT on ``pg_replication_origin_status`` (in the target
    database: each database has its own catalog), and SET on ``session_replication_role``
    (PostgreSQL 15 and later; a superuser's before)."""
    row = conn.execute(
        "SELECT rolsuper, current_user, current_database(), "
        "array(SELECT f FROM unnest(%s::text[]) AS f "
        "      WHERE NOT has_function_privilege(f, 'EXECUTE')), "
        "has_table_privilege('pg_catalog.pg_replication_origin_status', 'SELECT') "
        "FROM pg_roles WHERE rolname = current_user",
        (list(ORIGIN_FUNCTIONS),),
    ).fetchone()
    assert row is not None
    superuser, role, database, functions, status = row
    if superuser:
        return
    who = sql.Identifier(role).as_string(conn)
    grants = [f"GRANT EXECUTE ON FUNCTION {', '.join(functions)} TO {who}"] if functions else []
    if not status:
        grants.append(f"GRANT SELECT ON pg_replication_origin_status TO {who}")
    if conn.info.server_version >= 150000:
        (may_set,) = conn.execute(  # type: ignore[misc]
            "SELECT has_parameter_privilege('session_replication_role', 'SET')"
        ).fetchone()
        if not may_set:
            grants.append(f"GRANT SET ON PARAMETER session_replication_role TO {who}")
    else:
        grants.append(f"ALTER ROLE {who} SUPERUSER (before PostgreSQL 15 nothing less will do)")
    if grants:
        raise OriginError(
            f"role {role} may not keep the target's replication origin (the record of what is "
            "applied) or apply with session_replication_role = replica: as a superuser, in "
            f"database {database}, run {'; '.join(grants)}; or connect as a superuser"
        )


ORIGIN_SLOTS_SETTING_SINCE = 180000
"""From PostgreSQL 18 the origins' state slots have a setting of their own,
``max_active_replication_origins``; on older servers, ``max_replication_slots`` bounds them."""


def origin_slots_setting(server_version: int) -> str:
    """The setting that bounds the origins with progress on a server of ``server_version``."""
    if server_version >= ORIGIN_SLOTS_SETTING_SINCE:
        return "max_active_replication_origins"
    return "max_replication_slots"


def check_room_for(conn: psycopg.Connection[Any], name: str) -> None:
    """Refuse, before a base snapshot changes anything, a target that could not record the
    progress of origin ``name``: every origin with progress holds one of the target's state
    slots (:func:`origin_slots_setting`), and :func:`set_origin` runs only after the whole
    copy, which would then be lost to a setting."""
    setting = origin_slots_setting(conn.info.server_version)
    row = conn.execute(
        "SELECT count(*), coalesce(bool_or(external_id = %s), false), "
        "current_setting(%s)::int FROM pg_replication_origin_status",
        (name, setting),
    ).fetchone()
    assert row is not None
    used, ours, limit = int(row[0]), bool(row[1]), int(row[2])
    if not ours and used >= limit:
        raise OriginError(
            f"the target has no room for replication origin {name}: the {used} origins with "
            f"progress there take all of its {setting} ({limit}); drop the ones no "
            "longer used (SELECT pg_replication_origin_drop(roname) FROM pg_replication_origin "
            f"WHERE ...) or raise {setting} on the target, then run it again"
        )


def set_origin(target_dsn: str, name: str, consistent_point: Lsn) -> None:
    """Create the origin if needed and put it at ``consistent_point``: the apply resumes
    strictly after it. (``pg_replication_origin_advance`` may move backwards, which a
    re-snapshot relies on.)"""
    with connect(target_dsn, role="target") as tgt:
        tgt.execute(
            "SELECT pg_replication_origin_create(%s) "
            "WHERE NOT EXISTS (SELECT FROM pg_replication_origin WHERE roname = %s)",
            (name, name),
        )
        tgt.execute(
            "SELECT pg_replication_origin_advance(%s, %s::pg_lsn)", (name, str(consistent_point))
        )
        tgt.commit()


def drop_origin(conn: psycopg.Connection[Any], name: str) -> None:
    """Drop the origin if it exists (in the caller's transaction)."""
    conn.execute(
        "SELECT pg_replication_origin_drop(roname) FROM pg_replication_origin WHERE roname = %s",
        (name,),
    )


def setup_session(conn: psycopg.Connection[Any], name: str, wait_seconds: float) -> None:
    """Make ``name`` this session's origin, waiting up to ``wait_seconds`` for a killed
    holder's backend to exit (the server frees the origin only once that backend is gone)."""
    deadline = time.monotonic() + wait_seconds
    while True:
        try:
            conn.execute("SELECT pg_replication_origin_session_setup(%s)", (name,))
            return
        except psycopg.errors.ObjectInUse as exc:
            if time.monotonic() >= deadline:
                raise OriginError(
                    f"replication origin {name} is in use ({server_message(exc)}): "
                    "another apply holds it; wait for it to finish, or terminate that backend "
                    "if its client is gone"
                ) from None
            time.sleep(0.1)
        except psycopg.errors.InsufficientPrivilege as exc:
            raise OriginError(
                f"cannot apply with replication origin {name}: "
                f"{server_message(exc)}; connect to the target as a superuser (the apply "
                "also sets session_replication_role), or GRANT EXECUTE ON FUNCTION "
                "pg_replication_origin_session_setup(text), "
                "pg_replication_origin_xact_setup(pg_lsn, timestamptz), "
                "pg_replication_origin_session_reset() to the apply's role"
            ) from None


def reset_session(conn: psycopg.Connection[Any]) -> None:
    """Release the session origin. On a broken connection there is nothing to do: the server
    releases the origin with the backend."""
    if conn.closed or conn.broken:
        return
    with contextlib.suppress(psycopg.Error):
        conn.execute("SELECT pg_replication_origin_session_reset()")


def marked_commit(lsn: Lsn, commit_time: dt.datetime) -> sql.Composed:
    """The statement that ends the apply transaction: it marks the transaction as replaying
    the source's commit at ``lsn`` and commits it, **in one message**, so the session origin
    moves to ``lsn`` with the COMMIT record and never without it.

    Why one message: on newer servers (PostgreSQL 18 does, 15 does not), a transaction marked by
    ``pg_replication_origin_xact_setup`` that *aborts* moves the origin too, to the marked
    LSN (the abort record carries it). Sent apart, a client killed between the mark and its
    COMMIT would make the server abort the transaction, and the origin would then claim a
    range whose rows were never written: the next run would skip them. Sent as one simple
    query, the mark and the COMMIT run together once the server has the message, whatever
    becomes of the client.
    What is left: a COMMIT the server itself refuses after the mark would still move the
    origin there; the apply's has nothing deferred to check (``session_replication_role =
    replica`` keeps deferred triggers quiet), so no such refusal is known.

    The transaction is given a transaction id (``pg_current_xact_id``): the origin moves with
    the COMMIT record, and a transaction that wrote nothing has none. A range whose changes
    net to nothing on the target (a row inserted and deleted inside it, a job queue's whole
    life; or a table's changes its own copy already holds) would otherwise leave the origin
    where it was: the next range would find a gap, and every re-run would apply the same range
    again."""
    return sql.SQL(
        "SELECT pg_replication_origin_xact_setup({}::pg_lsn, {}::timestamptz), "
        "pg_current_xact_id(); COMMIT"
    ).format(sql.Literal(str(lsn)), sql.Literal(commit_time))
