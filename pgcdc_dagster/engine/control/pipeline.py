"""The replication stages as plain functions: snapshot, plan, receive, apply, verify, status.

Like pgcopydb's commands, each stage can run on its own (from an asset, the sensor, the CLI or
a test) and finds its position in the three durable places that own progress: the source slot
(what has been stored), the output store (what each range holds, and where the current chain
of ranges begins), the target's replication origin (what has been applied). Nothing here keeps
state of its own, and nothing here knows Dagster.

Why one module: it is the list of what a caller (an asset, the sensor, the CLI) can ask the
engine to do, each step a short function over the modules that do the work; the add-table and
resync steps call the apply of a range and are called by it (a killed resync is finished at the
next apply), so they stay beside it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, TypeAlias, TypeVar, Union

from ..apply.ddl import ResyncNeeded, SourceDdl
from ..apply.origin import progress_of
from ..apply.staging import drop_shared
from ..connect import connect, server_errors
from ..errors import PgcdcError
from ..failpoints import failpoint
from ..identifiers import TableName
from ..lsn import Lsn, LsnRange
from ..progress import SnapshotProgress, active, publish
from ..settings import ReplicationSettings, work_mem_setting
from ..source.failover import failover_readiness
from ..source.peek import receive
from ..source.slot import SlotInfo, advance_slot, current_flush_lsn, keep_failover, read_slot
from ..source.timeline import identify_system
from ..store.output_store import (
    SNAPSHOT_IN_PROGRESS,
    Chain,
    OutputStore,
    RangeResult,
    StoredRange,
    StoreError,
)
from ..store.retention import prune_if_due
from .failover import follow_timeline
from .next_step import ApplyStored, CaughtUp, ReceiveNext, Step, decide, plan_next_range
from .range_lock import (
    RangeBusyError,
    RangeLock,
    command_holder,
    range_lock_or_way,
    tables_changing,
    tables_lock,
    who_holds,
)
from .range_lock import range_lock as hold_range_lock

if TYPE_CHECKING:
    import psycopg
    from pyspark.sql import SparkSession

    from ..apply.results import ApplyResult
    from ..catalog import ColumnInfo
    from ..snapshot import AddedTablesResult, BaseSnapshotResult
    from ..snapshot.common import SchemaRestoreResult
    from ..snapshot.continued import Continuing
    from ..snapshot.resume import Resumable


T = TypeVar("T")
SparkProvider: TypeAlias = Union["SparkSession", Callable[[], "SparkSession"], None]
"""A SparkSession, a callable returning one (started lazily), or ``None`` (in-process only).
(``Union``: the alias is evaluated when the module loads, before pyspark is imported.)"""


__all__ = ["RangeBusyError", "plan_next_range"]


class RangeOrderError(PgcdcError):
    """A range was asked for out of order: running it would lose or repeat changes."""


class CatchUpStalledError(PgcdcError):
    """A step ran but the durable facts did not move: running it again would loop."""


def store_of(settings: ReplicationSettings) -> OutputStore:
    return OutputStore(settings.store_path)


# -- snapshot ---------------------------------------------------------------------------------


def take_snapshot(
    settings: ReplicationSettings,
    spark: SparkSession | Callable[[], SparkSession],
    *,
    resnapshot: bool = False,
    lock_holder: str | None = None,
    notify: Callable[[str], None] | None = None,
) -> BaseSnapshotResult:
    """Base snapshot, then a new chain of ranges in the store at its consistent point.

    Crash-safe in the store's chain record: ``snapshot_in_progress`` is written once the
    target is known to be safe to fill (the populated-target guard passed) and before anything
    changes, the slot's consistent point once it exists (``copying_at``), ``complete`` after
    the target's origin is set. A snapshot killed anywhere between leaves a chain that
    catch-up refuses and that the next call finds. When that one copied some table whole, and
    its slot is still there, the next call resumes it (:mod:`..snapshot.resume`): the snapshot
    is finished at the slot's point with those tables, and the others are copied again as of
    a point of their own, as a resync (which any catch-up finishes if this is killed too).
    Otherwise it redoes the snapshot from scratch (drops the slot, truncates the target tables
    the killed attempt was filling, drops the origin). Either way it says so through
    ``notify``. The range lock is held throughout, so no catch-up of the slot runs meanwhile,
    and so is the tables lock while the snapshot is taken, so no ``pgcdc add-table`` copies
    meanwhile (it copies without the range).
    """
    from ..snapshot import take_base_snapshot
    from ..snapshot.continued import Continuing
    from ..snapshot.copied_ranges import forget_all as forget_copied
    from ..snapshot.resume import finish_resumed

    store = store_of(settings)
    with range_lock(settings, lock_holder):
        chain = store.chain()
        if _copying_again(chain, settings.slot) and not resnapshot:
            assert chain is not None
            return _finish_copying_again(settings, chain, spark, lock_holder, notify)
        with tables_lock(settings.target_dsn, settings.slot, lock_holder or command_holder()):
            # Read before the slot exists: a failover during the copy is then seen by the
            # first catch-up (:mod:`.failover`), from the timeline the slot began on.
            system = identify_system(settings.source_dsn)
            resume, line = (None, None) if resnapshot else snapshot_resume(settings)
            if line and notify is not None:
                notify(line)
            if resume is not None:
                result = finish_resumed(
                    settings.source_dsn,
                    settings.target_dsn,
                    settings.slot,
                    settings.publication,
                    resume,
                )
            else:
                result = take_base_snapshot(
                    settings.source_dsn,
                    settings.target_dsn,
                    settings.slot,
                    settings.publication,
                    settings.tables,
                    spark=spark,
                    resnapshot=resnapshot or line is not None,
                    export_store=settings.store_path if settings.snapshot_parquet else None,
                    begin=lambda: store.begin_snapshot(settings.slot),
                    slot_created=lambda point, name: store.record_copying_at(
                        settings.slot, point, name
                    ),
                    driver_max_rows=settings.driver_max_rows(),
                    slot_failover=settings.slot_failover,
                    **settings.range_options(),
                )
            rest = resume.rest if resume is not None else ()
            store.record_chain(
                settings.slot,
                result.consistent_point,
                result.snapshot_name,
                [*(t.table for t in result.tables), *rest],
                result.shapes,
                resyncing=rest,
                timeline=system.timeline,
                system_id=system.system_id,
            )
            forget_copied(settings.target_dsn, settings.slot)  # nothing resumes it now
        if rest:
            assert resume is not None
            again = resync_tables(
                settings,
                rest,
                spark,
                holding_range=True,
                lock_holder=lock_holder,
                continuing=Continuing(resume.consistent_point, resume.partly),
            )
            if notify is not None:
                for line in again.continued:
                    notify(line)
            result = dataclasses.replace(
                result,
                tables=(*result.tables, *again.tables),
                seconds=result.seconds + again.seconds,
                post_data=_merged(result.post_data, again.post_data),
            )
    if notify is not None:  # what a failover of the source would cost, now the slot exists
        for gap in failover_readiness(settings.source_dsn, settings.slot).gaps():
            notify(f"warning: {gap}")
    return result


def _copying_again(chain: Chain | None, slot: str) -> bool:
    """Whether ``chain`` is ``slot``'s complete snapshot with tables still being copied again."""
    return (
        chain is not None
        and chain.complete
        and chain.slot == slot
        and chain.finished is None
        and bool(chain.resyncing)
    )


