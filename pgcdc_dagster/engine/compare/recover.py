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
4. Every replicated table with a primary key takes the fast path where a transaction-id bound
   recorded at or before the target's position can be trusted (:mod:`.changed_since`, with the
   argument): the rows written since the bound are copied again, and the keys deleted since
   are found by a compare of keys only. Every other table (named, with the reason) is
   compared between the source at ``C2`` and the still target (:func:`~.verify.compare_pair`):
   per chunk a row count and two sums of the rows' hashes (:mod:`.chunks`). Each chunk that
   differs is replaced in one target transaction of its own with the source's rows of it at
   ``C2`` (:func:`~.repair.replace_chunks`). The target then holds every replicated table as
   the source held it at ``C2``. A bound is read before the new slot is created, and recorded
   with the origin: the next recovery's.
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
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..apply.origin import set_origin
from ..apply.xid_bounds import (
    XidBound,
    bound_for,
    forget_bounds,
    read_bound_of,
    record_bound_at,
)
from ..catalog import table_columns
from ..connect import connect
from ..control import pipeline
from ..control.failover import follow_timeline, forked, record_present_timeline
from ..control.head_start import Background, offer
from ..control.range_lock import command_holder, range_lock_or_way
from ..errors import PgcdcError
from ..failpoints import failpoint
from ..identifiers import TableName
from ..lsn import Lsn
from ..published_columns import published_shapes
from ..settings import ReplicationSettings
from ..snapshot.common import snapshot_transaction
from ..source.slot import SlotError, create_slot_with_snapshot, drop_slot, read_slot
from ..store.output_store import RECOVERING
from .changed_since import KeyedTable, TableChanges, bound_unusable, recover_changed
from .chunks import primary_key, same_text_hash
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
    changed: tuple[TableChanges, ...] = ()
    """Each table the fast path took (:mod:`.changed_since`)."""
    fallback: tuple[tuple[TableName, str], ...] = ()
    """Each table compared chunk by chunk instead, and why."""
    bound: str | None = None
    """The transaction-id bound the fast path used (``W``, ``X``), or why none could serve."""
    changed_seconds: float = 0.0

    @property
    def chunks_compared(self) -> int:
        return sum(c.chunks for c in self.tables)

    @property
    def rows_copied(self) -> int:
        return sum(c.copied for c in self.repaired) + self.rows_changed

    @property
    def rows_changed(self) -> int:
        """Rows copied again by the fast path: written since the bound."""
        return sum(c.rows_copied for c in self.changed)

    @property
    def keys_deleted(self) -> int:
        return sum(c.keys_deleted for c in self.changed)

    @property
    def mb_copied(self) -> float:
        return round(sum(c.bytes_copied for c in self.changed) / 1e6, 3)


class RecoverHeadStart(Background[RecoverResult]):
    """A recovery ``pgcdc recover`` starts before Dagster is imported, under the range lock it
    lends its run (:mod:`..control.head_start`); the run adopts it and logs what it said.
    Why: importing Dagster and creating the run cost the command as long as a recovery's
    fast path may take (``benchmarks/README.md``, "A lost slot")."""

    def __init__(
        self, settings: ReplicationSettings, *, wait_s: float, chunk_rows: int, every_row: bool
    ) -> None:
        self.said: list[str] = []
        super().__init__(
            lambda: recover(
                settings,
                command_holder("recover"),
                wait_s=wait_s,
                chunk_rows=chunk_rows,
                every_row=every_row,
                say=self.said.append,
            ),
            name="pgcdc-recover",
        )


