"""The slot progress sensor: catch-up keeps going with no hands, and a dead run never blocks it.

Each tick (every query has a 3 s timeout):

1. read the slot and the source's flushed WAL position; report an observation of the slot
   asset with the lag and the retained WAL (at most once a minute, see
   :func:`slot_observation`);
2. judge the not-finished runs that hold the range lock (:mod:`.run_liveness`): a run whose
   worker is gone is marked failed, with the reason, and no longer counts; a live or queued
   one means wait (ranges run one at a time);
3. ask the engine for the next step (:func:`pipeline.next_step`, the durable facts only) towards
   the flushed WAL position: a stored range not yet applied, the next range to receive (capped
   in bytes), or nothing;
4. in ``range`` mode, register that range as a partition (idempotently) and request its
   ``catchup`` run; in ``follow`` mode (``PGCDC_MODE=follow``), request one ``follow`` run that
   receives and applies continuously, whatever the next step is: a follower is kept alive, and
   when it dies the next tick finds it dead and starts another. No ``run_key``: Dagster never
   launches a run key twice, and a retry must be able to.

Besides, at most once a minute, it evaluates the ``replicated_tables`` check (a table the
publication no longer sends, or sends without having been added, or an add left unfinished),
the ``slot_health`` and the ``store_retention`` checks, recording each when its outcome changes
(:func:`check_evaluation`).
"""

import json
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

import psycopg
from dagster import (
    AssetCheckEvaluation,
    AssetCheckResult,
    AssetObservation,
    DefaultSensorStatus,
    RunRequest,
    SensorEvaluationContext,
    SensorResult,
    sensor,
)

from ..engine.compare.recover import recovery_needed
from ..engine.control import pipeline
from ..engine.control.next_step import CaughtUp
from ..engine.control.range_lock import lock_holders
from ..engine.failpoints import failpoint
from .checks import (
    REPLICATED_TABLES,
    SLOT_HEALTH,
    SLOT_SURVIVES_FAILOVER,
    STORE_RETENTION,
    finished_at,
    replicated_tables_result,
    slot_health_result,
    slot_survives_failover_result,
    store_retention_result,
)
from .failures import ENGINE_ERRORS
from .jobs import FOLLOW_JOB, RECOVER_JOB
from .keys import SLOT_KEY, source_key
from .metadata import number, text
from .range_events import register_range
from .resources import PgcdcResource
from .run_liveness import ALIVE, QUEUED, fail_dead_runs, judge, pgcdc_runs_not_finished

CATCHUP_JOB = "catchup"


DAEMON_TICK_FLOOR_S = 5
"""Dagster's sensor daemon evaluates a sensor at most this often, whatever the sensor asks
(``MIN_INTERVAL_LOOP_TIME``, no setting): a shorter interval would only make the UI's
"Frequency" line promise ticks that never come."""


def sensor_job(mode: str) -> str:
    """The job the slot sensor keeps going in ``mode`` (``PGCDC_MODE``)."""
    return FOLLOW_JOB if mode == "follow" else CATCHUP_JOB