def _finish_copying_again(
    settings: ReplicationSettings,
    chain: Chain,
    spark: SparkSession | Callable[[], SparkSession],
    lock_holder: str | None,
    notify: Callable[[str], None] | None,
) -> BaseSnapshotResult:
    """``pgcdc snapshot`` on a complete chain with tables still being copied again (a resumed
    snapshot, or a resync, stopped during its copy): the snapshot is taken but for them, so it
    copies them (a resync, under the range the caller holds) and reports that."""
    from ..snapshot.common import BaseSnapshotResult
    from ..snapshot.copied_ranges import forget_all

    assert chain.consistent_point is not None  # a complete chain has one
    forget_all(settings.target_dsn, settings.slot)  # a resumed snapshot killed before it did
    if notify is not None:
        names = " ".join(str(t) for t in chain.resyncing)
        notify(
            f"the base snapshot of slot {settings.slot} is taken but {names} were being copied "
            "again when that stopped: copying them now"
        )
    started = time.monotonic()
    again = resync_tables(
        settings, chain.resyncing, spark, holding_range=True, lock_holder=lock_holder
    )
    return BaseSnapshotResult(
        slot_name=settings.slot,
        snapshot_name=chain.snapshot or "",
        consistent_point=chain.consistent_point,
        origin_name=settings.origin,
        publication=settings.publication,
        tables=again.tables,
        pre_data=again.pre_data,
        post_data=again.post_data,
        sequences={},
        seconds=time.monotonic() - started,
        copy_seconds=again.seconds,
        shapes=again.shapes,
    )


def _merged(first: SchemaRestoreResult, then: SchemaRestoreResult) -> SchemaRestoreResult:
    """Two restores of one section as one."""
    return dataclasses.replace(
        first,
        created=(*first.created, *then.created),
        already_present=(*first.already_present, *then.already_present),
        skipped=(*first.skipped, *then.skipped),
        seconds=first.seconds + then.seconds,
    )


