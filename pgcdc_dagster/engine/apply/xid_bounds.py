"""Transaction-id bounds kept beside the origin: what lets a recovery find the rows that changed
since the target's applied position by their ``xmin``, without reading every value
(:mod:`..compare.changed_since`).

A bound is a pair ``(W, X)`` read on the source in one statement: ``X`` the oldest transaction
still running in the statement's snapshot (``pg_snapshot_xmin``), ``W`` the WAL insert position
read after that snapshot was taken. Why it bounds: a transaction whose COMMIT record begins at
or past ``W`` was reserved its place in WAL after the snapshot, so the snapshot saw it running
or not yet begun; every transaction id older than ``X`` had ended by then. So every
transaction that commits at or past ``W`` has an id not older than ``X``. For a target whose
origin says ``L`` (every commit ending at or before ``L`` applied, none after), the latest
bound with ``W <= L`` bounds every transaction the target lacks. The bound is keyed by ``W``,
never by when it was read: one read while a backlog range is received has a ``W`` far past
that range, and serves only once the target has applied up to ``W``.

What must hold: a bound is a fact about the source's history, true from the moment it is read,
so it may be recorded whenever, in any transaction; it is used only by the source it was read
on (the system identifier) and on the timeline it was read on (after a promotion, a bound of
the old timeline is not trusted: see :mod:`..compare.changed_since`). It is read on a primary
only (a standby has no WAL insert position). Recorded in ``pgcdc_ddl.xid_bounds`` on the
target: by the base snapshot and a recovery (read before their slot, so ``W`` is at or before
its consistent point), and by every applying process at most every :data:`EVERY_S`; older ones
are removed once a newer one is usable.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from ..catalog import ensure_records_schema, records_table, records_table_exists
from ..connect import ConnectError, connect
from ..lsn import Lsn

NAME = "xid_bounds"
TABLE = records_table(NAME)

EVERY_S = 30.0
"""How often an applying process records a bound. A recovery copies again the rows changed
between the bound's ``W`` and the target's position: about this long of the source's changes,
plus the follow's lag when the bound was read."""


@dataclass(frozen=True)
class XidBound:
    wal: Lsn
    """``W``: the WAL insert position read after the snapshot."""
    oldest_xid: int
    """``X``: the oldest transaction id running in the snapshot (64-bit, with its epoch)."""
    next_xid: int
    """The next transaction id to be assigned, at that snapshot (64-bit)."""
    system_id: str
    timeline: int


_READ = """
SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint,
       pg_snapshot_xmax(pg_current_snapshot())::text::bigint,
       pg_current_wal_insert_lsn()::text,
       (SELECT system_identifier FROM pg_control_system())::text,
       ('x' || substr(pg_walfile_name(pg_current_wal_insert_lsn()), 1, 8))::bit(32)::int
"""
"""One statement: its snapshot is taken before any of its functions runs, so ``W`` is read
after ``X`` (see the module docstring)."""


def read_bound(src: psycopg.Connection[Any]) -> XidBound | None:
    """A bound read now on the source ``src`` (autocommit); ``None`` on a standby."""
    row = src.execute("SELECT pg_is_in_recovery()").fetchone()
    if row is None or row[0]:
        return None
    read = src.execute(_READ).fetchone()
    assert read is not None
    oldest, upcoming, wal, system_id, timeline = read
    return XidBound(Lsn.parse(wal), int(oldest), int(upcoming), str(system_id), int(timeline))


def read_bound_of(source_dsn: str) -> XidBound | None:
    """:func:`read_bound` on a connection of its own; ``None`` when the source cannot say
    (away, a standby): a bound not recorded costs a later recovery time, never correctness."""
    try:  # bounded: an apply must not wait on a source that went away
        with connect(source_dsn, role="source", autocommit=True, connect_timeout=5) as src:
            return read_bound(src)
    except (ConnectError, psycopg.Error):
        return None


def _ensure_table(tgt: psycopg.Connection[Any]) -> None:
    ensure_records_schema(tgt)
    tgt.execute(
        sql.SQL(
            "CREATE TABLE IF NOT EXISTS {} (slot text NOT NULL, wal_position pg_lsn NOT NULL, "
            "oldest_xid bigint NOT NULL, next_xid bigint NOT NULL, system_id text NOT NULL, "
            "timeline int NOT NULL, read_at timestamptz NOT NULL DEFAULT now(), "
            "PRIMARY KEY (slot, wal_position))"
        ).format(TABLE)
    )


