"""The ``follow`` job: one long-lived run that receives and applies continuously.

``pgcdc follow`` runs it until stopped, ``pgcdc catchup --endpos L`` runs it up to ``L``, and the
slot sensor in ``follow`` mode keeps one alive. The run holds the range lock for its whole life
(through :class:`~pgcdc_dagster.defs.resources.RangeLockResource`); every range it takes is
registered as an ``lsn_ranges`` partition and materialised from inside the run as it is applied
(:mod:`.following`), so the UI's partitions and lineage look the same whichever way a range was
taken. Terminating the run from the UI (or SIGINT/SIGTERM to ``pgcdc``) stops it at a range
boundary.
"""

from collections.abc import Iterator, Sequence
from typing import Any

from dagster import Config, JobDefinition, OpExecutionContext, in_process_executor, job, op

from ..engine.identifiers import TableName
from .assets import ENGINE_ERRORS, as_failure
from .following import follow_events, new_follower
from .resources import PgcdcResource, RangeLockResource, SparkResource
from .runner import keep_storage_connections
from .runs import RANGE_LOCK_TAG

FOLLOW_JOB = "follow"
NO_ENDPOS = "none"


class FollowConfig(Config):
    endpos: str = NO_ENDPOS
    """Where to stop: ``none`` (follow until stopped), ``current`` (the source's flushed WAL
    when the run starts) or an LSN ``X/Y``."""


def build_follow_job(tables: Sequence[TableName]) -> JobDefinition:
    @op(
        name="follow_stream",
        out={},  # it yields events only
        description="Receive and apply ranges continuously, until endpos or a stop.",
    )
    def follow_stream(
        context: OpExecutionContext,
        config: FollowConfig,
        pgcdc: PgcdcResource,
        spark: SparkResource,
        range_lock: RangeLockResource,
    ) -> Iterator[Any]:
        settings = pgcdc.settings(spark)
        keep_storage_connections(context.instance)  # a long run writes events every range
        try:
            endpos = None if config.endpos.strip().lower() == NO_ENDPOS else config.endpos
            follower = new_follower(settings, endpos, spark)
            context.log.info(
                f"following slot {settings.slot}"
                + (f" up to {follower.endpos}" if follower.endpos else "")
            )
            yield from follow_events(context, settings, tables, follower)
        except ENGINE_ERRORS as exc:
            raise as_failure(exc) from None

    @job(
        name=FOLLOW_JOB,
        executor_def=in_process_executor,
        tags={RANGE_LOCK_TAG: "follow"},
        description="Follow the source: receive and apply continuously in one run, every "
        "range a partition; up to an endpos or until stopped.",
    )
    def follow() -> None:
        follow_stream()

    return follow