def add_tables(
    settings: ReplicationSettings,
    tables: Sequence[TableName],
    spark: SparkSession | Callable[[], SparkSession],
    *,
    lock_holder: str | None = None,
    wait_s: float = 120.0,
    resync: bool = False,
    holding_range: bool = False,
    continuing: Continuing | None = None,
) -> AddedTablesResult:
    """Add ``tables`` to the replication (:mod:`..snapshot.added`): copied as of a consistent
    point of their own, while the applies go on.

    How, as native logical replication's table sync does it:

    1. The tables enter the store chain's ``adding`` before anything changes: from there every
       apply holds their changes back (:func:`~..apply.transaction.apply_range`) and applies the
       other tables', so a follow keeps the rest of the target fresh while they copy.
    2. They are published and copied as of a temporary slot's consistent point ``C``, without
       the range.
    3. Their changes the applies held back, from ``C`` to the target's origin as it stands,
       are applied from the stored ranges (:func:`~..apply.transaction.apply_added_changes`), still
       without the range, in passes while each catches up on enough to take a while.
    4. With the range (the range lock, or a follow holding it that made way, waiting up to
       ``wait_s`` seconds for either: :func:`~.range_lock.range_lock_or_way`), the origin
       ``O`` stands still: the last held-back changes, up to ``O``, are applied, and the
       tables enter ``synced_from`` at ``max(C, O)``: later applies take their changes past
       it.

    One add or snapshot at a time (:func:`~.range_lock.tables_lock`, held throughout). Crash
    anywhere: the tables stay in ``adding``, their changes held back, and the next add copies
    them again from scratch; a prune removes nothing meanwhile (it would remove the ranges steps
    3 and 4 read).

    ``resync``: the tables are replicated already and copied again, each dropped and created
    again on the target (``pgcdc resync``, :func:`resync_tables`). ``holding_range``: the
    caller holds the range already (an apply that met DDL it cannot follow). ``continuing``:
    tables of a resync that a killed base snapshot copied in part, continued where they can
    be (:mod:`..snapshot.continued`; the caller holds the range, so the slot stays put)."""
    from ..apply.held_back import HeldBackApplied, apply_added_changes
    from ..published_columns import unpublished_columns
    from ..snapshot import add_tables as copy_added

    store = store_of(settings)
    store.consistent_point()  # a base snapshot to add to, or the error that says to take one
    holder = lock_holder or command_holder()

    def the_range() -> contextlib.AbstractContextManager[Any]:
        if holding_range:
            return contextlib.nullcontext()
        return range_lock_or_way(settings.target_dsn, settings.slot, holder, wait_s)

    def begin(tables: Sequence[TableName]) -> None:
        store.begin_adding(tables, resync=resync)
        redo = set(chain.adding) if chain else set()
        if (set(tables) - redo) & set(replicated_tables(settings)):
            # Published already (by hand), so their changes stream: an apply that read the
            # chain before this may be writing them now. Once the range was ours for a moment,
            # every apply reads the chain after it, and holds them back.
            with the_range():
                pass

    with tables_lock(settings.target_dsn, settings.slot, holder, wait_s):
        chain = store.chain()
        if chain is not None and chain.finished:
            raise StoreError(chain.finished)
        if resync and (unknown := set(tables) - set(replicated_tables(settings))):
            names = " ".join(str(t) for t in sorted(unknown))
            raise StoreError(
                f"the publication {settings.publication} does not send {names}, so there is "
                f"nothing to resync: pgcdc add-table {names} publishes and copies them"
            )
        result = copy_added(
            settings.source_dsn,
            settings.target_dsn,
            settings.slot,
            settings.publication,
            tables,
            spark=spark,
            redo=chain.adding if chain else (),
            replicated=chain.tables if chain else (),
            begin=begin,
            driver_max_rows=settings.driver_max_rows(),
            resync=resync,
            continuing=continuing,
            range_options=settings.range_options(),
        )
        added = [t.table for t in result.tables]
        unpublished = unpublished_columns(result.shapes)
        session = None if spark is None else spark if callable(spark) else lambda: spark
        staging_key = f"{settings.origin} add"
        with connect(settings.target_dsn, role="target", autocommit=True) as conn:
            # Shared staging tables a killed add's Spark workers filled (a big range's rows);
            # nothing else uses them: one add at a time.
            drop_shared(conn, staging_key)

        began = time.monotonic()

        def held_back_through(since: Lsn, label: str) -> tuple[Lsn, HeldBackApplied]:
            """The added tables' held-back changes committed in ``(since, O]``, ``O`` the
            target's origin now, applied: ``O`` (at least ``since``) and what they were.
            ``label`` names the pass in the progress shown meanwhile."""
            through = max(origin_progress(settings) or since, since)

            def progressed(so_far: HeldBackApplied, at: Lsn) -> None:
                note = (
                    f"{label}: {so_far.changes:,} change(s) held back during the copy applied "
                    f"in {so_far.transactions} transaction(s), at {at} of {through}"
                )
                publish(
                    SnapshotProgress(
                        "held back",
                        time.monotonic() - began,
                        note=note,
                        work="resync" if resync else "add-table",
                    )
                )

            applied = apply_added_changes(
                settings.target_dsn,
                store,
                added,
                since=since,
                through=through,
                unpublished=unpublished,
                staging_key=staging_key,
                spark=session,
                spark_min_changes=settings.spark_range_changes,
                progressed=progressed if active() else None,
                ddl=source_ddl(settings),
            )
            return through, applied

        # What the applies held back during the copy (hours of a busy table's changes, for a
        # big one) is applied first without the range, while they go on: nothing else writes
        # these tables (the applies hold them back, the tables lock keeps other adds away).
        # Each pass takes what was held back during the one before, so the last, with the
        # range, is short: the follow makes way only for that.
        applied, held_back, passes = result.consistent_point, HeldBackApplied(), 0
        for _ in range(_UNLOCKED_PASSES):
            started = time.monotonic()
            passes += 1
            applied, without_range = held_back_through(applied, f"pass {passes}")
            held_back += without_range
            if time.monotonic() - started < _SHORT_PASS_S:
                break
        failpoint("add.before_range")
        with the_range():
            chain = store.chain()
            if chain is not None and chain.finished:  # read with the range: no finish between
                raise StoreError(chain.finished)
            # The origin does not move now.
            applied, with_range = held_back_through(applied, "with the range")
            failpoint("add.after_held_back")
            store.record_added(added, applied, result.shapes)
    held_back += with_range
    return dataclasses.replace(
        result,
        held_back=held_back.changes,
        held_back_with_range=with_range.changes,
        held_back_passes=passes + 1,
        held_back_on_spark=held_back.on_spark,
        held_back_transactions=held_back.transactions,
        held_back_seconds=held_back.seconds,
    )


