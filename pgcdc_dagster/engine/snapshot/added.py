"""Tables added to a running replication, each copied as of a consistent point of its own.

A table the publication starts sending after the base snapshot (``ALTER PUBLICATION ... ADD
TABLE``, or this module itself) has changes in the stream and no rows on the target. Its rows
are copied here as native logical replication's table sync copies them: in the exported
snapshot of a temporary slot created now, whose consistent point ``X`` splits the table's
history. Its changes committed at or before ``X`` are in the copy; those after ``X`` arrive
through the chain's own slot, since the table is in the publication before the temporary slot
exists. The copy runs without the range: the applies hold the table's changes back meanwhile,
and the caller (:func:`~..control.pipeline.add_tables`) then applies those past ``X`` with the
range.

Foreign keys from or to the added tables are created ``NOT VALID``: the copy stands at ``X``,
the target's other tables at its origin (see :mod:`.foreign_keys`); the cutover validates them.

Crash anywhere: the tables are recorded as being added (``Chain.adding``, through ``begin``)
before the target changes, and as added by the caller once their held-back changes are
applied. Until then every apply holds their changes back; the next add copies them again,
truncating what the killed one left. The temporary slot goes with its connection, however
that ends.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from psycopg import sql

from ..apply.sequences import sync_sequences
from ..connect import connect
from ..failpoints import failpoint
from ..identifiers import TableName
from ..lsn import Lsn
from ..progress import CopyWatcher
from ..published_columns import PublishedShape
from .base import copy_published, populated_tables, start_spark_if_needed
from .common import (
    DEFAULT_DRIVER_MAX_ROWS,
    SchemaRestoreResult,
    TableCopyResult,
    TargetNotEmptyError,
    spark_app_of,
)
from .continued import Continuing, continuation, copy_touched, delete_touched, ranges_of
from .foreign_keys import AddedKeys, add_not_valid, drop_incoming
from .schema import copy_schema_post_data

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from ..spark.executors import SparkApp


@dataclass(frozen=True)
class AddedTablesResult:
    """What an add copied, and the consistent point its copy stands at."""

    tables: tuple[TableCopyResult, ...]
    consistent_point: Lsn
    shapes: dict[TableName, PublishedShape]
    pre_data: SchemaRestoreResult
    post_data: SchemaRestoreResult
    foreign_keys: AddedKeys
    not_null_dropped: tuple[str, ...]
    seconds: float
    held_back: int = 0
    """The tables' changes the applies held back while they were copied, applied after."""
    held_back_with_range: int = 0
    """Of ``held_back``, those applied in the last pass, with the range (a follow made way for
    it); the others were applied beside the applies."""
    held_back_passes: int = 0
    """Passes over the held-back changes, the last one with the range."""
    held_back_on_spark: int = 0
    """Ranges whose held-back changes Spark's workers compacted and staged."""
    held_back_on_driver: int = 0
    """Ranges big enough for Spark whose held-back changes this process staged instead: the
    executors could not read the store (``held_back_on_driver_why`` says what they met)."""
    held_back_on_driver_why: str | None = None
    held_back_transactions: int = 0
    """Target transactions the held-back changes were applied in (consecutive ranges'
    together)."""
    held_back_seconds: float = 0.0
    """Time spent applying them, over every pass."""
    continued: tuple[str, ...] = ()
    """What became of the tables a killed snapshot copied in part, a line each
    (:mod:`.continued`)."""

    @property
    def rows(self) -> int:
        return sum(t.rows for t in self.tables)

    @property
    def spark_app(self) -> SparkApp | None:
        return spark_app_of(self.tables)


def _drop(target_dsn: str, tables: Sequence[TableName]) -> None:
    """Drop ``tables`` on the target, with the foreign keys other tables have to them: a
    resync creates them again from the source's definition."""
    if not tables:
        return
    with connect(target_dsn, role="target") as tgt:
        drop_incoming(tgt, tables)
        for table in tables:
            tgt.execute(sql.SQL("DROP TABLE {}").format(table.sql))
        tgt.commit()


def temporary_slot_name(slot_name: str) -> str:
    """The add's own slot: temporary, named after the chain's slot and this process."""
    return f"{slot_name[:40]}_add_{os.getpid()}"


