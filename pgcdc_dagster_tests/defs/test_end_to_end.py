"""Through Dagster on real clusters: snapshot, sensor, catch-up ranges, cutover, secrets.

Dagster's own storage is PostgreSQL (dagster-postgres) on a throwaway cluster. The source and
the target need a password here, so the test can prove it never reaches metadata or logs.
"""

from __future__ import annotations

import itertools
import json
import secrets
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from dagster import (
    AssetCheckEvaluation,
    AssetCheckSeverity,
    AssetKey,
    AssetObservation,
    DagsterInstance,
    DagsterRunStatus,
    Definitions,
    build_sensor_context,
    instance_for_test,
)
from dagster._core.test_utils import create_run_for_test
from psycopg import sql

from pgcdc_dagster.definitions import build_definitions, resolve_tables
from pgcdc_dagster.defs.partitions import LSN_RANGES
from pgcdc_dagster.defs.run_liveness import PROCESS_TAG, RANGE_LOCK_TAG, lock_holder_name
from pgcdc_dagster.demo.local_cluster import (
    LOGICAL_SOURCE_SETTINGS,
    LocalCluster,
    temporary_cluster,
)
from pgcdc_dagster.engine.compare import verify
from pgcdc_dagster.engine.control import pipeline
from pgcdc_dagster.engine.control.range_lock import range_lock
from pgcdc_dagster.engine.lsn import Lsn, LsnRange
from pgcdc_dagster.engine.processes import identity as process_identity
from pgcdc_dagster.engine.settings import ReplicationSettings
from pgcdc_dagster_tests.support.pg import flush_lsn, run_sql

PASSWORD = "pw-" + secrets.token_hex(8)

SOURCE_SCHEMA = """
CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL, note text);
INSERT INTO accounts SELECT g, g * 10, 'n' || g FROM generate_series(1, 2000) g;
CREATE TABLE docs (id int PRIMARY KEY, title text, body text);
ALTER TABLE docs ALTER COLUMN body SET STORAGE EXTERNAL;
INSERT INTO docs SELECT g, 't' || g, repeat(md5(g::text), 300) FROM generate_series(1, 20) g;
CREATE TABLE events (kind text, n int);
ALTER TABLE events REPLICA IDENTITY FULL;
INSERT INTO events VALUES ('a', 1), ('a', 1), ('b', 2);
CREATE SCHEMA "Odd Schema";
CREATE TABLE "Odd Schema"."select" ("Key" int PRIMARY KEY, "order" text);
INSERT INTO "Odd Schema"."select" VALUES (1, 'one');
CREATE TABLE tickets (id serial PRIMARY KEY, v text);
INSERT INTO tickets (v) SELECT 'v' FROM generate_series(1, 41);
"""


@dataclass
class Replication:
    source: str
    target: str
    settings: ReplicationSettings
    defs: Definitions
    instance: DagsterInstance

    def sql(self, *statements: str) -> None:
        run_sql(self.source, *statements)

    def flush(self) -> Lsn:
        return flush_lsn(self.source)

    def run(self, job: str, partition_key: str | None = None, run_config=None):
        return self.defs.resolve_job_def(job).execute_in_process(
            instance=self.instance,
            partition_key=partition_key,
            run_config=run_config or {},
            raise_on_error=False,
        )

    def register(self, rng: LsnRange) -> str:
        self.instance.add_dynamic_partitions(LSN_RANGES, [rng.partition_key])
        return rng.partition_key

    def chain_end(self) -> Lsn:
        store = pipeline.store_of(self.settings)
        return store.chain_end()

    def sensor(self, cursor: str | None = None):
        sensor = self.defs.resolve_sensor_def("slot_progress_sensor")
        # Only what the sensor requires, as the daemon does (the range lock is a run's).
        resources = {"pgcdc": self.defs.resources["pgcdc"]}
        with build_sensor_context(
            instance=self.instance, resources=resources, cursor=cursor
        ) as ctx:
            return sensor(ctx)


@pytest.fixture(scope="module")
def secure_cluster() -> Iterator[LocalCluster]:
    cluster = temporary_cluster(LOGICAL_SOURCE_SETTINGS, password=PASSWORD, prefix="pgcdc-e2e-")
    with cluster:
        yield cluster
    cluster.destroy()


