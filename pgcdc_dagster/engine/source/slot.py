"""The source's replication slot: the durable record of what the source may discard.

This module owns the slot. Its ``confirmed_flush_lsn`` says "every transaction whose COMMIT
record starts before here is stored downstream": the source keeps every WAL record after the
slot's ``restart_lsn`` and streams only transactions committing after the confirmed position.
It is not the record of what is stored (the output store's manifests are, see
:mod:`..store.output_store`): it follows them, advanced only once a range is durable (:mod:`.peek`),
and may lag them after a crash. What the slot streams is chosen by the publication
(:mod:`.publication`).

How a replication starts::

    replication=database connection            ordinary connection(s)
    CREATE_REPLICATION_SLOT ... (SNAPSHOT 'export')
        -> consistent_point C, snapshot S      BEGIN ISOLATION LEVEL REPEATABLE READ;
    (stays open and idle)                      SET TRANSACTION SNAPSHOT 'S';  -- sees commits <= C
                                               COPY every table ... COMMIT
    close()                                    slot then streams every commit after C

The snapshot and the slot meet exactly at ``consistent_point``: a transaction is either in the
snapshot or in the slot's stream, never both and never neither. That only holds while the
exported snapshot is importable, i.e. while the exporting walsender connection sends nothing
more: :class:`ExportedSnapshotSlot` therefore never touches its connection until ``close()``.

Invariants kept here:

- The slot never moves backwards (:func:`advance_slot` refuses silently, returning where it is):
  moving it back is impossible anyway, and asking for it means the caller's idea of progress is
  stale, not that data should be re-read.
- An invalidated slot (WAL removed, or a recovery conflict) is reported as an error every time it
  is read: its stream has a gap that no amount of retrying fills; the only fix is a new slot and a
  new base snapshot.
- A permanent slot is a *failover* slot (PostgreSQL 17+: synchronised to physical standbys
  that have ``sync_replication_slots`` on, so it survives a promotion) where
  ``PGCDC_SLOT_FAILOVER`` asks for it (:func:`failover_wanted`; ``auto``: wherever the source
  supports it), and an existing slot is switched to what the setting asks
  (:func:`keep_failover`). See :mod:`.failover` for what else a failover needs.
- Slot names are restricted to ``[a-z0-9_]{1,63}`` (PostgreSQL's own rule) and checked before any
  server sees them: replication connections take no bound parameters, so the name is spliced in
  (through psycopg.sql) rather than bound.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import psycopg
from psycopg import errors, sql

from ..connect import connect
from ..errors import PgcdcError, server_message
from ..lsn import Lsn, lsn_or_none
from .slot_wait import naming_blockers
from .standby import in_recovery, running_xacts_logged, standby_primary

__all__ = [
    "CreatedSlot",
    "ExportedSnapshotSlot",
    "SlotError",
    "SlotInfo",
    "advance_slot",
    "create_slot_with_snapshot",
    "drop_slot",
    "failover_wanted",
    "keep_failover",
    "read_slot",
]

FAILOVER_SINCE = 170000
"""The first server version whose logical slots can be failover slots."""

_SLOT_NAME = re.compile(r"^[a-z0-9_]{1,63}$")

# Newest syntax first (PostgreSQL 15+), then the one older servers understand. On a
# replication connection with autocommit both return the snapshot name.
_CREATE_SLOT_SYNTAXES = (
    "CREATE_REPLICATION_SLOT {slot} LOGICAL pgoutput (SNAPSHOT 'export')",
    "CREATE_REPLICATION_SLOT {slot} LOGICAL pgoutput EXPORT_SNAPSHOT",
)
_CREATE_TEMPORARY_SLOT_SYNTAXES = tuple(
    syntax.replace("{slot} LOGICAL", "{slot} TEMPORARY LOGICAL") for syntax in _CREATE_SLOT_SYNTAXES
)
_CREATE_FAILOVER_SLOT_SYNTAXES = (
    "CREATE_REPLICATION_SLOT {slot} LOGICAL pgoutput (SNAPSHOT 'export', FAILOVER true)",
)


class SlotError(PgcdcError):
    """A slot or publication is missing, unusable or in use; the message says how to fix it."""


@dataclass(frozen=True)
class SlotInfo:
    """One row of ``pg_replication_slots`` for a logical slot, as typed values.

    ``retained_wal_bytes`` is how much WAL the slot forces the source to keep
    (``pg_current_wal_flush_lsn() - restart_lsn``, computed by the server so both ends of the
    subtraction come from the same moment). ``safe_wal_size`` is how many more bytes may be
    written before the slot risks invalidation; ``None`` when ``max_slot_wal_keep_size`` is
    unlimited.
    """

    name: str
    plugin: str
    database: str
    active: bool
    restart_lsn: Lsn | None
    confirmed_flush_lsn: Lsn | None
    wal_status: str | None
    safe_wal_size: int | None
    retained_wal_bytes: int | None
    failover: bool | None = None
    """Whether it is a failover slot; ``None`` on a server older than PostgreSQL 17."""


@dataclass(frozen=True)
class CreatedSlot:
    """A freshly created slot: its stream starts after ``consistent_point``, and
    ``snapshot_name`` is the snapshot that holds exactly the commits up to it."""

    name: str
    consistent_point: Lsn
    snapshot_name: str


class ExportedSnapshotSlot:
    """A created slot plus the idle replication connection that keeps its snapshot importable.

    Use as a context manager around the base copy: import :attr:`slot`'s ``snapshot_name`` in
    other connections (``SET TRANSACTION SNAPSHOT``) before leaving the block. Nothing may be sent
    on the replication connection meanwhile (any command ends the export), so this object has no
    method but :meth:`close`. Closing ends the export, not the slot: the slot is permanent and
    keeps retaining WAL from ``consistent_point`` until it is advanced or dropped — a failed copy
    must :func:`drop_slot` before retrying.
    """

    slot: CreatedSlot

    def __init__(self, conn: psycopg.Connection[Any], slot: CreatedSlot) -> None:
        self._conn = conn
        self.slot = slot

    @property
    def closed(self) -> bool:
        return self._conn.closed

    def close(self) -> None:
        """End the export; idempotent."""
        self._conn.close()

    def __enter__(self) -> ExportedSnapshotSlot:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "exporting"
        return f"ExportedSnapshotSlot({self.slot!r}, {state})"


def _checked_slot_name(slot_name: str) -> str:
    if not _SLOT_NAME.match(slot_name):
        raise SlotError(
            f"{slot_name!r} is not a valid replication slot name: use 1 to 63 characters of "
            "lower-case letters, digits and underscores, for example 'pgcdc_orders'"
        )
    return slot_name


def _redo_hint(slot_name: str) -> str:
    return (
        f"drop it (SELECT pg_drop_replication_slot('{slot_name}')) and re-take the base "
        "snapshot (run pgcdc snapshot), which creates the slot anew"
    )


def failover_wanted(setting: str, server_version: int, *, standby: bool = False) -> bool:
    """Whether the slot is to be a failover slot under ``PGCDC_SLOT_FAILOVER=setting`` on a
    server of ``server_version``: ``auto`` wherever the server has them, ``on`` always (a
    :class:`SlotError` naming the fix on an older server), ``off`` never. A slot on a hot
    standby (``standby``) is never one: PostgreSQL refuses it."""
    if setting == "off":
        return False
    if standby:
        if setting == "on":
            raise SlotError(
                "PGCDC_SLOT_FAILOVER=on, but the source is a hot standby, whose slots cannot be "
                "failover slots: set PGCDC_SLOT_FAILOVER=auto (the slot survives this "
                "standby's own promotion), or set PGCDC_SOURCE_DSN to the primary"
            )
        return False
    if server_version >= FAILOVER_SINCE:
        return True
    if setting == "on":
        raise SlotError(
            f"PGCDC_SLOT_FAILOVER=on, but the source runs PostgreSQL {server_version // 10000}, "
            "whose slots cannot be failover slots (PostgreSQL 17 or later): set "
            "PGCDC_SLOT_FAILOVER=auto, and after a failover run pgcdc recover"
        )
    return False


def create_slot_with_snapshot(
    dsn: str, slot_name: str, *, temporary: bool = False, failover: str = "off"
) -> ExportedSnapshotSlot:
    """Create the logical slot ``slot_name`` (pgoutput) and export the snapshot it starts from.

    The returned object owns the replication connection; keep it open (and use it only as a
    context manager) until every connection of the base copy has imported the snapshot.
    ``temporary``: the slot is dropped by the server when that connection ends, however it
    ends (a table added later wants only its consistent point and snapshot); such a slot is
    never a failover slot. ``failover``: ``PGCDC_SLOT_FAILOVER`` (:func:`failover_wanted`).
    """
    _checked_slot_name(slot_name)
    primary = standby_primary(dsn)  # on a standby, the primary that lets the slot start
    conn = connect(dsn, role="source", replication=True)
    try:
        if temporary:
            syntaxes = _CREATE_TEMPORARY_SLOT_SYNTAXES
        elif failover_wanted(failover, conn.info.server_version, standby=primary is not None):
            syntaxes = _CREATE_FAILOVER_SLOT_SYNTAXES
        else:
            syntaxes = _CREATE_SLOT_SYNTAXES
    except BaseException:
        conn.close()
        raise
    try:
        with naming_blockers(dsn, conn.info.backend_pid), running_xacts_logged(primary):
            row = _create_slot(conn, slot_name, syntaxes)
    except BaseException:
        conn.close()
        raise
    return ExportedSnapshotSlot(conn, row)


def _create_slot(
    conn: psycopg.Connection[Any],
    slot_name: str,
    syntaxes: Iterable[str] = _CREATE_SLOT_SYNTAXES,
) -> CreatedSlot:
    """Run ``CREATE_REPLICATION_SLOT`` with the first syntax the server accepts."""
    _checked_slot_name(slot_name)
    last_syntax_error: psycopg.Error | None = None
    for syntax in syntaxes:
        try:
            cur = conn.execute(sql.SQL(syntax).format(slot=sql.Identifier(slot_name)))
        except errors.SyntaxError as exc:
            last_syntax_error = exc
            continue
        except errors.DuplicateObject:
            raise SlotError(
                f"replication slot {slot_name} already exists on the source: a new slot needs a "
                "new base snapshot, so either keep using the existing one or "
                f"{_redo_hint(slot_name)}"
            ) from None
        except errors.ConfigurationLimitExceeded as exc:
            raise SlotError(
                f"cannot create replication slot {slot_name}: {server_message(exc)}: drop an "
                "unused slot (SELECT pg_drop_replication_slot(name)) or raise "
                "max_replication_slots / max_wal_senders and restart the source"
            ) from None
        except errors.ObjectNotInPrerequisiteState as exc:
            raise SlotError(
                f"cannot create replication slot {slot_name}: {server_message(exc)}: run "
                "ALTER SYSTEM SET wal_level = logical on the source and restart it"
            ) from None
        row = cur.fetchone()
        names = [column.name for column in cur.description or []]
        if row is None or "snapshot_name" not in names:
            raise SlotError(f"CREATE_REPLICATION_SLOT {slot_name} returned no snapshot")
        fields = dict(zip(names, row, strict=True))
        if not fields["snapshot_name"]:
            raise SlotError(
                f"replication slot {slot_name} was created but no snapshot was exported "
                "(the connection must be a replication=database connection in autocommit): "
                f"{_redo_hint(slot_name)}"
            )
        return CreatedSlot(
            name=str(fields["slot_name"]),
            consistent_point=Lsn(str(fields["consistent_point"])),
            snapshot_name=str(fields["snapshot_name"]),
        )
    raise SlotError(
        f"the source rejected every known CREATE_REPLICATION_SLOT syntax for {slot_name} "
        f"({last_syntax_error}): logical replication with pgoutput needs PostgreSQL 10 or later"
    )


_READ_SLOT = """
SELECT s.slot_name, s.slot_type, s.plugin, s.database, s.active,
       s.restart_lsn::text, s.confirmed_flush_lsn::text, s.wal_status, s.safe_wal_size,
       pg_wal_lsn_diff(
           CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn()
                ELSE pg_current_wal_flush_lsn() END,
           s.restart_lsn)::bigint,
       -- Columns of newer servers, read through jsonb so one query fits every version.
       (to_jsonb(s) ->> 'conflicting')::boolean,
       to_jsonb(s) ->> 'invalidation_reason',
       (to_jsonb(s) ->> 'failover')::boolean
