"""Asset checks that do not belong to one materialisation: slot health, the store's retention,
target = source."""

from collections.abc import Iterator, Sequence
from typing import Any

from dagster import (
    AssetCheckExecutionContext,
    AssetCheckResult,
    AssetCheckSeverity,
    AssetCheckSpec,
    asset_check,
    multi_asset_check,
)

from ..engine import pipeline, verify
from ..engine.identifiers import TableName
from ..engine.retention import retention_status
from ..engine.slot import SlotError
from .assets import DECODED_CHANGES_KEY, ENGINE_ERRORS, SLOT_KEY, target_key
from .metadata import comparison_metadata, differs, no_longer_published, number, text
from .resources import PgcdcResource


def build_slot_health(retained_wal_limit: int) -> Any:
    """The slot's health check, failing above ``retained_wal_limit`` bytes of retained WAL."""

    @asset_check(
        asset=SLOT_KEY,
        name="slot_health",
        description="The slot exists, is not invalidated, its WAL is not lost, and the WAL it "
        f"retains is under PGCDC_RETAINED_WAL_LIMIT ({retained_wal_limit} bytes).",
    )
    def slot_health(context: AssetCheckExecutionContext, pgcdc: PgcdcResource) -> AssetCheckResult:
        return slot_health_result(pgcdc.settings(), retained_wal_limit)

    return slot_health


def finished_at(settings: pipeline.ReplicationSettings) -> str | None:
    """When the replication was ended (``pgcdc finish``), what to say instead of watching its
    slot, which is gone by design; else ``None``."""
    chain = pipeline.store_of(settings).chain()
    return None if chain is None else chain.finished


def slot_health_result(
    settings: pipeline.ReplicationSettings, retained_wal_limit: int
) -> AssetCheckResult:
    if (ended := finished_at(settings)) is not None:
        return AssetCheckResult(passed=True, description=ended)
    try:
        positions = pipeline.source_positions(settings, timeout_s=5)
    except SlotError as exc:
        return AssetCheckResult(
            passed=False, severity=AssetCheckSeverity.ERROR, description=str(exc)
        )
    except ENGINE_ERRORS as exc:
        return AssetCheckResult(
            passed=False,
            severity=AssetCheckSeverity.ERROR,
            description=f"source unreachable: {exc}",
        )
    slot = positions.slot
    retained = slot.retained_wal_bytes or 0
    problems = []
    if slot.wal_status in ("lost", "unreserved"):
        problems.append(
            f"slot {slot.name} wal_status is {slot.wal_status}: WAL it needs is (about to be) "
            "removed; catch up now, or drop the slot and re-take the base snapshot"
        )
    if retained > retained_wal_limit:
        problems.append(
            f"slot {slot.name} retains {retained} bytes of WAL (limit {retained_wal_limit}): "
            "catch-up is stalled or too slow; check failed catchup runs and the sensor"
        )
    return AssetCheckResult(
        passed=not problems,
        severity=AssetCheckSeverity.ERROR,
        description="; ".join(problems) or None,
        metadata={
            "wal_status": text(slot.wal_status),
            "retained_wal_bytes": number(retained),
            "lag_bytes": number(positions.lag_bytes),
            "active": text(slot.active),
        },
    )


REPLICATED_TABLES = "replicated_tables"


@asset_check(
    asset=DECODED_CHANGES_KEY,
    name=REPLICATED_TABLES,
    description="The tables the replication copied and those the publication sends agree: "
    "none is no longer sent (its target copy would drift, silently), none is sent without "
    "having been added (its ranges fail to apply), no pgcdc add-table was left unfinished "
    "(its tables' changes are held back), and the publication sends no table otherwise than "
    "when it was copied (a row filter changed, a column list that sends more: what that let "
    "in was never copied). The slot sensor evaluates it every minute.",
)
def replicated_tables(
    context: AssetCheckExecutionContext, pgcdc: PgcdcResource
) -> AssetCheckResult:
    return replicated_tables_result(pgcdc.settings())