@pytest.fixture
def replication(secure_cluster, target_cluster, tmp_path, monkeypatch) -> Iterator[Replication]:
    suffix = uuid.uuid4().hex[:8]
    with psycopg.connect(secure_cluster.dsn(), autocommit=True) as conn:
        for name in (f"e2e_src_{suffix}", f"e2e_tgt_{suffix}"):
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    with psycopg.connect(target_cluster.dsn(), autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(f"dagster_{suffix}")))
    source = secure_cluster.dsn(f"e2e_src_{suffix}")
    target = secure_cluster.dsn(f"e2e_tgt_{suffix}")
    with psycopg.connect(source, autocommit=True) as conn:
        conn.execute(SOURCE_SCHEMA)
    env = {
        "PGCDC_SOURCE_DSN": source,
        "PGCDC_TARGET_DSN": target,
        "PGCDC_STORE": str(tmp_path / "store"),
        "PGCDC_SLOT": f"e2e_{suffix}",
        "PGCDC_RANGE_MAX_BYTES": str(4 * 1024 * 1024),
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    tables, error = resolve_tables(env)
    assert error is None
    storage_url = f"postgresql+psycopg2://postgres@127.0.0.1:{target_cluster.port}/dagster_{suffix}"
    with instance_for_test(
        overrides={"storage": {"postgres": {"postgres_url": storage_url}}}
    ) as instance:
        yield Replication(
            source,
            target,
            ReplicationSettings.from_env(env),
            build_definitions(tables, None),
            instance,
        )
    with psycopg.connect(secure_cluster.dsn(), autocommit=True) as conn:
        conn.execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
            "WHERE slot_name = %s AND NOT active",
            (env["PGCDC_SLOT"],),
        )


def identity_of_a_dead_process() -> str:
    """The ``pgcdc/process`` identity of a process that was running and has been killed."""
    child = subprocess.Popen(["sleep", "60"])
    identity = process_identity(child.pid)
    child.kill()
    child.wait()
    return identity


def metadata(result, key: AssetKey) -> dict:
    for event in result.get_asset_materialization_events():
        mat = event.step_materialization_data.materialization
        if mat.asset_key == key:
            return {k: v.value for k, v in mat.metadata.items()}
    raise AssertionError(f"no materialization of {key.to_user_string()}")


