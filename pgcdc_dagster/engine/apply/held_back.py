"""The changes held back while tables are added (``pgcdc add-table``): applied once the copy
stands, in batches of whole transactions, each batch in one apply transaction with the origin
left alone (it already stands past them); a big range's share staged by Spark's workers. See
:func:`apply_added_changes`."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psycopg

from ..compaction import DEFAULT_SPARK_MIN_CHANGES, HeldBack
from ..identifiers import TableName
from ..lsn import Lsn
from ..spark.executors import StoreUnreadableError
from ..store.output_store import OutputStore, StoredRange
from .ddl import SourceDdl
from .merge import (
    RefusedNetRows,
    apply_staged,
    apply_transaction,
    from_shared,
    replaying_refused,
    stage_all,
)
from .results import ApplyResult, ApplyStatus
from .staging import drop_shared
from .target_tables import read_target_tables
from .transaction import (
    carry_out_plans,
    on_spark,
    on_target,
    staged_on_workers,
    target_session,
    written_relations,
)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

HELD_BACK_BATCH_CHANGES = 100_000
"""At most about this many held-back changes (those of the tables being added) of consecutive
stored ranges are applied in one target transaction (:func:`apply_added_changes`): they are
in this process's memory meanwhile (the kernel's columns of each, as for a range's apply)."""


@dataclass
class HeldBackApplied:
    """What :func:`apply_added_changes` applied."""

    changes: int = 0
    on_spark: int = 0
    """Ranges whose share Spark's workers compacted and staged."""
    transactions: int = 0
    """Target transactions the changes were applied in (consecutive ranges' share together)."""
    seconds: float = 0.0
    on_driver: int = 0
    """Ranges big enough for Spark staged by this process instead: the executors could not
    read the store (``PGCDC_SPARK_STAGING=auto``)."""
    on_driver_why: str | None = None

    def __add__(self, other: HeldBackApplied) -> HeldBackApplied:
        return HeldBackApplied(
            self.changes + other.changes,
            self.on_spark + other.on_spark,
            self.transactions + other.transactions,
            round(self.seconds + other.seconds, 4),
            self.on_driver + other.on_driver,
            other.on_driver_why or self.on_driver_why,
        )


def apply_added_changes(
    target_dsn: str,
    store: OutputStore,
    tables: Sequence[TableName],
    *,
    since: Lsn,
    through: Lsn,
    unpublished: Mapping[TableName, Sequence[str]],
    staging_key: str,
    spark: Callable[[], SparkSession] | None = None,
    spark_min_changes: int | None = DEFAULT_SPARK_MIN_CHANGES,
    batch_changes: int | None = None,
    progressed: Callable[[HeldBackApplied, Lsn], None] | None = None,
    ddl: SourceDdl | None = None,
    spark_staging: str = "auto",
) -> HeldBackApplied:
    """Apply the changes of ``tables`` (being added) committed in ``(since, through]`` that
    the applies held back (:func:`apply_range`), in LSN order; say what was applied.
    ``since``: their copy's consistent point, or where an earlier call stopped; ``through``:
    the target's origin as the caller read it (the applies took the ranges' other tables up to
    it, so every range it reads is stored).

    Nothing else writes ``tables`` meanwhile (the applies hold them back), so the caller may
    call this without the range while the origin moves on, and then once more with it, up to
    the origin that no longer moves, before it records the tables as added there
    (:func:`~..control.pipeline.add_tables`). Consecutive ranges' shares, up to ``batch_changes``
    changes (default :data:`HELD_BACK_BATCH_CHANGES`), are compacted together
    (:class:`~..compaction.HeldBack`) and applied in one target transaction that leaves the
    origin alone (it already stands past them); nothing is lost by a crash between two, since
    the tables stay in ``Chain.adding`` and the next add copies them again. A prune removes no
    range while a table is being added (:mod:`..store.retention`). ``progressed`` is told, after
    each transaction, what was applied so far and the position it reached (for people: an add of a
    big, busy table may have minutes of these after its copy).

    A range of ``spark_min_changes`` or more (``spark``: a session, started when first needed)
    whose transactions all lie at or before ``through`` is compacted and staged by Spark's
    workers, as :func:`apply_range` does such a range (a big transaction on a table while it
    copied is not funnelled through this process), alone, in shared staging tables of
    ``staging_key``: not the origin's, whose tables an apply running beside makes anew. Where
    the executors cannot read the store, that range is staged here instead, as an apply's is
    (``spark_staging``: ``required`` raises instead)."""
    applied = HeldBackApplied()
    if through <= since:
        return applied  # no apply went past the copy: the applies to come take it all
    started = time.perf_counter()
    wanted = set(tables)
    cap = batch_changes or HELD_BACK_BATCH_CHANGES

    def gathered() -> HeldBack:
        return HeldBack(wanted, since=int(since), through=int(through))

    reached = since

    def done(step: HeldBackApplied) -> None:
        nonlocal applied
        applied += step
        if progressed is not None and step.transactions:
            progressed(applied, reached)

    with target_session(target_dsn, None) as conn:
        batch = gathered()
        for rng in store.chain_from(since):
            if rng.start >= through:
                break
            stored = store.get(rng)
            if stored is None or rng.end <= since or not batch.lists_any(stored):
                continue
            whole = stored.transform_lsn is not None and stored.transform_lsn <= through
            if spark is not None and whole and on_spark(stored, spark_min_changes):
                done(_apply_held_back(conn, batch, unpublished, ddl))
                batch = gathered()
                staging = _HeldBackStaging(spark(), target_dsn, staging_key)
                try:
                    on_workers = _held_back_on_spark(
                        conn, stored, wanted, since, unpublished, staging, ddl
                    )
                except StoreUnreadableError as unreadable:
                    if spark_staging == "required":
                        raise
                    said = str(unreadable).removeprefix("Spark's executors cannot read ")
                    why = "executors cannot read the store: " + said.split(": ", 1)[0]
                    done(HeldBackApplied(on_driver=1, on_driver_why=why))
                    on_workers = None  # staged here, with the others
                reached = min(rng.end, through)
                if isinstance(on_workers, HeldBackApplied):
                    done(on_workers)
                    continue
                batch.add(stored)  # refused, or DDL: again here (that table in commit order)
                refused = set() if on_workers is None else {on_workers}
                done(_apply_held_back(conn, batch, unpublished, ddl, in_order=refused))
                batch = gathered()
                continue
            batch.add(stored)
            reached = min(rng.end, through)
            if batch.rows >= cap:
                done(_apply_held_back(conn, batch, unpublished, ddl))
                batch = gathered()
        done(_apply_held_back(conn, batch, unpublished, ddl))
    applied.seconds = round(time.perf_counter() - started, 4)
    return applied


