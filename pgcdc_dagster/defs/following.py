"""The Dagster side of a follower: every range it takes, recorded as a per-range run would.

A follower (:mod:`pgcdc_dagster.engine.follow.follower`) receives and applies inside one long-lived
run; this turns each range it finishes into the events a per-range run records (its ``lsn_ranges``
partition, the ``decoded_changes`` and target-table materialisations with the same metadata,
the blocking ``no_gap`` evaluation), as they happen.

The events are *recorded* as each range is applied (:func:`record`), in the run's event log
under its step exactly as yielded events are, not yielded: a step keeps every event it yields
until it ends (Dagster hands the list to the step's hooks), and an op's ``context.log_event``
only reaches the event log when the op yields or returns. For a run that follows for days,
the first grows the run's memory with every range, without bound (see
``benchmarks/HISTORY.md``, ``benchmarks/freshness.py --extra-tables 100``, the memory of
``pgcdc follow``), and the second would record nothing until the end.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import psycopg
from dagster import (
    AssetCheckEvaluation,
    AssetMaterialization,
    AssetObservation,
    DagsterEvent,
    Failure,
    MetadataValue,
)
from dagster._core.errors import DagsterExecutionInterruptedError

from ..engine.control import pipeline
from ..engine.control.range_lock import RangeLock
from ..engine.errors import PgcdcError
from ..engine.failpoints import failpoint
from ..engine.follow.follower import Followed, Follower, Following, FollowSummary, Idle
from ..engine.follow.process import ProcessFollower, adopt
from ..engine.identifiers import TableName
from ..engine.lsn import Lsn, LsnRange
from .failures import ENGINE_ERRORS
from .keys import DECODED_CHANGES_KEY, target_key
from .metadata import number, spark_metadata, text
from .progress_log import logged
from .range_events import no_gap, range_events, register_range
from .row_counts import TargetRowCounts
from .storage_outage import StorageRide, StorageUnavailableError, give_up

INTERRUPTS = (KeyboardInterrupt, DagsterExecutionInterruptedError)
"""What a stop of the run looks like inside it: SIGINT, or Dagster's termination."""


RECORDING_NICENESS = 10
"""How much lower the recording thread's CPU priority is than the follower's, when the follower
runs in a process of its own (``pgcdc follow``, ``pgcdc catchup``)."""


def yield_to_the_follower() -> None:
    """Lower this thread's CPU priority (Linux: a thread's own nice value) by
    :data:`RECORDING_NICENESS`. On a machine whose cores are busy, the follower's receive and
    apply, and the servers, then come before the run's events: a change does not wait for
    Dagster's bookkeeping, whose records trail the applies instead (never lost: the ranges wait
    in the follower's backlog). Only for a follower in a process of its own: on threads it
    shares the interpreter lock with this thread, which would then hold it while it waits for
    a core. Where the platform refuses, nothing changes."""
    with contextlib.suppress(OSError, AttributeError):
        thread = threading.get_native_id()
        now = os.getpriority(os.PRIO_PROCESS, thread)
        os.setpriority(os.PRIO_PROCESS, thread, min(19, now + RECORDING_NICENESS))


