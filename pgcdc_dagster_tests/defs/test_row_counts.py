"""The target tables' row counts after an apply: carried from range to range, from the base
snapshot's rows on the first apply after it, and counted only where nothing recorded is exact."""

from __future__ import annotations

import psycopg
import pytest
from dagster import AssetMaterialization, instance_for_test

from pgcdc_dagster.defs import row_counts
from pgcdc_dagster.defs.keys import BASE_SNAPSHOT_KEY
from pgcdc_dagster.defs.metadata import CONSISTENT_POINT, COPIED_TABLES, copied_tables, text
from pgcdc_dagster.defs.row_counts import TargetRowCounts
from pgcdc_dagster.engine.apply.results import ApplyResult, ApplyStatus, TableApplyCounts
from pgcdc_dagster.engine.identifiers import TableName
from pgcdc_dagster.engine.settings import ReplicationSettings
from pgcdc_dagster.engine.snapshot.common import TableCopyResult

COPIED = TableName("public", "copied")
ADDED = TableName("public", "added_later")


@pytest.mark.parametrize("snapshot_at", ["0/1000", "0/900"])
def test_the_first_apply_after_a_snapshot_carries_its_rows_and_counts_only_the_rest(
    target_dsn: str, monkeypatch: pytest.MonkeyPatch, snapshot_at: str
) -> None:
    """``copied`` is locked against reads while the counts are taken: a count of it would come
    back unknown. Its count comes from the snapshot's rows (those a resumed copy kept
    included) when the snapshot's consistent point is where this apply started; a table the
    snapshot did not copy is counted. A snapshot at another point is not used."""
    monkeypatch.setattr(row_counts, "COUNT_TIMEOUT_S", 0.2)
    with psycopg.connect(target_dsn, autocommit=True) as setup:
        setup.execute("CREATE TABLE copied (id int PRIMARY KEY)")
        setup.execute("INSERT INTO copied SELECT generate_series(1, 4)")  # 3 copied, 1 applied
        setup.execute("CREATE TABLE added_later (id int PRIMARY KEY)")
        setup.execute("INSERT INTO added_later SELECT generate_series(1, 5)")
    settings = ReplicationSettings(target_dsn=target_dsn)
    applied = ApplyResult(
        "0/1000-0/2000", ApplyStatus.APPLIED, replay_lsn="0/1F00", previous_lsn="0/1000"
    )
    applied.tables[str(COPIED)] = TableApplyCounts(changes=1, net_rows=1, inserted=1)
    copy = TableCopyResult(COPIED, rows=2, bytes=None, seconds=None, kept_rows=1)
    with instance_for_test() as instance, psycopg.connect(target_dsn) as blocker:
        instance.report_runless_asset_event(
            AssetMaterialization(
                BASE_SNAPSHOT_KEY,
                metadata={
                    CONSISTENT_POINT: text(snapshot_at),
                    COPIED_TABLES: copied_tables([copy], {}),
                },
            )
        )
        blocker.execute("LOCK TABLE copied IN ACCESS EXCLUSIVE MODE")
        counts = TargetRowCounts(instance, settings, [COPIED, ADDED]).after(applied)
        blocker.rollback()
    assert counts == {COPIED: 4 if snapshot_at == "0/1000" else None, ADDED: 5}