@dataclass(frozen=True)
class _HeldBackStaging:
    """Where a big range's held-back changes are staged by Spark's workers."""

    spark: SparkSession
    target_dsn: str
    key: str


def _apply_held_back(
    conn: psycopg.Connection[Any],
    batch: HeldBack,
    unpublished: Mapping[TableName, Sequence[str]],
    ddl: SourceDdl | None,
    in_order: set[TableName] | None = None,
) -> HeldBackApplied:
    """``batch``'s changes in one transaction: net rows, and for a table whose net rows a
    unique key refused (or one of ``in_order``), its changes in commit order (as
    :func:`apply_range` does)."""
    if not batch.rows:
        return HeldBackApplied()
    relations, targets, plans = on_target(conn, batch.relations(), unpublished, ddl)
    result = ApplyResult(f"{batch.ranges} range(s)", ApplyStatus.APPLIED, None, None)
    ordered = set(in_order or ())

    def attempt() -> HeldBackApplied:
        nonlocal targets
        with apply_transaction(conn):
            if plans:
                carry_out_plans(conn, plans)
                targets = read_target_tables(conn, list(relations))
            nets = batch.compact(
                {t: rel.with_identity(()) if t in ordered else rel for t, rel in relations.items()}
            )
            apply_staged(conn, stage_all(conn, nets, targets), result)
        return HeldBackApplied(sum(net.changes for net in nets.values()), transactions=1)

    return replaying_refused(attempt, ordered, ordered.add)


def _held_back_on_spark(
    conn: psycopg.Connection[Any],
    stored: StoredRange,
    tables: set[TableName],
    since: Lsn,
    unpublished: Mapping[TableName, Sequence[str]],
    staging: _HeldBackStaging,
    ddl: SourceDdl | None,
) -> HeldBackApplied | TableName | None:
    """One big range's share of :func:`apply_added_changes` (every transaction of it at or
    before the caller's ``through``), compacted and staged by Spark's workers and merged in
    one transaction; or the table whose net rows a unique key refused (rolled back whole,
    the staging dropped); or ``None`` when it has DDL to carry out (applied in process).
    Raises :class:`~..spark.executors.StoreUnreadableError` before anything is written when
    the executors cannot read the range."""
    relations = {t: rel for t, rel in written_relations(stored).items() if t in tables}
    if not relations:
        return HeldBackApplied()
    relations, targets, plans = on_target(conn, relations, unpublished, ddl)
    if plans:
        return None  # DDL commits with the rows: this range's share goes with the others
    shared = staged_on_workers(
        conn,
        staging.spark,
        staging.target_dsn,
        staging.key,
        stored,
        relations,
        after_lsn=int(since),
    )
    result = ApplyResult(stored.range.key, ApplyStatus.APPLIED, None, None)
    try:
        with apply_transaction(conn):
            apply_staged(conn, from_shared(shared, targets), result)
            drop_shared(conn, staging.key)
    except RefusedNetRows as refused:
        drop_shared(conn, staging.key)
        return refused.table
    return HeldBackApplied(sum(s.changes for s in shared.values()), on_spark=1, transactions=1)
