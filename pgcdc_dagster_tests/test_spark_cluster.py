"""``pgcdc`` against a real Spark standalone cluster: two workers whose executors have the
project's dependencies but not the package, and executors that miss a dependency or cannot
reach the servers.

Every command runs in a process of its own (a fresh driver: this test session already holds a
local SparkSession, and a process has one). What the tables hold decides; the executors' own
stderr under the workers' work dirs says where the tasks ran.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest

from pgcdc_dagster_tests.support.s3 import S3Server, s3_server
from pgcdc_dagster_tests.support.spark_cluster import (
    StandaloneCluster,
    bare_python,
    deps_python,
    imports,
    kill_group,
    standalone_cluster,
)

# One worker runs the module: its fixtures (a server, a cluster) start once.
pytestmark = [pytest.mark.xdist_group("spark_cluster"), pytest.mark.long]

PGCDC = str(Path(sys.executable).parent / "pgcdc")
DRIVER_ROWS = 1_000
"""Tables estimated above this go to Spark's tasks; ``items`` (100 rows) stays the driver's."""
SPARK_MIN_CHANGES = 1_000
"""Ranges with this many changes or more are staged by Spark's workers."""


@dataclass(frozen=True)
class ExecutorPythons:
    deps: Path
    """Has psycopg, pyarrow, ... but not pgcdc_dagster."""
    bare: Path
    """The standard library only."""


@pytest.fixture(scope="module")
def driver_only(tmp_path_factory) -> Path | None:
    """A folder the cluster's workers see empty (a mount namespace of their own with a tmpfs
    over it, as on hosts that do not mount the driver's disk); ``None`` without root."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return None
    return tmp_path_factory.mktemp("driver-only")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, driver_only) -> Iterator[StandaloneCluster]:
    """One master and two one-core workers for the whole module."""
    with standalone_cluster(
        tmp_path_factory.mktemp("spark-standalone"), hidden=driver_only
    ) as running:
        yield running


@pytest.fixture(scope="module")
def executor_pythons(tmp_path_factory) -> ExecutorPythons:
    folder = tmp_path_factory.mktemp("executor-pythons")
    pythons = ExecutorPythons(deps=deps_python(folder / "deps"), bare=bare_python(folder / "bare"))
    # What the cluster's executors can import decides these tests: checked, not assumed.
    assert imports(pythons.deps, "psycopg, pyarrow, numpy, pandas, pydantic").returncode == 0
    no_package = imports(pythons.deps, "pgcdc_dagster")
    assert no_package.returncode != 0 and "No module named 'pgcdc_dagster'" in no_package.stderr
    assert "No module named 'psycopg'" in imports(pythons.bare, "psycopg").stderr
    return pythons


def spark_env(cluster: StandaloneCluster, python: Path, *extra_conf: str) -> dict[str, str]:
    conf = [
        f"spark.pyspark.python={python}",
        "spark.executor.memory=512m",
        # Small data: Spark's other shuffles need not be 200 partitions (the engine sizes the
        # staging's own, see apply.staging_partitions).
        "spark.sql.shuffle.partitions=4",
        *extra_conf,
    ]
    return {
        **os.environ,
        "PGCDC_SPARK_MASTER": cluster.master_url,
        "PGCDC_SPARK_CONF": "; ".join(conf),
        "PGCDC_SNAPSHOT_DRIVER_ROWS": str(DRIVER_ROWS),
        "PGCDC_SPARK_MIN_CHANGES": str(SPARK_MIN_CHANGES),
    }


@dataclass
class Ran:
    code: int
    out: str
    err: str
    seconds: float

    @property
    def last_line(self) -> str:
        lines = self.err.strip().splitlines()
        return lines[-1] if lines else ""


def pgcdc(env: dict[str, str], *args: str, timeout: float = 240.0) -> Ran:
    """``pgcdc args`` in a process group of its own (its Spark driver JVM with it), ended
    whole if it outlives ``timeout``."""
    started = time.monotonic()
    process = subprocess.Popen(
        [PGCDC, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(process)
        out, err = process.communicate()
        pytest.fail(f"pgcdc {' '.join(args)} still running after {timeout:.0f} s:\n{err[-4000:]}")
    finally:
        kill_group(process)  # whatever it left in its group (a driver JVM)
    return Ran(process.returncode, out, err, time.monotonic() - started)


def table_digest(dsn: str, table: str) -> tuple[int, str]:
    """Row count and md5 of every row in key order."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            f"SELECT count(*), md5(coalesce(string_agg(t::text, ',' ORDER BY id), '')) "
            f"FROM {table} t"
        ).fetchone()
    assert row is not None
    return int(row[0]), str(row[1])