_UNLOCKED_PASSES = 5
"""At most this many passes of an add's held-back changes before it takes the range."""
_SHORT_PASS_S = 0.2
"""A pass shorter than this leaves a last one, with the range, of about as short."""


def adding_not_done(chain: Chain | None) -> str | None:
    """While tables are being added, one line saying why the target is not a whole copy of the
    source (the applies hold their changes back) and what to run; ``None`` otherwise. Ending
    the replication on it (a cutover, a finish) would leave the target without them."""
    if chain is None or not chain.adding:
        return None
    names = " ".join(str(t) for t in chain.adding)
    if set(chain.adding) <= set(chain.resyncing):
        return (
            f"resyncing {names} is not done, so their changes are held back and the target is "
            f"not a whole copy: let pgcdc resync {names} (or the next catch-up) finish first"
        )
    return (
        f"adding {names} is not done, so their changes are held back and the target is not a "
        f"whole copy: let pgcdc add-table {names} finish (run it again if it was killed) first"
    )


def refuse_while_adding(settings: ReplicationSettings) -> None:
    """Raise :class:`~..store.output_store.StoreError` while tables are being added
    (:func:`adding_not_done`; a cutover also compares only the tables its code location listed)."""
    if (refusal := adding_not_done(store_of(settings).chain())) is not None:
        raise StoreError(refusal)


def snapshot_resume(settings: ReplicationSettings) -> tuple[Resumable | None, str | None]:
    """What the next base snapshot does about an earlier one of this slot that did not finish:
    resume it (:mod:`..snapshot.resume`), with the line that says so; or take it again from
    scratch (``None``), with the line that says why. ``(None, None)`` when there is none."""
    from ..snapshot.resume import Resumable, resumable
    from ..source.preflight import check_source

    chain = store_of(settings).chain()
    if chain is None or chain.complete or chain.slot != settings.slot:
        return None, None
    if chain.state != SNAPSHOT_IN_PROGRESS or chain.copying_at is None:
        why = "it copied nothing"
    elif settings.snapshot_parquet:
        why = "its export to Parquet is taken whole"
    else:
        with connect(settings.source_dsn, role="source", autocommit=True) as src:
            tables = check_source(src, settings.tables, free_slots_needed=0)
        found = resumable(
            settings.source_dsn,
            settings.target_dsn,
            settings.slot,
            tables,
            chain.copying_at,
            chain.snapshot or "",
        )
        if isinstance(found, Resumable):
            return found, found.line(settings.slot)
        why = found
    return None, (
        f"an earlier base snapshot of slot {settings.slot} (started {chain.started_at}) did not "
        f"finish ({why}): dropping its slot and partial copy and taking it again"
    )


# -- positions and planning -------------------------------------------------------------------


@dataclass(frozen=True)
class SourcePositions:
    slot: SlotInfo
    flush_lsn: Lsn

    @property
    def lag_bytes(self) -> int:
        confirmed = self.slot.confirmed_flush_lsn or self.flush_lsn
        return max(0, self.flush_lsn - confirmed)


def _source_session(
    settings: ReplicationSettings, timeout_s: int | None, **kwargs: Any
) -> psycopg.Connection[Any]:
    """A session on the source whose connect and every statement end within ``timeout_s``
    seconds (``None``: unbounded): the slot sensor's tick must not hang on a source that
    stopped answering."""
    if timeout_s is None:
        return connect(settings.source_dsn, role="source", **kwargs)
    conn = connect(settings.source_dsn, role="source", connect_timeout=timeout_s, **kwargs)
    conn.execute(f"SET statement_timeout = '{int(timeout_s)}s'")
    return conn


def source_row_estimates(
    settings: ReplicationSettings, *, timeout_s: int = 5
) -> dict[TableName, int | None]:
    """The source's estimate of each replicated table's rows (:func:`..catalog.estimated_rows`),
    bounded in time (the sensor calls it)."""
    from ..catalog import estimated_rows
    from ..source.publication import publication_tables

    with _source_session(settings, timeout_s, autocommit=True) as conn:
        return estimated_rows(conn, publication_tables(conn, settings.publication))


def source_positions(settings: ReplicationSettings, *, timeout_s: int = 5) -> SourcePositions:
    """The slot and the source's flushed WAL position, bounded in time (the sensor calls it)."""
    with _source_session(settings, timeout_s) as conn:
        slot = read_slot(conn, settings.slot)
        flush = current_flush_lsn(conn)
    return SourcePositions(slot, flush)


