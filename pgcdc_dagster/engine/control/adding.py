"""Adding tables to a running replication (``pgcdc add-table``), and copying replicated ones
again (``pgcdc resync``): each copied as of a consistent point of its own while the applies
hold its changes back, then those changes applied. The apply of a range finishes a resync that
was killed (:func:`.pipeline.apply_stored_range`)."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..apply.staging import drop_shared
from ..connect import connect
from ..failpoints import failpoint
from ..identifiers import TableName
from ..lsn import Lsn
from ..progress import SnapshotProgress, active, publish
from ..settings import ReplicationSettings
from ..store.output_store import (
    StoreError,
)
from .range_lock import (
    command_holder,
    range_lock_or_way,
    tables_lock,
)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from ..snapshot import AddedTablesResult
    from ..snapshot.continued import Continuing


from .positions import origin_progress, replicated_tables
from .sessions import SparkProvider, source_ddl, store_of


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
                spark_staging=settings.spark_staging,
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
        held_back_on_driver=held_back.on_driver,
        held_back_on_driver_why=held_back.on_driver_why,
        held_back_transactions=held_back.transactions,
        held_back_seconds=held_back.seconds,
    )


_UNLOCKED_PASSES = 5
"""At most this many passes of an add's held-back changes before it takes the range."""


_SHORT_PASS_S = 0.2
"""A pass shorter than this leaves a last one, with the range, of about as short."""


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