def record_bound(
    tgt: psycopg.Connection[Any], slot: str, bound: XidBound, applied: Lsn | None
) -> None:
    """Record ``bound`` for ``slot`` (autocommit ``tgt``), then remove the bounds that a newer
    usable one makes useless: those before the latest with ``W`` at or before ``applied``
    (the origin's progress now)."""
    _ensure_table(tgt)
    tgt.execute(
        sql.SQL(
            "INSERT INTO {} (slot, wal_position, oldest_xid, next_xid, system_id, timeline) "
            "VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING"
        ).format(TABLE),
        (
            slot,
            str(bound.wal),
            bound.oldest_xid,
            bound.next_xid,
            bound.system_id,
            bound.timeline,
        ),
    )
    if applied is not None:
        tgt.execute(
            sql.SQL(
                "DELETE FROM {t} WHERE slot = %(slot)s AND wal_position < (SELECT "
                "max(wal_position) FROM {t} WHERE slot = %(slot)s AND wal_position <= %(at)s)"
            ).format(t=TABLE),
            {"slot": slot, "at": str(applied)},
        )


def record_bound_at(target_dsn: str, slot: str, bound: XidBound | None, applied: Lsn) -> None:
    """:func:`record_bound` on a connection of its own, for a base snapshot or a recovery
    that read ``bound`` before its slot and now stands at ``applied``."""
    if bound is None:
        return
    try:
        with connect(target_dsn, role="target", autocommit=True) as tgt:
            record_bound(tgt, slot, bound, applied)
    except (ConnectError, psycopg.Error):
        pass  # the step it ends is done: a bound not recorded costs a later recovery time


def forget_bounds(target_dsn: str, slot: str) -> None:
    """Remove every bound of ``slot``: the target is ahead of the source's new timeline (a
    fork), so its position no longer says what it lacks; until a recovery records a new one,
    none serves. Durable before the recovery starts, so a recovery killed after it finds
    none either."""
    with connect(target_dsn, role="target", autocommit=True) as tgt:
        if records_table_exists(tgt, NAME):
            tgt.execute(sql.SQL("DELETE FROM {} WHERE slot = %s").format(TABLE), (slot,))


def drop_bounds(tgt: psycopg.Connection[Any], slot: str) -> None:
    """Remove ``slot``'s bounds, in ``tgt``'s transaction (the replication is finished), and
    the table once no other slot has any."""
    if not records_table_exists(tgt, NAME):
        return
    tgt.execute(sql.SQL("DELETE FROM {} WHERE slot = %s").format(TABLE), (slot,))
    left = tgt.execute(sql.SQL("SELECT EXISTS (SELECT FROM {})").format(TABLE)).fetchone()
    if left is not None and not left[0]:
        tgt.execute(sql.SQL("DROP TABLE {}").format(TABLE))


def bound_for(tgt: psycopg.Connection[Any], slot: str, applied: Lsn) -> XidBound | None:
    """The latest bound of ``slot`` with ``W`` at or before ``applied``; ``None``: none."""
    if not records_table_exists(tgt, NAME):
        return None
    row = tgt.execute(
        sql.SQL(
            "SELECT wal_position::text, oldest_xid, next_xid, system_id, timeline FROM {} "
            "WHERE slot = %s AND wal_position <= %s ORDER BY wal_position DESC LIMIT 1"
        ).format(TABLE),
        (slot, str(applied)),
    ).fetchone()
    if row is None:
        return None
    wal, oldest, upcoming, system_id, timeline = row
    return XidBound(Lsn.parse(wal), int(oldest), int(upcoming), str(system_id), int(timeline))


_recorded_at: dict[tuple[str, str], float] = {}


def record_if_due(
    source_dsn: str, target_dsn: str, slot: str, applied: Lsn | None, now: float | None = None
) -> bool:
    """At most every :data:`EVERY_S` in this process (its first apply always), read a bound on
    the source and record it: called after each apply. Whether one was recorded. A failure is
    swallowed: the replication does not wait for a bound (the next one is recorded)."""
    key = (target_dsn, slot)
    now = time.monotonic() if now is None else now
    if now - _recorded_at.get(key, -EVERY_S) < EVERY_S:
        return False
    _recorded_at[key] = now
    bound = read_bound_of(source_dsn)
    if bound is None:
        return False
    try:
        with connect(target_dsn, role="target", autocommit=True, connect_timeout=5) as tgt:
            record_bound(tgt, slot, bound, applied)
    except (ConnectError, psycopg.Error):
        return False
    return True
