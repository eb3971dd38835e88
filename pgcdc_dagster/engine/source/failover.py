"""Whether the slot survives a failover of the source: what the source has, and each gap.

A promoted standby has the slot only if it is a *failover* slot (PostgreSQL 17+) and the
standby synchronises slots (``sync_replication_slots = on``, with ``hot_standby_feedback`` and
a ``dbname`` in ``primary_conninfo``). Its copy counts only once it is ``synced`` and not
``temporary``: a copy stays temporary until the primary's slot has advanced after the standby
first saw it, and a temporary copy is dropped at promotion; the sync worker naps up to 30 s
between rounds.

Having the slot is not enough: the target must never hold a transaction the promoted standby
lacks, or the replication forks (:mod:`..control.failover` stops on a fork, naming
``pgcdc recover``). PostgreSQL guarantees that only when the primary's
``synchronized_standby_slots`` names the standby's physical slot: logical decoding of a failover
slot then sends nothing that standby has not flushed. A standby named there that is down stalls
that decoding, which is worth a line too.

:func:`failover_readiness` reads all of it from the primary, and from each other host of a
multi-host DSN (``host=a,b``: where a moving primary is followed from) the standby's own copy of
the slot. It changes nothing and needs no privilege beyond what replication needs; each gap is
one line naming the setting to change (:meth:`FailoverReadiness.gaps`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from ..connect import ConnectError, connect, describe_dsn
from .slot import FAILOVER_SINCE
from .standby import StandbyError, in_recovery, primary_dsn, standby_gaps

__all__ = ["FailoverReadiness", "Standby", "StandbyCopy", "failover_readiness"]

COPY_CONNECT_TIMEOUT_S = 3
"""How long reading a standby's copy of the slot may wait for that standby to answer."""


@dataclass(frozen=True)
class Standby:
    """A physical standby the primary knows: attached now, or only by its slot."""

    name: str
    """Its ``application_name`` (``walreceiver`` unless set), else its slot's name."""
    slot: str | None
    """Its physical slot; ``None``: it streams without one."""
    state: str | None
    """``streaming``, ``catchup``...; ``None``: not attached now (its slot is inactive)."""


@dataclass(frozen=True)
class StandbyCopy:
    """What a standby reached through the DSN holds of the slot."""

    where: str
    """``host:port``."""
    in_recovery: bool
    sync_slots: bool
    present: bool
    synced: bool = False
    temporary: bool = False
    confirmed_flush_lsn: str | None = None

    @property
    def counts(self) -> bool:
        """Whether a promotion of this standby keeps the slot."""
        return self.present and self.synced and not self.temporary