def replicated_tables_result(
    settings: pipeline.ReplicationSettings, timeout_s: int | None = None
) -> AssetCheckResult:
    """:func:`replicated_tables`'s evaluation: an error when ranges cannot apply (a table sent
    but never added), a warning when a target copy is not kept in sync (a table no longer
    sent: nothing fails, as with native replication; an add left unfinished: its tables'
    changes are held back; a table published otherwise since its copy: the rows or columns
    the change let in are not). An add under way passes, and says so."""
    try:
        agreement = pipeline.tables_agreement(settings, timeout_s=timeout_s)
    except ENGINE_ERRORS as exc:
        return AssetCheckResult(
            passed=False, severity=AssetCheckSeverity.WARN, description=f"not known: {exc}"
        )
    lines = [no_longer_published(t) for t in agreement.no_longer_published]
    if agreement.not_added:
        names = " ".join(str(t) for t in agreement.not_added)
        lines.append(
            f"{names}: sent by the publication but never copied to the target, so a range that "
            f"changes one fails to apply: run pgcdc add-table {names}"
        )
    if (adding := agreement.adding_line()) is not None:
        lines.append(adding)
    lines += agreement.reshaped_lines()
    return AssetCheckResult(
        check_name=REPLICATED_TABLES,
        passed=agreement.agree,
        severity=AssetCheckSeverity.ERROR if agreement.not_added else AssetCheckSeverity.WARN,
        description="; ".join(lines) or None,
        metadata={
            "no_longer_published": text(" ".join(map(str, agreement.no_longer_published))),
            "not_added": text(" ".join(map(str, agreement.not_added))),
            "adding": text(" ".join(map(str, agreement.adding))),
            "published_otherwise": text(" ".join(str(r.table) for r in agreement.reshaped)),
        },
    )


@asset_check(
    asset=DECODED_CHANGES_KEY,
    name="store_retention",
    description="The output store's retention keeps up: no applied range older than "
    "PGCDC_STORE_RETENTION (plus two prune intervals) is still stored.",
)
def store_retention(context: AssetCheckExecutionContext, pgcdc: PgcdcResource) -> AssetCheckResult:
    settings = pgcdc.settings()
    try:
        origin = pipeline.origin_progress(settings)
    except ENGINE_ERRORS as exc:
        return AssetCheckResult(
            passed=False, severity=AssetCheckSeverity.WARN, description=f"target: {exc}"
        )
    status = retention_status(pipeline.store_of(settings), origin, settings.store_retention)
    return AssetCheckResult(
        passed=status.overdue is None,
        severity=AssetCheckSeverity.WARN,
        description=status.overdue,
        metadata={
            "ranges_stored": status.ranges,
            "pruned_through": text(status.pruned_through),
            "oldest_range_age_s": text(
                None if status.oldest_age_s is None else round(status.oldest_age_s)
            ),
            "last_prune_age_s": text(
                None if status.last_prune_age_s is None else round(status.last_prune_age_s)
            ),
            "retention_s": text(
                "forever" if settings.store_retention is None else settings.store_retention
            ),
        },
    )


def build_consistency_check(tables: Sequence[TableName]) -> Any:
    """Target equals source, table by table (rows and content hash). Meaningful when the
    source is quiescent at an endpos that the target has reached: it belongs to cutover."""

    @multi_asset_check(
        name="target_matches_source",
        specs=[
            AssetCheckSpec(
                "target_matches_source",
                asset=target_key(t),
                description=(f"{t}: same row count and content hash as the source"),
            )
            for t in tables
        ],
        can_subset=False,
    )
    def target_matches_source(
        context: AssetCheckExecutionContext,
        pgcdc: PgcdcResource,
    ) -> Iterator[AssetCheckResult]:
        settings = pgcdc.settings()
        for stale in pipeline.no_longer_published(settings):  # no asset, so no check: a line
            context.log.warning(no_longer_published(stale))
        for comparison in verify.compare_tables(settings, tables):
            yield AssetCheckResult(
                asset_key=target_key(comparison.table),
                check_name="target_matches_source",
                passed=comparison.equal,
                severity=AssetCheckSeverity.ERROR,
                metadata=comparison_metadata([comparison]),
                description=None if comparison.equal else differs(comparison),
            )

    return target_matches_source