def test_snapshot_sensor_ranges_and_cutover_keep_target_equal_to_source(replication):
    r = replication
    snap = r.run("snapshot")
    assert snap.success
    snap_meta = metadata(snap, AssetKey("base_snapshot"))
    consistent_point = Lsn.parse(snap_meta["consistent_point"])
    assert snap_meta["slot"] == r.settings.slot

    # Writes after the snapshot: inserts, updates (one keeping a TOASTed body), deletes,
    # a key change, FULL-identity duplicates, odd identifiers.
    r.sql(
        "INSERT INTO accounts SELECT g, 0, 'new' FROM generate_series(2001, 2500) g",
        "UPDATE accounts SET balance = balance + 1 WHERE id % 7 = 0",
        "DELETE FROM accounts WHERE id % 11 = 0",
        "UPDATE accounts SET id = 100000 WHERE id = 1",
        "UPDATE docs SET title = 'changed' WHERE id = 3",
        "UPDATE events SET n = 9 WHERE ctid = (SELECT min(ctid) FROM events WHERE kind = 'a')",
        """INSERT INTO "Odd Schema"."select" VALUES (2, 'two')""",
        "SELECT nextval('tickets_id_seq')",
    )

    # The sensor registers the first range at the consistent point and requests its run.
    tick = r.sensor()
    assert len(tick.run_requests) == 1
    (registered,) = r.instance.get_dynamic_partitions(LSN_RANGES)
    assert registered == f"{consistent_point}-{Lsn.parse(registered.split('-')[1])}"
    first = LsnRange.from_partition_key(registered)
    assert first.start == consistent_point
    assert tick.run_requests[0].partition_key == first.partition_key
    observation, *sources = [e for e in tick.asset_events if isinstance(e, AssetObservation)]
    checks = [e for e in tick.asset_events if isinstance(e, AssetCheckEvaluation)]
    assert observation.asset_key == AssetKey("replication_slot")
    # The source tables are observed too (their planner's estimate, no table read).
    assert {s.asset_key for s in sources} == {
        AssetKey(["source", *k.path[1:]])
        for k in r.defs.resolve_asset_graph().get_all_asset_keys()
        if k.path[0] == "target"
    }
    assert all("estimated_rows" in s.metadata for s in sources)
    # The replication's own checks sit on the slot asset, which no range materialises.
    assert {(c.asset_key, c.check_name, c.passed) for c in checks} == {
        (AssetKey("replication_slot"), "slot_health", True),
        (AssetKey("replication_slot"), "replicated_tables", True),
        (AssetKey("replication_slot"), "store_retention", True),
        (AssetKey("replication_slot"), "slot_survives_failover", True),
    }
    assert int(observation.metadata["lag_bytes"].value) > 0
    r.register(first)
    # The slot is observed at most once a minute (the cursor says when it last was), and at
    # once when its state changes; the tick's decision is the same either way.
    quiet = r.sensor(cursor=tick.cursor)
    assert quiet.asset_events == [] and quiet.cursor == tick.cursor
    assert [q.partition_key for q in quiet.run_requests] == [first.partition_key]
    aged = json.loads(tick.cursor)
    observed = aged["observed_at"]
    aged["observed_at"] = _older(observed, 61)
    assert len(r.sensor(cursor=json.dumps(aged)).asset_events) == 1
    aged["observed_at"] = observed
    aged["state"]["active"] = "True" if aged["state"]["active"] == "False" else "False"
    assert len(r.sensor(cursor=json.dumps(aged)).asset_events) == 1

    # A range that is not done is requested again (how a failed run is retried): from the same
    # start, and it is the only range registered. Its end may have moved on: the source's
    # background writer logs a running-transactions record every 15 s, and a range that is not
    # stored is planned afresh towards the flushed WAL each tick.
    def requested_again(tick) -> LsnRange:
        (request,) = tick.run_requests
        again = LsnRange.from_partition_key(request.partition_key)
        assert again.start == first.start
        assert r.instance.get_dynamic_partitions(LSN_RANGES) == [again.partition_key]
        return again

    first = requested_again(r.sensor())

    # A run whose worker is gone never blocks: the sensor marks it failed, saying why, and
    # requests the range anyway. So is a run its command created and then died before
    # starting (NOT_STARTED, tagged with that command's process): dead, not queued.
    for job_name, status in (
        ("catchup", DagsterRunStatus.STARTED),
        ("follow", DagsterRunStatus.NOT_STARTED),
    ):
        dead = create_run_for_test(
            r.instance,
            job_name=job_name,
            status=status,
            tags={RANGE_LOCK_TAG: job_name, PROCESS_TAG: identity_of_a_dead_process()},
        )
        first = requested_again(r.sensor())
        assert r.instance.get_run_by_id(dead.run_id).status == DagsterRunStatus.FAILURE
        assert any(
            "worker is gone" in (record.message or "")
            for record in r.instance.all_logs(dead.run_id)
        )

    # While a catch-up run is alive (it holds the range lock), the sensor waits.
    in_flight = create_run_for_test(
        r.instance,
        job_name="catchup",
        status=DagsterRunStatus.STARTED,
        tags={RANGE_LOCK_TAG: "catchup"},
    )
    with range_lock(r.target, r.settings.slot, lock_holder_name(in_flight.run_id)):
        assert r.sensor().skip_reason is not None
    r.instance.delete_run(in_flight.run_id)

    result = r.run("catchup", first.partition_key)
    assert result.success
    received = metadata(result, AssetKey("decoded_changes"))
    assert received["start_lsn"] == str(first.start) and received["endpos"] == str(first.end)
    assert received["endpos_outcome"] in ("at_commit_boundary", "between_transactions")
    assert received["transactions"] == 8 - 1  # nextval() alone writes no published change
    applied = metadata(result, AssetKey(["target", "public", "accounts"]))
    assert applied["replay_lsn"] == received["transform_lsn"]
    assert "/" in applied["replay_lsn"]
    # Dagster's standard metadata: the range's rows, where it is stored, the table's rows.
    assert received["dagster/partition_row_count"] == received["changes"]
    assert received["dagster/uri"].startswith("file://") and first.key in received["dagster/uri"]
    with psycopg.connect(r.target) as conn:
        accounts = conn.execute("SELECT count(*) FROM accounts").fetchone()[0]
    assert applied["dagster/row_count"] == accounts
    assert applied["dagster/partition_row_count"] == applied["table_changes"] > 0
    assert applied["table_missing"] == 0  # every update and delete found its row
    assert "applied_in_commit_order" not in applied  # its net rows went in set-based
    assert snap_meta["dagster/row_count"] == snap_meta["rows"]

    # Re-running a finished range is a no-op reported as such.
    again = r.run("catchup", first.partition_key)
    assert again.success
    assert metadata(again, AssetKey("decoded_changes"))["already_stored"] is True
    assert metadata(again, AssetKey(["target", "public", "accounts"]))["apply_status"] == (
        "already_applied"
    )

    # A range that does not start where the chain ends is refused, naming the missing range.
    chain_end = r.chain_end()
    r.sql("INSERT INTO accounts VALUES (300000, 1, 'x')")
    out_of_order = LsnRange(chain_end + 8, r.flush())
    refused = r.run("catchup", r.register(out_of_order))
    assert not refused.success
    failure = next(e for e in refused.all_events if e.is_step_failure)
    assert "cannot run yet" in failure.step_failure_data.user_failure_data.description
    r.instance.delete_dynamic_partition(LSN_RANGES, out_of_order.partition_key)

    # Mid-transaction endpos: the straddling transaction goes whole to the next range.
    with psycopg.connect(r.source) as open_txn:
        open_txn.execute("INSERT INTO accounts VALUES (400000, 1, 'straddler 1')")
        with psycopg.connect(r.source) as other:
            endpos = Lsn(other.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()[0])
        open_txn.execute("INSERT INTO accounts VALUES (400001, 1, 'straddler 2')")
        open_txn.commit()
    r.sql("SELECT pg_switch_wal()")
    mid = LsnRange(r.chain_end(), endpos)
    mid_result = r.run("catchup", r.register(mid))
    assert mid_result.success
    assert metadata(mid_result, AssetKey("decoded_changes"))["endpos_outcome"] == (
        "mid_transaction"
    )
    with psycopg.connect(r.target) as conn:
        assert conn.execute("SELECT count(*) FROM accounts WHERE id >= 400000").fetchone()[0] == 0

    # A burst of writes bigger than one range: the CLI's loop runs several capped ranges.
    r.sql(
        "INSERT INTO accounts SELECT g, g, repeat('p', 200) FROM generate_series(500000, 530000) g",
        "UPDATE accounts SET note = 'bulk' WHERE id >= 500000",
    )
    # The sensor caps the next range at PGCDC_RANGE_MAX_BYTES.
    tick = r.sensor()
    capped = LsnRange.from_partition_key(tick.run_requests[0].partition_key)
    assert capped.start == r.chain_end()
    assert capped.end - capped.start == r.settings.range_max_bytes
    r.register(capped)
    ran = list(
        pipeline.catch_up(
            r.settings,
            r.flush(),
            run_step=lambda step: r.run("catchup", r.register(step.range)),
        )
    )
    assert len(ran) >= 2 and all(run.success for run in ran)
    with psycopg.connect(r.target) as conn:
        assert conn.execute("SELECT count(*) FROM accounts WHERE id >= 400000").fetchone()[0] == (
            2 + 30001
        )
        accounts = conn.execute("SELECT count(*) FROM accounts").fetchone()[0]
    # The row count carried from range to range is still exact after many ranges.
    assert metadata(ran[-1], AssetKey(["target", "public", "accounts"]))["dagster/row_count"] == (
        accounts
    )

    # Cutover: catch up to the flush position, sync sequences, verify.
    cut = r.run("cutover_job")
    assert cut.success
    checks = cut.get_asset_check_evaluations()
    assert [c.passed for c in checks if c.check_name == "data_consistency"] == [True]
    comparisons = verify.compare_tables(r.settings, pipeline.replicated_tables(r.settings))
    assert comparisons and all(c.equal for c in comparisons)
    with psycopg.connect(r.target) as conn:
        assert conn.execute("SELECT last_value FROM tickets_id_seq").fetchone()[0] == 42

    # Every range is contiguous and registered in LSN order.
    ranges = [LsnRange.from_partition_key(k) for k in r.instance.get_dynamic_partitions(LSN_RANGES)]
    assert ranges[0].start == consistent_point
    assert all(a.end == b.start for a, b in itertools.pairwise(ranges))

    # No credential in any run's events, metadata or messages.
    for run in r.instance.get_runs():
        for record in r.instance.all_logs(run.run_id):
            assert PASSWORD not in str(record)


