"""Where a replication stands, read from its three durable facts and both servers: one model
that every view renders.

``pgcdc status`` prints it (adding the Dagster runs in flight, which only the Dagster side
knows); the slot sensor, the ``slot_health`` check and a follow's heartbeat render its
:class:`~.pipeline.SourcePositions` part, read by the same :func:`~.pipeline.source_positions`
within a few seconds, since they run every tick and must not hang on a source that stopped
answering. Nothing here is remembered: each call reads the slot, the store's chain and the
target's origin afresh, so the status cannot disagree with what the next step will do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import PgcdcError
from ..lsn import Lsn
from ..settings import ReplicationSettings
from ..snapshot.foreign_keys import not_valid_foreign_keys
from ..source.failover import FailoverReadiness, failover_readiness
from ..source.slot import SlotError
from . import pipeline
from .failover import forked


@dataclass(frozen=True)
class ReplicationStatus:
    """One replication's state. ``finished`` set: it was ended (``pgcdc finish``), its slot
    is gone by design, and only ``finished_at`` and ``next_step`` say anything."""

    slot: str
    next_step: str
    """What the next catch-up step would do, or ``blocked: <why>``."""
    finished: str | None = None
    finished_at: Lsn | None = None
    versions: dict[str, str] = field(default_factory=dict)
    """Each server's release by role (``source``: ``15.20``)."""
    positions: pipeline.SourcePositions | None = None
    consistent_point: Lsn | None = None
    snapshot_state: str | None = None
    store: str = ""
    """The output store's URL (an object store's holds no credential)."""
    ranges_stored: int = 0
    pruned_through: Lsn | None = None
    last_range: str | None = None
    """The partition key of the chain's last stored range."""
    replay_lsn: Lsn | None = None
    """What the target applied: its replication origin's progress."""
    agreement: pipeline.TablesAgreement = field(default_factory=pipeline.TablesAgreement)
    foreign_keys_not_valid: list[str] = field(default_factory=list)
    failover: FailoverReadiness | None = None
    """Whether the slot survives a failover of the source (:mod:`..source.failover`)."""
    timeline: int | None = None
    """The source timeline the chain's positions belong to."""

    def as_dict(self) -> dict[str, Any]:
        """The status as text and numbers, keyed as ``pgcdc status --json`` prints it."""
        if self.finished is not None:
            return {
                "slot": self.slot,
                "finished_at": str(self.finished_at),
                "next_step": self.next_step,
            }
        slot = self.positions.slot if self.positions else None
        return {
            "slot": self.slot,
            "source_version": self.versions.get("source"),
            "target_version": self.versions.get("target"),
            "confirmed_flush_lsn": _text(slot.confirmed_flush_lsn if slot else None),
            "restart_lsn": _text(slot.restart_lsn if slot else None),
            "wal_status": slot.wal_status if slot else None,
            "active": slot.active if slot else None,
            "flush_lsn": _text(self.positions.flush_lsn if self.positions else None),
            "lag_bytes": self.positions.lag_bytes if self.positions else None,
            "retained_wal_bytes": slot.retained_wal_bytes if slot else None,
            "consistent_point": _text(self.consistent_point),
            "snapshot_state": self.snapshot_state,
            "store": self.store,
            "ranges_stored": self.ranges_stored,
            "pruned_through": _text(self.pruned_through),
            "last_range": self.last_range,
            "replay_lsn": _text(self.replay_lsn),
            "next_step": self.next_step,
            "no_longer_published": [str(t) for t in self.agreement.no_longer_published],
            "adding": self.agreement.adding_line(),
            "published_otherwise": self.agreement.reshaped_lines(),
            "foreign_keys_not_valid": self.foreign_keys_not_valid,
            "timeline": self.timeline,
            **(
                {
                    **{f"failover: {k}": v for k, v in self.failover.facts().items()},
                    "failover_gaps": self.failover.gaps(),
                }
                if self.failover is not None
                else {}
            ),
        }


def _text(lsn: Lsn | None) -> str | None:
    return None if lsn is None else str(lsn)


def replication_status(settings: ReplicationSettings) -> ReplicationStatus:
    """Read the replication's status now. A next step that cannot be decided (a missing slot,
    a range out of order) is reported as ``blocked: <why>`` rather than raised: the status
    is what a user reads to find out why."""
    store = pipeline.store_of(settings)
    chain = store.chain()
    if chain is not None and chain.finished:
        return ReplicationStatus(
            slot=settings.slot,
            next_step=f"none: {chain.finished}",
            finished=chain.finished,
            finished_at=chain.finished_at,
        )
    try:
        positions: pipeline.SourcePositions | None = pipeline.source_positions(settings)
    except SlotError as exc:  # lost, or a failover to a standby without it: say so, go on
        positions, lost = None, f"blocked: {exc}"
    complete = chain is not None and chain.complete
    last_range = store.last_chain_range() if complete else None
    try:
        fork = forked(settings)
        if fork is not None:
            next_step = f"blocked: {fork}"
        elif positions is None:
            next_step = lost
        else:
            next_step = pipeline.next_step(settings, positions.flush_lsn).describe()
    except PgcdcError as exc:
        next_step = f"blocked: {exc}"
    return ReplicationStatus(
        slot=settings.slot,
        next_step=next_step,
        versions=pipeline.server_versions(settings),
        positions=positions,
        consistent_point=chain.consistent_point if chain else None,
        snapshot_state=chain.state if chain else None,
        store=store.url,
        ranges_stored=store.chain_count() if complete else 0,
        pruned_through=chain.pruned_through if chain else None,
        last_range=last_range.partition_key if last_range else None,
        replay_lsn=pipeline.origin_progress(settings),
        agreement=pipeline.tables_agreement(settings),
        foreign_keys_not_valid=not_valid_foreign_keys(settings.target_dsn),
        failover=failover_readiness(settings.source_dsn, settings.slot),
        timeline=chain.timeline if chain else None,
    )