def check_range_order(store: OutputStore, rng: LsnRange) -> None:
    """A range may run only right after the last stored range of the chain (or first)."""
    consistent_point = store.consistent_point()
    if rng.start < consistent_point:
        raise RangeOrderError(
            f"range {rng.key} starts at {rng.start}, before the current base snapshot's "
            f"consistent point {consistent_point}: it belongs to an earlier snapshot and is kept "
            "as history only; it is never re-applied"
        )
    if store.get(rng) is not None:
        return  # re-running a stored range: receive and apply are both idempotent
    chain = store.chain()
    pruned = None if chain is None else chain.pruned_through
    if pruned is not None and rng.end <= pruned:
        raise RangeOrderError(
            f"range {rng.key} was applied and then removed from the output store by its "
            f"retention (PGCDC_STORE_RETENTION; the chain's stored ranges now begin at "
            f"{pruned}): there is nothing left to run for it"
        )
    expected = store.chain_end()
    if rng.start != expected:
        missing = f"{expected} to {rng.start}" if rng.start > expected else f"from {expected}"
        raise RangeOrderError(
            f"range {rng.key} cannot run yet: the chain of stored ranges ends at {expected}, "
            f"so the range {missing} must be received and applied first (ranges run in LSN "
            "order, each starting where the previous one ended)"
        )


# -- catch-up of one range --------------------------------------------------------------------


@contextlib.contextmanager
def range_lock(settings: ReplicationSettings, holder: str | None = None) -> Iterator[RangeLock]:
    """One catch-up per slot at a time, whoever starts it (see :mod:`.range_lock`)."""
    holder = holder or command_holder()
    with hold_range_lock(settings.target_dsn, settings.slot, holder) as lock:
        yield lock


def decoding_session(settings: ReplicationSettings) -> psycopg.Connection[Any]:
    """A source session to read the slot with: its ``logical_decoding_work_mem`` is
    ``settings.decoding_work_mem`` (see there), set after connecting (a startup option an older
    server does not know would refuse the connection)."""
    conn = connect(settings.source_dsn, role="source")
    if settings.decoding_work_mem:
        conn.execute(
            "SELECT set_config('logical_decoding_work_mem', %s, false)",
            (work_mem_setting(settings.decoding_work_mem),),
        )
        conn.commit()
    return conn


def receive_range(settings: ReplicationSettings, rng: LsnRange) -> RangeResult:
    follow_timeline(settings)
    store = store_of(settings)
    check_range_order(store, rng)
    with server_errors("source", settings.source_dsn), decoding_session(settings) as conn:
        result = receive(
            settings.source_dsn,
            settings.slot,
            settings.publication,
            store,
            rng.start,
            rng.end,
            conn=conn,
        )
    assert result is not None  # ranges are kept even when empty unless asked otherwise
    return result


def stored_range(settings: ReplicationSettings, rng: LsnRange) -> StoredRange:
    stored = store_of(settings).get(rng)
    if stored is None:
        raise RangeOrderError(
            f"range {rng.key} is not in the output store {settings.store_path}: receive it "
            "(materialise decoded_changes for that partition) before applying it"
        )
    return stored


def source_ddl(settings: ReplicationSettings) -> SourceDdl:
    """How the applies follow the source's DDL (:mod:`..apply.ddl`), from ``settings``."""
    return SourceDdl(
        settings.source_dsn,
        keep_dropped=settings.dropped_columns == "keep",
        auto_add=settings.ddl == "auto" and settings.auto_add,
    )


def apply_stored_range(
    settings: ReplicationSettings,
    rng: LsnRange,
    spark: SparkProvider = None,
    conn: psycopg.Connection[Any] | None = None,
) -> ApplyResult:
    """Apply a stored range. Spark is started (through ``spark``, a session or a callable that
    returns one) only for ranges large enough to be worth a Spark job. ``conn``: a target
    connection kept across ranges (see :func:`~..apply.transaction.apply_range`).

    A table whose DDL in the range cannot be followed column by column (:mod:`..apply.ddl`) is
    re-copied first (``PGCDC_DDL=auto``: :func:`resync_tables`, under the range the caller
    holds), and the range applied after, the table's changes up to its copy skipped; with
    ``strict``, the apply stops there. Nothing of the range is applied before either."""
    resumed = _resume_resync(settings, spark) + _reconcile_due(settings, spark)
    try:
        applied = _apply_stored(settings, rng, spark, conn)
        applied.schema_changes += resumed
        return applied
    except ResyncNeeded as need:
        if settings.ddl != "auto":
            raise
        resynced = resync_tables(settings, need.tables, spark, holding_range=True)
        applied = _apply_stored(settings, rng, spark, conn)
        applied.schema_changes += [
            f"{t.table}: re-copied ({need.reasons[t.table]}), {t.rows} rows as of "
            f"{resynced.consistent_point}"
            for t in resynced.tables
        ]
        applied.reshaped += [str(t.table) for t in resynced.tables]
        return applied


def reshaped_columns(
    settings: ReplicationSettings, applied: ApplyResult
) -> dict[TableName, list[ColumnInfo]]:
    """The target's columns of the tables ``applied`` reshaped (for the UI's column schema:
    it shows when a table's shape changed); none read when none was."""
    if not applied.reshaped:
        return {}
    from ..catalog import table_columns

    with connect(settings.target_dsn, role="target", autocommit=True) as conn:
        return table_columns(conn, [TableName.parse(t) for t in applied.reshaped])


RECONCILE_EVERY_S = 60.0
"""How often an applying process compares the source's and the target's catalogs for what the
change stream never shows (:func:`~..apply.ddl.reconcile`): a default changed, a generated column
added, a column dropped and added again under its name."""
_reconciled_at: dict[tuple[str, str], float] = {}