def _tables_check(tick) -> list[AssetCheckEvaluation]:
    return [
        e
        for e in tick.asset_events
        if isinstance(e, AssetCheckEvaluation) and e.check_name == "replicated_tables"
    ]


def _older(stamp: str, seconds: float) -> str:
    """A sensor cursor's time (UTC, to the second) moved ``seconds`` back."""
    at = datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    return (at - timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%SZ")


def _aged(cursor: str) -> str:
    """``cursor`` as if the sensor's last look at its checks were a minute older."""
    aged = json.loads(cursor)
    for part in ("health", "tables", "retention"):
        aged[part]["checked_at"] = _older(aged[part]["checked_at"], 61)
    return json.dumps(aged)


def test_the_sensor_says_when_the_replicated_and_published_tables_part_ways(replication):
    """A table dropped from the publication (its target copy silently stops following) and
    one added to it without pgcdc add-table (its ranges would fail to apply): the slot
    sensor's ``replicated_tables`` evaluation, once a minute, names each with its fix; an
    unchanged outcome is not recorded again; the slot_health job runs the same check."""
    r = replication
    assert r.run("snapshot").success
    tick = r.sensor()
    (agree,) = _tables_check(tick)
    assert agree.check_name == "replicated_tables" and agree.passed
    assert agree.asset_key == AssetKey("replication_slot")
    quiet = r.sensor(cursor=_aged(tick.cursor))
    assert _tables_check(quiet) == []  # looked again, the same: not recorded again

    publication = sql.Identifier(r.settings.publication).as_string()
    r.sql(
        "CREATE TABLE later (id int PRIMARY KEY)",
        f"ALTER PUBLICATION {publication} ADD TABLE later",
        f"ALTER PUBLICATION {publication} DROP TABLE docs",
    )
    assert _tables_check(r.sensor(cursor=quiet.cursor)) == []  # within the minute
    (parted,) = _tables_check(r.sensor(cursor=_aged(quiet.cursor)))
    assert not parted.passed and parted.severity == AssetCheckSeverity.ERROR
    assert parted.description is not None
    assert "public.docs: replicated, but the publication no longer sends it" in (parted.description)
    assert "public.later: sent by the publication but never copied" in parted.description
    assert "run pgcdc add-table public.later" in parted.description
    assert parted.metadata["no_longer_published"].value == "public.docs"

    result = r.run("slot_health")
    (evaluation,) = [
        e for e in result.get_asset_check_evaluations() if e.check_name == "replicated_tables"
    ]
    assert not evaluation.passed and evaluation.description == parted.description


def test_wrong_password_is_one_clear_error_without_the_secret(secure_cluster):
    from pgcdc_dagster.engine.connect import ConnectError, connect

    dsn = secure_cluster.dsn(password="not-the-" + PASSWORD)
    with pytest.raises(ConnectError) as failure:
        connect(dsn, role="source")
    message = str(failure.value)
    assert "password authentication failed" in message
    assert "check the user and password" in message
    assert PASSWORD not in message


def test_a_source_ddl_shows_on_the_table_asset_with_its_new_columns(replication):
    """The range that meets an ``ADD COLUMN ... DEFAULT`` carries it out on the target and
    says so on the table's materialisation: the step, and the table's new column schema (the
    UI shows when the table's shape changed)."""
    r = replication
    assert r.run("snapshot").success
    r.sql(
        "ALTER TABLE accounts ADD COLUMN memo text DEFAULT 'n'",
        "UPDATE accounts SET balance = balance + 1 WHERE id = 2",
    )
    results = list(
        pipeline.catch_up(
            r.settings,
            r.flush(),
            run_step=lambda step: r.run("catchup", r.register(step.range)),
        )
    )
    assert all(result.success for result in results)
    reshaped = [
        meta
        for meta in (
            metadata(result, AssetKey(["target", "public", "accounts"])) for result in results
        )
        if "schema_changes" in meta
    ]
    assert [meta["schema_changes"] for meta in reshaped] == [
        "public.accounts: column memo text added, existing rows 'n'"
    ]
    assert [c.name for c in reshaped[0]["dagster/column_schema"].columns][-1] == "memo"
    assert "dagster/column_schema" not in metadata(
        results[0], AssetKey(["target", "public", "docs"])
    )