def build_slot_sensor(  # type: ignore[no-untyped-def]
    interval_s: int, grace_s: float, mode: str, jobs: Sequence[Any]
):
    """The slot sensor, targeting ``jobs``: the catch-up job (range mode) or the follow job
    (follow mode), and the ``recover`` job, which it runs when the slot is lost and
    ``PGCDC_AUTO_RECOVER`` allows it."""
    follow = mode == "follow"
    main_job = sensor_job(mode)

    @sensor(
        name="slot_progress_sensor",
        jobs=list(jobs),
        minimum_interval_seconds=max(interval_s, DAEMON_TICK_FLOOR_S),
        default_status=DefaultSensorStatus.RUNNING,
        description="Keeps catch-up going: a follow run alive (follow mode) or the next "
        "per-range catch-up run (range mode); fails runs whose worker died; reports the slot's "
        "lag and retained WAL; recovers a lost slot where PGCDC_AUTO_RECOVER allows it.",
    )
    def slot_progress_sensor(
        context: SensorEvaluationContext,
        pgcdc: PgcdcResource,
    ) -> SensorResult:
        settings = pgcdc.settings()
        if (ended := finished_at(settings)) is not None:
            return SensorResult(skip_reason=ended)
        try:
            holders = lock_holders(settings.target_dsn, settings.slot)
            verdicts = judge(
                context.instance, pgcdc_runs_not_finished(context.instance), holders, grace_s
            )
            for dead in fail_dead_runs(context.instance, verdicts, "the slot sensor"):
                context.log.warning(f"run {dead.run.run_id} marked failed: {dead.reason}")
            live = [v for v in verdicts if v.state in (ALIVE, QUEUED)]
            lost = recovery_needed(settings)
        except ENGINE_ERRORS as exc:
            return SensorResult(skip_reason=str(exc))
        if lost is not None:
            return _recovering(lost, live, settings.auto_recover)
        try:
            positions = pipeline.source_positions(settings, timeout_s=3)
        except ENGINE_ERRORS as exc:
            return SensorResult(skip_reason=f"cannot read the source slot: {exc}")
        last = _parse(context.cursor)
        events, cursor = slot_observation(last, positions)
        sources, cursor["sources"] = source_observations(last.get("sources"), settings)
        events += sources
        checked: list[AssetCheckEvaluation] = []
        for part in SENSOR_CHECKS:
            evaluations, cursor[part] = check_evaluation(last.get(part), settings, part)
            checked += evaluations

        def result(**outcome: Any) -> SensorResult:
            return SensorResult(
                asset_events=[*events, *checked],
                cursor=json.dumps(cursor, sort_keys=True),
                **outcome,
            )

        if live:
            return result(
                skip_reason=f"a {live[0].run.job_name} run is in flight: "
                f"{live[0].run.run_id} ({live[0].reason})",
            )
        if holders:
            return result(skip_reason=f"the range lock is held by {holders[0].holder}")
        try:
            step = pipeline.next_step(settings, positions.flush_lsn, timeout_s=3)
        except ENGINE_ERRORS as exc:
            return result(skip_reason=str(exc))
        if follow:
            return result(run_requests=[RunRequest(job_name=main_job)])
        if isinstance(step, CaughtUp):
            return result(skip_reason=f"{step.describe()}: no new WAL")
        register_range(context.instance, settings, step.range)
        failpoint("sensor.after_register")
        return result(
            run_requests=[RunRequest(job_name=main_job, partition_key=step.range.partition_key)]
        )

    return slot_progress_sensor


def _recovering(lost: str, live: Sequence[Any], allowed: bool) -> SensorResult:
    """The tick's answer to a lost slot (``lost``, in a line): a run of the ``recover`` job
    where ``PGCDC_AUTO_RECOVER`` allows it and no pgcdc run is in flight (a recovery already,
    or a run that would fail on the lost slot: the sensor judges it dead or done first), else
    why not. A recovery that dies is taken for dead like any run, and the next tick runs
    another, which starts again at a new point (:mod:`..engine.compare.recover`)."""
    if not allowed:
        return SensorResult(
            skip_reason=f"{lost} (PGCDC_AUTO_RECOVER=on lets this sensor run pgcdc recover)"
        )
    if live:
        return SensorResult(
            skip_reason=f"{lost}: a {live[0].run.job_name} run is in flight: "
            f"{live[0].run.run_id} ({live[0].reason})"
        )
    return SensorResult(run_requests=[RunRequest(job_name=RECOVER_JOB)])


SLOT_OBSERVED_EVERY_S = 60.0
"""The slot sensor records its observation of the slot at most this often, and at once when
the slot's ``wal_status`` or ``active`` changes."""


def _parse(cursor: str | None) -> dict[str, Any]:
    """The sensor's cursor: when and what it last recorded (nothing is decided on it)."""
    try:
        last = json.loads(cursor) if cursor else {}
    except ValueError:
        return {}
    return last if isinstance(last, dict) else {}


