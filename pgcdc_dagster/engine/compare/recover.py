"""Recovering a replication whose slot was lost (invalidated, or dropped), without copying every
row again: the target is compared with the source at a new slot's point, chunk by chunk, and
only the chunks that differ are copied (``pgcdc recover``).

A lost slot means the source removed WAL the replication had not read: the changes between
what the target applied and the source's present are gone from the stream. A new base snapshot
would empty every target table and copy it whole, leaving the target unusable meanwhile. But
the target still holds every row it had, and most of them are still the source's.

Why it ends exactly as a base snapshot at the new point would:

1. Under the range (:func:`~.range_lock.range_lock_or_way`), nothing applies: the target
   stands still for the whole recovery.
2. The chain is marked :data:`~..store.output_store.RECOVERING`, durably, before the slot is
   touched: from here catch-up refuses to run, and only a recovery ends this state.
3. The lost slot is dropped and created again, under its name, exporting the snapshot of its
   consistent point ``C2``: the snapshot sees exactly the transactions committed before
   ``C2``, and the slot streams exactly those committed after it (the base snapshot's rule).
4. Every replicated table is compared between the source at ``C2`` and the still target
   (:func:`~.verify.compare_pair`): per chunk a row count and two sums of the rows' hashes
   (:mod:`.chunks`). Each chunk that differs is replaced in one target transaction of its own
   with the source's rows of it at ``C2`` (:func:`~.repair.replace_chunks`). The target then
   holds every replicated table as the source held it at ``C2``.
5. The origin is set to ``C2``, then the chain is recorded complete at ``C2``
   (:meth:`~..store.output_store.OutputStore.record_chain`), as the base snapshot's last two
   steps. The follow goes on from ``C2``: every transaction after it once, none before it.

Crash anywhere: before step 5 ends, the chain says ``recovering`` and the next ``pgcdc
recover`` starts again from step 3 with a new slot at ``C3``: chunks already replaced hold
the source's rows at ``C2``, the rest the old ones; the compare at ``C3`` finds every chunk
that differs from ``C3``, whatever it holds, and the origin (even if a killed recovery set it
to ``C2``) is set to ``C3``. A chunk's transaction commits whole or not at all. The stored
ranges of the old chain stay as history: they end before ``C2``.

What it does not do: a table whose columns differ between the sides (DDL while the slot was
lost) is named with the fix, and nothing is changed; a table missing on the target likewise.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..apply.origin import set_origin
from ..catalog import table_columns
from ..connect import connect
from ..control import pipeline
from ..control.failover import follow_timeline, forked, record_present_timeline
from ..control.range_lock import range_lock_or_way
from ..errors import PgcdcError
from ..failpoints import failpoint
from ..identifiers import TableName
from ..lsn import Lsn
from ..published_columns import published_shapes
from ..settings import ReplicationSettings
from ..snapshot.common import snapshot_transaction
from ..source.slot import SlotError, create_slot_with_snapshot, drop_slot, read_slot
from ..store.output_store import RECOVERING
from .consistent_pair import ConsistentPair, export_snapshot
from .repair import RepairedChunk, replace_chunks
from .verify import DEFAULT_CHUNK_ROWS, TableComparison, compare_pair


class RecoverError(PgcdcError):
    """A recovery that cannot or need not run: the problem and the fix, in one line."""


@dataclass(frozen=True)
class RecoverResult:
    point: Lsn
    """``C2``: the new slot's consistent point, where the target now stands."""
    applied_before: Lsn | None
    """What the target had applied when the slot was lost (its origin before)."""
    tables: tuple[TableComparison, ...]
    """Each replicated table compared at ``C2``, before its chunks were replaced."""
    repaired: tuple[RepairedChunk, ...]
    compare_seconds: float
    repair_seconds: float
    seconds: float
    made_way_by: str | None

    @property
    def chunks_compared(self) -> int:
        return sum(c.chunks for c in self.tables)

    @property
    def rows_copied(self) -> int:
        return sum(c.copied for c in self.repaired)


def slot_lost(settings: ReplicationSettings) -> str | None:
    """Why the slot cannot be used, in a line; ``None``: it is usable. Lost: invalidated,
    missing, confirmed past what the store holds (its changes since were consumed elsewhere),
    or a failover left the target ahead of the source (:func:`.failover.forked`).

    The slot is read before the store's chain: a follow stores a range before it confirms the
    slot past it, so a chain read after the slot ends at or past the slot's position unless
    changes really went missing."""
    with connect(settings.source_dsn, role="source") as conn:
        try:
            confirmed = read_slot(conn, settings.slot).confirmed_flush_lsn
        except SlotError as exc:
            return str(exc)
    store = pipeline.store_of(settings)
    chain = store.chain()
    if confirmed is not None and chain is not None and chain.complete:
        end = store.chain_end()
        if confirmed > end:
            return (
                f"replication slot {settings.slot} is confirmed up to {confirmed}, past "
                f"{end}, where the output store's ranges end: the changes between were "
                "consumed elsewhere (another consumer of the slot, a store deleted or restored "
                "from an older copy); run pgcdc recover, which compares the target with the "
                "source and copies what differs"
            )
    return forked(settings)


def recovery_needed(settings: ReplicationSettings) -> str | None:
    """Why a recovery must run now, in a line: the slot of a complete chain is lost, or a
    recovery did not finish (the chain says ``recovering``); ``None`` otherwise (no chain, a
    snapshot under way, a finished replication, a usable slot). The slot sensor asks this
    each tick, to run the ``recover`` job by itself where ``PGCDC_AUTO_RECOVER`` allows it."""
    chain = pipeline.store_of(settings).chain()
    if chain is None or chain.finished or chain.slot != settings.slot:
        return None
    if chain.state == RECOVERING:
        return f"a recovery of slot {settings.slot} (started {chain.started_at}) did not finish"
    if not chain.complete:
        return None
    return slot_lost(settings)