FROM pg_replication_slots s
WHERE s.slot_name = %s
"""


def current_flush_lsn(conn: psycopg.Connection[Any]) -> Lsn:
    """The source's flushed WAL position: the furthest logical decoding can read, and the
    catch-up target for "now" (``pg_current_wal_lsn()`` can trail it, the insert position
    can run ahead of it). On a hot standby, its replay position: decoding there reads no
    further."""
    with conn.transaction():
        (flush,) = conn.execute(_FLUSH_LSN).fetchone()  # type: ignore[misc]
    return Lsn.parse(flush)


_FLUSH_LSN = (
    "SELECT CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() "
    "ELSE pg_current_wal_flush_lsn() END::text"
)


def read_slot(conn: psycopg.Connection[Any], slot_name: str) -> SlotInfo:
    """The slot's current state; :class:`SlotError` if it is missing, physical or invalidated.

    An invalidated slot can never be used again, whatever its other columns say, so it is an
    error here rather than a status for every caller to remember to check.
    """
    _checked_slot_name(slot_name)
    with conn.transaction():
        row = conn.execute(_READ_SLOT, (slot_name,)).fetchone()
    if row is None:
        raise SlotError(
            f"replication slot {slot_name} does not exist on the source (dropped, or a "
            "failover to a standby that had no synced copy of it): run pgcdc recover, which "
            "creates it anew and copies only the rows that differ (before any base snapshot: "
            "pgcdc snapshot)"
        )
    (name, slot_type, plugin, database, active, restart, confirmed, wal_status, safe_size) = row[:9]
    retained, conflicting, invalidation_reason, failover = row[9:]
    if slot_type != "logical":
        raise SlotError(
            f"replication slot {slot_name} is a {slot_type} slot, not a logical one: it belongs "
            "to something else (a standby?); choose another slot name"
        )
    if wal_status == "lost" or conflicting or invalidation_reason:
        reason = invalidation_reason or (
            "the WAL it still needed was removed" if wal_status == "lost" else "recovery conflict"
        )
        raise SlotError(
            f"replication slot {slot_name} is invalidated ({reason}; wal_status {wal_status}): "
            "changes after its last confirmed position are gone from the source, so the target "
            "can no longer be kept in step; run pgcdc recover, which creates it anew and copies "
            f"only the chunks of rows that differ, or {_redo_hint(slot_name)}"
        )
    return SlotInfo(
        name=name,
        plugin=plugin,
        database=database,
        active=active,
        restart_lsn=lsn_or_none(restart),
        confirmed_flush_lsn=lsn_or_none(confirmed),
        wal_status=wal_status,
        safe_wal_size=safe_size,
        retained_wal_bytes=retained,
        failover=failover,
    )


def keep_failover(dsn: str, slot_name: str, setting: str) -> bool | None:
    """Switch the existing slot ``slot_name`` to what ``PGCDC_SLOT_FAILOVER=setting`` asks
    (``ALTER_REPLICATION_SLOT``, PostgreSQL 17+), when it is not so already; returns whether
    it is a failover slot now (``None``: the server has no failover slots, or no such slot).

    The server makes an ``ALTER_REPLICATION_SLOT`` of a slot a walsender holds wait until it
    is let go: so the slot is first waited for here, as any reader waits (:func:`released`),
    and a slot still held then is an error naming the consumer, never a wait without end."""
    _checked_slot_name(slot_name)
    with connect(dsn, role="source") as conn:
        standby = in_recovery(conn)
        wanted = failover_wanted(setting, conn.info.server_version, standby=standby)
        if conn.info.server_version < FAILOVER_SINCE or standby:
            return None
        row = conn.execute(
            "SELECT failover FROM pg_replication_slots WHERE slot_name = %s", (slot_name,)
        ).fetchone()
        conn.commit()
        if row is None:
            return None
        if bool(row[0]) == wanted:
            return wanted
        if released(conn, slot_name).active:
            raise SlotError(
                f"cannot switch replication slot {slot_name} to failover={wanted} "
                f"(PGCDC_SLOT_FAILOVER={setting}): a consumer streams from it; stop it (SELECT "
                f"active_pid FROM pg_replication_slots WHERE slot_name = '{slot_name}') and "
                "run the command again"
            )
    with connect(dsn, role="source", replication=True) as conn:
        conn.execute(
            sql.SQL("ALTER_REPLICATION_SLOT {} (FAILOVER {})").format(
                sql.Identifier(slot_name), sql.SQL("true" if wanted else "false")
            )
        )
    return wanted


ADVANCE_PROBE_TIMEOUT = "1s"
"""How long an advance may wait for WAL before the flush is forced (see :func:`advance_slot`)."""


RELEASE_WAIT_S = 10.0
"""How long a reader of the slot waits for a walsender to let it go: a follower's stream just
closed, or the stream of a process that was killed (its walsender ends once it sees the socket
closed, a few milliseconds later)."""


def released(
    conn: psycopg.Connection[Any], slot_name: str, wait_s: float = RELEASE_WAIT_S
) -> SlotInfo:
    """The slot as read once no session holds it, or after ``wait_s`` (a reader then gets the
    server's own "slot is active" error, naming the process). Leaves no transaction open."""
    deadline = time.monotonic() + wait_s
    while True:
        info = read_slot(conn, slot_name)
        conn.commit()
        if not info.active or time.monotonic() >= deadline:
            return info
        time.sleep(0.01)


def advance_slot(
    conn: psycopg.Connection[Any], slot_name: str, to: Lsn, *, wait_s: float = RELEASE_WAIT_S
) -> Lsn:
    """Confirm everything up to ``to`` as stored, letting the source free the WAL before it.

    Never moves backwards: when ``to`` is at or before the confirmed position, nothing happens.
    The server also never moves past its own flush position, so the result can be below ``to``.
    Returns the confirmed position afterwards. ``to`` must be a transaction boundary (a
    COMMIT's end LSN): a point inside a COMMIT record marks that transaction as consumed.
    The server writes the new position to disk at its next checkpoint; after a crash the slot
    may come back at an earlier position, so consumers must tolerate re-reading a range.

    Never waits for WAL that nobody will write. PostgreSQL (15 at least) advances a logical slot
    by decoding up to ``to`` with a reader that *waits* for WAL past the flush position, so a
    ``to`` inside a record that is only partly flushed (the WAL writer flushes whole pages; a
    record spanning a page boundary leaves the flush position in its middle) blocks until that
    record is flushed, which on an idle server is never. That can only happen while WAL is
    inserted but not flushed: then the advance gets a short timeout, and if it expires the
    flush is forced with one empty transaction (its synchronous COMMIT flushes every record
    before it; pgoutput sends nothing for it) and the advance is retried.

    A slot a walsender holds is waited for up to ``wait_s`` (:func:`released`).
    """
    current = released(conn, slot_name, wait_s).confirmed_flush_lsn
    if current is not None and to <= current:
        return current
    with conn.transaction():
        (unflushed,) = conn.execute(  # type: ignore[misc]
            "SELECT NOT pg_is_in_recovery() "
            "AND pg_current_wal_insert_lsn() > pg_current_wal_flush_lsn()"
        ).fetchone()
    try:
        try:
            return _advance(conn, slot_name, to, probe=bool(unflushed))
        except errors.QueryCanceled:
            with conn.transaction():
                conn.execute("SET LOCAL synchronous_commit = on")
                conn.execute("SELECT pg_current_xact_id()")
            return _advance(conn, slot_name, to, probe=False)
    except errors.ObjectNotInPrerequisiteState:
        # Someone else moved the slot past `to` since we read it: that is "nothing to do".
        after = read_slot(conn, slot_name).confirmed_flush_lsn
        if after is not None and to <= after:
            return after
        raise
    except errors.ObjectInUse as exc:
        raise SlotError(
            f"cannot advance replication slot {slot_name}: {server_message(exc)}: a consumer is "
            "streaming from it; stop that consumer (or wait for it) and retry"
        ) from None


def _advance(conn: psycopg.Connection[Any], slot_name: str, to: Lsn, *, probe: bool) -> Lsn:
    with conn.transaction():
        if probe:
            conn.execute(f"SET LOCAL statement_timeout = '{ADVANCE_PROBE_TIMEOUT}'")
        row = conn.execute(
            "SELECT end_lsn::text FROM pg_replication_slot_advance(%s, %s::pg_lsn)",
            (slot_name, str(Lsn(to))),
        ).fetchone()
    assert row is not None
    return Lsn(row[0])


def drop_slot(
    conn: psycopg.Connection[Any],
    slot_name: str,
    *,
    missing_ok: bool = True,
    wait_seconds: float = 0.0,
) -> None:
    """Drop the slot, releasing the WAL it retains. The stream's position is lost with it: the
    next replication needs a new slot and a new base snapshot.

    ``wait_seconds``: how long to wait for a consumer that is going away (the walsender of a
    killed process exits a moment after its client) before reporting the slot as in use.
    """
    _checked_slot_name(slot_name)
    deadline = time.monotonic() + wait_seconds
    while True:
        try:
            with conn.transaction():
                conn.execute("SELECT pg_drop_replication_slot(%s)", (slot_name,))
            return
        except errors.UndefinedObject:
            if missing_ok:
                return
            raise SlotError(
                f"replication slot {slot_name} does not exist on the source, so it cannot be "
                "dropped: check the slot name (SELECT slot_name FROM pg_replication_slots)"
            ) from None
        except errors.ObjectInUse as exc:
            if time.monotonic() < deadline:
                time.sleep(0.2)
                continue
            raise SlotError(
                f"cannot drop replication slot {slot_name}: {server_message(exc)}: stop the "
                "consumer streaming from it (or SELECT pg_terminate_backend(active_pid) FROM "
                f"pg_replication_slots WHERE slot_name = '{slot_name}') and retry"
            ) from None