def _stamp(at: float) -> str:
    """A cursor's time as people read it on the sensor's page: UTC, to the second."""
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _since(stamp: Any, now: float) -> float:
    """Seconds from a cursor's time (:func:`_stamp`; an epoch number from an older cursor) to
    ``now``; anything unreadable counts as long ago, which only makes the next record due."""
    if isinstance(stamp, int | float):
        return now - float(stamp)
    try:
        at = datetime.strptime(str(stamp), "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    except ValueError:
        return float("inf")
    return now - at.timestamp()


CHECKED_EVERY_S = 60.0
"""The slot sensor evaluates each of the replication's checks (:data:`SENSOR_CHECKS`) at most
this often (a query of the source's publication or of the target's origin, and of the store)."""
RECORDED_EVERY_S = 600.0
"""An unchanged evaluation is recorded again at most this often: every evaluation is a row of
Dagster's event log that nothing prunes (see :func:`slot_observation`), while a change is
recorded at once."""

SENSOR_CHECKS: dict[str, tuple[str, Callable[[pipeline.ReplicationSettings], AssetCheckResult]]] = {
    "health": (SLOT_HEALTH, lambda s: slot_health_result(s, s.retained_wal_limit)),
    "tables": (REPLICATED_TABLES, lambda s: replicated_tables_result(s, timeout_s=3)),
    "retention": (STORE_RETENTION, store_retention_result),
    "failover": (SLOT_SURVIVES_FAILOVER, slot_survives_failover_result),
}
"""The checks of ``replication_slot`` the sensor evaluates, by their part of its cursor. A
table the publication stops sending breaks nothing and is seen by no range (its changes just
stop), and a store that outgrows its retention fails nothing either: without these, only
``pgcdc status`` and ``pgcdc verify`` would ever say so."""


def check_evaluation(
    last: Any, settings: pipeline.ReplicationSettings, part: str
) -> tuple[list[AssetCheckEvaluation], dict[str, Any]]:
    """The tick's evaluation of the check :data:`SENSOR_CHECKS` names ``part``, if one is
    due, and its part of the next cursor (``last``: the part before)."""
    last = last if isinstance(last, dict) else {}
    now = time.time()
    if _since(last.get("checked_at"), now) < CHECKED_EVERY_S:
        return [], last
    name, evaluate = SENSOR_CHECKS[part]
    result = evaluate(settings)
    said = [result.passed, result.description]
    state = {**last, "checked_at": _stamp(now)}
    if said == last.get("said") and _since(last.get("recorded_at"), now) < RECORDED_EVERY_S:
        return [], state
    evaluation = AssetCheckEvaluation(
        asset_key=SLOT_KEY,
        check_name=name,
        passed=result.passed,
        metadata=result.metadata,
        severity=result.severity,
        description=result.description,
    )
    return [evaluation], {**state, "said": said, "recorded_at": _stamp(now)}


SOURCES_OBSERVED_EVERY_S = 3600.0
"""The slot sensor observes the source tables' sizes at most this often: an observation a
table (200 tables: 4,800 rows a day of Dagster's event log, see :func:`slot_observation`)."""


def source_observations(
    last: Any, settings: pipeline.ReplicationSettings
) -> tuple[list[AssetObservation], dict[str, Any]]:
    """The tick's observations of the source tables, if due: each table's estimated rows (the
    source's planner statistics: no table is read, see :func:`.catalog.estimated_rows`), so
    the source assets show their size beside the targets' exact ``dagster/row_count``. Its
    part of the next cursor (``last``: the part before)."""
    last = last if isinstance(last, dict) else {}
    now = time.time()
    if _since(last.get("observed_at"), now) < SOURCES_OBSERVED_EVERY_S:
        return [], last
    try:
        estimates = pipeline.source_row_estimates(settings, timeout_s=3)
    except (*ENGINE_ERRORS, psycopg.Error):
        return [], last  # the slot's observation says the source is away
    observations = [
        AssetObservation(
            source_key(table),
            metadata={"estimated_rows": number(rows) if rows is not None else text("unknown")},
        )
        for table, rows in estimates.items()
    ]
    return observations, {"observed_at": _stamp(now)}


def slot_observation(
    last: dict[str, Any], positions: pipeline.SourcePositions
) -> tuple[list[AssetObservation], dict[str, Any]]:
    """The tick's observation of the slot asset, if one is due, and the sensor's next cursor
    (``last``: the one before).

    Why at most once a minute: every observation is a row of Dagster's event log that nothing
    prunes (the slot asset has no partitions for the retention to drop), and the sensor ticks
    every ``PGCDC_SENSOR_INTERVAL`` seconds for as long as the replication runs: 17,280 rows a
    day at the default 5 s, 86,400 at the demo's 1 s, against 1,440. A change of the slot's
    state (lost WAL, no consumer) is recorded at once. The cursor holds only when and what
    was last recorded; nothing is decided on it."""
    slot = positions.slot
    state = {"wal_status": str(slot.wal_status), "active": str(slot.active)}
    now = time.time()
    if _since(last.get("observed_at"), now) < SLOT_OBSERVED_EVERY_S and last.get("state") == state:
        return [], dict(last)
    observation = AssetObservation(
        SLOT_KEY,
        metadata={
            "lag_bytes": number(positions.lag_bytes),
            "retained_wal_bytes": number(slot.retained_wal_bytes or 0),
            "confirmed_flush_lsn": text(slot.confirmed_flush_lsn),
            "restart_lsn": text(slot.restart_lsn),
            "flush_lsn": text(positions.flush_lsn),
            "wal_status": text(slot.wal_status),
            "active": text(slot.active),
        },
    )
    return [observation], {**last, "observed_at": _stamp(now), "state": state}