def follow_events(
    context: Any,
    settings: pipeline.ReplicationSettings,
    tables: Sequence[TableName],
    follower: Following,
) -> Iterator[AssetObservation]:
    """Run ``follower`` (this run holds the range lock), recording each range's events as
    soon as the range is applied; yield the run's totals at the end. A failed ``no_gap``
    stops the follower and fails the run. Without an endpos, the events' writes ride through
    Dagster's storage going away (:mod:`.storage_outage`) for as long as
    ``PGCDC_FOLLOW_RETRY`` lets the follow wait for any of its servers; the follower goes on
    applying meanwhile."""
    # A catch-up (an endpos) rides through no outage: its caller wants an answer, as for its
    # source and target (dagster-postgres' own retries still cover a blip of a few seconds).
    budget = settings.follow_retry if follower.endpos is None else 0
    storage = StorageRide(budget, stopping=lambda: follower.stopping)
    if isinstance(follower, ProcessFollower):
        yield_to_the_follower()
    recorded = list(tables)  # grows with tables added while the run follows (_record_ranges)
    row_counts = TargetRowCounts(context.instance, settings, recorded)
    gone: StorageUnavailableError | None = None
    try:
        with logged(context) as lines:
            try:
                # A log line that cannot be written raises out of Dagster's log handler once
                # the storage is away (after its own retries): each one goes through the ride.
                storage.write(
                    lambda: context.log.info(
                        f"following slot {settings.slot}"
                        + (f" up to {follower.endpos}" if follower.endpos else "")
                    )
                )
                _record_ranges(context, settings, recorded, follower, row_counts, storage)
            except StorageUnavailableError as exc:
                lines.drop()
                gone = exc
                raise
    finally:
        follower.close("the run ended")  # however it ends: its threads stop at a boundary
        if gone is not None:
            give_up(gone)
    summary = follower.summary
    yield AssetObservation(
        DECODED_CHANGES_KEY,
        description="this follow run's totals",
        metadata=follow_summary_metadata(summary, storage),
    )
    context.log.info(
        f"follow ended ({summary.stopped_by}): {summary.ranges} range(s), "
        f"{summary.transactions} transaction(s), {summary.changes} change(s) in "
        f"{summary.seconds} s; receive busy {summary.receive_busy_s} s, apply busy "
        f"{summary.apply_busy_s} s, both at once {summary.overlap_s} s; CPU receiving "
        f"{summary.receive_cpu_s} s, applying {summary.apply_cpu_s} s"
        + (
            f"; rode through {summary.outages} outage(s) of its servers, "
            f"{summary.outage_s} s in all"
            if summary.outages
            else ""
        )
        + (
            f"; made way for pgcdc add-table {summary.made_way} time(s), "
            f"{summary.made_way_s} s in all"
            if summary.made_way
            else ""
        )
        + (
            f"; recorded through {storage.outages.count} outage(s) of Dagster's storage, "
            f"{storage.outages.total_s} s in all"
            if storage.outages.count
            else ""
        )
    )


def follow_summary_metadata(
    summary: FollowSummary, storage: StorageRide | None = None
) -> dict[str, Any]:
    """How the run ended and where its time went: receive and apply busy seconds, how long
    both ran at once (the pipelining), the CPU each side spent in the follower itself, the
    outages it rode through (of its servers, and of Dagster's storage), and the time it made
    way for ``pgcdc add-table``, and how often its kept target connection was lost and
    replaced."""
    return {
        "stopped_by": summary.stopped_by,
        "ranges": summary.ranges,
        "transactions": summary.transactions,
        "changes": summary.changes,
        "seconds": summary.seconds,
        "receive_busy_s": summary.receive_busy_s,
        "apply_busy_s": summary.apply_busy_s,
        "overlap_s": summary.overlap_s,
        "target_reconnects": summary.target_reconnects,
        "receive_cpu_s": summary.receive_cpu_s,
        "apply_cpu_s": summary.apply_cpu_s,
        "outages": summary.outages,
        "outage_s": summary.outage_s,
        "made_way": summary.made_way,
        "made_way_s": summary.made_way_s,
        "streams": summary.streams,
        "spark_ranges": summary.spark_ranges,
        "spark_tasks": summary.spark_tasks,
        "spark_changes": summary.spark_changes,
        "spark_seconds": summary.spark_seconds,
        "staged_on_driver": summary.driver_staged,
        "staged_on_driver_why": summary.driver_staged_why,
        **spark_metadata(summary.spark_app),
        "storage_outages": storage.outages.count if storage else 0,
        "storage_outage_s": storage.outages.total_s if storage else 0.0,
    }


RangeEvent = AssetMaterialization | AssetCheckEvaluation | AssetObservation


