"""Going on after the source failed over: the chain's positions carried onto the new timeline.

When the source's primary dies and a standby is promoted, the source's WAL goes on on a new
timeline from the *switch point* ``S`` (:mod:`..source.timeline`). Below ``S`` the new primary
holds exactly the old one's WAL; above it, nothing of the old one's. So, of what this
replication holds past ``S``:

- a stored range that ends past ``S`` may hold transactions the new primary never had, and its
  LSNs past ``S`` name other WAL there: it is dropped from the store (never applied), and its
  part below ``S`` is read again from the slot, whose position on the new primary is at or
  before ``S`` (a synchronised slot is never ahead of what its standby flushed);
- a target whose origin is past ``S`` has applied a transaction the new primary lacks: it is a
  *fork*. Nothing is applied on top of it: :class:`ForkError` names ``pgcdc recover``, which
  compares the target with the new primary and copies what differs.

PostgreSQL rules out the fork when the primary's ``synchronized_standby_slots`` names the
standby's slot (logical decoding then sends nothing the standby has not flushed): see
:mod:`..source.failover` for the checks, ``docs/operations/failover.md`` for the settings.

Why it holds, crash anywhere: :func:`follow_timeline` runs under the range lock before anything
else a catch-up does (:func:`.pipeline.confirm_stored`: before the slot is confirmed to the
last stored range, which past ``S`` would skip new-timeline transactions), and it changes two
durable things in this order: the ranges past ``S`` leave the store, then the chain records the
new timeline. Killed before the second, the next call finds the old timeline recorded and does
both again (dropping is idempotent). The chain records the timeline only after the fork check
passed, or, in a recovery, after the chain says ``recovering`` (:mod:`.recover`), so a fork is
never forgotten.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from ..apply.origin import progress_of
from ..connect import connect
from ..errors import PgcdcError
from ..failpoints import failpoint
from ..lsn import Lsn, LsnRange
from ..settings import ReplicationSettings
from ..source.timeline import SourceSystem, identify, switch_point
from ..store import open_store


class ForkError(PgcdcError):
    """The target holds transactions the source no longer has (a failover lost them)."""


@dataclass(frozen=True)
class TimelineSwitch:
    """What :func:`follow_timeline` found and did after a promotion."""

    from_timeline: int
    to_timeline: int
    switch_point: Lsn | None
    """Where the old timeline ended in the new one's history; ``None``: not an ancestor."""
    applied: Lsn | None
    """The target's origin when it looked."""
    dropped: tuple[LsnRange, ...]
    """Stored ranges taken out, ending past the switch point."""
    own_slot: bool = False
    """The slot is the source server's own, not a synchronised copy (:func:`_own_slot`):
    everything read from it is in that server's history, so nothing forked."""

    @property
    def forked(self) -> bool:
        """Whether the target applied past what the new timeline shares with the old one."""
        if self.own_slot:
            return False
        if self.switch_point is None:
            return True
        return self.applied is not None and self.applied > self.switch_point

    def line(self) -> str:
        where = "an unknown point" if self.switch_point is None else str(self.switch_point)
        dropped = f"; {len(self.dropped)} stored range(s) past it dropped" if self.dropped else ""
        return (
            f"the source failed over: timeline {self.from_timeline} -> {self.to_timeline} at "
            f"{where}{dropped}"
        )


