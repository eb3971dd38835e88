"""Apply one stored range to the target, exactly once, in one transaction.

Data flow::

    stored range ──compaction (Arrow, in process)──▶ net rows per table
         │                                                        │ COPY ... (FORMAT csv)
         ▼                                                        ▼
    origin progress ──checks──▶ BEGIN; session_replication_role = replica
                                ALTER TABLE ...                 (the source's DDL, :mod:`.ddl`)
                                temp staging tables (typed like the target's columns),
                                                                (few rows: inline in the merge)
                                COPY into the target            (insert-only tables without
                                                                 identity: no staging table)
                                TRUNCATE                        (tables the range truncated)
                                per table: fill moved rows' unsent values from their origin key,
                                           DELETE ... USING, INSERT ... ON CONFLICT DO UPDATE,
                                           UPDATE for rows with unsent TOAST values,
                                           or an ordered replay (no identity)
                                DROP shared staging tables      (Spark path)
                                pg_replication_origin_xact_setup(transform_lsn, commit time)
                                COMMIT

    A range of ``spark_min_changes`` or more (with a SparkSession): before BEGIN, Spark's
    workers compact it and COPY the net rows into shared staging tables (:mod:`.spark_staging`);
    the transaction then merges from those instead of temp tables. A range of more than
    ``partition_changes`` otherwise: the same, by this process, one key-hash partition at a
    time (:mod:`.partitioned_staging`: bounded memory). Nothing durable but the staging tables
    happens before BEGIN; a range with DDL to carry out is never staged there.

Why this is exactly once
    The target's replication origin (``pgcdc_<slot>``, created at the slot's consistent point
    by the base snapshot) is the one durable record of what has been applied. This module
    advances it only inside the transaction that writes the range's rows, through the
    session's origin (``pg_replication_origin_session_setup``, then ``xact_setup`` before
    COMMIT): the commit record carries the new progress, so rows and progress become durable
    together or not at all. A crash or kill at any moment therefore leaves the target at a
    previous range boundary, and running the same range again converges. Holding the session
    origin also excludes a second apply of the same origin while this one runs.

What the origin's progress P says about range ``(start, end]`` with last commit T
    * ``T`` is ``None``: the range stored no transaction; nothing to apply (``empty``).
    * ``P >= T``: every transaction of the range is applied (``already_applied``).
    * Otherwise every transaction committing after ``P`` must be applied, and nothing between
      ``P`` and ``start`` may be missing. A range is applied whole, so after it ``P`` equals its
      last commit, which is at or before its end; a range without transactions leaves ``P``
      lower still. ``P < start`` is thus normal after empty ranges. The rule: walk back from
      ``start`` over contiguous stored ranges; every one that lies after ``P`` must be empty
      (or hold only commits at or before ``P``), and the walk must reach ``P`` without a hole.
      Anything else is a gap, refused with the missing interval named.
    * Transactions of this range committing at or before ``P`` are skipped (the origin's own
      rule), which never happens in the normal chain but keeps a re-snapshot safe.

Counts
    ``inserted`` and ``updated`` come from one ``INSERT ... ON CONFLICT DO UPDATE ...
    RETURNING (xmax = 0)`` per table, counted server side (a freshly inserted row version has
    no xmax; an updated one carries the updating transaction's; a partitioned table's, which
    cannot return it, by its partitions' write counters, see :func:`_partition_writes`), plus
    the UPDATE of rows whose TOASTed values were not sent. ``missing`` counts updates and
    deletes whose row the target did not have (a diverged target: they are skipped, as
    PostgreSQL's own apply does).

Not replicated by design: the TRUNCATE option CASCADE (like PostgreSQL's apply worker, only
the truncated tables the source sent are truncated; cascading could empty tables outside the
replicated set). A column an older relation version of the range did not have takes, in that
version's rows, the value the source gave the rows that existed when it was added
(:attr:`~..compaction.TableRelation.fills`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import psycopg
import pyarrow as pa
import pyarrow.compute as pc
from psycopg import sql

from ..compaction import (
    DEFAULT_SPARK_MIN_CHANGES,
    HeldBack,
    NetChanges,
    TableRelation,
    compact_in_commit_order,
    compact_range,
    relations_of,
)
from ..connect import connect
from ..errors import ApplyError, server_reason
from ..failpoints import failpoint
from ..identifiers import TableName
from ..lsn import Lsn
from ..spark.executors import SparkApp, spark_app
from ..store.output_store import OutputStore, StoredRange
from .ddl import (
    ResyncNeeded,
    SchemaDriftError,
    SourceDdl,
    TableChanges,
    carry_out,
    in_play,
    matches,
    plan_changes,
    read_records,
    records_by_relid,
)
from .origin import mark_transaction, require_progress, reset_session, setup_session
from .partitioned_staging import Routed, partitions_for, route_range, stage_routed
from .shared_staging import SharedStage
from .spark_staging import stage_on_spark
from .staging import (
    copy_into,
    copy_rows,
    create_stage,
    drop_shared,
    flag,
    inline_fits,
    inline_stage,
    typed_as,
)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


class ApplyStatus(StrEnum):
    """What applying a range did."""

    APPLIED = "applied"
    ALREADY_APPLIED = "already_applied"
    """The origin was already at or past the range's last commit: nothing written."""
    EMPTY = "empty"
    """The range holds no transaction: nothing to write."""


class ApplyGapError(ApplyError):
    """Changes between the target's origin progress and the range's start were not applied."""


@dataclass
class TableApplyCounts:
    changes: int = 0
    net_rows: int = 0
    truncated: bool = False
    inserted: int = 0
    updated: int = 0
    deleted: int = 0
    missing: int = 0
    """Updates/deletes whose row the target did not have (skipped)."""


@dataclass
class ApplyResult:
    range_key: str
    status: ApplyStatus
    replay_lsn: str | None
    """The origin's progress after this call: what the target has applied."""
    previous_lsn: str | None
    """The origin's progress before this call."""
    tables: dict[str, TableApplyCounts] = field(default_factory=dict)
    schema_changes: list[str] = field(default_factory=list)
    """The source's DDL the range showed, as carried out on the target (:mod:`.ddl`): one
    line per step, each beginning with its table."""
    reshaped: list[str] = field(default_factory=list)
    """The tables whose shape the range's DDL changed (or that were copied again for it)."""
    renamed_tables: list[tuple[TableName, TableName]] = field(default_factory=list)
    """``(before, now)`` of every table the range's DDL renamed."""
    changes: int = 0
    net_rows: int = 0
    compaction_path: str | None = None
    staged_by: str = "driver"
    """Who COPYed the net rows into staging tables: ``driver`` (this process, inside the apply
    transaction), ``driver, N partition(s)`` (this process, inside it too, one key-hash
    partition at a time; :mod:`.partitioned_staging`) or ``spark executors`` (before it;
    :mod:`.spark_staging`)."""
    spark_app: SparkApp | None = None
    """The Spark application whose executors staged the range (``staged_by`` ``spark
    executors``)."""
    spark_tasks: int = 0
    """The Spark tasks that staged it."""
    compaction_seconds: float = 0.0
    staging_seconds: float = 0.0
    apply_seconds: float = 0.0
    seconds: float = 0.0
    in_commit_order: list[str] = field(default_factory=list)
    """Tables whose net rows a unique key of the target refused, applied change by change in
    the source's order instead (see :func:`apply_range`)."""
    held_back: list[str] = field(default_factory=list)
    """Tables being added whose changes in the range were held back for their add
    (:func:`apply_added_changes`)."""


