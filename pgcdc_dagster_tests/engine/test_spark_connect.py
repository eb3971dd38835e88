"""The same snapshot copy and Spark compaction through a Spark Connect server (``sc://``)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from pgcdc_dagster.demo.local_cluster import free_port
from pgcdc_dagster.engine import pipeline, verify
from pgcdc_dagster.engine.apply import apply_range
from pgcdc_dagster.engine.settings import ReplicationSettings
from pgcdc_dagster.engine.spark_session import get_spark, is_connect_session


@pytest.fixture(scope="module")
def connect_url(tmp_path_factory) -> Iterator[str]:
    """A local Spark Connect server, the one that ships inside the pyspark wheel."""
    import pyspark

    home = Path(pyspark.__file__).parent
    port = free_port()
    work = tmp_path_factory.mktemp("spark-connect")
    env = {
        **os.environ,
        "SPARK_HOME": str(home),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "PYSPARK_PYTHON": sys.executable,
        "SPARK_PID_DIR": str(work),
        "SPARK_LOG_DIR": str(work),
    }
    args = [
        "--master", "local[2]",
        "--conf", "spark.connect.grpc.binding.address=127.0.0.1",
        "--conf", f"spark.connect.grpc.binding.port={port}",
        "--conf", "spark.ui.enabled=false",
    ]  # fmt: skip
    subprocess.run([str(home / "sbin" / "start-connect-server.sh"), *args], env=env, check=True)
    try:
        deadline = time.monotonic() + 90
        while True:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if time.monotonic() > deadline:
                logs = "\n".join(p.read_text()[-2000:] for p in work.glob("*.out"))
                pytest.fail(f"Spark Connect server did not listen on {port}:\n{logs}")
            time.sleep(0.5)
        yield f"sc://127.0.0.1:{port}"
    finally:
        pids = [int(f.read_text().strip()) for f in work.glob("*.pid")]
        subprocess.run([str(home / "sbin" / "stop-connect-server.sh")], env=env, check=False)
        _make_sure_gone(pids)


def _make_sure_gone(pids: list[int], wait_s: float = 15.0) -> None:
    """The stop script only sends SIGTERM and forgets: a server still busy can outlive the
    test session (it did, orphaned). SIGKILL whatever is left after ``wait_s``."""
    deadline = time.monotonic() + wait_s
    for pid in pids:
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        if Path(f"/proc/{pid}").exists():
            os.kill(pid, signal.SIGKILL)


def test_snapshot_and_spark_compaction_work_unchanged_over_spark_connect(
    connect_url, source_dsn, target_dsn, tmp_path
):
    # A process holds either a classic or a Connect session, never both (PySpark refuses):
    # the test session already has a classic one, so the scenario runs in its own process.
    done = subprocess.run(
        [sys.executable, "-c", f"import {__name__} as m, sys; m.scenario(*sys.argv[1:])",
         connect_url, source_dsn, target_dsn, str(tmp_path / "store")],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert "connect scenario ok" in done.stdout


def scenario(connect_url: str, source_dsn: str, target_dsn: str, store: str) -> None:
    """Snapshot through Connect, then one range applied with compaction on Connect."""
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE t (id int PRIMARY KEY, v text);"
            "INSERT INTO t SELECT g, 'v' || g FROM generate_series(1, 20000) g"
        )
    spark = get_spark(remote=connect_url)
    assert is_connect_session(spark)
    settings = ReplicationSettings(
        source_dsn=source_dsn,
        target_dsn=target_dsn,
        slot="connect_slot",
        store=store,
        snapshot_driver_rows=0,  # the copy on Spark Connect, not in this process
    )
    snapshot = pipeline.take_snapshot(settings, spark)
    assert snapshot.rows == 20000

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
    comparisons = verify.compare_tables(settings, pipeline.replicated_tables(settings))
    assert [(str(c.table), c.equal) for c in comparisons] == [("public.t", True)]
    spark.stop()
    print("connect scenario ok")