def record(step: Any, event: RangeEvent) -> None:
    """Record ``event`` in the run's event log now, under the step ``step`` (the op's
    ``get_step_execution_context()``), as Dagster records an event the step yields, but without
    the step keeping it (see the module docstring)."""
    if isinstance(event, AssetMaterialization):
        DagsterEvent.asset_materialization(step, event)
    elif isinstance(event, AssetCheckEvaluation):
        DagsterEvent.asset_check_evaluation(step, event)
    else:
        DagsterEvent.asset_observation(step, event)


def _record_ranges(
    context: Any,
    settings: pipeline.ReplicationSettings,
    tables: list[TableName],
    follower: Following,
    row_counts: TargetRowCounts,
    storage: StorageRide,
) -> None:
    """Record each range ``follower`` applies. ``tables`` (shared with ``row_counts``) are the
    target tables whose partitions the ranges materialise: it grows, at each session of the
    follower, by the tables an add gave the replication since the code location listed them
    (:func:`~.pipeline.added_beyond`), so a follow that made way for ``pgcdc add-table``
    records the added table's partitions from its next range on, as a run started after the
    code location's reload would."""
    step = context.get_step_execution_context()

    def log(line: str) -> None:
        storage.write(lambda: context.log.info(line))

    table_events = TableEvents(log, settings, tables)
    pace = RecordPace(follower, min(PACED_CUT_S, settings.follow_cut_ms / 1000))
    session = 0
    said_at = time.monotonic()  # when the run last recorded a range or a heartbeat

    def beat() -> float:
        """A heartbeat, if none and no range was recorded for :data:`HEARTBEAT_S`."""
        if time.monotonic() - said_at < HEARTBEAT_S:
            return said_at
        idle = Idle(round(time.monotonic() - said_at, 1))
        storage.write(lambda: record(step, heartbeat(settings, idle)))
        return time.monotonic()

    for followed in follower.run(idle_s=HEARTBEAT_S):
        if isinstance(followed, Idle):
            said_at = beat()
            continue
        failpoint("follow.recording")
        pace.note(followed)
        if followed.session != session:
            try:
                added = pipeline.added_beyond(settings, tables)
            except (PgcdcError, psycopg.Error):
                added = None  # the source away meanwhile (the follower's business): next range
            else:
                session = followed.session
            if added:
                tables.extend(added)
                log(
                    f"recording {', '.join(str(t) for t in added)} too from range "
                    f"{LsnRange.from_key(followed.done.received.range_key).partition_key} on: "
                    "added to the replication "
                    "(pgcdc add-table) since the code location listed its tables"
                )
        done = followed.done
        rng = LsnRange.from_key(done.received.range_key)
        for line in done.applied.schema_changes:  # the source's DDL, followed on the target
            log(f"range {rng.partition_key}: {line}")
        for line in done.applied.warnings:
            storage.write(lambda line=line: context.log.warning(line))
        counts = storage.write(lambda done=done: row_counts.after(done.applied))
        gap = None
        if tables:
            replay = done.applied.replay_lsn
            # Strict even for a range found applied: in a follow, the origin past a range
            # it takes means another applier, which must stop it.
            gap = no_gap(settings, rng, Lsn(replay) if replay else None)
        events: list[RangeEvent] = []
        if _empty(followed):
            said_at = beat()
        else:
            said_at = time.monotonic()
            storage.write(lambda rng=rng: register_range(context.instance, settings, rng))
            recorded, described = table_events.choose(followed)
            events += range_events(
                recorded, settings, done, followed.lag_bytes, counts, table_events=described
            )
            if gap is not None:
                events += [gap.evaluation(target_key(t)) for t in recorded]
        for event in events:  # each written once: a retry goes on from the one that failed
            storage.write(lambda event=event: record(step, event))
        while storage.back_notes:
            log(
                f"{storage.back_notes.pop(0)}: this follow went on applying while it was "
                "away, and the ranges it applied meanwhile were recorded once it was back"
            )
        if gap is not None and not gap.passed:
            follower.stop("no_gap failed")
            raise Failure(description=gap.description)
    table_events.log_trailed()


HEARTBEAT_S = 60.0
"""How long a follow that applies nothing goes before it says it is alive (:func:`heartbeat`)."""