@dataclass(frozen=True)
class TargetColumn:
    name: str
    type_oid: int
    typmod: int
    type_sql: str
    """``format_type`` of the column on the target."""
    type_name_sql: str
    """The same without the type modifier (``format_type(type, -1)``: ``"bit"``, not ``bit``,
    which a cast reads as ``bit(1)``): what inline staging casts the column's values to."""
    generated: bool
    has_equality: bool
    identity_always: bool
    """``GENERATED ALWAYS AS IDENTITY``: an UPDATE may not set it (see :func:`_writable`)."""


@dataclass(frozen=True)
class TargetTable:
    table: TableName
    columns: Mapping[str, TargetColumn]
    primary_key: tuple[str, ...]
    unique_keys: tuple[frozenset[str], ...]
    partitioned: bool = False
    """A partitioned table: its rows live in partitions, where a ``ctid`` is unique only
    together with the ``tableoid``, and an ``INSERT`` routed to one cannot return ``xmax``."""


def apply_range(
    target_dsn: str,
    stored: StoredRange,
    origin_name: str,
    *,
    spark: SparkSession | None = None,
    store: OutputStore | None = None,
    spark_min_changes: int | None = DEFAULT_SPARK_MIN_CHANGES,
    origin_wait_seconds: float = 30.0,
    conn: psycopg.Connection[Any] | None = None,
    ddl: SourceDdl | None = None,
    partition_changes: int | None = None,
) -> ApplyResult:
    """Apply ``stored`` to the target and advance ``origin_name`` to its last commit, atomically.

    ``store`` is the output store holding the range (default: the one it lies in); it is read
    to tell an applied-up-to-here chain from a gap. ``spark`` runs the compaction on Spark when
    the range has at least ``spark_min_changes`` changes. ``origin_wait_seconds`` is how long
    to wait for the origin to be released by an earlier, killed apply whose server backend has
    not exited yet. ``conn``: an autocommit connection to the target to apply on, for a caller
    that applies range after range (a follower); by default a connection of its own. It is
    left as it was found: no transaction open, the session's origin reset. ``ddl``: where to
    read the source's catalog when a table's columns no longer match the target's
    (:mod:`.ddl`); without it such a range is refused. ``partition_changes``: a range of more
    changes than that (and not on Spark) is compacted and staged in key-hash partitions of
    about that many, one at a time (:mod:`.partitioned_staging`), so its memory stays bounded
    whatever its size; ``None``: always whole, in memory.
    """
    started = time.perf_counter()
    transform = stored.transform_lsn
    result = ApplyResult(stored.range.key, ApplyStatus.APPLIED, None, None)
    store = store or OutputStore(stored.store_root)
    with _target_session(target_dsn, conn) as conn:
        progress = require_progress(conn, origin_name)
        result.previous_lsn = result.replay_lsn = str(progress)
        # Before any outcome, the empty one included: a range is never reported applied or
        # empty while an earlier range's transactions are missing on the target.
        check_no_gap(store, stored, progress, origin_name)
        if transform is None:
            result.status = ApplyStatus.EMPTY
        elif progress >= transform:
            result.status = ApplyStatus.ALREADY_APPLIED
        if result.status != ApplyStatus.APPLIED:
            result.seconds = round(time.perf_counter() - started, 4)
            return result
        assert transform is not None

        chain = store.chain()
        relations = _written(stored)
        # Tables being added (pgcdc add-table): their copy is under way, or a killed add left
        # it partial. Their changes are held back (the add applies them once its copy is
        # done); the other tables' are applied.
        held_back = {t: relations.pop(t) for t in (chain.adding if chain else ()) if t in relations}
        result.held_back = sorted(str(t) for t in held_back)
        relations, targets, plans = _on_target(
            conn, relations, chain.unpublished if chain else {}, ddl
        )
        # A table added after the snapshot skips its changes that its own copy holds.
        floors = {
            t: int(lsn)
            for t, lsn in (chain.synced_from if chain else {}).items()
            if t in relations and lsn > progress
        }
        shared: dict[TableName, SharedStage] | None = None
        routed: Routed | None = None
        parts = partitions_for(stored.changes, partition_changes) if partition_changes else 1
        # A range with DDL to carry out is compacted whole, here: shared staging tables are
        # typed like the target's columns before the apply's transaction, and the DDL must
        # commit with the rows (see :mod:`.ddl`).
        if spark is not None and on_spark(stored, spark_min_changes) and not plans:
            spark_started = time.perf_counter()
            shared = _staged_on_workers(
                conn,
                spark,
                target_dsn,
                origin_name,
                stored,
                relations,
                after_lsn=int(progress),
                floors=floors,
            )
            result.compaction_path = "spark"
            result.staged_by = "spark executors"
            result.spark_app = spark_app(spark)
            result.spark_tasks = sum(s.tasks for s in shared.values())
            result.staging_seconds = round(time.perf_counter() - spark_started, 4)
            result.changes = sum(s.changes for s in shared.values())
            result.net_rows = sum(s.net_rows for s in shared.values())
        elif parts > 1 and not plans:
            routing_started = time.perf_counter()
            routed = route_range(
                stored, relations, parts=parts, after_lsn=int(progress), floors=floors
            )
            result.compaction_path = "partitioned"
            result.staged_by = f"driver, {len(routed.files)} partition(s)"
            result.compaction_seconds = round(time.perf_counter() - routing_started, 4)
        else:
            compaction = compact_range(
                stored,
                relations,
                after_lsn=int(progress),
                floors=floors,
                held_back=[v for rel in held_back.values() for v in rel.versions],
            )
            result.compaction_path = compaction.path
            result.compaction_seconds = compaction.seconds
            result.changes = sum(t.changes for t in compaction.tables.values())
            result.net_rows = compaction.net_rows

        in_order: dict[TableName, NetChanges] = {}
        while True:
            setup_session(conn, origin_name, origin_wait_seconds)
            try:
                with conn.transaction():
                    again = require_progress(conn, origin_name)
                    if again != progress:
                        raise ApplyError(
                            f"replication origin {origin_name} moved from {progress} to "
                            f"{again} while range {stored.range.key} was being prepared: "
                            "another apply ran at the same time; run this one again"
                        )
                    conn.execute("SET LOCAL session_replication_role = replica")
                    result.schema_changes = _carry_out(conn, plans)
                    result.reshaped = [str(p.table) for p in plans]
                    result.renamed_tables = [
                        (p.renamed_from, p.table) for p in plans if p.renamed_from is not None
                    ]
                    if plans:
                        targets = read_target_tables(conn, list(relations))
                    stage_started = time.perf_counter()
                    if routed is not None:
                        _truncate(conn, routed.truncated)
                        shared = stage_routed(conn, routed, skip=in_order)
                        result.changes = sum(s.changes for s in shared.values())
                        result.net_rows = sum(s.net_rows for s in shared.values())
                    if shared is None:
                        staged = _stage_all(conn, {**compaction.tables, **in_order}, targets)
                    else:
                        staged = [
                            s
                            for s in _from_shared(shared, targets)
                            if s.net.relation.table not in in_order
                        ] + _stage_all(conn, in_order, targets)
                    if shared is None or in_order or routed is not None:
                        result.staging_seconds = round(time.perf_counter() - stage_started, 4)
                    _apply_staged(conn, staged, result, truncated_first=routed is not None)
                    for table, stage in (shared or {}).items():
                        if stage.direct and str(table) in result.tables:
                            result.tables[str(table)].inserted += stage.direct
                    if shared is not None and routed is None:
                        # Gone with the COMMIT; tables a killed apply left are dropped by the
                        # next apply that stages in them before it does (no catalog query on
                        # the in-memory path).
                        drop_shared(conn, origin_name)
                    mark_transaction(
                        conn, transform, _commit_time(stored.manifest.result.last_commit_ts_us)
                    )
                    failpoint("apply.in_transaction")
                    commit_started = time.perf_counter()
                result.apply_seconds = round(
                    result.apply_seconds + time.perf_counter() - commit_started, 4
                )
                break
            except _RefusedNetRows as refused:
                # Rolled back whole. The source's own order of statements passed every unique
                # key; its net rows may not (a swap through a third value): once per table,
                # apply that table's changes one by one, in that order.
                if refused.table in in_order:
                    raise refused.error from refused.error.__cause__
                in_order[refused.table] = compact_in_commit_order(
                    stored, relations, refused.table, after_lsn=int(progress), floors=floors
                )
                result.in_commit_order.append(str(refused.table))
            finally:
                reset_session(conn)
        if routed is not None:
            routed.remove()
        failpoint("apply.after_commit")
        result.replay_lsn = str(require_progress(conn, origin_name))
    result.seconds = round(time.perf_counter() - started, 4)
    return result


