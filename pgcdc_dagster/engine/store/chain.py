"""The chain record (``_CHAIN.json``): where the current base snapshot's ranges begin, the
state of a snapshot or recovery under way, the tables replicated, and how much was pruned;
its JSON codec. The store writes it (:class:`~.output_store.OutputStore`, under its lock);
this module only says what it holds and how it reads and writes as JSON."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..identifiers import TableName
from ..lsn import Lsn
from .errors import StoreError

SNAPSHOT_IN_PROGRESS = "snapshot_in_progress"

CHAIN_COMPLETE = "complete"

RECOVERING = "recovering"
"""A recovery of a lost slot (:mod:`..compare.recover`) began and has not finished: the chain
keeps its tables, and catch-up refuses until ``pgcdc recover`` ends it at a new point."""


@dataclass(frozen=True)
class Chain:
    """Where the current base snapshot's ranges begin, or that a snapshot is under way, and
    how much of the chain's start was pruned.

    The base snapshot writes ``snapshot_in_progress`` before it touches the slot or the target
    and ``complete`` (with the consistent point) as its very last step: a snapshot killed at any
    point in between leaves a chain that catch-up refuses and the next snapshot redoes.

    A prune (:mod:`.retention`) records ``pruned_through`` *before* it removes a folder: the
    chain's ranges up to there were applied and removed, so the chain now begins there, with
    ``pruned_last_commit`` standing in for the removed ranges' record of their last COMMIT.
    """

    slot: str
    state: str
    consistent_point: Lsn | None = None
    snapshot: str | None = None
    started_at: str | None = None
    pruned_through: Lsn | None = None
    pruned_last_commit: Lsn | None = None
    pruned_at: float | None = None
    """When a prune last looked (Unix time), whether or not it removed anything: prunes are
    spaced by this, across processes."""
    tables: tuple[TableName, ...] = ()
    """The tables the chain replicates: those its base snapshot copied, and those added since
    (``pgcdc add-table``). A table here that the publication no longer sends is no longer
    kept in sync on the target (:func:`~..control.pipeline.no_longer_published`)."""
    unpublished: dict[TableName, tuple[str, ...]] = field(default_factory=dict)
    """Per table, the columns the publication's column list left out when the table was
    copied (:class:`~..published_columns.PublishedShape`): the target keeps them, empty, and the
    apply takes their absence from the stream for that, not for a column dropped on the source."""
    row_filters: dict[TableName, str | None] = field(default_factory=dict)
    """Per table, the publication's row filter when the table was copied (``None``: none).
    A filter changed since leaves the target as the old one made it, as with native
    replication: rows that pass only the new one were never copied, rows that pass only the
    old one stay (:func:`~..control.pipeline.tables_agreement`). A table copied before filters were
    recorded is absent: not compared."""
    adding: tuple[TableName, ...] = ()
    """Tables an add (``pgcdc add-table``) began to copy and has not finished: their rows on
    the target may be partial, so every apply holds their changes back (applying the other
    tables') until their add applies those and records them as added."""
    resyncing: tuple[TableName, ...] = ()
    """Of :attr:`adding`, the tables being copied again (``pgcdc resync``, or an apply that met
    DDL it cannot follow): replicated already, so a catch-up finishes a resync that was killed
    (:func:`~..control.pipeline.apply_stored_range`), where an add waits for ``pgcdc add-table``."""
    synced_from: dict[TableName, Lsn] = field(default_factory=dict)
    """Per table added after the base snapshot, its own copy's consistent point: the copy
    holds its changes committed at or before it, so the apply skips those in the stream."""
    copying_at: Lsn | None = None
    """While a base snapshot is under way (``snapshot_in_progress``), its slot's consistent
    point once the slot exists: the copy records on the target what it finished at that point
    (:mod:`~..snapshot.copied_ranges`), and the next snapshot resumes from there
    (:mod:`~..snapshot.resume`)."""
    finished_at: Lsn | None = None
    """The replication was ended (``pgcdc finish``, :mod:`..control.finish`) with the target's
    origin here: its slot is dropped, and nothing follows it again until a new base snapshot."""
    timeline: int | None = None
    """The source's WAL timeline the chain's positions belong to: the one its base snapshot
    (or recovery) was taken on, moved on by :meth:`OutputStore.record_timeline` once a
    promotion's switch point was dealt with (:mod:`..control.failover`). ``None``: a chain
    recorded before timelines were."""
    system_id: str | None = None
    """The source cluster's ``IDENTIFY_SYSTEM`` identifier when :attr:`timeline` was read."""

    @property
    def complete(self) -> bool:
        return self.state == CHAIN_COMPLETE and self.consistent_point is not None

    @property
    def finished(self) -> str | None:
        """What to say of a replication that was ended (:attr:`finished_at`), with the way
        to start again; ``None`` while it runs."""
        if self.finished_at is None:
            return None
        return (
            f"the replication was finished at {self.finished_at} (pgcdc finish): its slot is "
            "dropped, nothing follows it; pgcdc snapshot --resnapshot starts a new one"
        )

    @property
    def start(self) -> Lsn | None:
        """Where the chain's stored ranges begin: past the pruned ones, else the consistent
        point (``None`` when the snapshot is not complete)."""
        if not self.complete:
            return None
        return self.pruned_through or self.consistent_point


def put_tables(
    record: dict[str, Any],
    tables: Sequence[TableName],
    unpublished: Mapping[TableName, Sequence[str]],
    row_filters: Mapping[TableName, str | None],
    adding: Sequence[TableName] = (),
    synced_from: Mapping[TableName, Lsn] | None = None,
    resyncing: Sequence[TableName] = (),
) -> None:
    """Write a chain's per-table fields (:attr:`Chain.tables`, :attr:`Chain.unpublished`,
    :attr:`Chain.row_filters`, :attr:`Chain.adding`, :attr:`Chain.synced_from`) into its
    ``record``, each only when it holds something."""
    if tables:
        record["tables"] = [[t.schema, t.name] for t in sorted(tables)]
    if any(unpublished.values()):
        record["unpublished"] = [
            [t.schema, t.name, list(cols)] for t, cols in sorted(unpublished.items()) if cols
        ]
    if row_filters:
        record["row_filters"] = [[t.schema, t.name, f] for t, f in sorted(row_filters.items())]
    if adding:
        record["adding"] = [[t.schema, t.name] for t in sorted(adding)]
    if resyncing:
        record["resyncing"] = [[t.schema, t.name] for t in sorted(resyncing)]
    if synced_from:
        record["synced_from"] = [[t.schema, t.name, str(x)] for t, x in sorted(synced_from.items())]


def chain_record(chain: Chain, **tables: Any) -> dict[str, Any]:
    """``chain``'s record, its per-table fields replaced by ``tables``'s."""
    record: dict[str, Any] = {
        "slot": chain.slot,
        "state": CHAIN_COMPLETE,
        "consistent_point": str(chain.consistent_point),
        "snapshot": chain.snapshot,
    }
    if chain.pruned_at is not None:
        record["pruned_at"] = chain.pruned_at
    if chain.pruned_through is not None:
        record["pruned_through"] = str(chain.pruned_through)
        last = chain.pruned_last_commit
        record["pruned_last_commit"] = None if last is None else str(last)
    if chain.finished_at is not None:
        record["finished_at"] = str(chain.finished_at)
    if chain.timeline is not None:
        record["timeline"] = chain.timeline
        record["system_id"] = chain.system_id
    fields = {
        "tables": chain.tables,
        "unpublished": chain.unpublished,
        "row_filters": chain.row_filters,
        "adding": chain.adding,
        "synced_from": chain.synced_from,
        "resyncing": chain.resyncing,
    }
    put_tables(record, **{**fields, **tables})
    return record


def parse_chain(raw: dict[str, Any]) -> Chain:
    """A chain record (``_CHAIN.json``) as read back."""
    point = raw.get("consistent_point")
    pruned = raw.get("pruned_through")
    pruned_commit = raw.get("pruned_last_commit")
    return Chain(
        slot=raw["slot"],
        # Chains written before snapshots recorded their state were always complete.
        state=raw.get("state", CHAIN_COMPLETE),
        consistent_point=None if point is None else Lsn.parse(point),
        snapshot=raw.get("snapshot"),
        started_at=raw.get("started_at"),
        pruned_through=None if pruned is None else Lsn.parse(pruned),
        pruned_last_commit=None if pruned_commit is None else Lsn.parse(pruned_commit),
        pruned_at=raw.get("pruned_at"),
        tables=tuple(TableName(schema, name) for schema, name in raw.get("tables", [])),
        unpublished={
            TableName(schema, name): tuple(columns)
            for schema, name, columns in raw.get("unpublished", [])
        },
        row_filters={
            TableName(schema, name): row_filter
            for schema, name, row_filter in raw.get("row_filters", [])
        },
        adding=tuple(TableName(schema, name) for schema, name in raw.get("adding", [])),
        resyncing=tuple(TableName(s, n) for s, n in raw.get("resyncing", [])),
        synced_from={
            TableName(schema, name): Lsn.parse(lsn)
            for schema, name, lsn in raw.get("synced_from", [])
        },
        finished_at=None if raw.get("finished_at") is None else Lsn.parse(raw["finished_at"]),
        copying_at=None if raw.get("copying_at") is None else Lsn.parse(raw["copying_at"]),
        timeline=raw.get("timeline"),
        system_id=raw.get("system_id"),
    )


def complete_chain(chain: Chain | None) -> Chain:
    if chain is None or not chain.complete:
        raise StoreError(
            "there is no complete base snapshot in the store: take one (pgcdc snapshot) first"
        )
    return chain
