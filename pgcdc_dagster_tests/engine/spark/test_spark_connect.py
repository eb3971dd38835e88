"""The same snapshot copy and Spark compaction through a Spark Connect server (``sc://``)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from pgcdc_dagster.engine.apply.transaction import apply_range
from pgcdc_dagster.engine.compare import verify
from pgcdc_dagster.engine.control import pipeline
from pgcdc_dagster.engine.settings import SPARK_TABLE_ROWS, ReplicationSettings
from pgcdc_dagster.engine.spark import server as spark_server
from pgcdc_dagster.engine.spark.executors import check_executors, is_connect_session, package_zip
from pgcdc_dagster.engine.spark.session import get_spark

# One worker runs the module: its fixtures (a server, a cluster) start once.
pytestmark = [pytest.mark.xdist_group("spark_connect")]


@pytest.fixture(scope="module")
def warm_store(tmp_path_factory) -> Iterator[Path]:
    """An output store with a warm Spark Connect server recorded in it, as ``pgcdc spark
    start`` leaves it (the server that ships inside the pyspark wheel)."""
    store = tmp_path_factory.mktemp("warm-store")
    server, started = spark_server.start(store, "local[2]")
    try:
        assert started and server.url.startswith("sc://127.0.0.1:")
        assert spark_server.start(store)[0] == server  # found again, not started twice
        yield store
    finally:
        stopped = spark_server.stop(store)
    assert stopped == server
    assert spark_server.running(store) is None
    assert not spark_server.record_path(store).exists()
    # Gone: whoever looks now gets local Spark, not an error.
    assert spark_server.spark_target(None, None, store) == {"master": None, "remote": None}


def test_snapshot_and_spark_compaction_work_unchanged_over_spark_connect(
    warm_store, source_dsn, target_dsn
):
    # A process holds either a classic or a Connect session, never both (PySpark refuses):
    # the test session already has a classic one, so the scenario runs in its own process.
    done = subprocess.run(
        [sys.executable, "-c", f"import {__name__} as m, sys; m.scenario(*sys.argv[1:])",
         source_dsn, target_dsn, str(warm_store)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert "connect scenario ok" in done.stdout


def scenario(source_dsn: str, target_dsn: str, store: str) -> None:
    """Snapshot through Connect, then one range applied with compaction on Connect: settings
    that name no Spark find the warm server recorded in the store."""
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE t (id int PRIMARY KEY, v text);"
            "INSERT INTO t SELECT g, 'v' || g FROM generate_series(1, 20000) g"
        )
    settings = ReplicationSettings(
        source_dsn=source_dsn,
        target_dsn=target_dsn,
        slot="connect_slot",
        store=store,
    )
    target = settings.spark_target()
    assert target["remote"] == spark_server.running_url(Path(store))
    # The warm server runs local[*] on this machine's cores: the driver copies every table
    # (faster on the same cores); a server on a cluster, or a configured remote, takes big ones.
    assert settings.driver_max_rows() == sys.maxsize
    remote = settings.model_copy(update={"spark_remote": target["remote"]})
    assert remote.driver_max_rows() == SPARK_TABLE_ROWS
    settings = settings.model_copy(update={"snapshot_driver_rows": 0})  # every table on Spark
    spark = get_spark(**target)
    assert is_connect_session(spark)
    snapshot = pipeline.take_snapshot(settings, spark)
    assert snapshot.rows == 20000
    assert snapshot.spark_app is not None and snapshot.spark_app.application_id
    # The executors were checked before the copy, and import the package from the zip the
    # session shipped (addArtifacts), not from this checkout.
    check = check_executors(spark, {"source": source_dsn, "target": target_dsn})
    assert check is not None and check.tasks >= 1
    assert package_zip().name in check.versions["pgcdc_dagster.engine.snapshot.copy"], check

    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute("UPDATE t SET v = 'x' WHERE id % 3 = 0")
        conn.execute("DELETE FROM t WHERE id % 7 = 0")
    consistent_point = pipeline.store_of(settings).consistent_point()
    endpos = pipeline.resolve_endpos(settings, "current")
    rng = pipeline.plan_next_range(consistent_point, None, endpos, 1 << 30)
    assert rng is not None
    pipeline.receive_range(settings, rng)
    applied = apply_range(
        settings.target_dsn,
        pipeline.stored_range(settings, rng),
        settings.origin,
        spark=spark,
        store=pipeline.store_of(settings),
        spark_min_changes=1,  # force the Spark compaction path
    )
    assert applied.status == "applied" and applied.compaction_path == "spark"
    assert applied.spark_app is not None and applied.spark_tasks >= 1
    assert applied.spark_app.application_id == snapshot.spark_app.application_id
    comparisons = verify.compare_tables(settings, pipeline.replicated_tables(settings))
    assert [(str(c.table), c.equal) for c in comparisons] == [("public.t", True)]
    spark.stop()
    print("connect scenario ok")


@pytest.mark.parametrize(
    ("master", "remote", "local"),
    [
        (None, None, True),  # local Spark: every table on the driver
        ("local[2]", None, True),
        ("spark://spark-master:7077", None, False),  # a cluster takes tables past 2M rows
        (None, "sc://spark-connect:15002", False),
        ("local[2]", "sc://spark-connect:15002", False),  # remote wins, as in get_spark
    ],
)
def test_snapshot_split_follows_where_spark_cores_are(
    master: str | None, remote: str | None, local: bool, tmp_path: Path
) -> None:
    settings = ReplicationSettings(spark_master=master, spark_remote=remote, store=str(tmp_path))
    assert settings.driver_max_rows() == (sys.maxsize if local else SPARK_TABLE_ROWS)
    explicit = settings.model_copy(update={"snapshot_driver_rows": 0})
    assert explicit.driver_max_rows() == 0  # the setting always wins
