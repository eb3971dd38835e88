"""What a new slot waits for, said while it waits.

Why: ``CREATE_REPLICATION_SLOT`` returns only once every transaction that holds a transaction
id on the source when it starts (in any database of the cluster, prepared ones included) has
ended: the slot's starting point must come after all of them. A session left idle in a
transaction, or a forgotten prepared transaction, therefore holds ``pgcdc snapshot`` for as long
as it lives, and without a word it looks hung. So while the creation waits, another session
names what it waits for, with the fix, through the engine's progress reports (the terminal,
the command's log lines, the Dagster run's log).

What must hold: this only reads ``pg_stat_activity`` and ``pg_prepared_xacts`` on a connection
of its own; it never touches the replication connection (a command there would end the
snapshot's export) and never ends anyone's transaction itself.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg

from .. import progress
from ..connect import connect

QUIET_S = 2.0
"""How long the creation may take before its blockers are named (a slot on a quiet source is
created in milliseconds)."""
EVERY_S = 5.0
"""How often they are named again while it waits."""

_BLOCKERS = """
SELECT 'session', a.pid::text, a.usename, a.application_name, a.state,
       extract(epoch FROM now() - a.xact_start)::bigint
FROM pg_stat_activity a
WHERE a.backend_xid IS NOT NULL AND a.pid <> %(creator)s AND a.pid <> pg_backend_pid()
UNION ALL
SELECT 'prepared', p.gid, p.owner, p.database, NULL,
       extract(epoch FROM now() - p.prepared)::bigint
FROM pg_prepared_xacts p
ORDER BY 6 DESC NULLS LAST
"""


def blockers(conn: psycopg.Connection[Any], creator_pid: int) -> list[str]:
    """Each transaction the slot creation by ``creator_pid`` may be waiting for, in one line
    that names it and the fix, oldest first."""
    lines = []
    for kind, ident, user, where, state, age_s in conn.execute(
        _BLOCKERS, {"creator": creator_pid}
    ).fetchall():
        age = f"open {age_s} s" if age_s is not None else "age hidden from this role"
        if kind == "prepared":
            lines.append(
                f"prepared transaction {ident!r} of {user} in database {where} ({age}): "
                f"COMMIT PREPARED or ROLLBACK PREPARED {ident!r} there"
            )
        else:
            lines.append(
                f"pid {ident} of {user or '?'} ({where or 'no application name'}, "
                f"{state or 'state hidden from this role'}, {age}): end it, or "
                f"SELECT pg_terminate_backend({ident})"
            )
    return lines


@contextlib.contextmanager
def naming_blockers(dsn: str, creator_pid: int) -> Iterator[None]:
    """While inside, if it lasts over :data:`QUIET_S` and someone listens to progress, publish
    every :data:`EVERY_S` what the slot creation by ``creator_pid`` waits for."""
    if not progress.active():
        yield
        return
    done = threading.Event()
    thread = threading.Thread(
        target=_name_blockers, args=(dsn, creator_pid, done), name="slot-wait", daemon=True
    )
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=EVERY_S)


def _name_blockers(dsn: str, creator_pid: int, done: threading.Event) -> None:
    started = time.monotonic()
    if done.wait(QUIET_S):
        return
    with contextlib.suppress(Exception), connect(dsn, role="source", autocommit=True) as conn:
        while not done.is_set():
            waiting = blockers(conn, creator_pid)
            note = (
                f"creating the slot waits for {len(waiting)} transaction(s) on the source to "
                "end (its starting point must follow every transaction open when it was "
                f"asked for): {'; '.join(waiting)}"
                if waiting
                else "creating the slot waits for the source's transactions to end"
            )
            progress.publish(
                progress.SnapshotProgress(
                    phase="slot", elapsed_s=time.monotonic() - started, note=note
                )
            )
            done.wait(EVERY_S)
