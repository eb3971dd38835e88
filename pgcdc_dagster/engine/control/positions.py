"""Where a replication stands, as read from its durable facts and its servers: the slot and the
source's flush, the target's origin, what the chain says the origin must become, the tables
the publication sends. Read afresh each call; nothing remembered."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..apply.origin import progress_of
from ..connect import connect
from ..identifiers import TableName
from ..lsn import Lsn, LsnRange
from ..settings import ReplicationSettings
from ..source.slot import SlotInfo, current_flush_lsn, read_slot

if TYPE_CHECKING:
    pass


from .sessions import source_session, store_of


@dataclass(frozen=True)
class SourcePositions:
    slot: SlotInfo
    flush_lsn: Lsn

    @property
    def lag_bytes(self) -> int:
        confirmed = self.slot.confirmed_flush_lsn or self.flush_lsn
        return max(0, self.flush_lsn - confirmed)


def source_row_estimates(
    settings: ReplicationSettings, *, timeout_s: int = 5
) -> dict[TableName, int | None]:
    """The source's estimate of each replicated table's rows (:func:`..catalog.estimated_rows`),
    bounded in time (the sensor calls it)."""
    from ..catalog import estimated_rows
    from ..source.publication import publication_tables

    with source_session(settings, timeout_s, autocommit=True) as conn:
        return estimated_rows(conn, publication_tables(conn, settings.publication))


def source_positions(settings: ReplicationSettings, *, timeout_s: int = 5) -> SourcePositions:
    """The slot and the source's flushed WAL position, bounded in time (the sensor calls it)."""
    with source_session(settings, timeout_s) as conn:
        slot = read_slot(conn, settings.slot)
        flush = current_flush_lsn(conn)
    return SourcePositions(slot, flush)


def server_versions(settings: ReplicationSettings) -> dict[str, str]:
    """Both servers' releases (``15.20``), by role: a replication may cross majors."""
    from ..postgres_installs import release

    versions = {}
    for role, dsn in (("source", settings.source_dsn), ("target", settings.target_dsn)):
        with connect(dsn, role=role, autocommit=True) as conn:
            versions[role] = release(conn.info.server_version)
    return versions


def origin_progress(settings: ReplicationSettings, *, durable: bool = False) -> Lsn | None:
    """What the target has applied: the replication origin's progress (``durable``: what a
    crash of the target keeps of it, see :func:`~..apply.origin.read_progress`)."""
    return progress_of(settings.target_dsn, settings.origin, durable=durable)


def replicated_tables(
    settings: ReplicationSettings, *, timeout_s: int | None = None
) -> list[TableName]:
    """The tables the publication carries (the source's own answer); within ``timeout_s``
    seconds, when given (the slot sensor's tick)."""
    from ..source.publication import publication_tables

    with source_session(settings, timeout_s, autocommit=True) as conn:
        return publication_tables(conn, settings.publication)


def expected_origin_progress(
    settings: ReplicationSettings, through: LsnRange | None = None
) -> Lsn | None:
    """Where the origin must be once every stored range of the chain (up to and including
    ``through``, when given) is applied: the last commit stored in them."""
    store = store_of(settings)
    chain = store.chain()
    if chain is None or not chain.complete:
        return None
    point = chain.consistent_point
    if through is not None and chain.start is not None and through.end <= chain.start:
        return chain.pruned_last_commit if through.end == chain.pruned_through else None
    latest = None if through is None or point is None else store.get(through)
    if latest is not None and point is not None and latest.range.start >= point:
        # A follow asks this for every range it applies: one step back, not a walk.
        last = store.last_commit_through(latest)
        if last is not None:
            return last
    chain_start = store.chain_start()
    for rng in store.walk(None if through is None else through.start, reverse=True):
        if rng.start < chain_start:
            break
        if through is not None and rng.end > through.end:
            continue
        stored = store.get(rng)
        known = None if stored is None else stored.last_commit_known
        if known is not None:
            return known
    return store.last_commit_before(store.chain_start())


def resolve_endpos(settings: ReplicationSettings, endpos: str | Lsn) -> Lsn:
    """``current`` means the source's flushed WAL position now."""
    if isinstance(endpos, str) and endpos.strip().lower() == "current":
        with connect(settings.source_dsn, role="source", autocommit=True) as conn:
            return current_flush_lsn(conn)
    return Lsn(endpos)
