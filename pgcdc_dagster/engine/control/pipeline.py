"""The replication stages as plain functions: snapshot, plan, receive, apply, verify, status.

Like pgcopydb's commands, each stage can run on its own (from an asset, the sensor, the CLI or
a test) and finds its position in the three durable places that own progress: the source slot
(what has been stored), the output store (what each range holds, and where the current chain
of ranges begins), the target's replication origin (what has been applied). Nothing here keeps
state of its own, and nothing here knows Dagster.

The catch-up lives here (a range's order, receive, apply, the next step and the loop); the
other steps each have a module of their own beside it, and every name is re-exported here, the
list of what a caller (an asset, the sensor, the CLI) can ask the engine to do: the base
snapshot (:mod:`.snapshot_step`), adding and resyncing tables (:mod:`.adding`), where a
replication stands (:mod:`.positions`), whether the replicated and published tables agree
(:mod:`.agreement`), and what every step opens (:mod:`.sessions`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from ..apply.ddl import ResyncNeeded
from ..apply.xid_bounds import record_if_due
from ..connect import connect, server_errors
from ..errors import PgcdcError
from ..failpoints import failpoint
from ..identifiers import TableName
from ..lsn import Lsn, LsnRange
from ..settings import ReplicationSettings
from ..source.peek import receive
from ..source.slot import advance_slot, keep_failover
from ..store.chain import Chain
from ..store.output_store import (
    OutputStore,
    RangeResult,
    StoredRange,
)
from ..store.retention import prune_if_due
from .adding import add_tables, resync_tables
from .agreement import (
    Reshaped,
    TablesAgreement,
    added_beyond,
    adding_not_done,
    no_longer_published,
    refuse_while_adding,
    tables_agreement,
)
from .failover import follow_timeline
from .next_step import ApplyStored, CaughtUp, ReceiveNext, Step, decide, plan_next_range
from .positions import (
    SourcePositions,
    expected_origin_progress,
    origin_progress,
    replicated_tables,
    resolve_endpos,
    server_versions,
    source_positions,
    source_row_estimates,
)
from .range_lock import (
    RangeBusyError,
    tables_changing,
)
from .sessions import (
    SparkProvider,
    decoding_session,
    range_lock,
    source_ddl,
    source_session,
    store_of,
)
from .snapshot_step import snapshot_resume, take_snapshot

if TYPE_CHECKING:
    import psycopg

    from ..apply.results import ApplyResult
    from ..catalog import ColumnInfo


T = TypeVar("T")


__all__ = [
    "RangeBusyError",
    "Reshaped",
    "SourcePositions",
    "SparkProvider",
    "TablesAgreement",
    "add_tables",
    "added_beyond",
    "adding_not_done",
    "decoding_session",
    "expected_origin_progress",
    "no_longer_published",
    "origin_progress",
    "plan_next_range",
    "range_lock",
    "refuse_while_adding",
    "replicated_tables",
    "resolve_endpos",
    "resync_tables",
    "server_versions",
    "snapshot_resume",
    "source_ddl",
    "source_positions",
    "source_row_estimates",
    "source_session",
    "store_of",
    "tables_agreement",
    "take_snapshot",
]


class RangeOrderError(PgcdcError):
    """A range was asked for out of order: running it would lose or repeat changes."""


class CatchUpStalledError(PgcdcError):
    """A step ran but the durable facts did not move: running it again would loop."""


# -- snapshot ---------------------------------------------------------------------------------


# -- positions and planning -------------------------------------------------------------------


def check_range_order(store: OutputStore, rng: LsnRange) -> None:
    """A range may run only right after the last stored range of the chain (or first)."""
    chain = store.complete_chain()
    consistent_point = chain.consistent_point
    assert consistent_point is not None
    if rng.start < consistent_point:
        raise RangeOrderError(
            f"range {rng.key} starts at {rng.start}, before the current base snapshot's "
            f"consistent point {consistent_point}: it belongs to an earlier snapshot and is kept "
            "as history only; it is never re-applied"
        )
    if store.get(rng) is not None:
        return  # re-running a stored range: receive and apply are both idempotent
    pruned = chain.pruned_through
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
    chain = store_of(settings).chain()  # read once for both, unless a resync changes it
    resumed = _resume_resync(settings, spark, chain) + _reconcile_due(settings, spark)
    try:
        applied = _apply_stored(settings, rng, spark, conn, None if resumed else chain)
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


def _resume_resync(
    settings: ReplicationSettings, spark: SparkProvider, chain: Chain | None
) -> list[str]:
    """Finish a resync that was killed (its tables still in ``chain``'s
    :attr:`~..store.output_store.Chain.resyncing`, their changes held back), unless one runs now or
    ``PGCDC_DDL=strict``: the next catch-up converges by itself. The caller holds the range. One
    line per table copied."""
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


def _apply_stored(
    settings: ReplicationSettings,
    rng: LsnRange,
    spark: SparkProvider,
    conn: psycopg.Connection[Any] | None,
    chain: Chain | None = None,
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
            spark_staging=settings.spark_staging,
            chain=chain,
            synchronous_commit=settings.apply_synchronous_commit,
        )
    if applied.renamed_tables:
        store.record_renamed(applied.renamed_tables)
    replay = Lsn.parse(applied.replay_lsn) if applied.replay_lsn else None

    def durable() -> Lsn | None:
        with server_errors("target", settings.target_dsn):
            return origin_progress(settings, durable=True)

    prune_if_due(store, durable, settings.store_retention)
    record_if_due(settings.source_dsn, settings.target_dsn, settings.slot, replay)
    return applied


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