def head_start(
    settings: ReplicationSettings, *, wait_s: float, chunk_rows: int, every_row: bool
) -> RecoverHeadStart:
    """Start the recovery now, for this process's run to adopt (``adopt("recover", slot)``);
    the caller holds the range lock, lent."""
    work = RecoverHeadStart(settings, wait_s=wait_s, chunk_rows=chunk_rows, every_row=every_row)
    offer("recover", settings.slot, work)
    return work


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
    every_row: bool = False,
    say: Callable[[str], None] | None = None,
) -> RecoverResult:
    """Recover the replication of a lost slot (see the module docstring); ``say`` is told each
    step's progress in a line. ``every_row``: no fast path, every table compared chunk by
    chunk (a target that may have been written to)."""
    started = time.monotonic()
    tell = say or (lambda _line: None)
    store = pipeline.store_of(settings)
    chain = store.chain()
    if chain is None or chain.consistent_point is None:
        raise RecoverError(
            f"no base snapshot of slot {settings.slot} in the output store {store.where}: there "
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
        if switch is not None and switch.forked:
            forget_bounds(settings.target_dsn, settings.slot)  # no fast path on a fork
        store.begin_recovering()
        tell(f"recovering slot {settings.slot}: {lost or 'a recovery did not finish'}")
        if switch is not None:
            tell(switch.line())
        failpoint("recover.after_begin")
        system = record_present_timeline(settings)
        prior = (
            "every row compared, as asked (--every-row)"
            if every_row
            else _prior_bound(settings, applied_before)
        )
        with contextlib.ExitStack() as held:
            src = held.enter_context(connect(settings.source_dsn, role="source"))
            tgt = held.enter_context(connect(settings.target_dsn, role="target"))
            with connect(settings.source_dsn, role="source", autocommit=True) as dropping:
                drop_slot(dropping, settings.slot, wait_seconds=10.0)
            next_bound = read_bound_of(settings.source_dsn)  # before the slot: W <= C2
            with create_slot_with_snapshot(
                settings.source_dsn, settings.slot, failover=settings.slot_failover
            ) as exported:
                point = exported.slot.consistent_point
                snapshot_name = exported.slot.snapshot_name
                held.enter_context(snapshot_transaction(src, snapshot_name))
                source_snapshot = export_snapshot(src)
            fast, fallback, why_not = _fast_tables(settings, src, tables, chain.adding, prior)
            text_hash = same_text_hash(src, tgt)
            tgt.commit()  # the probe's transaction: the target's snapshot comes after the copy
            tell(f"new slot {settings.slot} at {point}; {why_not or _describe(prior)}")
            changed_at = time.monotonic()
            changed: list[TableChanges] = []
            if fast and isinstance(prior, XidBound):
                tell(f"copying the rows changed since {_describe(prior)} in {len(fast)} table(s)")
                changed = recover_changed(
                    settings,
                    source_snapshot,
                    fast,
                    prior,
                    text_hash=text_hash,
                    workers=workers or os.cpu_count() or 1,
                    say=tell,
                )
                fallback += [(c.table, c.fallback) for c in changed if c.fallback]
            changed_s = time.monotonic() - changed_at
            compared = [t for t, _ in fallback]
            if compared:
                tell(
                    f"comparing {len(compared)} table(s) chunk by chunk: "
                    + "; ".join(f"{t} ({why})" for t, why in fallback)
                )
            with snapshot_transaction(tgt, None):
                pair = ConsistentPair(
                    point, source_snapshot, export_snapshot(tgt), applied_before, 0, None
                )
                compared_at = time.monotonic()
                found = compare_pair(
                    settings,
                    pair,
                    compared,
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
        record_bound_at(settings.target_dsn, settings.slot, next_bound, point)
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
        tuple(changed),
        tuple(fallback),
        why_not or _describe(prior),
        changed_s,
    )


def _prior_bound(settings: ReplicationSettings, applied: Lsn | None) -> XidBound | str:
    """The bound the fast path may use (:mod:`.changed_since`), or why there is none: read
    before the slot is touched, from the target, at its position ``applied``."""
    if applied is None:
        return "the target has no replication origin progress"
    with connect(settings.target_dsn, role="target", autocommit=True) as tgt:
        bound = bound_for(tgt, settings.slot, applied)
    if bound is not None:
        return bound
    return (
        f"no transaction-id bound recorded at or before the target's position {applied} (a "
        "base snapshot, each applying process and each recovery record one; a fork removes them)"
    )


def _fast_tables(
    settings: ReplicationSettings,
    src: Any,
    tables: Sequence[TableName],
    adding: Sequence[TableName],
    prior: XidBound | str,
) -> tuple[list[KeyedTable], list[tuple[TableName, str]], str | None]:
    """The tables the fast path takes, those it does not (each with why), and why it takes
    none (``None``: the bound serves). ``src`` is in the new slot's snapshot."""
    if isinstance(prior, str):
        return [], [(t, "no usable bound") for t in tables], prior
    with connect(settings.source_dsn, role="source", autocommit=True) as now:
        unusable = bound_unusable(now, prior, settings.source_dsn)
    if unusable is not None:
        return [], [(t, "no usable bound") for t in tables], unusable
    columns = table_columns(src, tables)
    shapes = published_shapes(src, settings.publication, tables)
    fast: list[KeyedTable] = []
    fallback: list[tuple[TableName, str]] = []
    for table in tables:
        if table not in columns:
            fallback.append((table, "not on the source"))
            continue
        if table in adding:
            fallback.append((table, "being added (pgcdc add-table)"))
            continue
        key, integer = primary_key(src, table)
        if not key:
            fallback.append((table, "no primary key"))
            continue
        shape = shapes.get(table)
        left_out = set(shape.unpublished) if shape else set()
        fast.append(
            KeyedTable(
                table,
                tuple(c.name for c in columns[table] if c.name not in left_out),
                key,
                shape.row_filter if shape else None,
                integer,
            )
        )
    return fast, fallback, None


def _describe(bound: XidBound | str) -> str:
    if isinstance(bound, str):
        return bound
    return f"the bound (WAL {bound.wal}, transaction {bound.oldest_xid})"


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
