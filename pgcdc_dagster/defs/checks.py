"""Asset checks that do not belong to one materialisation: slot health, the store's retention,
target = source.

Where each sits, so that Dagster's UI shows its true state: the UI shows a check's latest result
only while it is newer than the asset's latest materialisation, or from the run that made it.
``decoded_changes`` and the target tables are materialised by every range (five a second under
a follow), so a check evaluated beside them (by the sensor, from the UI) would show "Not
evaluated" within a second. The checks of the replication as a whole (its slot, the tables it
sends, the store's retention) therefore sit on ``replication_slot``, which is observed, never
materialised; ``no_gap`` is recorded with each range on every target table the range
materialises (:mod:`.range_events`); ``target_matches_source`` on each target table, by the
``verify`` job and by the cutover, whose own follow materialised the tables just before."""

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

from ..engine.compare import verify
from ..engine.control import pipeline
from ..engine.identifiers import TableName
from ..engine.source.failover import failover_readiness
from ..engine.source.slot import SlotError
from ..engine.store.retention import retention_status
from .failures import ENGINE_ERRORS
from .keys import SLOT_KEY, target_key
from .metadata import comparison_metadata, differs, no_longer_published, number, text
from .resources import PgcdcResource
from .run_liveness import lock_holder_name

SLOT_HEALTH = "slot_health"


def build_slot_health(retained_wal_limit: int) -> Any:
    """The slot's health check, failing above ``retained_wal_limit`` bytes of retained WAL."""

    @asset_check(
        asset=SLOT_KEY,
        name=SLOT_HEALTH,
        description="The slot exists, is not invalidated, its WAL is not lost, and the WAL it "
        f"retains is under PGCDC_RETAINED_WAL_LIMIT ({retained_wal_limit} bytes). The slot "
        "sensor evaluates it every minute.",
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


SLOT_SURVIVES_FAILOVER = "slot_survives_failover"


@asset_check(
    asset=SLOT_KEY,
    name=SLOT_SURVIVES_FAILOVER,
    description="A failover of the source to one of its physical standbys keeps the slot and "
    "loses nothing the target has: the slot is a failover slot (PostgreSQL 17+), each standby "
    "streams from a slot named in the source's synchronized_standby_slots, and each standby "
    "the DSN reaches holds a synced, persistent copy of the slot. Warns, naming each setting "
    "to change; passes when the source has no standby. The slot sensor evaluates it every "
    "minute.",
)
def slot_survives_failover(
    context: AssetCheckExecutionContext, pgcdc: PgcdcResource
) -> AssetCheckResult:
    return slot_survives_failover_result(pgcdc.settings())


def slot_survives_failover_result(settings: pipeline.ReplicationSettings) -> AssetCheckResult:
    if (ended := finished_at(settings)) is not None:
        return AssetCheckResult(passed=True, description=ended)
    try:
        readiness = failover_readiness(settings.source_dsn, settings.slot)
    except ENGINE_ERRORS as exc:
        return AssetCheckResult(
            passed=False,
            severity=AssetCheckSeverity.WARN,
            description=f"source unreachable: {exc}",
        )
    gaps = readiness.gaps()
    return AssetCheckResult(
        passed=not gaps,
        severity=AssetCheckSeverity.WARN,
        description="; ".join(gaps) or None,
        metadata={key: text(value) for key, value in readiness.facts().items()},
    )


REPLICATED_TABLES = "replicated_tables"


@asset_check(
    asset=SLOT_KEY,
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


STORE_RETENTION = "store_retention"


@asset_check(
    asset=SLOT_KEY,
    name=STORE_RETENTION,
    description="The output store (decoded_changes) keeps up its retention: no applied range "
    "older than PGCDC_STORE_RETENTION (plus two prune intervals) is still stored. The slot "
    "sensor evaluates it every minute.",
)
def store_retention(context: AssetCheckExecutionContext, pgcdc: PgcdcResource) -> AssetCheckResult:
    return store_retention_result(pgcdc.settings())


def store_retention_result(settings: pipeline.ReplicationSettings) -> AssetCheckResult:
    """:func:`store_retention`'s evaluation."""
    try:
        origin = pipeline.origin_progress(settings)
    except ENGINE_ERRORS as exc:
        return AssetCheckResult(
            passed=False, severity=AssetCheckSeverity.WARN, description=f"target: {exc}"
        )
    status = retention_status(pipeline.store_of(settings), origin, settings.store_retention)
    return AssetCheckResult(
        check_name=STORE_RETENTION,
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


TARGET_MATCHES_SOURCE = "target_matches_source"


def build_consistency_check(tables: Sequence[TableName]) -> Any:
    """Target equals source, table by table, chunk by chunk. The ``verify`` job compares both
    sides at one consistent point while the replication goes on (a running follow makes way
    for a moment, :func:`~pgcdc_dagster.engine.compare.verify.compare_online`); the cutover
    records it at its endpos. Each table's check can be executed on its own from the UI."""
    by_key = {target_key(t): t for t in tables}

    @multi_asset_check(
        name=TARGET_MATCHES_SOURCE,
        specs=[
            AssetCheckSpec(
                TARGET_MATCHES_SOURCE,
                asset=target_key(t),
                description=(
                    f"{t}: same rows as the source, chunk by chunk, both read at one "
                    "consistent point while the replication goes on (pgcdc verify, the "
                    "cutover)"
                ),
            )
            for t in tables
        ],
        can_subset=True,
    )
    def target_matches_source(
        context: AssetCheckExecutionContext,
        pgcdc: PgcdcResource,
    ) -> Iterator[AssetCheckResult]:
        settings = pgcdc.settings()
        for stale in pipeline.no_longer_published(settings):  # no asset, so no check: a line
            context.log.warning(no_longer_published(stale))
        selected = [by_key[k.asset_key] for k in context.selected_asset_check_keys]
        compared = verify.compare_online(
            settings,
            selected,
            lock_holder_name(context.run.run_id),
            spark=settings.spark_session,
            caught_up=lambda n: context.log.info(
                f"the target caught up to the verify's consistent point ({n} range(s))"
            ),
            progressed=lambda progress: context.log.info(progress.line()),
        )
        where = "as the sides stand" if compared.point is None else f"at {compared.point}"
        way = f"; {compared.made_way_by} made way" if compared.made_way_by else ""
        context.log.info(
            f"compared {len(selected)} table(s) {where} in {compared.seconds:.1f} s{way}"
        )
        for comparison in compared.tables:
            result = consistency_result(comparison)
            if compared.point is not None:
                result["metadata"]["compared_at"] = text(compared.point)
            yield AssetCheckResult(**result)

    return target_matches_source


def consistency_result(comparison: verify.TableComparison) -> dict[str, Any]:
    """One table's ``target_matches_source`` result, as the ``verify`` job and the cutover
    record it (arguments of ``AssetCheckResult`` or ``AssetCheckEvaluation``)."""
    return {
        "asset_key": target_key(comparison.table),
        "check_name": TARGET_MATCHES_SOURCE,
        "passed": comparison.equal,
        "severity": AssetCheckSeverity.ERROR,
        "metadata": comparison_metadata([comparison]),
        "description": None if comparison.equal else differs(comparison),
    }