def _empty(followed: Followed) -> bool:
    """A range with no transaction: an idle source's (the slot moved on through WAL that
    published nothing). A follow records it as no partition: the partitions are the ranges
    that hold changes, told apart from the idle ones at a glance, and the asset's latest
    materialisation is the last range with data. Its progress shows in the heartbeat; its
    ``no_gap`` is still enforced and the tables' row counts carried past it."""
    return followed.done.received.transactions == 0


def heartbeat(settings: pipeline.ReplicationSettings, idle: Idle) -> AssetObservation:
    """An observation of ``decoded_changes`` from a live follow with nothing to apply: how
    far behind the source it is and where it stands, so an idle follow is told from a hung
    one (a range the follower stores and applies is a materialisation instead)."""
    metadata: dict[str, Any] = {"idle_s": MetadataValue.float(idle.seconds)}
    try:
        positions = pipeline.source_positions(settings, timeout_s=3)
        metadata["source_lag_bytes"] = number(positions.lag_bytes)
        metadata["source_flush_lsn"] = text(positions.flush_lsn)
        metadata["slot_confirmed_lsn"] = text(positions.slot.confirmed_flush_lsn)
    except (*ENGINE_ERRORS, psycopg.Error) as exc:
        metadata["source"] = text(f"not reachable now: {exc}")
    try:
        metadata["replay_lsn"] = text(pipeline.origin_progress(settings) or "none")
    except (*ENGINE_ERRORS, psycopg.Error) as exc:
        metadata["target"] = text(f"not reachable now: {exc}")
    return AssetObservation(
        DECODED_CHANGES_KEY,
        description=f"a live follow's heartbeat: nothing to apply for {idle.seconds:g} s",
        metadata=metadata,
    )


TRAILING_S = 2.0
"""How far behind the apply a follow's events may fall before a follow that records every
table (``all``) records only the tables a range changed."""

CAUGHT_UP_S = 0.5
"""...and how close they must come again before it records every table again."""

TRAIL_LOG_S = 60.0
"""At most one log line this often about ranges recorded with only the tables they changed."""


PACED_CUT_S = 0.05
"""While a run's records trail, the shortest time between two of its follower's cuts
(:class:`RecordPace`): at most 20 ranges a second."""

PACE_AFTER_S = 10.0
"""How far a run's records may trail the applies before its follower is paced
(:class:`RecordPace`)..."""

PACE_UNTIL_S = 1.0
"""...and how close they must come again before it is let go."""


class RecordPace:
    """Keeps the run's records within seconds of the applies: once they trail by more than
    :data:`PACE_AFTER_S` (the recording short of CPU: each range is a few of its events), the
    follower cuts its ranges at most every ``cut_s`` (:data:`PACED_CUT_S`) instead of whenever
    its applier is free (:meth:`~.follower.Follower.pace`), until they trail by less than
    :data:`PACE_UNTIL_S`. Fewer, bigger ranges then cost the run fewer events, and the
    follower's apply less time, so the trail does not grow however long the
    follow runs (see ``benchmarks/HISTORY.md``, "Freshness: the recording at a lower
    priority")."""

    def __init__(self, follower: Following, cut_s: float) -> None:
        self.follower = follower
        self.cut_s = cut_s
        self.paced = False

    def note(self, followed: Followed) -> None:
        """``followed`` is being recorded now: pace the follower, or let it go, by how far the
        records trail its apply."""
        if not followed.applied_at:
            return
        behind = time.monotonic() - followed.applied_at
        if not self.paced and behind > PACE_AFTER_S:
            self.paced = True
            self.follower.pace(self.cut_s)
        elif self.paced and behind < PACE_UNTIL_S:
            self.paced = False
            self.follower.pace(0.0)


