"""The base snapshot as a step: the copy, then a new chain of ranges in the store at its
consistent point, crash-safe in the chain record; a killed snapshot resumed, or redone."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..connect import connect
from ..settings import ReplicationSettings
from ..source.failover import failover_readiness
from ..source.timeline import identify_system
from ..store.output_store import (
    SNAPSHOT_IN_PROGRESS,
    Chain,
)
from .range_lock import (
    command_holder,
    tables_lock,
)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from ..snapshot import BaseSnapshotResult
    from ..snapshot.common import SchemaRestoreResult
    from ..snapshot.resume import Resumable


from .adding import resync_tables
from .sessions import range_lock, store_of


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
                    export_store=settings.snapshot_export,
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
