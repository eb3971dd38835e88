"""Decoding from a hot standby (PostgreSQL 16+): the few things a standby cannot do itself.

``PGCDC_SOURCE_DSN`` may name a hot standby, to spare the primary the decoding. The slot, its
exported snapshot, the base copy (which imports that snapshot on the same standby), the
stream, the peeks and the slot's advances all run there, as they do on a primary. Two things
need the primary, because a standby is read-only:

- the publication's DDL (``CREATE``/``ALTER PUBLICATION``); the standby then sees the
  publication once it has replayed it, which :func:`writes_on_primary` waits for;
- a slot's creation, which on a standby waits for a running-transactions record from the
  primary: a busy primary logs one about every 15 s, an idle one never, so
  :func:`running_xacts_logged` asks for one (``pg_log_standby_snapshot()``) until the creation
  returns.

The primary is the server the standby streams from (``pg_stat_wal_receiver``), reached with the
source DSN's own user, password, database and options: a physical standby is a copy of its
primary, with the same roles. Reading the sender's address needs ``pg_read_all_stats`` (or a
superuser); a cascading standby's sender is another standby, which is refused in one line.

What must hold on the standby, or the primary's VACUUM invalidates its slots
(``rows_removed``) with no warning at creation: ``hot_standby_feedback = on`` and a physical
slot (``primary_slot_name``). :func:`standby_gaps` names them; the preflight reports them.
A slot on a standby is never a failover slot (PostgreSQL refuses it); it survives the
promotion of its own standby, as an ordinary slot.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

from ..connect import connect, describe_dsn
from ..errors import PgcdcError

REPLAY_TIMEOUT_S = 60.0
"""How long a write made on the primary may take to be replayed by the standby."""

RUNNING_XACTS_EVERY_S = 0.2
"""How often a slot's creation on a standby asks the primary for a running-transactions
record (each is one small WAL record)."""


class StandbyError(PgcdcError):
    """The source is a standby and its primary cannot do what is needed, or cannot be reached."""


def in_recovery(conn: psycopg.Connection[Any]) -> bool:
    """Whether ``conn``'s server is a standby (in recovery). Leaves no transaction open."""
    row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
    if not conn.autocommit:
        conn.commit()
    return bool(row and row[0])


def primary_dsn(conn: psycopg.Connection[Any]) -> str:
    """The connection string of the primary that ``conn``'s standby streams from: the sender's
    host and port with ``conn``'s user, password, database and options (see the module
    docstring)."""
    row = conn.execute(
        "SELECT sender_host, sender_port, status FROM pg_stat_wal_receiver"
    ).fetchone()
    if not conn.autocommit:
        conn.commit()
    where = describe_dsn(conn.info.dsn)
    if row is None or row[0] is None:
        raise StandbyError(
            f"the source {where} is a hot standby whose primary cannot be read from "
            "pg_stat_wal_receiver (no WAL receiver, or the role lacks pg_read_all_stats): "
            "GRANT pg_read_all_stats to the source role, or set PGCDC_SOURCE_DSN to the primary"
        )
    host, port, _status = row
    return make_conninfo(
        conn.info.dsn,
        host=str(host),
        hostaddr="",
        port=str(port),
        password=conn.info.password or "",
        target_session_attrs="read-write",
    )


@contextmanager
def writes_on_primary(conn: psycopg.Connection[Any]) -> Iterator[psycopg.Connection[Any]]:
    """A connection that accepts writes for ``conn``'s database: ``conn`` itself on a primary;
    on a standby, an autocommit connection to its primary, and on leaving the block a wait
    until the standby has replayed what the block wrote (so ``conn`` then sees it)."""
    if not in_recovery(conn):
        yield conn
        return
    dsn = primary_dsn(conn)
    with connect(dsn, role="source's primary", autocommit=True) as primary:
        if in_recovery(primary):
            raise StandbyError(
                f"the source {describe_dsn(conn.info.dsn)} is a cascading standby: its sender "
                f"{describe_dsn(dsn)} is a standby too; set PGCDC_SOURCE_DSN to a standby of "
                "the primary itself, or to the primary"
            )
        yield primary
        row = primary.execute("SELECT pg_current_wal_flush_lsn()::text").fetchone()
    wait_replayed(conn, str(row[0]) if row else "0/0")


def wait_replayed(
    conn: psycopg.Connection[Any], lsn: str, timeout: float = REPLAY_TIMEOUT_S
) -> None:
    """Wait until ``conn``'s standby has replayed the WAL up to ``lsn`` (text form)."""
    deadline = time.monotonic() + timeout
    while True:
        row = conn.execute(
            "SELECT coalesce(pg_last_wal_replay_lsn() >= %s::pg_lsn, false)", (lsn,)
        ).fetchone()
        if not conn.autocommit:
            conn.commit()
        if row and row[0]:
            return
        if time.monotonic() > deadline:
            raise StandbyError(
                f"the source standby {describe_dsn(conn.info.dsn)} has not replayed its "
                f"primary's WAL up to {lsn} in {timeout:.0f} s: check its replication "
                "(SELECT * FROM pg_stat_wal_receiver on the standby) and run the command again"
            )
        time.sleep(0.02)


def standby_primary(dsn: str) -> str | None:
    """The primary's connection string when ``dsn`` reaches a standby (:func:`primary_dsn`);
    ``None`` on a primary. One connection."""
    with connect(dsn, role="source", autocommit=True) as conn:
        return primary_dsn(conn) if in_recovery(conn) else None


@contextmanager
def running_xacts_logged(primary: str | None) -> Iterator[None]:
    """While the block runs, have ``primary`` (a standby's, :func:`standby_primary`) log a
    running-transactions record every :data:`RUNNING_XACTS_EVERY_S`, for a slot being created
    on the standby to find its starting point. Nothing when ``primary`` is ``None`` (the
    source is the primary)."""
    if primary is None:
        yield
        return
    stop = threading.Event()

    def log_records() -> None:
        try:
            with connect(primary, role="source's primary", autocommit=True) as pconn:
                while not stop.is_set():
                    pconn.execute("SELECT pg_log_standby_snapshot()")
                    stop.wait(RUNNING_XACTS_EVERY_S)
        except (psycopg.Error, PgcdcError):
            pass  # the creation then waits for the primary's own record (every 15 s when busy)

    thread = threading.Thread(target=log_records, name="pgcdc-running-xacts", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def standby_gaps(conn: psycopg.Connection[Any]) -> list[str]:
    """On a standby, what it lacks for its logical slots to be kept by the primary's VACUUM,
    one line each naming the setting; nothing on a primary."""
    if not in_recovery(conn):
        return []
    row = conn.execute(
        "SELECT current_setting('hot_standby_feedback')::bool, "
        "coalesce(current_setting('primary_slot_name', true), '') <> ''"
    ).fetchone()
    if not conn.autocommit:
        conn.commit()
    feedback, has_slot = row if row else (False, False)
    gaps = []
    if not feedback:
        gaps.append(
            "the source is a standby without hot_standby_feedback: the primary's VACUUM "
            "invalidates its slot; ALTER SYSTEM SET hot_standby_feedback = on on the standby, "
            "then SELECT pg_reload_conf()"
        )
    if not has_slot:
        gaps.append(
            "the source is a standby without a physical slot on its primary "
            "(primary_slot_name): its feedback is lost while it reconnects and the primary may "
            "remove rows its slot needs; create one on the primary "
            "(pg_create_physical_replication_slot) and set primary_slot_name on the standby"
        )
    return gaps