def follow_timeline(
    settings: ReplicationSettings, *, recovering: bool = False
) -> TimelineSwitch | None:
    """Carry the chain onto the source's current timeline, if it changed (module docstring);
    ``None`` when it did not (or there is no complete chain yet). A chain recorded before
    timelines were takes the present one. Raises :class:`ForkError` on a fork unless
    ``recovering`` (a recovery repairs it: the ranges past the switch point are dropped, and
    the caller records the timeline once its chain says ``recovering``)."""
    store = open_store(settings.store_location)
    chain = store.chain()
    if chain is None or chain.consistent_point is None or chain.finished:
        return None
    with connect(settings.source_dsn, role="source", replication=True) as conn:
        system = identify(conn)
        if not recovering:
            _check_same_cluster(chain.system_id, system, settings)
        if chain.timeline is None:
            store.record_timeline(system.timeline, system.system_id)
            return None
        if chain.timeline == system.timeline:
            return None
        point = switch_point(conn, system.timeline, chain.timeline)
        own = _own_slot(conn, settings.slot)
    applied = progress_of(settings.target_dsn, settings.origin)
    switch = TimelineSwitch(chain.timeline, system.timeline, point, applied, (), own)
    if switch.forked and not recovering:
        raise ForkError(_fork_line(settings, switch))
    dropped = (
        []
        if own
        else store.drop_ranges_after(point if point is not None else chain.consistent_point)
    )
    switch = TimelineSwitch(chain.timeline, system.timeline, point, applied, tuple(dropped), own)
    failpoint("failover.after_drop")
    if not recovering:
        store.record_timeline(system.timeline, system.system_id)
    return switch


def record_present_timeline(settings: ReplicationSettings) -> SourceSystem:
    """Record the source's present timeline as the chain's (a recovery, once its chain says
    ``recovering``); returns what the source said."""
    with connect(settings.source_dsn, role="source", replication=True) as conn:
        system = identify(conn)
    open_store(settings.store_location).record_timeline(system.timeline, system.system_id)
    return system


def forked(settings: ReplicationSettings) -> str | None:
    """Why the target cannot go on from the source, in a line naming ``pgcdc recover``, when
    a failover left it ahead of the new primary; ``None`` otherwise. Changes nothing."""
    store = open_store(settings.store_location)
    chain = store.chain()
    if chain is None or chain.timeline is None or chain.consistent_point is None:
        return None
    with connect(settings.source_dsn, role="source", replication=True) as conn:
        system = identify(conn)
        if system.timeline == chain.timeline:
            return None
        point = switch_point(conn, system.timeline, chain.timeline)
        own = _own_slot(conn, settings.slot)
    applied = progress_of(settings.target_dsn, settings.origin)
    switch = TimelineSwitch(chain.timeline, system.timeline, point, applied, (), own)
    return _fork_line(settings, switch) if switch.forked else None


def _own_slot(conn: psycopg.Connection[Any], slot: str) -> bool:
    """Whether ``slot`` is the source server's own slot: present and not a synchronised copy
    (``synced``, PostgreSQL 17+, stays true on a promoted standby's copies). Such a slot was
    made on this server (a slot decoded on a hot standby that was then promoted, see
    :mod:`..source.standby`), so it only ever decoded this server's WAL, all of it in the
    present timeline's history: its ranges are kept, and the target cannot be ahead."""
    row = conn.execute(  # literal: a replication connection takes no parameters
        sql.SQL(
            "SELECT coalesce((to_jsonb(s) ->> 'synced')::boolean, false) "
            "FROM pg_replication_slots s WHERE s.slot_name = {}"
        ).format(sql.Literal(slot))
    ).fetchone()
    return row is not None and not row[0]


def _fork_line(settings: ReplicationSettings, switch: TimelineSwitch) -> str:
    if switch.switch_point is None:
        shared = (
            f"timeline {switch.from_timeline}, which the target's positions belong to, is not "
            f"in the history of the source's timeline {switch.to_timeline} (another branch)"
        )
    else:
        shared = (
            f"the target applied up to {switch.applied}, past {switch.switch_point}, where the "
            f"source's timeline {switch.to_timeline} left timeline {switch.from_timeline}: "
            "the promoted standby never received those transactions"
        )
    return (
        f"the source failed over and the target is ahead of it ({shared}); nothing more is "
        f"applied on top of that fork: run pgcdc recover, which compares the target with the "
        f"source and copies what differs (slot {settings.slot})"
    )


def _check_same_cluster(
    recorded: str | None, system: SourceSystem, settings: ReplicationSettings
) -> None:
    if recorded is not None and recorded != system.system_id:
        raise ForkError(
            f"the source is another cluster than the one slot {settings.slot} replicated "
            f"(system identifier {system.system_id}, recorded {recorded}): point "
            "PGCDC_SOURCE_DSN at the replicated cluster or one of its standbys, or run pgcdc "
            "recover to bring the target in step with this one"
        )