def _reconcile_due(settings: ReplicationSettings, spark: SparkProvider) -> list[str]:
    """At an apply's start, at most every :data:`RECONCILE_EVERY_S` in this process (the first
    apply of a process always): :func:`~..apply.ddl.reconcile` on the replicated tables; a table it
    finds must be copied again is resynced (``PGCDC_DDL=auto``, under the range the caller
    holds) or refused (``strict``). One line per step."""
    from ..apply.ddl import reconcile

    key = (settings.store, settings.slot)
    now = time.monotonic()
    if now - _reconciled_at.get(key, -RECONCILE_EVERY_S) < RECONCILE_EVERY_S:
        return []
    _reconciled_at[key] = now
    chain = store_of(settings).chain()
    if chain is None or not chain.complete:
        return []
    tables = [t for t in chain.tables if t not in chain.adding]
    if not tables:
        return []
    with (
        connect(settings.source_dsn, role="source", autocommit=True) as src,
        connect(settings.target_dsn, role="target", autocommit=True) as tgt,
    ):
        steps, resync = reconcile(src, tgt, tables)
    if resync:
        if settings.ddl != "auto":
            raise ResyncNeeded(resync)
        resynced = resync_tables(settings, sorted(resync), spark, holding_range=True)
        steps += [
            f"{t.table}: re-copied ({resync[t.table]}), {t.rows} rows as of "
            f"{resynced.consistent_point}"
            for t in resynced.tables
        ]
    return steps


def _resume_resync(settings: ReplicationSettings, spark: SparkProvider) -> list[str]:
    """Finish a resync that was killed (its tables still in
    :attr:`~..store.output_store.Chain.resyncing`, their changes held back), unless one runs now or
    ``PGCDC_DDL=strict``: the next catch-up converges by itself. The caller holds the range. One
    line per table copied."""
    chain = store_of(settings).chain()
    if settings.ddl != "auto" or chain is None or not chain.resyncing:
        return []
    if tables_changing(settings.target_dsn, settings.slot):
        return []  # an add or resync runs: it finishes them
    resynced = resync_tables(settings, chain.resyncing, spark, holding_range=True)
    return [
        f"{t.table}: re-copied (a resync that was stopped, finished), {t.rows} rows as of "
        f"{resynced.consistent_point}"
        for t in resynced.tables
    ]


def resync_tables(
    settings: ReplicationSettings,
    tables: Sequence[TableName],
    spark: SparkProvider = None,
    *,
    holding_range: bool = False,
    lock_holder: str | None = None,
    wait_s: float = 120.0,
    continuing: Continuing | None = None,
) -> AddedTablesResult:
    """Copy replicated ``tables`` again while replication goes on (``pgcdc resync``): each
    dropped on the target and copied, definition and rows, as of a consistent point of its
    own, its changes held back meanwhile and taken from there (:func:`add_tables`). The repair
    for a table that drifted: DDL the apply cannot follow, a hand edit on the target, a
    difference ``pgcdc verify`` found."""
    return add_tables(
        settings,
        tables,
        settings.spark_session if spark is None else spark,
        lock_holder=lock_holder,
        wait_s=wait_s,
        resync=True,
        holding_range=holding_range,
        continuing=continuing,
    )


def _apply_stored(
    settings: ReplicationSettings,
    rng: LsnRange,
    spark: SparkProvider,
    conn: psycopg.Connection[Any] | None,
) -> ApplyResult:
    from ..apply.transaction import apply_range, on_spark

    stored = stored_range(settings, rng)
    session = None
    if spark is not None and on_spark(stored, settings.spark_range_changes):
        session = spark() if callable(spark) else spark
    store = store_of(settings)
    with server_errors("target", settings.target_dsn):
        applied = apply_range(
            settings.target_dsn,
            stored,
            settings.origin,
            spark=session,
            store=store,
            spark_min_changes=settings.spark_range_changes,
            conn=conn,
            ddl=source_ddl(settings),
            partition_changes=settings.partition_changes,
        )
    if applied.renamed_tables:
        store.record_renamed(applied.renamed_tables)
    replay = Lsn.parse(applied.replay_lsn) if applied.replay_lsn else None
    prune_if_due(store, replay, settings.store_retention)
    return applied


def server_versions(settings: ReplicationSettings) -> dict[str, str]:
    """Both servers' releases (``15.20``), by role: a replication may cross majors."""
    from ..postgres_installs import release

    versions = {}
    for role, dsn in (("source", settings.source_dsn), ("target", settings.target_dsn)):
        with connect(dsn, role=role, autocommit=True) as conn:
            versions[role] = release(conn.info.server_version)
    return versions


def origin_progress(settings: ReplicationSettings) -> Lsn | None:
    """What the target has applied: the replication origin's durable progress."""
    return progress_of(settings.target_dsn, settings.origin)


