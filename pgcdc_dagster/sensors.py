"""The slot progress sensor: continuous, ordered catch-up with no hands.

Each tick (a few seconds at most: every query has a 3 s timeout):

1. read the slot and the source's flushed WAL position; report an observation of the slot
   asset with the lag and the retained WAL;
2. if a catch-up run is queued or running, do nothing more (ranges run one at a time);
3. if the last registered range is not done (not stored, or stored but not applied), request
   its run again: that is how a failed range is retried. No ``run_key`` is used, because
   Dagster never launches a run key twice and a retry must be able to;
4. otherwise register the next range (from the last range's end, or from the base snapshot's
   consistent point, up to the flushed WAL, capped in bytes) and request its run.
"""

import os

from dagster import (
    AddDynamicPartitionsRequest,
    AssetObservation,
    DefaultSensorStatus,
    RunRequest,
    RunsFilter,
    SensorEvaluationContext,
    SensorResult,
    sensor,
)
from dagster._core.storage.dagster_run import NOT_FINISHED_STATUSES

from . import pipeline
from .asset_metadata import number, text
from .assets import ENGINE_ERRORS, SLOT_KEY
from .lsn import LsnRange
from .partitions import LSN_RANGES, registered_ranges
from .resources import PgcdcResource

CATCHUP_JOB = "catchup"
CATCHUP_TAG = "pgcdc/catchup"
SENSOR_INTERVAL_S = int(os.environ.get("PGCDC_SENSOR_INTERVAL", "5"))


def catchup_in_flight(instance) -> bool:  # type: ignore[no-untyped-def]
    """A catch-up run is queued, starting or running (queued counts: it will run a range)."""
    runs = instance.get_runs_count(
        RunsFilter(job_name=CATCHUP_JOB, statuses=list(NOT_FINISHED_STATUSES))
    )
    return runs > 0


def range_done(settings: pipeline.ReplicationSettings, rng: LsnRange) -> bool:
    """Stored and applied: the engine's own records, not Dagster's."""
    stored = pipeline.store_of(settings).get(rng)
    if stored is None:
        return False
    transform = stored.manifest["result"]["transform_lsn"]
    if transform is None:
        return True
    progress = pipeline.origin_progress(settings)
    return progress is not None and progress >= pipeline.Lsn.parse(transform)


def build_slot_sensor(job_name: str = CATCHUP_JOB):  # type: ignore[no-untyped-def]
    @sensor(
        name="slot_progress_sensor",
        job_name=job_name,
        minimum_interval_seconds=SENSOR_INTERVAL_S,
        default_status=DefaultSensorStatus.RUNNING,
        description="Registers the next LSN range when the source has new WAL and requests "
        "its catch-up run; reports the slot's lag and retained WAL.",
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
        events = [observation]
        if catchup_in_flight(context.instance):
            return SensorResult(asset_events=events, skip_reason="a catch-up run is in flight")
        chain_store = pipeline.store_of(settings)
        if chain_store.chain() is None:
            return SensorResult(
                asset_events=events, skip_reason="no base snapshot yet: materialise base_snapshot"
            )
        consistent_point = chain_store.consistent_point()
        ranges = [r for r in registered_ranges(context.instance) if r.start >= consistent_point]
        try:
            if ranges and not range_done(settings, ranges[-1]):
                last = ranges[-1]
                return SensorResult(
                    asset_events=events,
                    run_requests=[RunRequest(partition_key=last.key, tags={CATCHUP_TAG: "retry"})],
                    cursor=last.key,
                )
        except ENGINE_ERRORS as exc:
            return SensorResult(asset_events=events, skip_reason=f"cannot read the target: {exc}")
        nxt = pipeline.plan_next_range(
            consistent_point,
            ranges[-1].end if ranges else None,
            positions.flush_lsn,
            settings.range_max_bytes,
        )
        if nxt is None:
            return SensorResult(asset_events=events, skip_reason="caught up: no new WAL")
        return SensorResult(
            asset_events=events,
            dynamic_partitions_requests=[
                AddDynamicPartitionsRequest(
                    partitions_def_name=LSN_RANGES, partition_keys=[nxt.key]
                )
            ],
            run_requests=[RunRequest(partition_key=nxt.key, tags={CATCHUP_TAG: "next"})],
            cursor=nxt.key,
        )

    return slot_progress_sensor
