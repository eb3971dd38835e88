"""The ``follow`` job: one run that catches the target up, range after range.

``pgcdc catchup --endpos L`` runs it. The run holds the range lock for its whole life (through
:class:`~pgcdc_dagster.defs.resources.RangeLockResource`); every range it receives and applies is
registered as an ``lsn_ranges`` partition and materialised from inside the run, with the same
metadata as a per-range run, so the UI's partitions and lineage look the same whichever way a
range was taken.
"""

from collections.abc import Sequence

from dagster import Config, JobDefinition, OpExecutionContext, in_process_executor, job, op

from ..engine import pipeline
from ..engine.identifiers import TableName
from .assets import ENGINE_ERRORS, as_failure, catch_up_logging_ranges
from .resources import PgcdcResource, RangeLockResource, SparkResource
from .runs import RANGE_LOCK_TAG

FOLLOW_JOB = "follow"


class FollowConfig(Config):
    endpos: str = "current"
    """Where to stop: ``current`` (the source's flushed WAL when the run starts) or ``X/Y``."""


def build_follow_job(tables: Sequence[TableName]) -> JobDefinition:
    @op(
        name="follow_stream",
        description="Receive and apply ranges until the target has caught up to endpos.",
    )
    def follow_stream(
        context: OpExecutionContext,
        config: FollowConfig,
        pgcdc: PgcdcResource,
        spark: SparkResource,
        range_lock: RangeLockResource,
    ) -> None:
        settings = pgcdc.settings(spark)
        try:
            endpos = pipeline.resolve_endpos(settings, config.endpos)
            done = catch_up_logging_ranges(
                context, settings, tables, endpos, lambda: spark.spark_session
            )
        except ENGINE_ERRORS as exc:
            raise as_failure(exc) from None
        context.log.info(f"caught up to {endpos}: {len(done)} range(s) received and applied")

    @job(
        name=FOLLOW_JOB,
        executor_def=in_process_executor,
        tags={RANGE_LOCK_TAG: "follow"},
        description="Catch the target up to endpos in one run, range after range.",
    )
    def follow() -> None:
        follow_stream()

    return follow