def no_longer_published(
    settings: ReplicationSettings, published: Sequence[TableName] | None = None
) -> list[TableName]:
    """The tables the chain replicates (:attr:`~..store.output_store.Chain.tables`) that the
    publication no longer sends (``published``, when the caller has read it) and the target still
    holds: their copy there is no longer kept in sync. A table dropped and created again on the
    source is one (a publication lists tables by identity, so the new one is not in it), as
    is one dropped from the publication."""
    from ..catalog import table_columns

    chain = store_of(settings).chain()
    if chain is None or not chain.tables:
        return []
    sent = set(replicated_tables(settings) if published is None else published)
    gone = [t for t in chain.tables if t not in sent]
    if not gone:
        return []
    with connect(settings.target_dsn, role="target", autocommit=True) as conn:
        on_target = set(table_columns(conn, gone))
    return [t for t in gone if t in on_target]


@dataclass(frozen=True)
class TablesAgreement:
    """Where the tables the chain replicates and those the publication sends part ways (each
    empty when they agree): what a user must act on, or the target silently drifts."""

    no_longer_published: tuple[TableName, ...] = ()
    """Replicated, still on the target, no longer sent (:func:`no_longer_published`): their
    copy is no longer kept in sync, and nothing fails (as with native replication)."""
    not_added: tuple[TableName, ...] = ()
    """Sent, not replicated (added to the publication by hand, never copied): every apply
    of a range that changes one fails until ``pgcdc add-table`` copies it."""
    adding: tuple[TableName, ...] = ()
    """Tables being added (:attr:`~..store.output_store.Chain.adding`): the applies hold their
    changes back until their add is done."""
    adding_by: str = ""
    """Who is adding them (the holder of :func:`~.range_lock.tables_lock`); empty: nobody, an
    add ended before finishing and must run again."""
    reshaped: tuple[Reshaped, ...] = ()
    """Replicated tables the publication sends more or other rows of than when they were
    copied: nothing copies what the change let in (as with native replication)."""

    @property
    def agree(self) -> bool:
        """Nothing to act on: an add under way is not a problem, one left unfinished is."""
        unfinished = self.adding and not self.adding_by
        return not (self.no_longer_published or self.not_added or unfinished or self.reshaped)

    def reshaped_lines(self) -> list[str]:
        """One line a table the publication sends otherwise than at its copy, with the fix."""
        return [r.line() for r in self.reshaped]

    def adding_line(self) -> str | None:
        """One line on the tables being added, with the fix when an add did not finish."""
        if not self.adding:
            return None
        names = " ".join(str(t) for t in self.adding)
        if self.adding_by:
            return (
                f"adding {names} ({self.adding_by}): their changes are held back until its "
                "copy is done; the other tables' are applied"
            )
        return (
            f"adding {names} did not finish, so their changes are held back (the other "
            f"tables' are applied): run pgcdc add-table {names} again"
        )


@dataclass(frozen=True)
class Reshaped:
    """A replicated table whose row filter changed since its copy (:attr:`~.store.Chain.
    row_filters`), or whose column list now sends columns it left out then
    (:attr:`~..store.output_store.Chain.unpublished`). The stream follows the publication from the
    change on; a column list that leaves out more stops the apply
    (:mod:`..apply.transaction`), this does not."""

    table: TableName
    filter_then: str | None
    filter_now: str | None
    columns_now_sent: tuple[str, ...] = ()

    def line(self) -> str:
        what = []
        if self.filter_now != self.filter_then:
            what.append(
                f"the publication's row filter is {_filter_text(self.filter_now)}, it was "
                f"{_filter_text(self.filter_then)} when the table was copied, so the target "
                "lacks the rows only the new one passes and keeps those only the old one did"
            )
        if self.columns_now_sent:
            names = ", ".join(self.columns_now_sent)
            what.append(
                f"the publication now sends column(s) {names}, left out when the table was "
                "copied, so they are empty in the rows copied then"
            )
        return (
            f"{self.table}: {'; and '.join(what)} (as with native replication): pgcdc resync "
            f"{self.table} copies it again as now published"
        )


def _filter_text(row_filter: str | None) -> str:
    return "none" if row_filter is None else f"WHERE {row_filter}"


def tables_agreement(
    settings: ReplicationSettings, *, timeout_s: int | None = None
) -> TablesAgreement:
    """How the chain's tables and the publication's agree (one source session, within
    ``timeout_s`` when given, and one of the target when a replicated table is no longer sent
    or one is being added). Nothing to say before a base snapshot completes, nor of a chain
    that predates its record of tables."""
    from ..published_columns import published_shapes
    from ..source.publication import publication_tables

    chain = store_of(settings).chain()
    if chain is None or not chain.complete or not chain.tables:
        return TablesAgreement()
    with _source_session(settings, timeout_s, autocommit=True) as conn:
        published = publication_tables(conn, settings.publication)
        sent = set(published)
        compared = [t for t in chain.row_filters if t in sent and t not in chain.adding]
        shapes = published_shapes(conn, settings.publication, compared, whole=True)
    reshaped = []
    for table in compared:
        shape, then = shapes.get(table), chain.row_filters[table]
        now = shape.row_filter if shape else then  # gone since read: no_longer_published
        sent_now = [c for c in chain.unpublished.get(table, ()) if shape and c in shape.columns]
        if now != then or sent_now:
            reshaped.append(Reshaped(table, then, now, tuple(sent_now)))
    wanted = set(settings.tables) if settings.tables else None
    replicated = {*chain.tables, *chain.adding}
    adders = tables_changing(settings.target_dsn, settings.slot) if chain.adding else []
    adding_by = who_holds(adders) if adders else ""
    return TablesAgreement(
        adding_by=adding_by,
        no_longer_published=tuple(no_longer_published(settings, published)),
        not_added=tuple(
            t for t in published if t not in replicated and (wanted is None or t in wanted)
        ),
        adding=chain.adding,
        reshaped=tuple(reshaped),
    )


