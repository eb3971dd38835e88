"""Resuming a base snapshot that was killed or failed during its copy: the tables it copied
whole are kept, the rest are copied again, each as of a consistent point of its own.

A base snapshot copies every table in its slot's exported snapshot, at the slot's consistent
point ``C1``. That snapshot dies with the process that exported it, so what a killed attempt
did not copy can never be copied at ``C1`` again. What it did copy is recorded with its rows
(:mod:`.copied_ranges`), and its slot, which the killed process does not drop, still retains
every change after ``C1``. So a resume finishes the snapshot at ``C1`` with the tables copied
whole (:func:`finish_resumed`: their keys, the sequences, the origin at ``C1``), and the
caller then copies the others again the way ``pgcdc resync`` does (a temporary slot's point
``C2``, their changes up to ``C2`` skipped).

Why this is exactly once, table by table:

* A kept table holds exactly the source's rows at ``C1``: each of its ranges was read in the
  snapshot exported at ``C1``, and committed with its record (one transaction), and its
  records tile every relation it is copied from. The chain starts at ``C1`` and the origin is
  set there, so its changes committed after ``C1`` are applied, each once, as for any table.
* Any other table is recorded as being copied again (``Chain.adding`` and ``Chain.resyncing``)
  in the same write that makes the chain complete: from then on every apply holds its changes
  back. The resync drops what the killed copy left, copies the table as of ``C2``, and records
  it synced from ``C2`` (``max(C2, origin)``, see :func:`~..control.pipeline.add_tables`):
  its changes at or before ``C2`` are in the copy and skipped, those after are applied. This
  is the argument of an added table, whose copy stands at a later point than the target's
  other tables.

A table some of whose ranges were copied is among the others, but the resync keeps those
ranges where it can: it copies the rest of its blocks at ``C2`` and copies again the rows of
every key changed in ``(C1, C2]``, which the slot, still at ``C1``, holds (:mod:`.continued`,
with its argument and what makes it copy the table whole instead).

Crash anywhere: until the chain is complete, the next snapshot finds the same kept tables and
does this again (each step keeps what exists, the origin is set again to ``C1``); after it,
the tables still to copy are a resync that any catch-up finishes. The resume is refused, and
the snapshot redone from scratch, when the slot is gone or lost, or was not created at the
recorded point (:func:`resumable`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from ..apply.origin import check_origin_rights, check_room_for, set_origin
from ..apply.sequences import sync_sequences
from ..catalog import table_columns
from ..connect import connect
from ..failpoints import failpoint
from ..identifiers import TableName, origin_name
from ..lsn import Lsn
from ..postgres_installs import release
from ..published_columns import published_shapes
from . import copied_ranges
from .common import (
    BaseSnapshotResult,
    SchemaRestoreResult,
    SnapshotError,
    TableCopyResult,
    bulk_load_facts,
)
from .copied_ranges import PartlyCopied
from .copy import plan_table_ranges
from .foreign_keys import complete as complete_foreign_keys
from .schema import copy_schema_post_data


@dataclass(frozen=True)
class Resumable:
    """A killed snapshot that can be resumed: its slot's point, and its tables split."""

    consistent_point: Lsn
    snapshot_name: str
    kept: tuple[TableName, ...]
    """Copied whole at :attr:`consistent_point`: kept as they are."""
    kept_rows: dict[TableName, int | None]
    """Each kept table's rows, as its ranges' records counted them (``None``: unknown)."""
    rest: tuple[TableName, ...]
    """Not copied, or in part: copied again, each as of a point of its own."""
    partly: dict[TableName, PartlyCopied] = field(default_factory=dict)
    """Of :attr:`rest`, those copied in part, whose copied ranges the resync keeps where it
    can (:mod:`.continued`)."""

    def line(self, slot_name: str) -> str:
        """What the resume does, in one line for the user."""
        rest = " ".join(str(t) for t in self.rest) or "none"
        partly = " ".join(str(t) for t in self.partly)
        return (
            f"an earlier base snapshot of slot {slot_name} did not finish: resuming it at "
            f"{self.consistent_point}, keeping the {len(self.kept)} table(s) it copied whole; "
            f"copying again: {rest}" + (f" (continuing {partly} from its ranges)" if partly else "")
        )


def resumable(
    source_dsn: str,
    target_dsn: str,
    slot_name: str,
    tables: Sequence[TableName],
    copying_at: Lsn,
    snapshot_name: str,
) -> Resumable | str:
    """Whether the snapshot of ``slot_name`` whose slot was created at ``copying_at`` (the
    store's :attr:`~..store.output_store.Chain.copying_at`) can be resumed for ``tables`` (the
    resolved replicated tables): the split, or why not (the snapshot is then taken again from
    scratch). Its slot must still exist, unadvanced (a slot never advances before its
    snapshot completes, so another position means another slot of that name) and not lost,
    and some table must have been copied whole, or a table in part from its own relation."""
    with connect(source_dsn, role="source", autocommit=True) as src:
        row = src.execute(
            "SELECT confirmed_flush_lsn::text, wal_status FROM pg_replication_slots "
            "WHERE slot_name = %s",
            (slot_name,),
        ).fetchone()
        if row is None:
            return "its slot is gone"
        confirmed, wal_status = row
        if wal_status == "lost":
            return "its slot was invalidated"
        if confirmed is None or Lsn.parse(confirmed) != copying_at:
            return f"its slot is not at {copying_at}, where that snapshot created it"
        relations: dict[TableName, list[TableName]] = {t: [] for t in tables}
        for rng in plan_table_ranges(src, tables, None):
            if rng.source not in relations[rng.table]:
                relations[rng.table].append(rng.source)
    with connect(target_dsn, role="target", autocommit=True) as tgt:
        _wait_for_orphaned_copies(tgt, tables)
        found = copied_ranges.copied(tgt, slot_name, copying_at, relations)
    if not found.whole and not found.partly:
        return "it copied no table whole, and no range of a table it could continue"
    rest = tuple(t for t in tables if t not in found.whole)
    return Resumable(
        copying_at, snapshot_name, tuple(sorted(found.whole)), found.whole, rest, found.partly
    )


