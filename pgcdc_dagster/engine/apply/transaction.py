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
                                pg_replication_origin_xact_setup(transform_lsn, commit time);
                                COMMIT                          (one message: origin.marked_commit)

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
    session's origin (``pg_replication_origin_session_setup``, then ``xact_setup`` sent with
    the COMMIT in one message, since on newer servers an aborted marked transaction moves the
    origin too): the commit record carries the new progress, so rows and progress become
    durable together or not at all. A crash or kill at any moment therefore leaves the target
    at a previous range boundary, and running the same range again converges. Holding the session
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
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import psycopg

from ..compaction import (
    DEFAULT_SPARK_MIN_CHANGES,
    NetChanges,
    TableRelation,
    compact_in_commit_order,
    compact_range,
    relations_of,
)
from ..connect import connect
from ..errors import ApplyError
from ..failpoints import failpoint
from ..identifiers import TableName
from ..lsn import Lsn
from ..spark.executors import StoreUnreadableError, spark_app
from ..store.chain import Chain
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
from .merge import (
    apply_staged,
    apply_transaction,
    from_shared,
    replaying_refused,
    stage_all,
    truncate_tables,
)
from .origin import require_progress, reset_session, setup_session
from .partitioned_staging import Routed, partitions_for, route_range, stage_routed
from .results import ApplyGapError, ApplyResult, ApplyStatus
from .shared_staging import SharedStage
from .spark_staging import stage_on_spark
from .staging import drop_shared
from .target_tables import TargetTable, identity_on_target, read_target_tables

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


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
    spark_staging: str = "auto",
    chain: Chain | None = None,
    synchronous_commit: str | None = None,
) -> ApplyResult:
    """Apply ``stored`` to the target and advance ``origin_name`` to its last commit, atomically.

    ``spark_staging`` (``PGCDC_SPARK_STAGING``): when Spark's executors cannot read the range's
    files, ``auto`` stages it on the driver (``staged_by`` says why, and :attr:`ApplyResult.
    warnings` holds the line to show), ``required`` raises the executors' one line. Either way
    nothing was written before: the check runs before any staging table exists.

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
    whatever its size; ``None``: always whole, in memory. ``chain``: the store's chain record
    as the caller read it just before (the tables being added, their floors), so that it is
    not read again (a GET on an object store); by default read here. ``synchronous_commit``:
    the apply transaction's (:func:`~.merge.apply_transaction`); ``None``: the server's.
    """
    started = time.perf_counter()
    transform = stored.transform_lsn
    result = ApplyResult(stored.range.key, ApplyStatus.APPLIED, None, None)
    store = store or stored.home()
    with target_session(target_dsn, conn) as conn:
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

        chain = chain if chain is not None else store.chain()
        relations = written_relations(stored)
        # Tables being added (pgcdc add-table): their copy is under way, or a killed add left
        # it partial. Their changes are held back (the add applies them once its copy is
        # done); the other tables' are applied.
        held_back = {t: relations.pop(t) for t in (chain.adding if chain else ()) if t in relations}
        result.held_back = sorted(str(t) for t in held_back)
        relations, targets, plans = on_target(
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
        driver_because: str | None = None
        if spark is not None and on_spark(stored, spark_min_changes) and not plans:
            spark_started = time.perf_counter()
            try:
                shared = staged_on_workers(
                    conn,
                    spark,
                    target_dsn,
                    origin_name,
                    stored,
                    relations,
                    after_lsn=int(progress),
                    floors=floors,
                )
            except StoreUnreadableError as unreadable:
                if spark_staging == "required":
                    raise
                said = str(unreadable).removeprefix("Spark's executors cannot read ")
                driver_because = "executors cannot read the store: " + said.split(": ", 1)[0]
                result.warnings.append(
                    f"range {stored.range.partition_key} staged on the driver: {driver_because} "
                    "(PGCDC_SPARK_STAGING=required stops instead)"
                )
        if shared is not None:
            assert spark is not None
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
            if driver_because:
                result.staged_by += f" ({driver_because})"
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
            if driver_because:
                result.staged_by = f"driver ({driver_because})"
            result.compaction_seconds = compaction.seconds
            result.changes = sum(t.changes for t in compaction.tables.values())
            result.net_rows = compaction.net_rows

        in_order: dict[TableName, NetChanges] = {}

        def attempt() -> None:
            nonlocal targets, shared
            setup_session(conn, origin_name, origin_wait_seconds)
            try:
                with apply_transaction(conn, synchronous_commit) as transaction:
                    again = require_progress(conn, origin_name)
                    if again != progress:
                        raise ApplyError(
                            f"replication origin {origin_name} moved from {progress} to "
                            f"{again} while range {stored.range.key} was being prepared: "
                            "another apply ran at the same time; run this one again"
                        )
                    result.schema_changes = carry_out_plans(conn, plans)
                    result.reshaped = [str(p.table) for p in plans]
                    result.renamed_tables = [
                        (p.renamed_from, p.table) for p in plans if p.renamed_from is not None
                    ]
                    if plans:
                        targets = read_target_tables(conn, list(relations))
                    stage_started = time.perf_counter()
                    if routed is not None:
                        truncate_tables(conn, routed.truncated)
                        shared = stage_routed(conn, routed, skip=in_order)
                        result.changes = sum(s.changes for s in shared.values())
                        result.net_rows = sum(s.net_rows for s in shared.values())
                    if shared is None:
                        staged = stage_all(conn, {**compaction.tables, **in_order}, targets)
                    else:
                        staged = [
                            s
                            for s in from_shared(shared, targets)
                            if s.net.relation.table not in in_order
                        ] + stage_all(conn, in_order, targets)
                    if shared is None or in_order or routed is not None:
                        result.staging_seconds = round(time.perf_counter() - stage_started, 4)
                    apply_staged(conn, staged, result, truncated_first=routed is not None)
                    for table, stage in (shared or {}).items():
                        if stage.direct and str(table) in result.tables:
                            result.tables[str(table)].inserted += stage.direct
                    if shared is not None and routed is None:
                        # Gone with the COMMIT; tables a killed apply left are dropped by the
                        # next apply that stages in them before it does (no catalog query on
                        # the in-memory path).
                        drop_shared(conn, origin_name)
                    transaction.mark(
                        transform, _commit_time(stored.manifest.result.last_commit_ts_us)
                    )
                    failpoint("apply.in_transaction")
                    commit_started = time.perf_counter()
                result.apply_seconds = round(
                    result.apply_seconds + time.perf_counter() - commit_started, 4
                )
            finally:
                reset_session(conn)

        def take_in_order(table: TableName) -> None:
            in_order[table] = compact_in_commit_order(
                stored, relations, table, after_lsn=int(progress), floors=floors
            )
            result.in_commit_order.append(str(table))

        replaying_refused(attempt, in_order, take_in_order)
        if routed is not None:
            routed.remove()
        failpoint("apply.after_commit")
        result.replay_lsn = str(transform)  # what the COMMIT marked: the origin is there now
    result.seconds = round(time.perf_counter() - started, 4)
    return result


def on_spark(stored: StoredRange, spark_min_changes: int | None) -> bool:
    """Whether ``stored`` is big enough to be worth a Spark job (when a session is at hand):
    its compaction and staging then run on Spark's workers (:mod:`.spark_staging`). ``None``:
    never (:attr:`~..settings.ReplicationSettings.spark_range_changes`)."""
    return spark_min_changes is not None and stored.changes >= spark_min_changes


def written_relations(stored: StoredRange) -> dict[TableName, TableRelation]:
    """The tables ``stored``'s rows write: only those are read on the target and checked for
    drift (a relation no row uses may not match the target, see
    :meth:`~..store.output_store.StoredRange.relation_versions`)."""
    used = stored.relation_versions()
    return {
        t: rel
        for t, rel in relations_of(stored.manifest.relations).items()
        if used & rel.versions.keys()
    }


def on_target(
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
        t: identity_on_target(rel, _as_after(targets[t], plans.get(t)))
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


def carry_out_plans(conn: psycopg.Connection[Any], plans: Sequence[TableChanges]) -> list[str]:
    """Every table's DDL (:func:`.ddl.carry_out`) in the caller's transaction; the steps."""
    return [line for changes in plans for line in carry_out(conn, changes)]


def staged_on_workers(
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
        stored.spark_inputs(),
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
def target_session(
    target_dsn: str, conn: psycopg.Connection[Any] | None
) -> Iterator[psycopg.Connection[Any]]:
    """``conn`` as it is (the caller's to close), or a connection of its own for one apply."""
    if conn is not None:
        yield conn
        return
    with connect(target_dsn, role="target", autocommit=True) as own:
        yield own


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