def added_beyond(settings: ReplicationSettings, listed: Sequence[TableName]) -> list[TableName]:
    """The tables the chain replicates (:attr:`~..store.output_store.Chain.tables`) and the
    publication sends that ``listed`` lacks: tables ``pgcdc add-table`` added after ``listed`` was
    read (a code location lists its tables once, when it loads; a follow that made way for an add
    goes on with the added ones). A table the publication no longer sends is not one: nothing keeps
    it in sync. Reads the source only when the chain holds a table ``listed`` lacks."""
    chain = store_of(settings).chain()
    if chain is None:
        return []
    known = set(listed)
    extra = [t for t in chain.tables if t not in known]
    if not extra:
        return []
    sent = set(replicated_tables(settings))
    return [t for t in extra if t in sent]


def replicated_tables(
    settings: ReplicationSettings, *, timeout_s: int | None = None
) -> list[TableName]:
    """The tables the publication carries (the source's own answer); within ``timeout_s``
    seconds, when given (the slot sensor's tick)."""
    from ..source.publication import publication_tables

    with _source_session(settings, timeout_s, autocommit=True) as conn:
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


# -- the next step and the catch-up loop ------------------------------------------------------


def next_step(settings: ReplicationSettings, endpos: Lsn, *, timeout_s: int = 10) -> Step:
    """What to do next to bring the target to ``endpos`` (see :mod:`.next_step`): read the
    origin and the slot, then decide with the store's chain."""
    origin = origin_progress(settings)
    positions = source_positions(settings, timeout_s=timeout_s)
    return decide(
        store_of(settings),
        origin,
        positions.slot.confirmed_flush_lsn,
        endpos,
        settings.range_max_bytes,
    )


def confirm_stored(
    settings: ReplicationSettings, told: Callable[[str], None] | None = None
) -> Lsn | None:
    """Advance the slot to the last stored range's safe point if it is behind it (a process
    killed between storing a range and advancing the slot, or a source that crashed and came
    back with an older slot position, or a promoted standby whose synchronised slot trails).
    Idempotent; never moves the slot backwards. A writer killed in that window may also have
    left its emptied scratch folder: removed here too.

    First, what every reader must do before it trusts a stored position: carry the chain onto
    the source's timeline after a failover (:func:`.failover.follow_timeline`: the ranges past
    the switch point leave the store, a fork stops here), and make the slot the failover slot
    ``PGCDC_SLOT_FAILOVER`` asks for (:func:`~..source.slot.keep_failover`); ``told`` hears
    of a failover in a line."""
    switch = follow_timeline(settings)
    if switch is not None and told is not None:
        told(switch.line())
    keep_failover(settings.source_dsn, settings.slot, settings.slot_failover)
    store = store_of(settings)
    last = store.last_stored()
    if last is None:
        return None
    store.drop_scratch(last.range.start)
    with connect(settings.source_dsn, role="source") as conn:
        confirmed = advance_slot(conn, settings.slot, last.safe_point)
        conn.commit()
    return confirmed


class RangeDone(NamedTuple):
    """One range through the pipeline: what the store holds, what the target did with it."""

    received: RangeResult
    applied: ApplyResult


def catch_up(
    settings: ReplicationSettings,
    endpos: Lsn,
    *,
    run_step: Callable[[ApplyStored | ReceiveNext], T],
) -> Iterator[T]:
    """Run step after step until the target has caught up to ``endpos``.

    Each step comes from :func:`next_step` (the durable facts, nothing remembered here) and is
    carried out by ``run_step``: in this process (:func:`run_step_in_process`) or as a Dagster
    run of the range. A step that comes back unchanged after running made no progress (its
    run failed): that stops the loop instead of repeating it for ever.
    """
    confirm_stored(settings)
    previous: Step | None = None
    while True:
        step = next_step(settings, endpos)
        if isinstance(step, CaughtUp):
            return
        if step == previous:
            raise CatchUpStalledError(
                f"{step.describe()} ran but made no progress: see the failed run or the error "
                "above, fix its cause and run the catch-up again"
            )
        yield run_step(step)
        previous = step


def run_step_in_process(
    settings: ReplicationSettings, step: ApplyStored | ReceiveNext, spark: SparkProvider = None
) -> RangeDone:
    """Carry out one step here: receive the range if it is not stored, then apply it. The
    caller holds the range lock (a Dagster run holds it for its whole life)."""
    if isinstance(step, ReceiveNext):
        received = receive_range(settings, step.range)
        failpoint("catchup.before_apply")
    else:
        received = step.stored.manifest.result
    return RangeDone(received, apply_stored_range(settings, step.range, spark))


def run_range_in_process(
    settings: ReplicationSettings, rng: LsnRange, spark: Any = None
) -> tuple[RangeResult, ApplyResult]:
    """Receive and apply one range here, under the range lock."""
    with range_lock(settings):
        received = receive_range(settings, rng)
        applied = apply_stored_range(settings, rng, spark)
    return received, applied