@dataclass(frozen=True)
class FailoverReadiness:
    """The facts :func:`failover_readiness` read (see the module docstring)."""

    slot: str
    server_version: int
    slot_exists: bool
    slot_failover: bool | None
    standbys: tuple[Standby, ...]
    synchronized: tuple[str, ...]
    """``synchronized_standby_slots`` on the primary."""
    copies: tuple[StandbyCopy, ...]
    unreachable: tuple[str, ...] = ()
    """Other hosts of the DSN that could not be read (``host:port: why``)."""
    standby_of: str | None = None
    """When the source is a hot standby that decodes (:mod:`.standby`): its primary
    (``user@host:port/db``, or why it could not be read); ``None`` on a primary."""
    standby_gaps: tuple[str, ...] = ()
    """What that standby lacks for its slot to be kept (:func:`.standby.standby_gaps`)."""

    @property
    def has_failover_slots(self) -> bool:
        return self.server_version >= FAILOVER_SINCE

    def gaps(self) -> list[str]:
        """Each reason the slot may not survive a failover, or may fork, in a line with its
        fix; empty when nothing is missing (or there is no standby to fail over to). A slot
        on a standby survives that standby's promotion: its gaps are the standby's own."""
        if self.standby_of is not None:
            return list(self.standby_gaps)
        standbys = self.standbys
        if not standbys and not self.copies:
            return []
        major = self.server_version // 10000
        if not self.has_failover_slots:
            return [
                f"the source runs PostgreSQL {major}, whose slots are not synchronised to its "
                f"{len(standbys)} standby(s) (PostgreSQL 17+): after a failover slot "
                f"{self.slot} is gone and pgcdc recover must run (PGCDC_AUTO_RECOVER=on lets "
                "the sensor do it)"
            ]
        gaps = []
        if self.slot_exists and not self.slot_failover:
            gaps.append(
                f"slot {self.slot} is not a failover slot, so no standby gets a copy: set "
                "PGCDC_SLOT_FAILOVER=auto (or on); the next pgcdc catchup or follow switches it"
            )
        for standby in standbys:
            if standby.slot is None:
                gaps.append(
                    f"standby {standby.name} streams without a physical replication slot, so "
                    "it cannot synchronise slots: set primary_slot_name on it (pg_basebackup "
                    "-C -S <name> makes one) and name that slot in the source's "
                    "synchronized_standby_slots"
                )
            elif standby.slot not in self.synchronized:
                gaps.append(
                    f"standby {standby.name}'s slot {standby.slot} is not in the source's "
                    "synchronized_standby_slots, so the target may apply transactions that "
                    "standby never received (a fork at failover): run ALTER SYSTEM SET "
                    f"synchronized_standby_slots = '{_listed(self.synchronized, standby.slot)}'"
                    "; SELECT pg_reload_conf(); on the source"
                )
            elif standby.state is None:
                gaps.append(
                    f"standby slot {standby.slot} is in synchronized_standby_slots but no "
                    "standby streams from it: decoding of failover slots waits until it is "
                    "back; bring the standby back, or take the slot out of that setting"
                )
        for copy in self.copies:
            if not copy.in_recovery:
                continue
            if not copy.sync_slots:
                gaps.append(
                    f"the standby at {copy.where} has sync_replication_slots off: set it on "
                    "there, with hot_standby_feedback = on and a dbname in primary_conninfo"
                )
            elif not copy.present:
                gaps.append(
                    f"the standby at {copy.where} has no copy of slot {self.slot} yet: its "
                    "slot sync worker copies a failover slot within 30 s"
                )
            elif copy.temporary or not copy.synced:
                gaps.append(
                    f"the standby at {copy.where} holds slot {self.slot}'s copy as temporary, "
                    "which a promotion drops: it becomes persistent once the slot has advanced "
                    "(a catch-up or follow) and the sync worker's next round (up to 30 s)"
                )
        return gaps

    @property
    def survives(self) -> bool:
        """Whether a failover to a standby keeps the slot, with nothing lost: no gap."""
        return not self.gaps()

    def facts(self) -> dict[str, Any]:
        """What was read, for status output and asset-check metadata."""
        if self.standby_of is not None:
            return {
                "decoding on": f"a hot standby of {self.standby_of}: the slot survives this "
                "standby's promotion, not a failover to another one (then pgcdc recover)",
                "slot failover": "n/a (a slot on a standby)",
            }
        return {
            "failover slots": "yes" if self.has_failover_slots else "no (before PostgreSQL 17)",
            "slot failover": "n/a" if self.slot_failover is None else str(self.slot_failover),
            "standbys": ", ".join(
                f"{s.name} ({s.state or 'not attached'}, slot {s.slot or 'none'})"
                for s in self.standbys
            )
            or "none attached",
            "synchronized_standby_slots": ", ".join(self.synchronized) or "(empty)",
            "standby copies": ", ".join(
                f"{c.where}: "
                + (
                    "primary"
                    if not c.in_recovery
                    else "synced"
                    if c.counts
                    else "temporary"
                    if c.present
                    else "missing"
                )
                for c in self.copies
            )
            or "not read (no other host in the DSN)",
        }


def _listed(names: tuple[str, ...], more: str) -> str:
    return ", ".join([*names, more])


_STANDBYS = """
SELECT coalesce(r.application_name, s.slot_name), s.slot_name, r.state
FROM pg_stat_replication r
FULL JOIN pg_replication_slots s ON s.active_pid = r.pid
WHERE (s.slot_type IS NULL OR s.slot_type = 'physical')
  AND (r.state IS NULL OR r.state <> 'backup')
  AND NOT EXISTS (
      SELECT FROM pg_replication_slots l WHERE l.active_pid = r.pid AND l.slot_type = 'logical')
ORDER BY 1
"""