def on_spark(stored: StoredRange, spark_min_changes: int | None) -> bool:
    """Whether ``stored`` is big enough to be worth a Spark job (when a session is at hand):
    its compaction and staging then run on Spark's workers (:mod:`.spark_staging`). ``None``:
    never (:attr:`~..settings.ReplicationSettings.spark_range_changes`)."""
    return spark_min_changes is not None and stored.changes >= spark_min_changes


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

    def __add__(self, other: HeldBackApplied) -> HeldBackApplied:
        return HeldBackApplied(
            self.changes + other.changes,
            self.on_spark + other.on_spark,
            self.transactions + other.transactions,
            round(self.seconds + other.seconds, 4),
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
    ``staging_key``: not the origin's, whose tables an apply running beside makes anew."""
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

    with _target_session(target_dsn, None) as conn:
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
                on_workers = _held_back_on_spark(
                    conn, stored, wanted, since, unpublished, staging, ddl
                )
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
    relations, targets, plans = _on_target(conn, batch.relations(), unpublished, ddl)
    result = ApplyResult(f"{batch.ranges} range(s)", ApplyStatus.APPLIED, None, None)
    in_order = set(in_order or ())
    while True:
        try:
            with conn.transaction():
                conn.execute("SET LOCAL session_replication_role = replica")
                if plans:
                    _carry_out(conn, plans)
                    targets = read_target_tables(conn, list(relations))
                nets = batch.compact(
                    {
                        t: rel.with_identity(()) if t in in_order else rel
                        for t, rel in relations.items()
                    }
                )
                _apply_staged(conn, _stage_all(conn, nets, targets), result)
            return HeldBackApplied(sum(net.changes for net in nets.values()), transactions=1)
        except _RefusedNetRows as refused:
            if refused.table in in_order:
                raise refused.error from refused.error.__cause__
            in_order.add(refused.table)


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
    the staging dropped); or ``None`` when it has DDL to carry out (applied in process)."""
    relations = {t: rel for t, rel in _written(stored).items() if t in tables}
    if not relations:
        return HeldBackApplied()
    relations, targets, plans = _on_target(conn, relations, unpublished, ddl)
    if plans:
        return None  # DDL commits with the rows: this range's share goes with the others
    shared = _staged_on_workers(
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
        with conn.transaction():
            conn.execute("SET LOCAL session_replication_role = replica")
            _apply_staged(conn, _from_shared(shared, targets), result)
            drop_shared(conn, staging.key)
    except _RefusedNetRows as refused:
        drop_shared(conn, staging.key)
        return refused.table
    return HeldBackApplied(sum(s.changes for s in shared.values()), on_spark=1, transactions=1)


def _written(stored: StoredRange) -> dict[TableName, TableRelation]:
    """The tables ``stored``'s rows write: only those are read on the target and checked for
    drift (a relation no row uses may not match the target, see
    :meth:`~..store.output_store.StoredRange.relation_versions`)."""
    used = stored.relation_versions()
    return {
        t: rel
        for t, rel in relations_of(stored.manifest.relations).items()
        if used & rel.versions.keys()
    }


def _on_target(
    conn: psycopg.Connection[Any],
    relations: Mapping[TableName, TableRelation],
    unpublished: Mapping[TableName, Sequence[str]],
    ddl: SourceDdl | None,
) -> tuple[dict[TableName, TableRelation], dict[TableName, TargetTable], list[TableChanges]]:
    """``relations`` as the target holds their tables: each collapsed by the target's key where
    the source sends whole rows (as the target will be once the range's DDL is carried out),
    the target's tables as they are (a table renamed on the source under its new name), and
    the DDL (:mod:`.ddl`) for those whose name or columns no longer match the range's (their
    relations then read older versions as now named).

    The records of the range's tables (one query) tell a table renamed on the source (its oid
    recorded under another name) and one dropped and created again (another oid under its
    name: its rows on the target are the old table's, so it is copied again)."""
    records = read_records(conn, list(relations))
    unknown = [rel.relid for t, rel in relations.items() if t not in records and rel.relid]
    moved: dict[TableName, TableName] = {}
    for relid, record in records_by_relid(conn, unknown).items():
        new = next(t for t, rel in relations.items() if rel.relid == relid)
        moved[new] = record.table
        records[new] = record
    read = read_target_tables(
        conn, [moved.get(t, t) for t in relations], auto_add=ddl is not None and ddl.auto_add
    )
    targets = {
        t: dataclasses.replace(read[moved[t]], table=t) if t in moved else read[t]
        for t in relations
    }
    recreated = {
        t: "it was dropped and created again on the source (another table of the same name), "
        "so its rows on the target are the old table's"
        for t, rel in relations.items()
        if t in records and rel.relid and records[t].relid and rel.relid != records[t].relid
    }
    if recreated:
        raise ResyncNeeded(recreated)

    def kept(t: TableName) -> list[str]:
        return list(records[t].kept) if t in records else []

    drifted = {
        t: rel
        for t, rel in relations.items()
        if t in moved
        or not matches(
            rel,
            targets[t].columns,
            in_play(targets[t].columns, rel, unpublished.get(t, ()), kept(t)),
        )
    }
    plans: dict[TableName, TableChanges] = {}
    if drifted:
        if ddl is None:
            names = ", ".join(str(t) for t in drifted)
            raise SchemaDriftError(
                f"the columns of {names} changed on the source: applying this range needs the "
                "source's catalog (apply it through pgcdc or the Dagster job)"
            )
        with connect(ddl.source_dsn, role="source", autocommit=True) as src:
            plans, rewritten = plan_changes(
                src,
                conn,
                {t: (rel, targets[t]) for t, rel in drifted.items()},
                unpublished,
                records,
                moved,
                keep_dropped=ddl.keep_dropped,
            )
        relations = {**relations, **rewritten}
    relations = {
        t: _identity_on_target(rel, _as_after(targets[t], plans.get(t)))
        for t, rel in relations.items()
    }
    return dict(relations), targets, [p for p in plans.values() if p]


def _as_after(target: TargetTable, changes: TableChanges | None) -> TargetTable:
    """``target``'s keys as they will be once ``changes`` are carried out (a key column
    renamed; a key with a dropped column gone)."""
    if changes is None or not (changes.renames or changes.drops):
        return target
    renamed = dict(changes.renames)
    gone = set(changes.drops)

    def after(names: Sequence[str]) -> tuple[str, ...] | None:
        return None if gone & set(names) else tuple(renamed.get(n, n) for n in names)

    return dataclasses.replace(
        target,
        primary_key=after(target.primary_key) or (),
        unique_keys=tuple(frozenset(k) for key in target.unique_keys if (k := after(tuple(key)))),
    )


def _carry_out(conn: psycopg.Connection[Any], plans: Sequence[TableChanges]) -> list[str]:
    """Every table's DDL (:func:`.ddl.carry_out`) in the caller's transaction; the steps."""
    return [line for changes in plans for line in carry_out(conn, changes)]


def _staged_on_workers(
    conn: psycopg.Connection[Any],
    spark: SparkSession,
    target_dsn: str,
    key: str,
    stored: StoredRange,
    relations: Mapping[TableName, TableRelation],
    *,
    after_lsn: int,
    floors: Mapping[TableName, int] | None = None,
) -> dict[TableName, SharedStage]:
    """``stored``'s net rows of ``relations`` compacted and staged by Spark's workers in the
    shared staging tables of ``key`` (:func:`~.spark_staging.stage_on_spark`), typed like the
    target's columns (so never for a range with DDL to carry out, see :func:`apply_range`)."""
    return stage_on_spark(
        spark,
        conn,
        target_dsn,
        key,
        [str(f) for f in stored.files],
        relations,
        after_lsn=after_lsn,
        floors=floors,
        partitions=staging_partitions(spark, stored.changes),
    )


CHANGES_PER_STAGING_TASK = 500_000
"""About a second or two of a staging task's work (compaction and COPY): enough that a task's
own costs (a target connection and transaction, a COPY per staging table) are noise."""


def staging_partitions(spark: SparkSession, changes: int) -> int:
    """How many partitions a range's changes are routed to (per table): one per
    :data:`CHANGES_PER_STAGING_TASK`, and at least one per executor core, so that every core
    works and a range is never cut into Spark's default of 200 (200 COPYs and transactions per
    table for a range a few tasks carry)."""
    from ..spark.executors import is_connect_session

    cores = 2 if is_connect_session(spark) else int(spark.sparkContext.defaultParallelism)
    return max(1, cores, -(-changes // CHANGES_PER_STAGING_TASK))


@contextlib.contextmanager
def _target_session(
    target_dsn: str, conn: psycopg.Connection[Any] | None
) -> Iterator[psycopg.Connection[Any]]:
    """``conn`` as it is (the caller's to close), or a connection of its own for one apply."""
    if conn is not None:
        yield conn
        return
    with connect(target_dsn, role="target", autocommit=True) as own:
        yield own


# -- progress ------------------------------------------------------------------------------------


def check_no_gap(
    store: OutputStore, stored: StoredRange, progress: Lsn, origin_name: str = "origin"
) -> None:
    """Refuse to apply ``stored`` when a transaction between ``progress`` and its start was
    never applied (see the module docstring for why this rule is exact)."""
    cursor = stored.range.start
    if cursor <= progress:
        return
    for previous in store.ranges_before(cursor):
        known = previous.chain_last_commit
        if known is not None and known <= progress:
            return  # every COMMIT stored up to here is at or before the origin
        last = previous.transform_lsn
        if last is not None and last > progress:
            key = previous.range.key
            raise ApplyGapError(
                f"range {stored.range.key} cannot be applied: the target's origin "
                f"{origin_name} is at {progress}, but range {key} (transactions up "
                f"to {last}) was not applied, so the changes in ({progress}, "
                f"{stored.range.start}] are missing on the target; apply range {key} "
                "first (ranges apply in LSN order)"
            )
        cursor = previous.range.start
        if cursor <= progress:
            return
    raise ApplyGapError(
        f"range {stored.range.key} cannot be applied: the target's origin "
        f"{origin_name} is at {progress}, and no stored range ends at {cursor}, so the "
        f"changes in ({progress}, {cursor}] are missing from the store; receive and "
        "apply them first, or re-take the base snapshot if they are lost"
    )


def _commit_time(us: int | None) -> dt.datetime:
    if us is None:
        return dt.datetime.now(dt.UTC)
    return dt.datetime(1970, 1, 1, tzinfo=dt.UTC) + dt.timedelta(microseconds=int(us))


# -- the target's tables and schema drift --------------------------------------------------------

_TARGET_COLUMNS = """
SELECT n.nspname, c.relname, a.attname, a.atttypid::int8, a.atttypmod,
       format_type(a.atttypid, a.atttypmod), format_type(a.atttypid, -1),
       a.attgenerated <> '',
       EXISTS (SELECT FROM pg_operator o WHERE o.oprname = '=' AND o.oprleft = a.atttypid
               AND o.oprright = a.atttypid),
       a.attidentity = 'a',
       COALESCE(array_position(pk.conkey, a.attnum), 0),
       c.relkind = 'p'
FROM unnest(%s::text[], %s::text[]) AS want(nspname, relname)
JOIN pg_namespace n ON n.nspname = want.nspname
JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = want.relname
     AND c.relkind IN ('r', 'p')
JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
LEFT JOIN pg_constraint pk ON pk.conrelid = c.oid AND pk.contype = 'p'
ORDER BY n.nspname, c.relname, a.attnum
"""

_TARGET_UNIQUE_KEYS = """
SELECT n.nspname, c.relname,
       array(SELECT a.attname FROM pg_attribute a
             WHERE a.attrelid = c.oid AND a.attnum = ANY(i.indkey))
FROM unnest(%s::text[], %s::text[]) AS want(nspname, relname)
JOIN pg_namespace n ON n.nspname = want.nspname
JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = want.relname
JOIN pg_index i ON i.indrelid = c.oid AND i.indisunique AND i.indpred IS NULL
     AND i.indexprs IS NULL AND i.indisvalid AND i.indimmediate
"""


def read_target_tables(
    conn: psycopg.Connection[Any], tables: Sequence[TableName], *, auto_add: bool = False
) -> dict[TableName, TargetTable]:
    """The target's columns, primary key and plain unique keys of ``tables`` (one query each).

    A table missing on the target is an error: creating tables is the base snapshot's job, or
    an add's (``auto_add``: :class:`~.ddl.ResyncNeeded`, whose copy adds it).
    """
    params = ([t.schema for t in tables], [t.name for t in tables])
    columns: dict[TableName, dict[str, TargetColumn]] = {t: {} for t in tables}
    found: set[TableName] = set()
    pk: dict[TableName, list[tuple[int, str]]] = {t: [] for t in tables}
    partitioned: set[TableName] = set()
    for row in conn.execute(_TARGET_COLUMNS, params).fetchall():
        schema, rel, name, oid, typmod, type_sql, type_name_sql, generated, eq, always = row[:10]
        pk_pos, is_partitioned = row[10:]
        table = TableName(schema, rel)
        found.add(table)
        if is_partitioned:
            partitioned.add(table)
        columns[table][name] = TargetColumn(
            name, int(oid), int(typmod), type_sql, type_name_sql, generated, eq, always
        )
        if pk_pos:
            pk[table].append((int(pk_pos), name))
    missing = [str(t) for t in tables if t not in found]
    if missing and auto_add:
        raise ResyncNeeded(
            {
                t: "it is not on the target: created on the source (or published) after the "
                "base snapshot, it is added (PGCDC_AUTO_ADD=on)"
                for t in tables
                if t not in found
            }
        )
    if missing:
        raise ApplyError(
            f"table(s) {', '.join(missing)} of the range do not exist on the target: the "
            "publication sends them, but the base snapshot did not copy them. Added to the "
            f"publication later: run pgcdc add-table {' '.join(missing)}, which copies their "
            "rows as of now and has the apply take their changes from there; renamed on the "
            "source: rename them on the target too"
        )
    unique: dict[TableName, list[frozenset[str]]] = {t: [] for t in tables}
    for schema, rel, names in conn.execute(_TARGET_UNIQUE_KEYS, params).fetchall():
        unique[TableName(schema, rel)].append(frozenset(names))
    return {
        t: TargetTable(
            t,
            columns[t],
            tuple(name for _, name in sorted(pk[t])),
            tuple(unique[t]),
            t in partitioned,
        )
        for t in tables
    }


def _identity_on_target(relation: TableRelation, target: TargetTable) -> TableRelation:
    """Collapse a REPLICA IDENTITY FULL table by the target's primary key when it has one; a
    key-identified table needs a unique index on its identity for ON CONFLICT."""
    if relation.replica_identity == "f":
        if target.primary_key and set(target.primary_key) <= set(relation.names):
            return relation.with_identity(target.primary_key)
        return relation
    if relation.identity and frozenset(relation.identity) not in target.unique_keys:
        cols = ", ".join(relation.identity)
        raise ApplyError(
            f"table {relation.table} on the target has no unique index on ({cols}), the "
            f"source's replica identity: create it (ALTER TABLE {relation.table} ADD PRIMARY KEY "
            f"({cols}), or a UNIQUE index) so rows can be matched"
        )
    return relation


# -- staging and applying -------------------------------------------------------------------------


def _stage_all(
    conn: psycopg.Connection[Any],
    tables: Mapping[TableName, NetChanges],
    targets: Mapping[TableName, TargetTable],
) -> list[_Staged]:
    """Every table's net rows COPYed into temporary staging tables."""
    return [
        _stage(conn, i, net, targets[table])
        for i, (table, net) in enumerate(sorted(tables.items()))
    ]


def _from_shared(
    shared: Mapping[TableName, SharedStage], targets: Mapping[TableName, TargetTable]
) -> list[_Staged]:
    """Tables staged in shared tables (by Spark's workers or partition by partition here,
    :mod:`.shared_staging`), as the merge reads them."""
    return [
        _Staged(
            stage.net_changes(),
            targets[table],
            upserts=stage.upserts,
            deletes=stage.deletes,
            ordered=stage.ordered,
            ordered_name=f"pgcdc_ord_{i}",
            keep=stage.keep,
            old_missing=stage.old_missing,
            has_origin=stage.has_origin,
            upsert_rows=stage.upsert_rows,
            new_rows=stage.new_rows,
            all_inserts=stage.all_inserts,
            net_rows=stage.net_rows,
        )
        for i, (table, stage) in enumerate(sorted(shared.items()))
    ]


def _apply_staged(
    conn: psycopg.Connection[Any],
    staged: list[_Staged],
    result: ApplyResult,
    *,
    truncated_first: bool = False,
) -> None:
    """TRUNCATE what the range truncated (unless done before staging, ``truncated_first``),
    then apply table by table from the staged rows."""
    apply_started = time.perf_counter()
    for stage in staged:
        net = stage.net
        result.tables[str(net.relation.table)] = TableApplyCounts(
            changes=net.changes, net_rows=stage.net_rows, truncated=net.truncate
        )
    if not truncated_first:
        _truncate(
            conn,
            {s.net.relation.table: s.net.truncate_flags for s in staged if s.net.truncate},
        )
    for stage in staged:
        counts = result.tables[str(stage.net.relation.table)]
        with _writable(conn, stage):
            if stage.net.ordered:
                _apply_ordered(conn, stage, counts)
                continue
            try:
                _apply_collapsed(conn, stage, counts)
            except ApplyError as exc:
                if isinstance(exc.__cause__, _NET_ROW_CONFLICTS):
                    raise _RefusedNetRows(stage.net.relation.table, exc) from exc
                raise
    result.apply_seconds = round(time.perf_counter() - apply_started, 4)


_PARTITION_WRITES = """
SELECT current_setting('track_counts')::bool,
       coalesce(sum(pg_stat_get_xact_tuples_inserted(p.relid)), 0),
       coalesce(sum(pg_stat_get_xact_tuples_updated(p.relid)), 0)
FROM pg_partition_tree(%s::regclass) AS p
WHERE p.isleaf
"""


def _partition_writes(conn: psycopg.Connection[Any], table: TableName) -> tuple[int, int] | None:
    """Rows inserted and updated in ``table``'s partitions so far by this transaction (the
    server's per-transaction counters), or ``None`` without them (``track_counts`` off).

    Why: an ``INSERT`` routed to a partition cannot return ``xmax`` ("cannot retrieve a system
    column in this context"), which tells an upsert's inserts from its updates elsewhere. The
    counters before and after the upsert tell them apart for 0.2-0.5 ms; counting the staged
    keys already there first cost 0.29 s against the upsert's 0.98 s (200,000 rows into a
    partitioned table of 1,000,000)."""
    row = conn.execute(_PARTITION_WRITES, (table.sql.as_string(conn),)).fetchone()
    assert row is not None
    tracked, inserted, updated = row
    return (int(inserted), int(updated)) if tracked else None


_NET_ROW_CONFLICTS = (psycopg.errors.UniqueViolation, psycopg.errors.ExclusionViolation)
"""What a table's net rows may meet that its changes in order would not: a unique or
exclusion key (other than the identity, which the upsert's ``ON CONFLICT`` names) holding a
value the net rows move from one row to another."""


class _RefusedNetRows(Exception):
    """A table's net rows met :data:`_NET_ROW_CONFLICTS`; :func:`apply_range` rolls back and
    applies that table in commit order."""

    def __init__(self, table: TableName, error: ApplyError) -> None:
        super().__init__(str(error))
        self.table = table
        self.error = error


@contextlib.contextmanager
def _writable(conn: psycopg.Connection[Any], stage: _Staged) -> Iterator[None]:
    """Let UPDATEs set ``GENERATED ALWAYS AS IDENTITY`` columns that are not identity keys.

    PostgreSQL only lets an UPDATE set such a column to DEFAULT (its own apply worker bypasses
    the check), so for the transaction the column becomes BY DEFAULT and then ALWAYS again:
    atomic with the rows, at the price of an ACCESS EXCLUSIVE lock on the table until COMMIT.
    Key columns never need it (they are matched, not set).
    """
    rel = stage.net.relation
    if stage.net.ordered:
        touched = stage.ordered is not None and not stage.all_inserts
        candidates = list(rel.names)
    else:
        touched = stage.upserts is not None
        candidates = [n for n in rel.names if n not in rel.identity]
    always = [n for n in candidates if stage.target.columns[n].identity_always] if touched else []

    def alter(kind: str) -> None:
        for name in always:
            conn.execute(
                sql.SQL("ALTER TABLE {} ALTER COLUMN {} SET GENERATED {}").format(
                    rel.table.sql, sql.Identifier(name), sql.SQL(kind)
                )
            )

    alter("BY DEFAULT")
    yield
    alter("ALWAYS")


@dataclass
class _Staged:
    net: NetChanges
    target: TargetTable
    upserts: sql.Composable | None = None
    """Where the merge reads the rows to upsert: a temporary table's name or, for few rows the
    merge only reads, an inline subquery (:func:`.staging.inline_stage`)."""
    deletes: sql.Composable | None = None
    ordered: sql.Identifier | None = None
    ordered_name: str = ""
    keep: list[int] = field(default_factory=list)
    """Positions of columns with a keep flag staged (``u<j>``)."""
    old_missing: list[int] = field(default_factory=list)
    has_origin: bool = False
    upsert_rows: int = 0
    new_rows: int = 0
    """Upserted rows of new keys (``n``, see :mod:`..compaction.kernel`) staged with their flag:
    inserted without an ``ON CONFLICT`` arbiter (0: every row goes through the upsert)."""
    all_inserts: bool = False
    net_rows: int = 0
    direct: pa.Table | None = None
    """An insert-only table's new rows in commit order, named as the target's columns: COPYed
    straight into the target when its turn comes (after the range's TRUNCATE)."""


def _stage(conn: psycopg.Connection[Any], i: int, net: NetChanges, target: TargetTable) -> _Staged:
    """COPY the table's net rows into temp tables typed like the target's columns (so the
    server parses each value once, in COPY, and the SQL needs no casts; dropped at COMMIT),
    or, when they are few and the merge only reads them, stage them inline in its statements
    (:func:`.staging.inline_stage`)."""
    stage = _Staged(net, target, net_rows=net.net.num_rows)
    rel = net.relation
    names = rel.names
    width = len(names)
    table = net.net
    if net.ordered:
        if table.num_rows == 0:
            return stage
        stage.all_inserts = bool(pc.all(pc.equal(table.column("op"), "I")).as_py())
        if stage.all_inserts:
            # The common case (a log table): new rows only, whose net rows are already in
            # commit order. One COPY into the target does what a staging COPY and an INSERT
            # ... SELECT from it did, at half the target's work.
            stage.direct = table.select([f"c{j}" for j in range(width)]).rename_columns(names)
            return stage
        stage.ordered_name = f"pgcdc_ord_{i}"
        stage.ordered = sql.Identifier(stage.ordered_name)
        stage.keep = _flagged(table, "u", width)
        stage.old_missing = _flagged(table, "m", width)
        cols = (
            [sql.SQL("0::int8 AS ord"), sql.SQL("''::text AS op")]
            + [typed_as(rel, j, f"o{j}") for j in range(width)]
            + [flag(f"m{j}") for j in stage.old_missing]
            + [typed_as(rel, j, f"c{j}") for j in range(width)]
            + [flag(f"u{j}") for j in stage.keep]
        )
        staged_names = (
            ["ord", "op"]
            + [f"o{j}" for j in range(width)]
            + [f"m{j}" for j in stage.old_missing]
            + [f"c{j}" for j in range(width)]
            + [f"u{j}" for j in stage.keep]
        )
        create_stage(conn, stage.ordered, rel.table, cols)
        copy_rows(conn, stage.ordered, table.select(staged_names), rel.table)
        return stage

    ident = rel.identity_positions
    deletes = net.deletes
    if deletes.num_rows:
        keys: list[tuple[str, int | None]] = [(f"k{j}", p) for j, p in enumerate(ident)]
        stage.deletes = _stage_rows(conn, f"pgcdc_del_{i}", deletes, keys, target, rel)
    upserts = net.upserts
    stage.upsert_rows = upserts.num_rows
    if upserts.num_rows:
        stage.keep = _flagged(upserts, "u", width)
        stage.has_origin = bool(ident) and upserts.column("f0").null_count < upserts.num_rows
        spec: list[tuple[str, int | None]] = [(f"c{j}", j) for j in range(width)]
        spec += [(f"u{j}", None) for j in stage.keep]
        if stage.has_origin:
            spec += [(f"f{j}", p) for j, p in enumerate(ident)]
        new_rows = int(pc.sum(upserts.column("n")).as_py() or 0)
        if new_rows >= NEW_ROWS_APART:
            stage.new_rows = new_rows
            spec.append(("n", None))
        rows = upserts.select([alias for alias, _ in spec])
        inline = not _fills_from_origin(stage)
        stage.upserts = _stage_rows(conn, f"pgcdc_up_{i}", rows, spec, target, rel, inline)
    return stage


def _stage_rows(
    conn: psycopg.Connection[Any],
    name: str,
    rows: pa.Table,
    spec: Sequence[tuple[str, int | None]],
    target: TargetTable,
    rel: TableRelation,
    inline: bool = True,
) -> sql.Composable:
    """Stage ``rows``, whose columns ``spec`` names with the position of the target column each
    is typed like (``None``: a boolean flag), and say where the merge reads them: inline when
    allowed and they are few (:func:`.staging.inline_stage`), else the temporary table
    ``name``."""
    if inline and inline_fits(rows):
        types = [
            _BOOLEAN if j is None else sql.SQL(target.columns[rel.names[j]].type_name_sql)
            for _, j in spec
        ]
        return inline_stage(rows, types)
    table = sql.Identifier(name)
    columns = [flag(alias) if j is None else typed_as(rel, j, alias) for alias, j in spec]
    create_stage(conn, table, rel.table, columns)
    copy_rows(conn, table, rows, rel.table)
    return table


_BOOLEAN = sql.SQL("boolean")


def _fills_from_origin(stage: _Staged) -> bool:
    """Moved rows have values the range did not send, which the merge first copies into the
    staged rows from their origin key (an UPDATE of the staging table: it must be one)."""
    return stage.has_origin and bool(stage.keep)


def _flagged(table: pa.Table, prefix: str, width: int) -> list[int]:
    """Positions whose boolean flag column is true in some row (only those are staged)."""
    return [j for j in range(width) if pc.any(table.column(f"{prefix}{j}")).as_py()]


def _run(
    conn: psycopg.Connection[Any], statement: sql.Composed | sql.SQL, what: str
) -> psycopg.Cursor[Any]:
    with _applying(conn, what):
        return conn.execute(statement)


@contextlib.contextmanager
def _applying(conn: psycopg.Connection[Any], what: str) -> Iterator[None]:
    """A statement that fails on the target names the table and the server's reason."""
    try:
        yield
    except psycopg.Error as exc:
        if conn.broken:
            raise  # the server went away, not the statement: the caller's server_errors says so
        raise ApplyError(f"applying {what} failed: {server_reason(exc)}") from exc


def _truncate(conn: psycopg.Connection[Any], tables: Mapping[TableName, int]) -> None:
    """TRUNCATE the tables a range truncated (with each one's last TRUNCATE's flags: RESTART
    IDENTITY if any asked for it; CASCADE never, see the module docstring)."""
    if not tables:
        return
    restart = any(flags & 2 for flags in tables.values())
    statement = sql.SQL("TRUNCATE {}{}").format(
        sql.SQL(", ").join(table.sql for table in tables),
        sql.SQL(" RESTART IDENTITY") if restart else sql.SQL(""),
    )
    _run(conn, statement, "the range's TRUNCATE")


NEW_ROWS_APART = 10_000
"""From this many rows of new keys on, a table's upsert inserts them apart, without an
``ON CONFLICT`` arbiter (less than half the target's work for a big insert:
``benchmarks/HISTORY.md``, big_transaction); below it, one statement less is worth more."""


def _insert_new(conn: psycopg.Connection[Any], stage: _Staged, what: str) -> bool:
    """INSERT the staged rows of new keys, in a savepoint; whether it went through. A target
    that has such a key after all (written by hand: a source key it lacked at the range's
    start) refuses it, and the upsert then takes every row, as it would have."""
    rel = stage.net.relation
    names = rel.names
    insert = sql.SQL(
        "INSERT INTO {t} ({cols}) OVERRIDING SYSTEM VALUE SELECT {vals} FROM {s} s "
        "WHERE s.n ORDER BY {order}"
    ).format(
        t=rel.table.sql,
        cols=sql.SQL(", ").join(sql.Identifier(n) for n in names),
        vals=sql.SQL(", ").join(
            sql.SQL("s.{}").format(sql.Identifier(f"c{j}")) for j in range(len(names))
        ),
        s=stage.upserts,
        order=sql.SQL(", ").join(
            sql.SQL("s.{}").format(sql.Identifier(f"c{p}")) for p in rel.identity_positions
        ),
    )
    try:
        with conn.transaction():
            _run(conn, insert, what)
    except ApplyError as exc:
        if isinstance(exc.__cause__, psycopg.errors.UniqueViolation):
            return False
        raise
    return True


def _apply_collapsed(
    conn: psycopg.Connection[Any], stage: _Staged, counts: TableApplyCounts
) -> None:
    """Moved rows' unsent values from their origin key, then DELETE, then upsert: deletes go
    first so that a key or unique value freed in the range can be taken again."""
    rel = stage.net.relation
    table = rel.table
    names = rel.names
    ident = rel.identity_positions
    what = f"the changes of table {table}"

    def col(j: int) -> sql.Identifier:
        return sql.Identifier(names[j])

    def staged(prefix: str, j: int) -> sql.Composable:
        return sql.SQL("s.{}").format(sql.Identifier(f"{prefix}{j}"))

    if stage.upserts is not None and _fills_from_origin(stage):
        # A moved row's values never sent in the range are those of the row it came from.
        sets = [
            sql.SQL("{c} = CASE WHEN {u} THEN o.{n} ELSE {c2} END").format(
                c=sql.Identifier(f"c{j}"), u=staged("u", j), n=col(j), c2=staged("c", j)
            )
            for j in stage.keep
        ]
        match = sql.SQL(" AND ").join(
            sql.SQL("o.{} = {}").format(col(p), staged("f", j)) for j, p in enumerate(ident)
        )
        _run(
            conn,
            sql.SQL("UPDATE {s} s SET {sets} FROM {t} o WHERE {m}").format(
                s=stage.upserts, sets=sql.SQL(", ").join(sets), t=table.sql, m=match
            ),
            what,
        )
        clear = sql.SQL(", ").join(
            sql.SQL("{} = false").format(sql.Identifier(f"u{j}")) for j in stage.keep
        )
        _run(
            conn,
            sql.SQL("UPDATE {} SET {} WHERE f0 IS NOT NULL").format(stage.upserts, clear),
            what,
        )

    if stage.deletes is not None:
        match = sql.SQL(" AND ").join(
            sql.SQL("t.{} = s.{}").format(col(p), sql.Identifier(f"k{j}"))
            for j, p in enumerate(ident)
        )
        deleted = _run(
            conn,
            sql.SQL("DELETE FROM {} t USING {} s WHERE {}").format(table.sql, stage.deletes, match),
            what,
        ).rowcount
        counts.deleted += deleted

    if stage.upserts is None:
        return
    keep_any = sql.SQL(" OR ").join(staged("u", j) for j in stage.keep)
    whole: list[sql.Composable] = [sql.SQL("NOT ({})").format(keep_any)] if stage.keep else []
    others = [j for j in range(len(names)) if j not in ident]
    partitioned = stage.target.partitioned
    before = _partition_writes(conn, table) if partitioned else None
    if stage.new_rows and _insert_new(conn, stage, what):
        if before is None:
            counts.inserted += stage.new_rows
        whole.append(sql.SQL("NOT s.n"))
    full_rows = sql.SQL(" WHERE {}").format(sql.SQL(" AND ").join(whole)) if whole else sql.SQL("")
    on_conflict: sql.Composable
    if others:
        on_conflict = sql.SQL("DO UPDATE SET {}").format(
            sql.SQL(", ").join(sql.SQL("{c} = EXCLUDED.{c}").format(c=col(j)) for j in others)
        )
    else:
        on_conflict = sql.SQL("DO NOTHING")
    existing = 0
    if partitioned and before is None:
        # Without the transaction's write counts (track_counts off), the rows whose key is
        # there already are counted first: one more pass over the staged keys.
        there = sql.SQL("EXISTS (SELECT FROM {t} t WHERE {m})").format(
            t=table.sql,
            m=sql.SQL(" AND ").join(
                sql.SQL("t.{} = {}").format(col(p), staged("c", p)) for p in ident
            ),
        )
        (existing,) = _run(
            conn,
            sql.SQL("SELECT count(*) FROM {s} s WHERE {full}{there}").format(
                s=stage.upserts,
                full=sql.SQL("").join(sql.SQL("{} AND ").format(w) for w in whole),
                there=there,
            ),
            what,
        ).fetchone()  # type: ignore[misc]
    upsert = sql.SQL(
        "WITH written AS ("
        "INSERT INTO {t} AS t ({cols}) OVERRIDING SYSTEM VALUE "
        "SELECT {vals} FROM {s} s{where} ORDER BY {order} "
        "ON CONFLICT ({key}) {on_conflict} RETURNING {inserted} AS inserted) "
        "SELECT count(*) FILTER (WHERE inserted), count(*) FILTER (WHERE NOT inserted) "
        "FROM written"
    ).format(
        t=table.sql,
        cols=sql.SQL(", ").join(col(j) for j in range(len(names))),
        vals=sql.SQL(", ").join(staged("c", j) for j in range(len(names))),
        s=stage.upserts,
        where=full_rows,
        order=sql.SQL(", ").join(staged("c", p) for p in ident),
        key=sql.SQL(", ").join(col(p) for p in ident),
        on_conflict=on_conflict,
        inserted=sql.SQL("true" if partitioned else "(t.xmax = 0)"),
    )
    inserted, updated = _run(conn, upsert, what).fetchone()  # type: ignore[misc]
    if before is not None:
        after = _partition_writes(conn, table)
        assert after is not None
        inserted, updated = after[0] - before[0], after[1] - before[1]
    elif others:  # DO NOTHING returns no row for a key that was there: none is counted
        inserted, updated = int(inserted) - int(existing), int(updated) + int(existing)
    counts.inserted += int(inserted)
    counts.updated += int(updated)

    if stage.keep:
        # Rows with values not sent (unchanged TOAST): update in place, keeping those values.
        sets = []
        for j in others:
            if j in stage.keep:
                sets.append(
                    sql.SQL("{c} = CASE WHEN {u} THEN t.{c} ELSE {v} END").format(
                        c=col(j), u=staged("u", j), v=staged("c", j)
                    )
                )
            else:
                sets.append(sql.SQL("{} = {}").format(col(j), staged("c", j)))
        match = sql.SQL(" AND ").join(
            sql.SQL("t.{} = {}").format(col(p), staged("c", p)) for p in ident
        )
        if sets:
            cursor = _run(
                conn,
                sql.SQL("UPDATE {t} t SET {sets} FROM {s} s WHERE ({keep}) AND {m}").format(
                    t=table.sql,
                    sets=sql.SQL(", ").join(sets),
                    s=stage.upserts,
                    keep=keep_any,
                    m=match,
                ),
                what,
            )
            (wanted,) = conn.execute(
                sql.SQL("SELECT count(*) FROM {} s WHERE {}").format(stage.upserts, keep_any)
            ).fetchone()  # type: ignore[misc]
            counts.updated += cursor.rowcount
            counts.missing += int(wanted) - cursor.rowcount


def _apply_ordered(conn: psycopg.Connection[Any], stage: _Staged, counts: TableApplyCounts) -> None:
    """Changes of a table without identity, replayed in commit order. Each UPDATE or DELETE
    touches exactly one row equal to the old row (found first, then touched by its
    ``tableoid`` and ``ctid``), so duplicate rows stay duplicates, as on the source. The
    ``tableoid`` matters in a partitioned table, whose partitions each have a row at ``(0,1)``:
    by ``ctid`` alone, one DELETE removed the row of every partition there. The function's
    variables are named ``pgcdc_*``: PL/pgSQL takes a bare name for its variable, so a user's
    column named like one (``c``, ``n``) made the statements ambiguous."""
    rel, target = stage.net.relation, stage.target
    what = f"the changes of table {rel.table}"
    if stage.direct is not None:
        with _applying(conn, what):
            counts.inserted += copy_into(conn, rel.table.sql, stage.direct)
        return
    if stage.ordered is None:
        return
    names = rel.names
    cols = sql.SQL(", ").join(sql.Identifier(n) for n in names)

    def r(prefix: str, j: int) -> sql.Composable:
        return sql.SQL("pgcdc_r.{}").format(sql.Identifier(f"{prefix}{j}"))

    if stage.all_inserts:
        inserted = _run(
            conn,
            sql.SQL(
                "INSERT INTO {t} ({cols}) OVERRIDING SYSTEM VALUE SELECT {vals} FROM {s} "
                "ORDER BY ord"
            ).format(
                t=rel.table.sql,
                cols=cols,
                vals=sql.SQL(", ").join(sql.Identifier(f"c{j}") for j in range(len(names))),
                s=stage.ordered,
            ),
            what,
        ).rowcount
        counts.inserted += inserted
        return

    matches = []
    for j, name in enumerate(names):
        column = target.columns[name]
        if column.has_equality:
            test = sql.SQL("x.{} IS NOT DISTINCT FROM {}").format(sql.Identifier(name), r("o", j))
        else:  # json, point, ...: no equality operator; the text forms are what was sent
            test = sql.SQL("x.{}::text IS NOT DISTINCT FROM {}::text").format(
                sql.Identifier(name), r("o", j)
            )
        if j in stage.old_missing:
            test = sql.SQL("({} OR {})").format(r("m", j), test)
        matches.append(test)
    find = sql.SQL(
        "SELECT x.tableoid, x.ctid INTO pgcdc_o, pgcdc_c FROM {t} x WHERE {m} LIMIT 1;"
    ).format(t=rel.table.sql, m=sql.SQL(" AND ").join(matches))
    sets = []
    for j, name in enumerate(names):
        if j in stage.keep:
            sets.append(
                sql.SQL("{c} = CASE WHEN {u} THEN t.{c} ELSE {v} END").format(
                    c=sql.Identifier(name), u=r("u", j), v=r("c", j)
                )
            )
        else:
            sets.append(sql.SQL("{} = {}").format(sql.Identifier(name), r("c", j)))
    body = sql.SQL(
        """
DECLARE pgcdc_r record; pgcdc_n int8; pgcdc_ins int8 := 0; pgcdc_upd int8 := 0;
  pgcdc_del int8 := 0; pgcdc_miss int8 := 0; pgcdc_o oid; pgcdc_c tid;
BEGIN
  FOR pgcdc_r IN SELECT * FROM {s} ORDER BY ord LOOP
    IF pgcdc_r.op = 'I' THEN
      INSERT INTO {t} ({cols}) OVERRIDING SYSTEM VALUE VALUES ({vals});
      pgcdc_ins := pgcdc_ins + 1;
    ELSIF pgcdc_r.op = 'U' THEN
      {find}
      UPDATE {t} t SET {sets} WHERE t.tableoid = pgcdc_o AND t.ctid = pgcdc_c;
      GET DIAGNOSTICS pgcdc_n = ROW_COUNT;
      pgcdc_upd := pgcdc_upd + pgcdc_n; pgcdc_miss := pgcdc_miss + 1 - pgcdc_n;
    ELSIF pgcdc_r.op = 'D' THEN
      {find}
      DELETE FROM {t} t WHERE t.tableoid = pgcdc_o AND t.ctid = pgcdc_c;
      GET DIAGNOSTICS pgcdc_n = ROW_COUNT;
      pgcdc_del := pgcdc_del + pgcdc_n; pgcdc_miss := pgcdc_miss + 1 - pgcdc_n;
    END IF;
  END LOOP;
  RETURN ARRAY[pgcdc_ins, pgcdc_upd, pgcdc_del, pgcdc_miss];
END
"""
    ).format(
        s=stage.ordered,
        t=rel.table.sql,
        cols=cols,
        vals=sql.SQL(", ").join(r("c", j) for j in range(len(names))),
        sets=sql.SQL(", ").join(sets),
        find=find,
    )
    function = sql.Identifier("pg_temp", f"{stage.ordered_name}_fn")
    conn.execute(
        sql.SQL("CREATE FUNCTION {}() RETURNS int8[] LANGUAGE plpgsql AS {}").format(
            function, sql.Literal(body.as_string(conn))
        )
    )
    (totals,) = _run(conn, sql.SQL("SELECT {}()").format(function), what).fetchone()  # type: ignore[misc]
    conn.execute(sql.SQL("DROP FUNCTION {}()").format(function))
    counts.inserted += int(totals[0])
    counts.updated += int(totals[1])
    counts.deleted += int(totals[2])
    counts.missing += int(totals[3])
