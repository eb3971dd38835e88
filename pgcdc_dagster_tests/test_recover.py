"""A slot lost for real (``max_slot_wal_keep_size`` small, WAL written while nothing read it)
and ``pgcdc recover``: a new slot, the target compared with the source at its point, only the
chunks that changed copied; killed between two chunks, the catch-up refuses and the next
recover converges; then the replication goes on and ends equal."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from pgcdc_dagster.demo.local_cluster import (
    LOGICAL_SOURCE_SETTINGS,
    LocalCluster,
    temporary_cluster,
)
from pgcdc_dagster_tests.conftest import databases_environment
from pgcdc_dagster_tests.test_cli import run_cli

PGCDC = str(Path(sys.executable).parent / "pgcdc")
ROWS = 40_000
CHUNK_ROWS = "2000"


@pytest.fixture(scope="module")
def losing_cluster() -> Iterator[LocalCluster]:
    """A source of its own: its WAL is switched and its slots lost on purpose."""
    cluster = temporary_cluster(LOGICAL_SOURCE_SETTINGS, prefix="pgcdc-test-losing-")
    with cluster:
        yield cluster
    cluster.destroy()


@pytest.fixture
def lost_env(losing_cluster, target_cluster, tmp_path, monkeypatch):
    with databases_environment(
        losing_cluster, target_cluster, target_cluster, tmp_path, monkeypatch
    ) as env:
        yield env


def _lose_the_slot(source_dsn: str, slot: str) -> None:
    """Nothing reads the slot while WAL is written past ``max_slot_wal_keep_size``; a checkpoint
    then removes the WAL it needed."""
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute("ALTER SYSTEM SET max_slot_wal_keep_size = '1MB'")
        conn.execute("SELECT pg_reload_conf()")
        try:
            for _ in range(4):
                conn.execute("CREATE TEMP TABLE IF NOT EXISTS filler (g int)")
                conn.execute("INSERT INTO filler VALUES (1)")
                conn.execute("SELECT pg_switch_wal()")
            conn.execute("CHECKPOINT")
            (status,) = conn.execute(
                "SELECT wal_status FROM pg_replication_slots WHERE slot_name = %s", (slot,)
            ).fetchone()
            assert status == "lost", status
        finally:
            conn.execute("ALTER SYSTEM RESET max_slot_wal_keep_size")
            conn.execute("SELECT pg_reload_conf()")


def _accounts_and_lines(source_dsn: str, accounts: int, lines: int) -> None:
    """A keyed table of ``accounts`` rows and a keyless one of ``lines`` rows, analysed."""
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE accounts (id int PRIMARY KEY, balance int, note text)")
        conn.execute(
            "INSERT INTO accounts SELECT g, g %% 100, 'account ' || g "
            "FROM generate_series(1, %s) g",
            (accounts,),
        )
        conn.execute("CREATE TABLE lines (line text)")
        conn.execute("ALTER TABLE lines REPLICA IDENTITY FULL")
        conn.execute(
            "INSERT INTO lines SELECT 'line ' || g FROM generate_series(1, %s) g", (lines,)
        )
        conn.execute("ANALYZE")


def _replicated_then_lost(env: dict[str, str], capsys) -> tuple[str, str]:
    """A small replication (a keyed table and a keyless one) snapshotted, then a change that
    nothing reads before its slot is lost: the source's and the target's DSNs."""
    source_dsn, target_dsn = env["PGCDC_SOURCE_DSN"], env["PGCDC_TARGET_DSN"]
    _accounts_and_lines(source_dsn, 5000, 1)
    code, _, err = run_cli(capsys, "snapshot")
    assert code == 0, err
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute("UPDATE accounts SET balance = 1 WHERE id <= 100")
        conn.execute("DELETE FROM accounts WHERE id = 4000")
    _lose_the_slot(source_dsn, env["PGCDC_SLOT"])
    return source_dsn, target_dsn


def _content(dsn: str) -> tuple:
    with psycopg.connect(dsn) as conn:
        return conn.execute(
            "SELECT (SELECT count(*) FROM accounts),"
            " (SELECT sum(hashtext(a::text)) FROM accounts a),"
            " (SELECT count(*) FROM lines), (SELECT sum(hashtext(line)) FROM lines)"
        ).fetchone()


def test_a_lost_slot_is_recovered_copying_only_the_chunks_that_changed(lost_env, capsys):
    """``--every-row``: every table compared chunk by chunk, as for a target that may have
    been written to."""
    source_dsn, target_dsn, slot = (
        lost_env["PGCDC_SOURCE_DSN"],
        lost_env["PGCDC_TARGET_DSN"],
        lost_env["PGCDC_SLOT"],
    )
    _accounts_and_lines(source_dsn, ROWS, 500)
    code, _, err = run_cli(capsys, "snapshot")
    assert code == 0, err
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute("UPDATE accounts SET balance = balance + 1 WHERE id <= 50")
    code, _, err = run_cli(capsys, "catchup")
    assert code == 0, err

    # Changes nothing reads: three key ranges of accounts and the keyless table.
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute("UPDATE accounts SET balance = -1 WHERE id BETWEEN 10001 AND 10100")
        conn.execute("DELETE FROM accounts WHERE id BETWEEN 25001 AND 25010")
        conn.execute("INSERT INTO accounts VALUES (50001, 1, 'new'), (50002, 2, 'new')")
        conn.execute("INSERT INTO lines VALUES ('while lost')")
    _lose_the_slot(source_dsn, slot)

    code, _, err = run_cli(capsys, "catchup")
    assert code != 0
    assert "is invalidated" in err and "pgcdc recover" in err, err

    # Killed once its first chunk is replaced: the catch-up refuses, naming the fix.
    killed = subprocess.run(
        [PGCDC, "recover", "--chunk-rows", CHUNK_ROWS, "--every-row"],
        env={**os.environ, "PGCDC_FAILPOINT": "recover.after_chunk=kill"},
        capture_output=True,
        text=True,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    code, _, err = run_cli(capsys, "catchup")
    assert code != 0 and "did not finish" in err and "pgcdc recover" in err, err

    code, out, err = run_cli(capsys, "recover", "--chunk-rows", CHUNK_ROWS, "--every-row", "--json")
    assert code == 0, err
    assert "pgcdc: recover compare: compared 100%" in err, err
    assert "pgcdc: recover repair: replaced 0/" in err, err  # the repair's progress
    recovered = json.loads(out)
    assert recovered["chunks_compared"] >= 20, recovered
    # The changed key ranges (each within a chunk or across two) and the keyless table's one
    # chunk, less the one the killed recover replaced: never the whole table.
    assert 1 <= recovered["chunks_repaired"] <= 7, recovered
    assert recovered["rows_copied"] < ROWS / 2, recovered
    assert _content(target_dsn) == _content(source_dsn)
    with capsys.disabled():
        print(f"\nrecovered after a kill: {recovered}")

    # The replication goes on from the recovery's point, exactly once.
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute("UPDATE accounts SET note = 'after' WHERE id % 1000 = 0")
        conn.execute("INSERT INTO lines VALUES ('after')")
    code, _, err = run_cli(capsys, "catchup")
    assert code == 0, err
    code, out, err = run_cli(capsys, "verify", "--json")
    assert code == 0, err
    assert json.loads(out)["equal"] is True, out
    with psycopg.connect(target_dsn) as conn:
        assert conn.execute("SELECT count(*) FROM lines").fetchone() == (502,)

    # A slot that is not lost is not recovered.
    code, _, err = run_cli(capsys, "recover")
    assert code != 0 and "is not lost" in err, err


def test_a_table_that_mostly_differs_is_replaced_whole_unless_a_foreign_key_references_it(
    lost_env, capsys
):
    """``--every-row``. A change in every chunk of two tables while the slot is lost: the one
    no foreign key references is replaced whole (truncated: a new file), the referenced one
    chunk by chunk (its file kept); a recovery killed inside a replacement is redone by the
    next; both tables end equal and the replication goes on."""
    source_dsn, target_dsn = lost_env["PGCDC_SOURCE_DSN"], lost_env["PGCDC_TARGET_DSN"]
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE parent (id int PRIMARY KEY, v int)")
        conn.execute("INSERT INTO parent SELECT g, 0 FROM generate_series(1, 10000) g")
        conn.execute(
            "CREATE TABLE child (id int PRIMARY KEY, parent_id int REFERENCES parent, v int)"
        )
        conn.execute("INSERT INTO child SELECT g, g, 0 FROM generate_series(1, 10000) g")
        # An inheritance child is a table of its own: a truncate of its parent must spare it.
        conn.execute("CREATE TABLE more_child (note text) INHERITS (child)")
        conn.execute("ALTER TABLE more_child ADD PRIMARY KEY (id)")
        conn.execute("INSERT INTO more_child VALUES (20001, 1, 0, 'kept')")
        conn.execute("ANALYZE")
    code, _, err = run_cli(capsys, "snapshot")
    assert code == 0, err
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute("UPDATE parent SET v = 1 WHERE id % 100 = 0")
        conn.execute("UPDATE child SET v = 1 WHERE id % 100 = 0")
        conn.execute("DELETE FROM child WHERE id = 5000")
    _lose_the_slot(source_dsn, lost_env["PGCDC_SLOT"])

    def files() -> tuple:
        with psycopg.connect(target_dsn) as conn:
            return conn.execute(
                "SELECT pg_relation_filenode('parent'), pg_relation_filenode('child')"
            ).fetchone()

    # The target's own indexes on the table replaced whole are set aside and built again, as
    # they were: a partial one with a comment, a unique constraint with one, an expression
    # index with a statistics target that the table is clustered on, the replica identity.
    with psycopg.connect(target_dsn, autocommit=True) as conn:
        conn.execute("CREATE INDEX child_v ON child (v) WHERE v > 0")
        conn.execute("COMMENT ON INDEX child_v IS 'partial'")
        conn.execute("ALTER TABLE child ADD CONSTRAINT child_pv UNIQUE (parent_id, id)")
        conn.execute("COMMENT ON CONSTRAINT child_pv ON child IS 'unique'")
        conn.execute("CREATE INDEX child_sum ON child ((v + parent_id)) WITH (fillfactor = 70)")
        conn.execute("ALTER INDEX child_sum ALTER COLUMN 1 SET STATISTICS 500")
        conn.execute("ALTER TABLE child CLUSTER ON child_sum")
        conn.execute("ALTER TABLE child REPLICA IDENTITY USING INDEX child_pkey")

    def child_indexes() -> tuple[set, set]:
        with psycopg.connect(target_dsn) as conn:
            shapes = conn.execute(
                "SELECT pg_get_indexdef(i.indexrelid), i.indisreplident, i.indisclustered,"
                " i.indisvalid, coalesce(obj_description(i.indexrelid, 'pg_class'),"
                " obj_description(k.oid, 'pg_constraint')), k.conname,"
                " (SELECT array_agg(a.attstattarget)::text FROM pg_attribute a"
                "  WHERE a.attrelid = i.indexrelid)"
                " FROM pg_index i LEFT JOIN pg_constraint k ON k.conindid = i.indexrelid"
                " AND k.conrelid = i.indrelid WHERE i.indrelid = 'child'::regclass"
            ).fetchall()
            oids = conn.execute(
                "SELECT indexrelid FROM pg_index WHERE indrelid = 'child'::regclass"
            ).fetchall()
        return set(shapes), set(oids)

    indexes_before, index_oids_before = child_indexes()
    assert len(indexes_before) == 4, indexes_before
    before = files()
    # Killed inside a replacement (the whole table's is in flight with the first chunks), rolled
    # back: the catch-up refuses, the next recover redoes it.
    killed = subprocess.run(
        [PGCDC, "recover", "--chunk-rows", "1000", "--every-row"],
        env={**os.environ, "PGCDC_FAILPOINT": "repair.in_transaction=kill"},
        capture_output=True,
        text=True,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert "replacing whole: public.child" in killed.stderr, killed.stderr
    code, _, err = run_cli(capsys, "catchup")
    assert code != 0 and "pgcdc recover" in err, err
    code, out, err = run_cli(capsys, "recover", "--chunk-rows", "1000", "--every-row", "--json")
    assert code == 0, err
    recovered = json.loads(out)
    assert recovered["chunks_repaired"] >= 20, recovered  # every chunk of both tables
    assert "replacing whole: public.child" in err, err
    after = files()
    assert after[0] == before[0] and after[1] != before[1], (before, after)
    indexes_after, index_oids_after = child_indexes()
    assert indexes_after == indexes_before
    assert not index_oids_after & index_oids_before  # each built again, not kept

    def both(dsn: str) -> tuple:
        with psycopg.connect(dsn) as conn:
            return conn.execute(
                "SELECT (SELECT array_agg(p ORDER BY id) FROM parent p),"
                " (SELECT array_agg(c ORDER BY id) FROM ONLY child c),"
                " (SELECT array_agg(m ORDER BY id) FROM more_child m)"
            ).fetchone()

    assert both(target_dsn) == both(source_dsn)
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute("UPDATE child SET v = 2 WHERE id = 7")
        conn.execute("DELETE FROM child WHERE id = 8")
    code, _, err = run_cli(capsys, "catchup")
    assert code == 0, err
    assert both(target_dsn) == both(source_dsn)


@pytest.mark.parametrize(
    "point",
    [
        "recover.after_begin",
        "recover.after_changed",
        "recover.deleted_in_transaction",
        "recover.after_origin",
    ],
)
def test_a_recovery_killed_at_a_durable_step_is_redone_by_the_next(lost_env, capsys, point):
    """Killed once the chain says recovering (the lost slot not yet dropped), once a part's
    changed rows are copied, inside the deletes of the keys the source lacks, or once the
    origin is at the new point (the chain not yet complete): the catch-up refuses, naming
    ``pgcdc recover``, and the next recovery ends equal and the replication goes on."""
    source_dsn, target_dsn = _replicated_then_lost(lost_env, capsys)
    killed = subprocess.run(
        [PGCDC, "recover", "--chunk-rows", "1000"],
        env={**os.environ, "PGCDC_FAILPOINT": f"{point}=kill"},
        capture_output=True,
        text=True,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    code, _, err = run_cli(capsys, "catchup")
    assert code != 0 and "pgcdc recover" in err, err
    code, _, err = run_cli(capsys, "recover", "--chunk-rows", "1000")
    assert code == 0, err
    assert _content(target_dsn) == _content(source_dsn)
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute("UPDATE accounts SET note = 'after' WHERE id = 7")
    code, _, err = run_cli(capsys, "catchup")
    assert code == 0, err
    assert _content(target_dsn) == _content(source_dsn)


def test_the_sensor_recovers_a_lost_slot_with_no_hands_where_the_setting_allows_it(
    lost_env, capsys, monkeypatch
):
    """The slot sensor's tick on a lost slot: without ``PGCDC_AUTO_RECOVER`` it skips, naming
    ``pgcdc recover``; with it, it asks for a run of the ``recover`` job, which (run as the
    daemon runs it, in process) ends equal; the next tick is back to catching up."""
    from dagster import DagsterInstance, build_sensor_context

    from pgcdc_dagster.definitions import defs

    source_dsn, target_dsn = _replicated_then_lost(lost_env, capsys)

    def tick():
        loaded = defs()
        sensor = loaded.resolve_sensor_def("slot_progress_sensor")
        with (
            DagsterInstance.get() as instance,
            build_sensor_context(
                instance=instance, resources={"pgcdc": loaded.resources["pgcdc"]}
            ) as context,
        ):
            return loaded, sensor(context)

    _, skipped = tick()
    assert not skipped.run_requests
    said = skipped.skip_reason.skip_message
    assert "is invalidated" in said and "PGCDC_AUTO_RECOVER=on" in said, said

    monkeypatch.setenv("PGCDC_AUTO_RECOVER", "on")
    loaded, asked = tick()
    (request,) = asked.run_requests or [asked.skip_reason]
    assert getattr(request, "job_name", None) == "recover", request
    with DagsterInstance.get() as instance:
        ran = loaded.get_job_def("recover").execute_in_process(
            instance=instance, run_config=request.run_config, tags=request.tags
        )
    assert ran.success
    assert _content(target_dsn) == _content(source_dsn)

    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute("UPDATE accounts SET note = 'after' WHERE id = 7")
    _, then = tick()  # not lost any more: the next range's catch-up
    assert [r.job_name for r in then.run_requests] == ["catchup"], then
    code, _, err = run_cli(capsys, "catchup")
    assert code == 0, err
    assert _content(target_dsn) == _content(source_dsn)


def test_a_store_restored_from_an_older_copy_is_named_and_recovered(lost_env, capsys):
    """The output store goes back to a copy from before some ranges (a restored backup): the
    slot is confirmed past what the store holds, so those changes can never be read again.
    The catch-up names ``pgcdc recover``, which makes the target equal to the source."""
    source_dsn, target_dsn = lost_env["PGCDC_SOURCE_DSN"], lost_env["PGCDC_TARGET_DSN"]
    store = Path(lost_env["PGCDC_STORE"])
    _accounts_and_lines(source_dsn, 5000, 10)
    code, _, err = run_cli(capsys, "snapshot")
    assert code == 0, err
    older = store.with_name("store-copy")
    shutil.copytree(store, older)
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute("UPDATE accounts SET balance = -1 WHERE id <= 100")
    code, _, err = run_cli(capsys, "catchup")
    assert code == 0, err
    shutil.rmtree(store)
    older.rename(store)
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM accounts WHERE id BETWEEN 200 AND 210")

    code, _, err = run_cli(capsys, "catchup")
    assert code != 0 and "pgcdc recover" in err and "consumed" in err, err
    code, _, err = run_cli(capsys, "recover")
    assert code == 0, err
    assert _content(target_dsn) == _content(source_dsn)
    code, out, err = run_cli(capsys, "verify", "--json")
    assert code == 0 and json.loads(out)["equal"] is True, out


def _every_table(dsn: str) -> dict[str, list]:
    """Every row of the tables the fast-path test replicates, in key order."""
    with psycopg.connect(dsn) as conn:
        return {
            table: conn.execute(f"SELECT * FROM {table} ORDER BY 1").fetchall()
            for table in ("accounts", "emptied", "frozen", "measures", "lines")
        }


def test_a_lost_slot_is_recovered_from_the_rows_changed_since_the_target_s_position(
    lost_env, capsys
):
    """The fast path: inserts, updates, deletes, a ``TRUNCATE``, a subtransaction, an ``ON
    CONFLICT DO UPDATE``, a row moved between partitions, rows frozen by ``VACUUM FREEZE``
    and a transaction begun before the last applied range but committed after it, all while
    nothing reads the slot. Only the rows changed since the bound are copied, the deleted keys
    are removed, the keyless table is compared chunk by chunk (named), and the target ends
    equal. Killed inside a part's copy and after a table's deletes, the next recover
    converges; the replication goes on."""
    source_dsn, target_dsn = lost_env["PGCDC_SOURCE_DSN"], lost_env["PGCDC_TARGET_DSN"]
    _accounts_and_lines(source_dsn, ROWS, 300)
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE emptied (id int PRIMARY KEY, v int)")
        conn.execute("INSERT INTO emptied SELECT g, g FROM generate_series(1, 500) g")
        conn.execute("CREATE TABLE frozen (id int PRIMARY KEY, v int)")
        conn.execute("INSERT INTO frozen SELECT g, 0 FROM generate_series(1, 2000) g")
        conn.execute(
            "CREATE TABLE measures (id int, region int, v int, PRIMARY KEY (id, region)) "
            "PARTITION BY LIST (region)"
        )
        conn.execute("CREATE TABLE measures_1 PARTITION OF measures FOR VALUES IN (1)")
        conn.execute("CREATE TABLE measures_2 PARTITION OF measures FOR VALUES IN (2)")
        conn.execute("INSERT INTO measures SELECT g, 1, g FROM generate_series(1, 1000) g")
        conn.execute("ANALYZE")
    code, _, err = run_cli(capsys, "snapshot")
    assert code == 0, err

    # A transaction that begins now and commits after the target's last applied range.
    straddling = psycopg.connect(source_dsn)
    straddling.execute("UPDATE accounts SET note = 'straddling' WHERE id = 30000")
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute("UPDATE accounts SET balance = 7 WHERE id <= 20")
    # Each catch-up's process records a bound as it applies; the straddler is running.
    code, _, err = run_cli(capsys, "catchup")
    assert code == 0, err
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute("UPDATE accounts SET balance = 8 WHERE id BETWEEN 21 AND 40")
    code, _, err = run_cli(capsys, "catchup")  # the target's position passes that bound
    assert code == 0, err
    straddling.commit()
    straddling.close()

    with psycopg.connect(source_dsn, autocommit=True) as conn:  # nothing reads these
        conn.execute("UPDATE accounts SET balance = -1 WHERE id BETWEEN 10001 AND 10100")
        conn.execute("DELETE FROM accounts WHERE id BETWEEN 25001 AND 25010 OR id = 39000")
        conn.execute("INSERT INTO accounts VALUES (50001, 1, 'new'), (50002, 2, 'new')")
        conn.execute(
            "INSERT INTO accounts VALUES (5, 0, 'upserted'), (50003, 3, 'upserted') "
            "ON CONFLICT (id) DO UPDATE SET note = excluded.note"
        )
        with conn.transaction():
            conn.execute("UPDATE accounts SET note = 'outer' WHERE id = 6")
            with conn.transaction():  # a subtransaction that commits
                conn.execute("UPDATE accounts SET note = 'inner' WHERE id = 7")
            with contextlib.suppress(psycopg.errors.UniqueViolation), conn.transaction():
                conn.execute("INSERT INTO accounts VALUES (8, 0, 'rolled back')")
        conn.execute("TRUNCATE emptied")
        conn.execute("INSERT INTO emptied VALUES (1000, 1)")
        conn.execute("UPDATE frozen SET v = 1 WHERE id % 100 = 0")
        conn.execute("VACUUM FREEZE frozen")
        conn.execute("UPDATE measures SET region = 2 WHERE id <= 5")  # moved between partitions
        conn.execute("DELETE FROM measures WHERE id = 500")
        conn.execute("INSERT INTO lines VALUES ('while lost')")
        conn.execute("DELETE FROM lines WHERE line = 'line 7'")
    _lose_the_slot(source_dsn, lost_env["PGCDC_SLOT"])

    for point in ("recover.changed_in_transaction", "recover.after_deleted"):
        killed = subprocess.run(
            [PGCDC, "recover"],
            env={**os.environ, "PGCDC_FAILPOINT": f"{point}=kill"},
            capture_output=True,
            text=True,
        )
        assert killed.returncode == -signal.SIGKILL, killed.stderr
        code, _, err = run_cli(capsys, "catchup")
        assert code != 0 and "did not finish" in err and "pgcdc recover" in err, err

    code, out, err = run_cli(capsys, "recover", "--json")
    assert code == 0, err
    recovered = json.loads(out)
    assert _every_table(target_dsn) == _every_table(source_dsn)
    # Rows changed since the bound only, never the tables: accounts' changes since the
    # snapshot or since the first catch-up (its bound), a few rows of the others.
    assert 100 < recovered["rows_changed"] < 600, recovered
    # emptied's 500 and measures' 6 (5 moved to another partition: their key changed); the
    # killed recovery removed accounts' 11 before it was killed.
    assert recovered["keys_deleted"] == 500 + 6, recovered
    assert recovered["compared_every_row"] == "public.lines (no primary key)", recovered
    assert recovered["chunks_repaired"] == 1, recovered  # the keyless table's one chunk
    with capsys.disabled():
        print(f"\nrecovered by the rows changed: {recovered}")

    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute("UPDATE accounts SET note = 'after' WHERE id % 1000 = 0")
        conn.execute("UPDATE measures SET v = 0 WHERE id = 1")
    code, _, err = run_cli(capsys, "catchup")
    assert code == 0, err
    assert _every_table(target_dsn) == _every_table(source_dsn)
    code, out, err = run_cli(capsys, "verify", "--json")
    assert code == 0 and json.loads(out)["equal"] is True, out
