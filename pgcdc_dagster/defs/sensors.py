"""The slot progress sensor: catch-up keeps going with no hands, and a dead run never blocks it.

Each tick (every query has a 3 s timeout):

1. read the slot and the source's flushed WAL position; report an observation of the slot
   asset with the lag and the retained WAL;
2. judge the not-finished runs that hold the range lock (:mod:`.runs`): a run whose worker is
   gone is marked failed, with the reason, and no longer counts; a live or queued one means
   wait (ranges run one at a time);
3. ask the engine for the next step (:func:`pipeline.next_step`, the durable facts only) towards
   the flushed WAL position: a stored range not yet applied, the next range to receive (capped
   in bytes), or nothing;
4. in ``range`` mode, register that range as a partition (idempotently) and request its
   ``catchup`` run; in ``follow`` mode (``PGCDC_MODE=follow``), request one ``follow`` run that
   receives and applies continuously, whatever the next step is: a follower is kept alive, and
   when it dies the next tick finds it dead and starts another. No ``run_key``: Dagster never
   launches a run key twice, and a retry must be able to.
"""

from dagster import (
    AssetObservation,
    DefaultSensorStatus,
    RunRequest,
    SensorEvaluationContext,
    SensorResult,
    sensor,
)

from ..engine import pipeline
from ..engine.failpoints import failpoint
from ..engine.next_step import CaughtUp
from ..engine.range_lock import lock_holders
from .assets import ENGINE_ERRORS
from .jobs import FOLLOW_JOB
from .keys import SLOT_KEY
from .metadata import number, text
from .range_events import register_range
from .resources import PgcdcResource
from .runs import ALIVE, QUEUED, fail_dead_runs, judge, pgcdc_runs_not_finished

CATCHUP_JOB = "catchup"


def build_slot_sensor(interval_s: int, grace_s: float, mode: str = "range"):  # type: ignore[no-untyped-def]
    follow = mode == "follow"

    @sensor(
        name="slot_progress_sensor",
        job_name=FOLLOW_JOB if follow else CATCHUP_JOB,
        minimum_interval_seconds=interval_s,
        default_status=DefaultSensorStatus.RUNNING,
        description="Keeps catch-up going: a follow run alive (follow mode) or the next "
        "per-range catch-up run (range mode); fails runs whose worker died; reports the slot's "
        "lag and retained WAL.",
    )
    def slot_progress_sensor(
        context: SensorEvaluationContext,
        pgcdc: PgcdcResource,
    ) -> SensorResult:
        settings = pgcdc.settings()
        try:
            positions = pipeline.source_positions(settings, timeout_s=3)
        except ENGINE_ERRORS as exc:
            return SensorResult(skip_reason=f"cannot read the source slot: {exc}")
        slot = positions.slot
        events = [
            AssetObservation(
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
        ]
        try:
            holders = lock_holders(settings.target_dsn, settings.slot)
            verdicts = judge(
                context.instance, pgcdc_runs_not_finished(context.instance), holders, grace_s
            )
            for dead in fail_dead_runs(context.instance, verdicts, "the slot sensor"):
                context.log.warning(f"run {dead.run.run_id} marked failed: {dead.reason}")
            live = [v for v in verdicts if v.state in (ALIVE, QUEUED)]
            if live:
                return SensorResult(
                    asset_events=events,
                    skip_reason=f"a catch-up run is in flight: {live[0].run.run_id} "
                    f"({live[0].reason})",
                )
            if holders:
                return SensorResult(
                    asset_events=events,
                    skip_reason=f"the range lock is held by {holders[0].holder}",
                )
            step = pipeline.next_step(settings, positions.flush_lsn, timeout_s=3)
        except ENGINE_ERRORS as exc:
            return SensorResult(asset_events=events, skip_reason=str(exc))
        if follow:
            return SensorResult(asset_events=events, run_requests=[RunRequest()])
        if isinstance(step, CaughtUp):
            return SensorResult(asset_events=events, skip_reason=f"{step.describe()}: no new WAL")
        register_range(context.instance, settings, step.range)
        failpoint("sensor.after_register")
        return SensorResult(
            asset_events=events,
            run_requests=[RunRequest(partition_key=step.range.key)],
        )

    return slot_progress_sensor