def add_tables(
    source_dsn: str,
    target_dsn: str,
    slot_name: str,
    publication: str,
    tables: Sequence[TableName],
    *,
    spark: SparkSession | Callable[[], SparkSession],
    redo: Collection[TableName],
    replicated: Sequence[TableName],
    begin: Callable[[Sequence[TableName]], None],
    driver_max_rows: int = DEFAULT_DRIVER_MAX_ROWS,
    resync: bool = False,
    continuing: Continuing | None = None,
    range_options: Mapping[str, Any] | None = None,
) -> AddedTablesResult:
    """Copy ``tables`` (schema, rows, keys) onto the target as of a new consistent point, with
    ``publication`` extended to send them first.

    ``redo``: tables an earlier add left unfinished; their rows on the target are truncated
    before the copy. Any other table that holds rows on the target is refused (an added table
    is copied whole), before anything changes. ``replicated``: the tables replicated already
    (a foreign key between an added table and one of them is created ``NOT VALID``; to any
    other, skipped). ``begin`` is called with the resolved tables once the guards passed and
    before anything changes (the caller records them as being added there, after which no
    apply writes them: it waits for an apply in flight that could).

    ``resync``: the tables are replicated already and are copied again (``pgcdc resync``):
    their rows on the target may be there, and each table is dropped and created again from
    the source's definition as of the new consistent point (the source's DDL it may not have
    followed included), its foreign keys from other tables too. ``continuing``: of those,
    tables a killed base snapshot copied in part, whose copied block ranges are kept where
    they can be (:mod:`.continued`; the others are copied whole as the rest).
    ``range_options``: how the copy cuts tables (``parallelism``, ``target_rows_per_task``,
    ``fine_ranges``: see :func:`~.scheduling.copy_tables`)."""
    from ..source.preflight import check_source
    from ..source.publication import ensure_publication
    from ..source.slot import create_slot_with_snapshot

    started = time.perf_counter()
    with connect(source_dsn, role="source", autocommit=True) as src:
        resolved = check_source(src, tables, free_slots_needed=1)
    with connect(target_dsn, role="target", autocommit=True) as tgt:
        existing, populated = populated_tables(tgt, resolved)
    held = [t for t in populated if t not in redo and not resync]
    if held:
        names = ", ".join(str(t) for t in held)
        raise TargetNotEmptyError(
            f"target table(s) {names} already hold rows: a table already replicated needs no "
            "adding, and an added table is copied whole; if those rows are not the replica's, "
            "empty the table(s) on the target (TRUNCATE ...) and add again"
        )
    begin(resolved)
    failpoint("add.after_begin")
    with connect(target_dsn, role="target", autocommit=True) as tgt:
        # Again, past ``begin``: an apply that read the chain before it (a table published by
        # hand streams already) may have written one since the guard; ``begin`` waited for it.
        existing, populated = populated_tables(tgt, resolved)
    kept = set(continuing.tables) if continuing is not None else set()
    if resync and existing:
        _drop(target_dsn, [t for t in existing if t not in kept])
        existing, populated = [t for t in existing if t in kept], []
    if populated:  # what a killed add copied, or such an apply wrote
        with connect(target_dsn, role="target") as tgt:
            drop_incoming(tgt, populated)
            tgt.execute(sql.SQL("TRUNCATE {}").format(sql.SQL(", ").join(t.sql for t in populated)))
            tgt.commit()
    with connect(source_dsn, role="source", autocommit=True) as src:
        ensure_publication(src, publication, resolved)
        spark = start_spark_if_needed(
            src, resolved, spark, driver_max_rows, {"source": source_dsn, "target": target_dsn}
        )

    # A big table copies for hours beside the applies: the same live progress as a snapshot's
    # (the command line's display, the run's log lines).
    progress = CopyWatcher(
        source_dsn,
        target_dsn,
        resolved,
        time.monotonic() - (time.perf_counter() - started),
        work="resync" if resync else "add-table",
    )
    with create_slot_with_snapshot(
        source_dsn, temporary_slot_name(slot_name), temporary=True
    ) as exported:
        slot = exported.slot
        if continuing is not None and continuing.tables:
            names = " ".join(str(t) for t in continuing.tables)
            progress.note("changed keys", f"reading those of {names} since its copy, from the slot")
        with continuation(
            source_dsn,
            target_dsn,
            slot_name,
            publication,
            continuing,
            slot.snapshot_name,
            slot.consistent_point,
        ) as continued:
            _drop(target_dsn, list(continued.whole))
            if continued.kept:
                progress.note(
                    "kept rows",
                    f"deleting those of the keys {continued.changes:,} change(s) touched",
                )
            delete_touched(continued)
            failpoint("continue.after_delete")
            schema, copies, _ = copy_published(
                spark,
                source_dsn,
                target_dsn,
                publication,
                resolved,
                slot.snapshot_name,
                progress,
                existing=[t for t in existing if t not in continued.whole],
                driver_max_rows=driver_max_rows,
                kept_blocks=continued.blocks(),
                **(range_options or {}),
            )
            if continued.kept:
                progress.note("changed rows", "copying those in the kept blocks again")
            ranges = ranges_of(source_dsn, list(continued.kept), slot.snapshot_name, schema.shapes)
            recopied = copy_touched(source_dsn, continued, slot.snapshot_name, ranges)
        copies = [
            dataclasses.replace(
                c, rows=c.rows + recopied[c.table], kept_rows=continued.kept[c.table].rows
            )
            if c.table in recopied
            else c
            for c in copies
        ]
    progress.phase("keys")
    post_data = copy_schema_post_data(source_dsn, target_dsn, resolved, foreign_keys=False)
    foreign_keys = add_not_valid(source_dsn, target_dsn, resolved, replicated)
    sync_sequences(source_dsn, target_dsn)
    progress.phase("done")
    failpoint("add.after_copy")
    return AddedTablesResult(
        continued=continued.lines(recopied),
        tables=tuple(copies),
        consistent_point=slot.consistent_point,
        shapes=schema.shapes,
        pre_data=schema.pre_data,
        post_data=post_data,
        foreign_keys=foreign_keys,
        not_null_dropped=schema.not_null_dropped,
        seconds=time.perf_counter() - started,
    )