ORPHANED_COPY_WAIT_S = 120
"""How long a resume waits for the killed attempt's copies still running on the target."""


def _wait_for_orphaned_copies(tgt: psycopg.Connection[Any], tables: Sequence[TableName]) -> None:
    """Wait until no transaction of the killed attempt still writes ``tables`` on the target,
    so the records read next are final. A range's transaction can outlive its snapshot's
    process: its ``COMMIT`` sent just before the kill, or a copier that is not in the killed
    process group (a Spark worker on another host, whose executor is only told later). No
    copy starts after the kill (the snapshot it would import died with the process that
    exported it), and one in flight holds its table's ``ROW EXCLUSIVE`` lock until it ends,
    which a ``SHARE`` lock waits for. Without this wait, such a range could commit after the
    resume read the records, and be copied again beside itself (:mod:`.continued`)."""
    on_target = table_columns(tgt, tables)
    existing = [t for t in tables if t in on_target]
    if not existing:
        return
    try:
        with tgt.transaction():
            tgt.execute(
                sql.SQL("SET LOCAL lock_timeout = {}").format(
                    sql.Literal(f"{ORPHANED_COPY_WAIT_S}s")
                )
            )
            tgt.execute(
                sql.SQL("LOCK TABLE {} IN SHARE MODE").format(
                    sql.SQL(", ").join(t.sql for t in existing)
                )
            )
    except psycopg.errors.LockNotAvailable:
        raise SnapshotError(
            f"a copy into the target's {', '.join(map(str, existing))} still runs after "
            f"{ORPHANED_COPY_WAIT_S} s (an orphaned Spark task of the killed snapshot, or another "
            "writer): end it (pg_stat_activity on the target), then run pgcdc snapshot again"
        ) from None


def _row_counts(conn: psycopg.Connection[Any], resume: Resumable) -> dict[TableName, int]:
    """Each kept table's rows: as recorded, else counted on the target (a table whose ranges
    were copied with the statistics' counters off, :data:`~.copied_ranges._ROWS_INSERTED`)."""
    known = {t: n for t, n in resume.kept_rows.items() if n is not None}
    tables = [t for t in resume.kept if t not in known]
    if not tables:
        return known
    query = sql.SQL(" UNION ALL ").join(
        sql.SQL("SELECT {}, count(*) FROM {}").format(sql.Literal(i), t.sql)
        for i, t in enumerate(tables)
    )
    counted = {tables[int(i)]: int(n) for i, n in conn.execute(query).fetchall()}
    return {**known, **counted}


def finish_resumed(
    source_dsn: str,
    target_dsn: str,
    slot_name: str,
    publication: str,
    resume: Resumable,
    *,
    sync_sequence_values: bool = True,
) -> BaseSnapshotResult:
    """Finish the snapshot at the resumed point with the kept tables: the publication as it
    must be, their keys and indexes, the foreign keys between them (valid: one point), the
    sequences and the target's origin at :attr:`Resumable.consistent_point`. The caller records
    the chain there, the other tables being copied again (module docstring). The failpoints
    are the snapshot's own, at the same steps."""
    from ..source.preflight import check_source
    from ..source.publication import ensure_publication

    started = time.perf_counter()
    origin = origin_name(slot_name)
    every = [*resume.kept, *resume.rest]
    with connect(source_dsn, role="source", autocommit=True) as src:
        resolved = check_source(src, every, free_slots_needed=0)
        source_version = release(src.info.server_version)
        ensure_publication(src, publication, resolved)
        shapes = published_shapes(src, publication, resume.kept)
    with connect(target_dsn, role="target", autocommit=True) as tgt:
        target_version = release(tgt.info.server_version)
        check_origin_rights(tgt)
        check_room_for(tgt, origin)
    failpoint("snapshot.after_copy")
    post_data = copy_schema_post_data(source_dsn, target_dsn, resume.kept, foreign_keys=False)
    complete_foreign_keys(source_dsn, target_dsn, resume.kept)
    failpoint("snapshot.after_post_data")
    sequences = sync_sequences(source_dsn, target_dsn) if sync_sequence_values else {}
    with connect(target_dsn, role="target", autocommit=True) as tgt:
        rows = _row_counts(tgt, resume)
        kept = [
            TableCopyResult(table=t, rows=rows[t], bytes=None, seconds=None, copied_by="kept")
            for t in resume.kept
        ]
        bulk_load = bulk_load_facts(tgt, kept)
    set_origin(target_dsn, origin, resume.consistent_point)
    failpoint("snapshot.after_origin")
    return BaseSnapshotResult(
        slot_name=slot_name,
        snapshot_name=resume.snapshot_name,
        consistent_point=resume.consistent_point,
        origin_name=origin,
        publication=publication,
        tables=tuple(kept),
        pre_data=SchemaRestoreResult("pre-data", (), (), (), 0.0),
        post_data=post_data,
        sequences=sequences,
        seconds=time.perf_counter() - started,
        copy_seconds=0.0,
        shapes=shapes,
        source_version=source_version,
        target_version=target_version,
        bulk_load=bulk_load,
    )
