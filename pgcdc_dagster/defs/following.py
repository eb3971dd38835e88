"""The Dagster side of a follower: every range it takes, recorded as a per-range run would.

A follower (:mod:`pgcdc_dagster.engine.follow`) receives and applies inside one long-lived run;
this turns each range it finishes into the events a per-range run records (its ``lsn_ranges``
partition, the ``decoded_changes`` and target-table materialisations with the same metadata,
the blocking ``no_gap`` evaluation), as they happen. The events are *yielded*: an op's
``context.log_event`` only reaches the event log when the op yields or returns, which for a
run that follows for hours would be never.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from dagster import AssetCheckEvaluation, AssetMaterialization, AssetObservation, Failure
from dagster._core.errors import DagsterExecutionInterruptedError

from ..engine import pipeline
from ..engine.failpoints import failpoint
from ..engine.follow import Follower, Following, FollowSummary, adopt
from ..engine.identifiers import TableName
from ..engine.lsn import Lsn, LsnRange
from .keys import DECODED_CHANGES_KEY, target_key
from .progress_log import logged
from .range_events import no_gap_evaluation, range_events, register_range
from .row_counts import TargetRowCounts

INTERRUPTS = (KeyboardInterrupt, DagsterExecutionInterruptedError)
"""What a stop of the run looks like inside it: SIGINT, or Dagster's termination."""


def follow_events(
    context: Any,
    settings: pipeline.ReplicationSettings,
    tables: Sequence[TableName],
    follower: Following,
) -> Iterator[AssetMaterialization | AssetCheckEvaluation | AssetObservation]:
    """Run ``follower`` (this run holds the range lock) and yield each range's events as soon
    as the range is applied. A failed ``no_gap`` stops the follower and fails the run."""
    row_counts = TargetRowCounts(context.instance, settings, tables)
    try:
        with logged(context):
            yield from _events(context, settings, tables, follower, row_counts)
    finally:
        follower.close("the run ended")  # however it ends: its threads stop at a boundary
    summary = follower.summary
    yield AssetObservation(
        DECODED_CHANGES_KEY,
        description="this follow run's totals",
        metadata=follow_summary_metadata(summary),
    )
    context.log.info(
        f"follow ended ({summary.stopped_by}): {summary.ranges} range(s), "
        f"{summary.transactions} transaction(s), {summary.changes} change(s) in "
        f"{summary.seconds} s; receive busy {summary.receive_busy_s} s, apply busy "
        f"{summary.apply_busy_s} s, both at once {summary.overlap_s} s; CPU receiving "
        f"{summary.receive_cpu_s} s, applying {summary.apply_cpu_s} s"
    )


def follow_summary_metadata(summary: FollowSummary) -> dict[str, Any]:
    """How the run ended and where its time went: receive and apply busy seconds, how long
    both ran at once (the pipelining), and the CPU each side spent in the follower itself."""
    return {
        "stopped_by": summary.stopped_by,
        "ranges": summary.ranges,
        "transactions": summary.transactions,
        "changes": summary.changes,
        "seconds": summary.seconds,
        "receive_busy_s": summary.receive_busy_s,
        "apply_busy_s": summary.apply_busy_s,
        "overlap_s": summary.overlap_s,
        "receive_cpu_s": summary.receive_cpu_s,
        "apply_cpu_s": summary.apply_cpu_s,
    }


def _events(
    context: Any,
    settings: pipeline.ReplicationSettings,
    tables: Sequence[TableName],
    follower: Following,
    row_counts: TargetRowCounts,
) -> Iterator[AssetMaterialization | AssetCheckEvaluation]:
    for followed in follower.run():
        failpoint("follow.recording")
        done = followed.done
        rng = LsnRange.from_key(done.received.range_key)
        register_range(context.instance, settings, rng)
        yield from range_events(
            recorded_tables(settings, tables, done),
            settings,
            done,
            followed.lag_bytes,
            row_counts.after(done.applied),
        )
        if tables:
            replay = done.applied.replay_lsn
            gap = no_gap_evaluation(
                settings, target_key(tables[0]), rng, Lsn(replay) if replay else None
            )
            yield gap
            if not gap.passed:
                follower.stop("no_gap failed")
                raise Failure(description=gap.description)


def recorded_tables(
    settings: pipeline.ReplicationSettings, tables: Sequence[TableName], done: pipeline.RangeDone
) -> Sequence[TableName]:
    """The target tables whose partition this range materialises: all of them, or with
    ``PGCDC_FOLLOW_TABLE_EVENTS=changed`` those the apply changed (measured with 108
    published tables at 1,000 tps: 110 events a range, and a run that needed minutes after
    its stop to record them)."""
    if settings.follow_table_events == "all":
        return tables
    counts = done.applied.tables
    return [
        t for t in tables if (c := counts.get(str(t))) is not None and (c.changes or c.truncated)
    ]


def new_follower(
    settings: pipeline.ReplicationSettings, endpos: str | None, spark: Any
) -> Following:
    """A follower of the run's slot up to ``endpos`` (``current``, ``X/Y``, or ``None``: until
    stopped), with Spark from the run's ``spark`` resource, started only if a range needs it.

    When the command that started this run already follows (its head start, see
    :func:`~pgcdc_dagster.engine.follow.head_start`), the run takes that follower over: same
    slot, same endpos, ranges it has done so far are reported first."""
    adopted = adopt(settings.slot)
    if adopted is not None:
        adopted.interrupts = INTERRUPTS
        return adopted
    target = None if endpos is None else pipeline.resolve_endpos(settings, endpos)
    return Follower(settings, target, spark=lambda: spark.spark_session, interrupts=INTERRUPTS)