def recover(
    settings: ReplicationSettings,
    holder: str,
    *,
    wait_s: float = 120.0,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    workers: int | None = None,
    say: Callable[[str], None] | None = None,
) -> RecoverResult:
    """Recover the replication of a lost slot (see the module docstring); ``say`` is told each
    step's progress in a line."""
    started = time.monotonic()
    tell = say or (lambda _line: None)
    store = pipeline.store_of(settings)
    chain = store.chain()
    if chain is None or chain.consistent_point is None:
        raise RecoverError(
            f"no base snapshot of slot {settings.slot} in the output store {store.root}: there "
            "is nothing to recover; take one (pgcdc snapshot)"
        )
    if chain.finished:
        raise RecoverError(chain.finished)
    with range_lock_or_way(settings.target_dsn, settings.slot, holder, wait_s) as lock:
        lost = slot_lost(settings)
        if lost is None and chain.state != RECOVERING:
            raise RecoverError(
                f"replication slot {settings.slot} is not lost: there is nothing to recover "
                "(pgcdc verify --repair mends a target that drifted)"
            )
        tables = sorted({*chain.tables, *chain.adding})
        _check_comparable(settings, tables)
        applied_before = pipeline.origin_progress(settings)
        switch = follow_timeline(settings, recovering=True)
        store.begin_recovering()
        tell(f"recovering slot {settings.slot}: {lost or 'a recovery did not finish'}")
        if switch is not None:
            tell(switch.line())
        failpoint("recover.after_begin")
        system = record_present_timeline(settings)
        with contextlib.ExitStack() as held:
            src = held.enter_context(connect(settings.source_dsn, role="source"))
            tgt = held.enter_context(connect(settings.target_dsn, role="target"))
            with connect(settings.source_dsn, role="source", autocommit=True) as dropping:
                drop_slot(dropping, settings.slot, wait_seconds=10.0)
            with create_slot_with_snapshot(
                settings.source_dsn, settings.slot, failover=settings.slot_failover
            ) as exported:
                point = exported.slot.consistent_point
                snapshot_name = exported.slot.snapshot_name
                held.enter_context(snapshot_transaction(src, snapshot_name))
                source_snapshot = export_snapshot(src)
            tell(f"new slot {settings.slot} at {point}; comparing {len(tables)} table(s)")
            with snapshot_transaction(tgt, None):
                pair = ConsistentPair(
                    point, source_snapshot, export_snapshot(tgt), applied_before, 0, None
                )
                compared_at = time.monotonic()
                found = compare_pair(
                    settings,
                    pair,
                    tables,
                    chunk_rows=chunk_rows,
                    workers=workers,
                    progressed=lambda progress: tell(progress.line()),
                    work="recover",
                )
                compare_s = time.monotonic() - compared_at
            differing = [(c, d) for c in found for d in c.differing if c.plan is not None]
            tell(
                f"compared {sum(c.chunks for c in found)} chunk(s) in {compare_s:.1f} s: "
                f"{len(differing)} differ"
            )
            repair_started = time.monotonic()

            def replaced(done: int, chunk: RepairedChunk) -> None:
                tell(f"replaced {done}/{len(differing)}: {chunk.table} {chunk.where}")
                failpoint("recover.after_chunk")

            repaired = replace_chunks(
                settings,
                source_snapshot,
                differing,
                workers=workers,
                replaced=replaced,
                work="recover",
            )
            repair_s = time.monotonic() - repair_started
            shapes = published_shapes(src, settings.publication, tables)
        set_origin(settings.target_dsn, settings.origin, point)
        failpoint("recover.after_origin")
        store.record_chain(
            settings.slot,
            point,
            snapshot_name,
            tables,
            shapes,
            timeline=system.timeline,
            system_id=system.system_id,
        )
        made_way_by = lock.made_way_by
    return RecoverResult(
        point,
        applied_before,
        tuple(found),
        tuple(repaired),
        compare_s,
        repair_s,
        time.monotonic() - started,
        made_way_by,
    )


def _check_comparable(settings: ReplicationSettings, tables: Sequence[TableName]) -> None:
    """Every replicated table on the target, with the source's columns: else the compare
    cannot say which rows differ, and nothing is changed."""
    with (
        connect(settings.source_dsn, role="source", autocommit=True) as src,
        connect(settings.target_dsn, role="target", autocommit=True) as tgt,
    ):
        theirs = table_columns(tgt, tables)
        ours = table_columns(src, tables)
        shapes = published_shapes(src, settings.publication, tables)
    for table in tables:
        if table not in ours:
            continue  # dropped on the source: the chain's tables say what was copied
        if table not in theirs:
            raise RecoverError(
                f"table {table} is replicated but missing on the target: restore it there, or "
                "take a new base snapshot (pgcdc snapshot --resnapshot)"
            )
        left_out = set(shapes[table].unpublished) if table in shapes else set()
        source_names = {c.name for c in ours[table]} - left_out
        target_names = {c.name for c in theirs[table]}
        if missing := sorted(source_names - target_names):
            raise RecoverError(
                f"table {table} has column(s) {', '.join(missing)} on the source that the "
                "target lacks (DDL while the slot was lost): add them on the target, then run "
                "pgcdc recover again"
            )