def failover_readiness(dsn: str, slot: str) -> FailoverReadiness:
    """Read what the source (the primary ``dsn`` connects to) and the other hosts of ``dsn``
    have for ``slot`` to survive a failover (module docstring)."""
    with connect(dsn, role="source", autocommit=True) as conn:
        version = conn.info.server_version
        if in_recovery(conn):
            return _on_standby(conn, slot)
        here = (conn.info.host, str(conn.info.port))
        standbys = tuple(Standby(*row) for row in conn.execute(_STANDBYS).fetchall())
        synchronized: tuple[str, ...] = ()
        failover: bool | None = None
        exists = False
        if version >= FAILOVER_SINCE:
            (setting,) = conn.execute(  # type: ignore[misc]
                "SELECT current_setting('synchronized_standby_slots')"
            ).fetchone()
            synchronized = tuple(s.strip() for s in setting.split(",") if s.strip())
            row = conn.execute(
                "SELECT failover FROM pg_replication_slots WHERE slot_name = %s", (slot,)
            ).fetchone()
            exists = row is not None
            failover = bool(row[0]) if row is not None else None
        else:
            exists = (
                conn.execute(
                    "SELECT FROM pg_replication_slots WHERE slot_name = %s", (slot,)
                ).fetchone()
                is not None
            )
    copies, unreachable = [], []
    for host, port in other_hosts(dsn, here):
        try:
            copies.append(_standby_copy(dsn, host, port, slot))
        except ConnectError as exc:
            unreachable.append(f"{host}:{port}: {exc}")
    return FailoverReadiness(
        slot,
        version,
        exists,
        failover,
        standbys,
        synchronized,
        tuple(copies),
        tuple(unreachable),
    )


def _on_standby(conn: psycopg.Connection[Any], slot: str) -> FailoverReadiness:
    """The readiness of a slot decoded on the hot standby ``conn`` is on."""
    try:
        primary = describe_dsn(primary_dsn(conn))
    except StandbyError:
        primary = "a primary pg_stat_wal_receiver does not show (no pg_read_all_stats)"
    exists = (
        conn.execute("SELECT FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone()
        is not None
    )
    return FailoverReadiness(
        slot,
        conn.info.server_version,
        exists,
        None,
        (),
        (),
        (),
        standby_of=primary,
        standby_gaps=tuple(standby_gaps(conn)),
    )


def other_hosts(dsn: str, here: tuple[str, str]) -> list[tuple[str, str]]:
    """The hosts of a multi-host ``dsn`` (``host=a,b port=p,q``) other than ``here``."""
    parts = conninfo_to_dict(dsn)
    hosts = str(parts.get("host") or "").split(",")
    ports = str(parts.get("port") or "5432").split(",")
    if len(hosts) < 2:
        return []
    if len(ports) == 1:
        ports = ports * len(hosts)
    return [(h, p) for h, p in zip(hosts, ports, strict=False) if (h, p) != here]


def _standby_copy(dsn: str, host: str, port: str, slot: str) -> StandbyCopy:
    parts = {k: v for k, v in conninfo_to_dict(dsn).items() if k != "hostaddr"}
    parts.update(host=host, port=port, target_session_attrs="any")
    parts["connect_timeout"] = str(COPY_CONNECT_TIMEOUT_S)
    with connect(make_conninfo("", **parts), role="standby", autocommit=True) as conn:
        (in_recovery, sync_setting) = conn.execute(  # type: ignore[misc]
            "SELECT pg_is_in_recovery(), current_setting('sync_replication_slots', true)"
        ).fetchone()
        try:
            row = conn.execute(
                "SELECT (to_jsonb(s) ->> 'synced')::boolean, temporary, "
                "confirmed_flush_lsn::text FROM pg_replication_slots s WHERE slot_name = %s",
                (slot,),
            ).fetchone()
        except psycopg.Error:
            row = None
    where = f"{host}:{port}"
    sync_slots = sync_setting == "on"
    if row is None:
        return StandbyCopy(where, bool(in_recovery), sync_slots, False)
    return StandbyCopy(
        where, bool(in_recovery), sync_slots, True, bool(row[0]), bool(row[1]), row[2]
    )