class TableEvents:
    """Which target tables' partitions each range a follow applies materialises.

    ``PGCDC_FOLLOW_TABLE_EVENTS=changed``: the tables the range changed. ``all`` (the default):
    every replicated table, as a per-range run does, as long as the run's events keep up with
    the apply. Each materialisation is a Dagster event of a few milliseconds, so with many
    tables and a range every few hundred milliseconds they cannot: the events trail the apply
    without bound, the run's stop takes minutes to record them, and the UI shows the target
    minutes behind where it is (see ``benchmarks/HISTORY.md``, ``benchmarks/freshness.py
    --extra-tables 100``). So while the events trail the apply by more than :data:`TRAILING_S`
    (a range's ``applied_at`` against now), a range records only the tables it changed, until
    they trail by less than :data:`CAUGHT_UP_S`: the UI stays within seconds of the target, and
    no table a range changed is ever left out. The ranges so recorded say so in their
    ``decoded_changes`` metadata (``table_events``) and, at most once a minute, in the run's
    log."""

    def __init__(
        self,
        log: Callable[[str], None],
        settings: pipeline.ReplicationSettings,
        tables: Sequence[TableName],
    ) -> None:
        self.log = log
        self.mode = settings.follow_table_events
        self.tables = tables
        self.trailing = False
        self.trailed_ranges = 0
        """Ranges recorded with only their changed tables, since the last log line."""
        self.trailed_most_s = 0.0
        self.logged_at: float | None = None

    def choose(self, followed: Followed) -> tuple[Sequence[TableName], str]:
        """The tables whose partitions the range materialises, and what its ``table_events``
        metadata says of them."""
        if self.mode == "changed":
            tables = changed_tables(self.tables, followed.done)
            return tables, "changed (PGCDC_FOLLOW_TABLE_EVENTS=changed)"
        behind = time.monotonic() - followed.applied_at if followed.applied_at else 0.0
        if behind > TRAILING_S:
            self.trailing = True
        elif behind < CAUGHT_UP_S:
            self.trailing = False
        if not self.trailing:
            return self.tables, "all"
        self.trailed_ranges += 1
        self.trailed_most_s = max(self.trailed_most_s, behind)
        if self.logged_at is None or time.monotonic() - self.logged_at >= TRAIL_LOG_S:
            self.log_trailed()
        return (
            changed_tables(self.tables, followed.done),
            f"changed (the run's events trailed the apply by more than {TRAILING_S:g} s)",
        )

    def log_trailed(self) -> None:
        if self.trailed_ranges:
            self.log(
                f"the run's events trailed the apply by up to {self.trailed_most_s:.1f} s: "
                f"{self.trailed_ranges} range(s) materialised only the target tables they "
                f"changed, not all {len(self.tables)} (with this many tables, "
                "PGCDC_FOLLOW_TABLE_EVENTS=changed always does)"
            )
        self.trailed_ranges = 0
        self.trailed_most_s = 0.0
        self.logged_at = time.monotonic()


def changed_tables(tables: Sequence[TableName], done: pipeline.RangeDone) -> list[TableName]:
    """Those of ``tables`` whose rows the range's apply changed or truncated."""
    counts = done.applied.tables
    return [
        t for t in tables if (c := counts.get(str(t))) is not None and (c.changes or c.truncated)
    ]


def new_follower(
    settings: pipeline.ReplicationSettings,
    endpos: str | None,
    spark: Any,
    lock: RangeLock | None = None,
) -> Following:
    """A follower of the run's slot up to ``endpos`` (``current``, ``X/Y``, or ``None``: until
    stopped), with Spark from the run's ``spark`` resource, started only if a range needs it.

    When the command that started this run already follows (its head start, see
    :func:`~pgcdc_dagster.engine.follow.process.head_start`), the run takes that follower over: same
    slot, same endpos, ranges it has done so far are reported first.

    ``lock``: the run's range lock, whose session the follower checks is still there after an
    outage."""
    adopted = adopt(settings.slot)
    if adopted is not None:
        adopted.interrupts = INTERRUPTS
        return adopted
    target = None if endpos is None else pipeline.resolve_endpos(settings, endpos)
    return Follower(
        settings,
        target,
        spark=lambda: spark.spark_session,
        interrupts=INTERRUPTS,
        lock_session=lock.session_pid if lock else None,
        lock_holder=lock.holder if lock else None,
    )