def rows_on_target(dsn: str) -> dict[str, int]:
    """Rows of every user table on the target (those the command created, if any; not the
    record of their source columns, :mod:`pgcdc_dagster.engine.apply.ddl`'s)."""
    with psycopg.connect(dsn) as conn:
        tables = conn.execute(
            "SELECT format('%I.%I', schemaname, tablename) FROM pg_tables "
            "WHERE schemaname NOT IN ('pg_catalog', 'information_schema', 'pgcdc_ddl')"
        ).fetchall()
        counts: dict[str, int] = {}
        for (name,) in tables:
            (counts[name],) = conn.execute(f"SELECT count(*) FROM {name}").fetchone() or (0,)
        return counts


def slots_of(dsn: str) -> list[str]:
    """The replication slots of ``dsn``'s database."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT slot_name FROM pg_replication_slots WHERE database = current_database()"
        ).fetchall()
    return [name for (name,) in rows]


def with_big_tables(source_dsn: str, accounts: int = 60_000, events: int = 30_000) -> None:
    """Beside ``items`` (100 rows, the driver's): two tables past :data:`DRIVER_ROWS`, one
    Spark task each, so both workers may get one."""
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE accounts (id int PRIMARY KEY, owner text, balance numeric(12,2))"
        )
        conn.execute(
            "INSERT INTO accounts SELECT g, 'owner ' || g, (g %% 1000) * 1.25 "
            "FROM generate_series(1, %s) g",
            (accounts,),
        )
        conn.execute(
            "CREATE TABLE events (id bigint PRIMARY KEY, kind text, at timestamptz, payload jsonb)"
        )
        conn.execute(
            "INSERT INTO events SELECT g, 'k' || (g %% 7), "
            "'2026-01-01'::timestamptz + g * interval '1 s', jsonb_build_object('n', g) "
            "FROM generate_series(1, %s) g",
            (events,),
        )
        conn.execute("ANALYZE")


COPIED = re.compile(r"copied ([\d,]+) rows, .* of (\S+) \(")
STAGED = re.compile(r"staged [\d,]+ net rows of ([\d,]+) changes of (\S+) \(")


def per_table(pattern: re.Pattern[str], lines: dict[Path, list[str]]) -> dict[str, int]:
    """The counts that ``pattern``'s task lines report (count, table), summed by table."""
    totals: dict[str, int] = {}
    for line in (line for found in lines.values() for line in found):
        match = pattern.search(line)
        if match:
            count, table = int(match.group(1).replace(",", "")), match.group(2)
            totals[table] = totals.get(table, 0) + count
    return totals


def on_the_cluster(
    cluster: StandaloneCluster, env: dict[str, str], *args: str, timeout: float = 240.0
) -> tuple[Ran, str]:
    """``pgcdc args``, and the id of the one Spark application it ran on the cluster."""
    before = cluster.applications()
    ran = pgcdc(env, *args, timeout=timeout)
    started = cluster.applications() - before
    assert len(started) == 1, (started, ran.err[-4000:])
    return ran, started.pop()


def test_snapshot_and_catchup_run_on_the_cluster_workers_without_the_package_installed(
    cluster, executor_pythons, cli_env
):
    source, target = cli_env["PGCDC_SOURCE_DSN"], cli_env["PGCDC_TARGET_DSN"]
    with_big_tables(source)
    env = spark_env(cluster, executor_pythons.deps)

    snapshot, snapshot_app = on_the_cluster(cluster, env, "snapshot")
    assert snapshot.code == 0, snapshot.err[-4000:]
    with psycopg.connect(source, autocommit=True) as conn:
        conn.execute("UPDATE accounts SET balance = balance + 1")  # 60,000 changes
        conn.execute(
            "INSERT INTO accounts SELECT g, 'late', 0 FROM generate_series(60001, 60500) g"
        )
        conn.execute("DELETE FROM accounts WHERE id % 97 = 0")
        conn.execute("UPDATE events SET payload = payload || '{\"seen\": true}' WHERE id <= 5000")
        conn.execute("DELETE FROM items WHERE id <= 10")
    catchup, catchup_app = on_the_cluster(cluster, env, "catchup", "--endpos", "current")
    assert catchup.code == 0, catchup.err[-4000:]

    for table in ("accounts", "events", "items"):
        assert table_digest(target, table) == table_digest(source, table), table
    assert table_digest(target, "accounts")[0] == 60500 - 60500 // 97

    # The big tables' copies and the whole range's staging ran on the workers' executors,
    # from the package the driver shipped (their Python has none installed); the driver
    # copied items itself.
    copies = cluster.task_lines(snapshot_app)
    assert per_table(COPIED, copies) == {"public.accounts": 60_000, "public.events": 30_000}, (
        copies or cluster.logs_tail()
    )
    staging = cluster.task_lines(catchup_app)
    assert per_table(STAGED, staging) == {
        "public.accounts": 60_000 + 500 + 60_500 // 97,
        "public.events": 5_000,
        "public.items": 10,
    }, staging or cluster.logs_tail()
    assert {cluster.worker_of(log) for log in (*copies, *staging)}  # one worker, or both

    # Each command names the application, for its logs on the cluster.
    assert snapshot_app in snapshot.out + snapshot.err, snapshot.out + snapshot.err
    assert catchup_app in catchup.out + catchup.err, catchup.out + catchup.err


def test_executors_without_psycopg_fail_at_once_with_one_line_and_copy_nothing(
    cluster, executor_pythons, cli_env
):
    source, target = cli_env["PGCDC_SOURCE_DSN"], cli_env["PGCDC_TARGET_DSN"]
    with_big_tables(source, accounts=3_000, events=2_000)
    env = spark_env(cluster, executor_pythons.bare)

    snapshot, app = on_the_cluster(cluster, env, "snapshot", timeout=120)

    assert snapshot.code != 0 and snapshot.seconds < 60, snapshot.err[-4000:]
    line = snapshot.last_line
    assert "psycopg" in line and "spark.archives" in line, snapshot.err[-4000:]
    assert "Traceback" not in snapshot.err, snapshot.err[-4000:]
    assert cluster.task_lines(app) == {}  # no copy task started
    assert sum(rows_on_target(target).values()) == 0, rows_on_target(target)
    assert slots_of(source) == []


def test_executors_that_cannot_reach_the_target_fail_at_once(cluster, executor_pythons, cli_env):
    """Inside the cluster the servers' address leads elsewhere: the executors' libpq connects
    to 127.0.0.2, where nothing listens (the test clusters listen on 127.0.0.1 only, and their
    connection strings name a host and no hostaddr, so PGHOSTADDR decides where libpq goes).
    The driver, outside, reaches both servers; the executors reach neither the target nor the
    source, and the check names the first it tried."""
    source, target = cli_env["PGCDC_SOURCE_DSN"], cli_env["PGCDC_TARGET_DSN"]
    assert all("hostaddr" not in dsn and "host=127.0.0.1" in dsn for dsn in (source, target))
    with_big_tables(source, accounts=3_000, events=2_000)
    env = spark_env(cluster, executor_pythons.deps, "spark.executorEnv.PGHOSTADDR=127.0.0.2")

    snapshot, app = on_the_cluster(cluster, env, "snapshot", timeout=120)

    assert snapshot.code != 0 and snapshot.seconds < 60, snapshot.err[-4000:]
    line = snapshot.last_line
    assert "executors" in line and "connect" in line and "127.0.0.2" in line, snapshot.err[-4000:]
    assert "Traceback" not in snapshot.err, snapshot.err[-4000:]
    assert cluster.task_lines(app) == {}  # no copy task started
    assert sum(rows_on_target(target).values()) == 0, rows_on_target(target)
    assert slots_of(source) == []


def test_a_store_the_executors_cannot_read_is_staged_on_the_driver_or_refused(
    cluster, executor_pythons, cli_env, driver_only
):
    """The output store on the driver's disk only: a range big enough for Spark is staged on
    the driver, with one warning line, and the target ends equal; with
    ``PGCDC_SPARK_STAGING=required`` the catch-up stops in one line, nothing applied. Then a
    range an add held back is staged on the driver too."""
    if driver_only is None:
        pytest.skip("hiding a folder from the workers needs root (a mount namespace)")
    source, target = cli_env["PGCDC_SOURCE_DSN"], cli_env["PGCDC_TARGET_DSN"]
    env = {
        **spark_env(cluster, executor_pythons.deps),
        "PGCDC_STORE": str(driver_only / cli_env["PGCDC_SLOT"]),
        "PGCDC_SNAPSHOT_DRIVER_ROWS": str(10**9),  # the copy is the driver's: not the point
    }
    taken = pgcdc(env, "snapshot")
    assert taken.code == 0, taken.err[-4000:]
    with psycopg.connect(source, autocommit=True) as conn:
        conn.execute("INSERT INTO items SELECT g, 'more' FROM generate_series(101, 1300) g")
    before = table_digest(target, "items")

    refused = pgcdc({**env, "PGCDC_SPARK_STAGING": "required"}, "catchup", "--endpos", "current")
    assert refused.code == 1, refused.err[-4000:]
    assert "cannot read" in refused.last_line and "PGCDC_STORE" in refused.last_line
    assert table_digest(target, "items") == before  # nothing applied

    staged = pgcdc(env, "catchup", "--endpos", "current", "--json")
    assert staged.code == 0, staged.err[-4000:]
    totals = json.loads(staged.out)["follow"]
    assert totals["staged_on_driver"] == 1, (totals, staged.err[-4000:])
    assert "executors cannot read the store" in totals["staged_on_driver_why"], totals
    assert "pgcdc: warning: 1 range(s) staged on the driver" in staged.err, staged.err
    assert table_digest(target, "items") == table_digest(source, "items")
    _a_held_back_range_is_staged_on_the_driver(env, source, target)


def _a_held_back_range_is_staged_on_the_driver(
    env: dict[str, str], source: str, target: str
) -> None:
    """``pgcdc add-table`` while a catch-up holds back a range of the added table's changes
    big enough for Spark, the store on the driver's disk only: the add stages that range on
    the driver, says so in one line, and the added table ends equal."""
    with psycopg.connect(source, autocommit=True) as conn:
        conn.execute("CREATE TABLE more (id int PRIMARY KEY, v text)")
        conn.execute("INSERT INTO more SELECT g, 'first' FROM generate_series(1, 100) g")
    adding = subprocess.Popen(
        [PGCDC, "add-table", "public.more"],
        env={**env, "PGCDC_FAILPOINT": "add.after_copy=sleep(6)"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while table_digest_or_none(target, "more") is None:  # its copy on the target
            assert adding.poll() is None and time.monotonic() < deadline, adding.stderr
            time.sleep(0.2)
        with psycopg.connect(source, autocommit=True) as conn:  # held back for the add
            conn.execute(
                "INSERT INTO more SELECT g, 'held' FROM generate_series(101, 1400) g; "
                "INSERT INTO items VALUES (2001, 'beside')"
            )
        caught = pgcdc(env, "catchup", "--endpos", "current")
        assert caught.code == 0, caught.err[-4000:]
        out, err = adding.communicate(timeout=240)
    finally:
        kill_group(adding)
    assert adding.returncode == 0, err[-4000:]
    assert "warning: 1 held-back range(s) staged on the driver: executors cannot read" in out, out
    assert table_digest(target, "more") == table_digest(source, "more")


def table_digest_or_none(dsn: str, table: str) -> tuple[int, str] | None:
    """:func:`table_digest` once ``table`` exists and holds rows; ``None`` before."""
    with psycopg.connect(dsn) as conn:
        there = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (table,)).fetchone()
        if not there or not there[0]:
            return None
    digest = table_digest(dsn, table)
    return digest if digest[0] else None


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with s3_server() as server:
        yield server


def test_a_store_on_s3_is_read_by_the_workers_that_stage_the_range(
    cluster, executor_pythons, cli_env, s3
):
    """The output store on the S3 server, which the workers reach with credentials of their
    own (``spark.executorEnv``; the driver passes them only the endpoint): the workers stage
    the range from there, and their logs show the tasks. Without credentials on the workers,
    ``PGCDC_SPARK_STAGING=required`` stops in one line naming them, nothing applied."""
    source, target = cli_env["PGCDC_SOURCE_DSN"], cli_env["PGCDC_TARGET_DSN"]
    bucket = s3.new_bucket()
    base = {
        **spark_env(cluster, executor_pythons.deps),
        **s3.env,
        "PGCDC_STORE": f"s3://{bucket}/{cli_env['PGCDC_SLOT']}",
        "PGCDC_SNAPSHOT_DRIVER_ROWS": str(10**9),  # the copy is the driver's: not the point
    }
    taken = pgcdc(base, "snapshot")
    assert taken.code == 0, taken.err[-4000:]
    with psycopg.connect(source, autocommit=True) as conn:
        conn.execute("INSERT INTO items SELECT g, 'more' FROM generate_series(101, 1300) g")
    before = table_digest(target, "items")

    refused = pgcdc({**base, "PGCDC_SPARK_STAGING": "required"}, "catchup", "--endpos", "current")
    assert refused.code == 1, refused.err[-4000:]
    assert f"cannot read s3://{bucket}/" in refused.last_line, refused.last_line
    assert "spark.executorEnv.AWS_ACCESS_KEY_ID" in refused.last_line, refused.last_line
    assert s3.secret not in refused.err
    assert table_digest(target, "items") == before  # nothing applied

    credentials = [
        f"spark.executorEnv.{name}={s3.env[name]}"
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")
    ]
    env = {**base, "PGCDC_SPARK_CONF": "; ".join([base["PGCDC_SPARK_CONF"], *credentials])}
    staged, app = on_the_cluster(cluster, env, "catchup", "--endpos", "current", "--json")
    assert staged.code == 0, staged.err[-4000:]
    assert json.loads(staged.out)["follow"]["staged_on_driver"] == 0, staged.out
    assert s3.secret not in staged.out + staged.err
    assert per_table(STAGED, cluster.task_lines(app)) == {"public.items": 1_200}, (
        cluster.logs_tail()
    )
    assert table_digest(target, "items") == table_digest(source, "items")
