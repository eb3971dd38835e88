"""The ``pgcdc`` command line against the project's own dagster.yaml (PostgreSQL storage)."""

from __future__ import annotations

import json
from pathlib import Path

import psycopg
import pytest

from pgcdc_dagster.cli import main
from pgcdc_dagster.engine.control.range_lock import range_lock
from pgcdc_dagster.engine.lsn import Lsn
from pgcdc_dagster.engine.settings import ReplicationSettings, SettingsError
from pgcdc_dagster_tests.support.pg import run_sql

REPO = Path(__file__).resolve().parent.parent


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_snapshot_catchup_status_verify_from_the_command_line(cli_env, capsys):
    code, out, _ = run_cli(capsys, "snapshot")
    assert code == 0 and "consistent point" in out

    code, _, err = run_cli(capsys, "snapshot")
    assert code != 0 and "--resnapshot" in err and "\n" not in err.strip()

    with psycopg.connect(cli_env["PGCDC_SOURCE_DSN"], autocommit=True) as conn:
        conn.execute("INSERT INTO items VALUES (101, 'new')")
        conn.execute("UPDATE items SET name = 'changed' WHERE id = 5")
        conn.execute("DELETE FROM items WHERE id = 6")

    code, out, err = run_cli(capsys, "catchup", "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert len(summary["ranges"]) == 1
    last = summary["last_range"]
    assert last["transactions"] == 3 and last["changes"] == 3
    assert last["endpos_outcome"] in ("at_commit_boundary", "between_transactions")
    assert summary["replay_lsn"] == last["transform_lsn"]

    code, out, _ = run_cli(capsys, "status", "--json")
    status = json.loads(out)
    assert code == 0 and status["ranges_stored"] == 1
    assert status["replay_lsn"] == last["transform_lsn"]

    code, out, err = run_cli(capsys, "verify", "--json")
    verified = json.loads(out)
    assert code == 0 and verified["equal"] is True
    assert Lsn(verified["compared_at"]) >= Lsn(last["transform_lsn"])
    assert "pgcdc: verify compare: compared 100%" in err, err  # the compare's progress

    with psycopg.connect(cli_env["PGCDC_TARGET_DSN"], autocommit=True) as conn:
        conn.execute("DELETE FROM items WHERE id = 7")
    code, out, err = run_cli(capsys, "verify")
    assert code != 0
    assert "public.items" in err
    assert "(7) missing" in out, out  # the chunk and the key that differ

    # With the range lock held elsewhere there is no head start: the command waits, then
    # refuses in one line naming the holder, and has changed nothing.
    with psycopg.connect(cli_env["PGCDC_SOURCE_DSN"], autocommit=True) as conn:
        conn.execute("INSERT INTO items VALUES (102, 'while busy')")
    env = cli_env
    with range_lock(env["PGCDC_TARGET_DSN"], env["PGCDC_SLOT"], "pid elsewhere"):
        code, _, err = run_cli(capsys, "catchup", "--wait", "1")
    assert code == 1 and "still in flight" in err and "pid elsewhere" in err, err
    assert "\n" not in err.strip()
    with psycopg.connect(cli_env["PGCDC_TARGET_DSN"]) as conn:
        assert conn.execute("SELECT count(*) FROM items WHERE id = 102").fetchone() == (0,)


def test_missing_settings_are_one_clear_line(monkeypatch, capsys):
    monkeypatch.delenv("PGCDC_SOURCE_DSN", raising=False)
    monkeypatch.delenv("PGCDC_TARGET_DSN", raising=False)
    code, _, err = run_cli(capsys, "status")
    assert code == 2
    assert err.startswith("pgcdc: PGCDC_SOURCE_DSN and PGCDC_TARGET_DSN not set")


@pytest.mark.parametrize("url", ["gs://bucket/store", "abfs://c@a/store", "wasbs://c@a/store"])
def test_an_object_store_url_not_supported_is_refused_in_one_line_and_never_taken_for_a_folder(
    url, monkeypatch, capsys, tmp_path
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PGCDC_STORE", url)
    monkeypatch.setenv("PGCDC_SOURCE_DSN", "host=127.0.0.1 port=1 dbname=x")
    monkeypatch.setenv("PGCDC_TARGET_DSN", "host=127.0.0.1 port=1 dbname=y")
    code, _, err = run_cli(capsys, "status")
    assert code == 2, err
    assert "output store is not supported" in err and "\n" not in err.strip(), err
    assert list(tmp_path.iterdir()) == []  # no folder "s3:" made here
    monkeypatch.setenv("PGCDC_STORE", f"file://{tmp_path}/store")
    settings = ReplicationSettings.from_env(require_servers=False)
    assert settings.store_path == tmp_path / "store"


def test_spark_settings_pass_through_and_a_wrong_one_is_one_line_without_its_value():
    conf = (
        "spark.executor.memory=4g; spark.archives=deps.tar.gz#deps,more.zip#more;"
        " spark.executor.extraJavaOptions=-Da=b -Dc=d"
    )
    settings = ReplicationSettings.from_env({"PGCDC_SPARK_CONF": conf}, require_servers=False)
    assert settings.spark_conf == {
        "spark.executor.memory": "4g",
        "spark.archives": "deps.tar.gz#deps,more.zip#more",
        "spark.executor.extraJavaOptions": "-Da=b -Dc=d",
    }
    assert "4g" not in repr(settings)  # a cluster's settings may hold keys
    with pytest.raises(SettingsError) as wrong:
        ReplicationSettings.from_env(
            {"PGCDC_SPARK_CONF": "spark.a=1; fs.s3a.secret.key=hunter2"}, require_servers=False
        )
    message = str(wrong.value)
    assert "PGCDC_SPARK_CONF" in message and "'fs.s3a.secret.key' is not a Spark setting" in message
    assert "hunter2" not in message and "\n" not in message


def test_the_warm_spark_command_needs_only_the_store(monkeypatch, capsys, tmp_path):
    """``pgcdc spark`` looks at the store alone (no servers); a stale record is no server.
    Starting and stopping one is ``test_spark_connect``'s."""
    monkeypatch.delenv("PGCDC_SOURCE_DSN", raising=False)
    monkeypatch.delenv("PGCDC_TARGET_DSN", raising=False)
    monkeypatch.setenv("PGCDC_STORE", str(tmp_path))
    code, out, err = run_cli(capsys, "spark", "status")
    assert (code, out.strip(), err) == (0, "not running", "")
    (tmp_path / "spark-connect.json").write_text(
        '{"url": "sc://127.0.0.1:9", "pid": 999999999, "master": "local[*]", '
        '"started": 0, "work_dir": "."}'
    )
    code, out, _ = run_cli(capsys, "spark", "status")
    assert (code, out.strip()) == (0, "not running")
    code, out, _ = run_cli(capsys, "spark", "stop")
    assert (code, out.strip()) == (0, "no Spark Connect server was running")
    assert not (tmp_path / "spark-connect.json").exists()


def not_progress(stderr: str) -> list[str]:
    """The lines of ``stderr`` that are not pgcdc's own progress lines."""
    progress = ("pgcdc: snapshot ", "pgcdc: follow: ")
    return [line for line in stderr.splitlines() if not line.startswith(progress)]


def test_the_cli_needs_no_dagster_set_up(cli_env, target_cluster, tmp_path):
    """No DAGSTER_HOME: the embedded default (Dagster's local storage under
    .pgcdc/dagster_home), silently. DAGSTER_HOME without a dagster.yaml and DAGSTER_POSTGRES_URL
    set: the same default on PostgreSQL storage."""
    import os
    import subprocess
    import sys

    from dagster import DagsterInstance
    from dagster._core.instance.ref import InstanceRef

    pgcdc = str(Path(sys.executable).parent / "pgcdc")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DAGSTER_")}
    env.update({k: v for k, v in cli_env.items() if not k.startswith("DAGSTER_")})
    work = tmp_path / "work"
    work.mkdir()

    def run(*args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [pgcdc, *args], cwd=work, env={**env, **extra}, capture_output=True, text=True
        )

    taken = run("snapshot")
    assert taken.returncode == 0, taken.stderr
    assert not_progress(taken.stderr) == []  # none of Dagster's instance warnings
    home = work / ".pgcdc" / "dagster_home"
    with DagsterInstance.from_ref(InstanceRef.from_dir(str(home))) as local:
        assert [r.job_name for r in local.get_runs()] == ["snapshot"]

    empty_home = tmp_path / "empty_home"
    empty_home.mkdir()
    url = cli_env["DAGSTER_POSTGRES_URL"]
    caught_up = run("catchup", DAGSTER_HOME=str(empty_home), DAGSTER_POSTGRES_URL=url)
    assert caught_up.returncode == 0, caught_up.stderr
    assert not_progress(caught_up.stderr) == []
    assert not (empty_home / "dagster.yaml").exists()
    overrides = {"storage": {"postgres": {"postgres_url": url}}}
    with DagsterInstance.from_ref(
        InstanceRef.from_dir(str(empty_home), overrides=overrides)
    ) as shared:
        assert [r.job_name for r in shared.get_runs()] == ["follow"]


def _pgcdc(*args: str, **kwargs):
    import subprocess
    import sys

    return subprocess.Popen([str(Path(sys.executable).parent / "pgcdc"), *args], **kwargs)


def test_progress_is_plain_lines_when_not_on_a_terminal(cli_env):
    import subprocess

    snap = _pgcdc("snapshot", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, err = snap.communicate(timeout=300)
    assert snap.returncode == 0, err
    lines = [line for line in err.splitlines() if line.startswith("pgcdc: snapshot ")]
    assert any(line.startswith("pgcdc: snapshot copy: ") for line in lines), err
    assert any("snapshot done: 100/~" in line and "rows" in line for line in lines), err
    assert "\x1b[" not in err

    with psycopg.connect(cli_env["PGCDC_SOURCE_DSN"], autocommit=True) as conn:
        conn.execute("INSERT INTO items SELECT g, 'n' FROM generate_series(1001, 1100) g")
    catchup = _pgcdc("catchup", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, err = catchup.communicate(timeout=300)
    assert catchup.returncode == 0, err
    assert "pgcdc: follow: 1 ranges, 1 transactions, 100 changes" in err, err

    # An add's copy (hours for a big table, beside the applies) says how far it is too.
    with psycopg.connect(cli_env["PGCDC_SOURCE_DSN"], autocommit=True) as conn:
        conn.execute("CREATE TABLE later AS SELECT g AS id FROM generate_series(1, 300) g")
        conn.execute("ALTER TABLE later ADD PRIMARY KEY (id)")
    add = _pgcdc("add-table", "later", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, err = add.communicate(timeout=300)
    assert add.returncode == 0, err
    assert "pgcdc: add-table copy: " in err, err
    assert "pgcdc: add-table done: 300/~" in err, err


def test_progress_is_drawn_live_on_a_terminal(cli_env):
    import os
    import pty
    import subprocess

    master, slave = pty.openpty()
    snap = _pgcdc("snapshot", stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    drawn = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the terminal's other side closed: the process is gone
            break
        if not chunk:
            break
        drawn += chunk
    snap.wait(timeout=300)
    os.close(master)
    assert snap.returncode == 0, drawn.decode(errors="replace")
    text = drawn.decode(errors="replace")
    assert "\x1b[" in text  # drawn, not printed line by line
    assert "public.items" in text and "snapshot: done" in text
    assert "pgcdc: snapshot copy:" not in text


def snapshot_then_catch_up_inserts(cli_env, capsys, *, first_id: int, count: int) -> None:
    """A base snapshot, then ``count`` rows inserted into ``items`` from ``first_id``, each
    caught up by its own ``pgcdc catchup`` (a range each, at least)."""
    assert run_cli(capsys, "snapshot")[0] == 0
    for n in range(count):
        with psycopg.connect(cli_env["PGCDC_SOURCE_DSN"], autocommit=True) as conn:
            conn.execute("INSERT INTO items VALUES (%s, 'new')", (first_id + n,))
        assert run_cli(capsys, "catchup")[0] == 0


def test_prune_removes_applied_ranges_and_their_partitions_and_catchup_goes_on(
    cli_env, capsys, monkeypatch
):
    from pgcdc_dagster.defs import instance as instance_module
    from pgcdc_dagster.defs.instance import dagster_instance
    from pgcdc_dagster.defs.partitions import LSN_RANGES
    from pgcdc_dagster.runner import run_job

    # This test reads its own storage: not the instance an earlier test left to the process.
    monkeypatch.setattr(instance_module, "_instance", None)

    snapshot_then_catch_up_inserts(cli_env, capsys, first_id=200, count=3)
    stored = json.loads(run_cli(capsys, "status", "--json")[1])["ranges_stored"]
    assert stored >= 3
    registered = set(dagster_instance().get_dynamic_partitions(LSN_RANGES))

    code, out, err = run_cli(capsys, "prune", "--retention", "0", "--dry-run", "--json")
    assert code == 0, err
    dry = json.loads(out)
    assert dry["ranges_removed"] == stored - 1 and dry["partitions_dropped"] == 0
    assert json.loads(run_cli(capsys, "status", "--json")[1])["ranges_stored"] == stored

    def storage_rows(query: str, *args: str) -> list[tuple]:
        # The storage the runs of this process write to (one instance per process).
        with dagster_instance().event_log_storage.index_connection() as conn:
            return [tuple(r) for r in conn.exec_driver_sql(query, args).fetchall()]

    (before,) = storage_rows(
        "SELECT count(DISTINCT partition) FROM event_logs "
        "WHERE dagster_event_type = 'ASSET_MATERIALIZATION' AND partition IS NOT NULL"
    )
    assert before == (stored,)

    code, out, err = run_cli(capsys, "prune", "--retention", "0", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["ranges_removed"] == stored - 1 and report["bytes_removed"] > 0
    status = json.loads(run_cli(capsys, "status", "--json")[1])
    assert status["ranges_stored"] == 1 and status["pruned_through"] == report["pruned_through"]
    assert status["last_range"] == report["oldest_kept"]
    left = set(dagster_instance().get_dynamic_partitions(LSN_RANGES))
    assert left == {status["last_range"]} and len(registered) == stored
    assert report["partitions_dropped"] == stored - 1
    # Their history goes with them: materialisations and no_gap evaluations of the pruned
    # partitions, of every asset; the kept partition's stay.
    kept = status["last_range"]
    rows = dict(
        storage_rows(
            "SELECT partition = %s, count(*) FROM event_logs "
            "WHERE dagster_event_type = 'ASSET_MATERIALIZATION' AND partition IS NOT NULL "
            "GROUP BY 1",
            kept,
        )
    )
    (checks,) = storage_rows(
        "SELECT count(*) FILTER (WHERE partition <> %s), count(*) FILTER (WHERE partition = %s) "
        "FROM asset_check_executions",
        kept,
        kept,
    )
    assert rows == {True: 2}  # decoded_changes and target/public/items
    assert checks == (0, 1)
    checked = run_job("slot_health")
    (retention,) = [
        e for e in checked.get_asset_check_evaluations() if e.check_name == "store_retention"
    ]
    assert retention.passed and retention.metadata["ranges_stored"].value == 1

    with psycopg.connect(cli_env["PGCDC_SOURCE_DSN"], autocommit=True) as conn:
        conn.execute("UPDATE items SET name = 'after prune' WHERE id = 200")
    assert run_cli(capsys, "catchup")[0] == 0
    code, out, _ = run_cli(capsys, "verify", "--json")
    assert code == 0 and json.loads(out)["equal"] is True

    code, _, err = run_cli(capsys, "prune", "--retention", "soon")
    assert code == 2 and "not a duration" in err and "\n" not in err.strip()


@pytest.mark.parametrize(
    ("catchup_env", "described"),
    [
        ({"PGCDC_FOLLOW_TABLE_EVENTS": "changed"}, "PGCDC_FOLLOW_TABLE_EVENTS=changed"),
        # The default (all), with the run's events held 3 s behind the apply (TRAILING_S: 2 s).
        ({"PGCDC_FAILPOINT": "follow.recording=sleep(3)@1"}, "trailed the apply"),
    ],
    ids=["changed", "all-but-trailing"],
)
def test_a_follow_can_materialise_only_the_tables_a_range_changed(cli_env, catchup_env, described):
    """Only the tables a range changed are materialised with PGCDC_FOLLOW_TABLE_EVENTS=changed,
    and with the default while the run's events trail the apply by more than a couple of
    seconds; the range's ``table_events`` metadata says which and why. Through the commands in
    fresh processes (the replicated tables are resolved when a process loads the
    definitions)."""
    import os
    import subprocess

    with psycopg.connect(cli_env["PGCDC_SOURCE_DSN"], autocommit=True) as conn:
        conn.execute("CREATE TABLE other (id int PRIMARY KEY)")
    env = {**os.environ, "PGCDC_SERVER": "off"}
    if "PGCDC_FOLLOW_TABLE_EVENTS" in catchup_env:
        env.update(catchup_env)
    for args in (["snapshot"], ["catchup"]):
        done = _pgcdc(
            *args,
            env={**env, **catchup_env} if args == ["catchup"] else env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        _, err = done.communicate(timeout=300)
        assert done.returncode == 0, err
        if args == ["snapshot"]:
            with psycopg.connect(cli_env["PGCDC_SOURCE_DSN"], autocommit=True) as conn:
                conn.execute("INSERT INTO items VALUES (300, 'only items')")
    storage_dsn = cli_env["DAGSTER_POSTGRES_URL"].replace("+psycopg2", "")
    with psycopg.connect(storage_dsn) as conn:
        materialised = dict(
            conn.execute(
                "SELECT asset_key, count(*) FROM event_logs WHERE partition IS NOT NULL "
                "AND dagster_event_type = 'ASSET_MATERIALIZATION' GROUP BY 1"
            ).fetchall()
        )
        (said,) = conn.execute(
            "SELECT count(*) FROM event_logs WHERE dagster_event_type = 'ASSET_MATERIALIZATION' "
            "AND asset_key = '[\"decoded_changes\"]' AND event LIKE %s",
            (f"%{described}%",),
        ).fetchone()
        (logged,) = conn.execute(
            "SELECT count(*) FROM event_logs WHERE event LIKE %s",
            ("%materialised only the target tables they changed%",),
        ).fetchone()
    ranges = materialised.pop('["decoded_changes"]')
    assert ranges >= 1 and materialised == {'["target", "public", "items"]': 1}
    assert said == ranges
    if "PGCDC_FOLLOW_TABLE_EVENTS" in catchup_env:
        assert logged == 0  # nothing to explain: always so
    else:
        assert logged >= 1


def test_re_running_an_applied_range_changes_nothing_and_passes_its_gap_check(
    cli_env, capsys, monkeypatch
):
    """A user re-materialises an old partition from the UI (for example "materialize missing"
    on a target table a follow did not record for a range): the range is stored and applied,
    later ranges too. The run changes nothing on the target, and its blocking ``no_gap`` check
    passes: nothing was skipped, the origin is past the range."""
    from pgcdc_dagster.defs import instance as instance_module
    from pgcdc_dagster.engine.control import pipeline
    from pgcdc_dagster.engine.settings import ReplicationSettings
    from pgcdc_dagster.runner import run_job

    monkeypatch.setattr(instance_module, "_instance", None)
    snapshot_then_catch_up_inserts(cli_env, capsys, first_id=400, count=2)
    settings = ReplicationSettings.from_env()
    store = pipeline.store_of(settings)
    first = next(r for r in store.chain_ranges() if store.get(r).manifest.result.changes)
    origin = pipeline.origin_progress(settings)
    assert origin is not None and origin > Lsn(first.end)

    result = run_job("catchup", partition_key=first.partition_key, allow_failure=True)
    assert result.success, [e.message for e in result.all_events if e.is_failure]
    # One outcome, recorded on every target table of the range (they are applied together).
    gaps = [e for e in result.get_asset_check_evaluations() if e.check_name == "no_gap"]
    assert {g.asset_key.path[0] for g in gaps} == {"target"}
    assert len(gaps) == len(pipeline.replicated_tables(settings))
    assert all(g.passed for g in gaps), gaps[0].description
    assert pipeline.origin_progress(settings) == origin
    code, out, _ = run_cli(capsys, "verify", "--json")
    assert code == 0 and json.loads(out)["equal"] is True


def test_a_follow_run_records_its_ranges_without_keeping_their_events(cli_env, capsys, monkeypatch):
    """A follow's ranges are in the run's event log, under its step, while the step keeps
    none of them (Dagster keeps every event a step yields until the step ends: without bound
    for a follow that runs for days)."""
    from dagster import AssetKey

    from pgcdc_dagster.defs import instance as instance_module
    from pgcdc_dagster.defs.instance import dagster_instance
    from pgcdc_dagster.runner import run_job

    monkeypatch.setattr(instance_module, "_instance", None)
    assert run_cli(capsys, "snapshot")[0] == 0
    with psycopg.connect(cli_env["PGCDC_SOURCE_DSN"], autocommit=True) as conn:
        conn.execute("INSERT INTO items VALUES (500, 'followed')")
    config = {"ops": {"follow_stream": {"config": {"endpos": "current"}}}}
    result = run_job("follow", run_config=config)
    assert result.get_asset_materialization_events() == []
    assert result.get_asset_observation_events()  # the totals, yielded at the end
    records = dagster_instance().fetch_materializations(AssetKey("decoded_changes"), 1000).records
    mine = [r for r in records if r.event_log_entry.run_id == result.run_id]
    assert mine and all(r.event_log_entry.step_key == "follow_stream" for r in mine)


def test_a_publication_that_narrows_its_table_from_the_command_line(cli_env, capsys, monkeypatch):
    """The user's own publication with a row filter and a column list: the commands copy,
    apply and compare only what it sends, and the snapshot's metadata says how it narrows."""
    from dagster import TableRecord

    from pgcdc_dagster.defs import instance as instance_module
    from pgcdc_dagster.defs.instance import dagster_instance
    from pgcdc_dagster.defs.keys import BASE_SNAPSHOT_KEY

    monkeypatch.setattr(instance_module, "_instance", None)  # this test's own storage
    monkeypatch.setenv("PGCDC_PUBLICATION", "narrow")
    with psycopg.connect(cli_env["PGCDC_SOURCE_DSN"], autocommit=True) as conn:
        conn.execute("CREATE PUBLICATION narrow FOR TABLE items (id) WHERE (id <= 50)")

    code, out, err = run_cli(capsys, "snapshot")
    assert code == 0 and "50 rows" in out, err
    event = dagster_instance().get_latest_materialization_event(BASE_SNAPSHOT_KEY)
    assert event is not None and event.asset_materialization is not None
    records: list[TableRecord] = event.asset_materialization.metadata["tables"].value.records  # type: ignore[attr-defined]
    assert [
        (r.data["table"], r.data["row_filter"], r.data["columns_left_out"]) for r in records
    ] == [("public.items", "(id <= 50)", "name")]

    with psycopg.connect(cli_env["PGCDC_SOURCE_DSN"], autocommit=True) as conn:
        conn.execute("INSERT INTO items VALUES (0, 'in'), (200, 'out')")
        conn.execute("UPDATE items SET name = 'changed' WHERE id IN (5, 60)")
        conn.execute("DELETE FROM items WHERE id IN (6, 70)")
    code, _, err = run_cli(capsys, "catchup")
    assert code == 0, err
    code, out, _ = run_cli(capsys, "verify", "--json")
    assert code == 0 and json.loads(out)["equal"] is True
    with psycopg.connect(cli_env["PGCDC_TARGET_DSN"]) as conn:
        assert conn.execute(
            "SELECT count(*), count(name), min(id), max(id) FROM items"
        ).fetchone() == (50, 0, 0, 50)


def _snapshot_then(cli_env: dict[str, str], capsys, *statements: str) -> None:
    """``pgcdc snapshot``, then ``statements`` on the source."""
    code, _, err = run_cli(capsys, "snapshot")
    assert code == 0, err
    run_sql(cli_env["PGCDC_SOURCE_DSN"], *statements)


def test_a_table_added_to_the_publication_later_is_named_then_added(cli_env, capsys):
    """The user adds a table to the publication after the snapshot: verify and catchup say
    it is not on the target and name the command that adds it; pgcdc add-table copies it, and
    the next catchup applies its changes past that copy."""
    _snapshot_then(
        cli_env,
        capsys,
        "CREATE TABLE later (id int PRIMARY KEY, v text)",
        "INSERT INTO later VALUES (1, 'before')",
        "ALTER PUBLICATION pgcdc_pub ADD TABLE later",
        "INSERT INTO later VALUES (2, 'published')",
    )

    code, out, err = run_cli(capsys, "verify")
    assert code != 0
    assert "DIFF public.later: not on the target (pgcdc add-table public.later)" in out
    code, _, err = run_cli(capsys, "catchup")
    assert code != 0 and "run pgcdc add-table public.later" in err

    code, out, err = run_cli(capsys, "add-table", "later", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["added_tables"] == "public.later" and report["rows"] == 2
    # Nothing was applied while it copied: one pass without the range, one with it.
    assert report["held_back_changes"] == report["held_back_with_range"] == 0
    assert report["held_back_passes"] >= 2 and report["held_back_ranges_on_spark"] == 0
    with psycopg.connect(cli_env["PGCDC_SOURCE_DSN"], autocommit=True) as conn:
        conn.execute("UPDATE later SET v = 'after' WHERE id = 1")
    code, _, err = run_cli(capsys, "catchup")
    assert code == 0, err
    code, out, _ = run_cli(capsys, "verify", "--json")
    assert code == 0 and json.loads(out)["equal"] is True


def test_verify_names_resync_for_a_table_that_drifted_and_resync_repairs_it(cli_env, capsys):
    """A hand edit on the target (or a DDL the apply could not follow): verify says which
    table differs and that ``pgcdc resync`` repairs it; it does, while replication goes on."""
    _snapshot_then(cli_env, capsys)
    table = "public.items"
    with psycopg.connect(cli_env["PGCDC_TARGET_DSN"], autocommit=True) as conn:
        conn.execute("DELETE FROM items WHERE id = 7")
    code, out, err = run_cli(capsys, "verify")
    assert code != 0
    assert f"(pgcdc resync {table} copies it again)" in out
    assert f"pgcdc resync {table} copies them again" in err
    code, out, err = run_cli(capsys, "resync", table)
    assert code == 0, err
    assert out.startswith(f"resynced {table}: ")
    code, out, err = run_cli(capsys, "verify", "--json")
    assert code == 0 and json.loads(out)["equal"] is True, out


def test_verify_repair_replaces_the_differing_chunk_and_the_next_verify_is_equal(cli_env, capsys):
    """``pgcdc verify --repair`` after hand edits on the target: the repair run replaces the
    differing chunk with the source's rows (its observation says so), its check evaluations
    say equal, and a plain verify agrees."""
    _snapshot_then(cli_env, capsys)
    with psycopg.connect(cli_env["PGCDC_TARGET_DSN"], autocommit=True) as conn:
        conn.execute("DELETE FROM items WHERE id = 7")
        conn.execute("UPDATE items SET name = 'edited' WHERE id = 3")
    code, out, err = run_cli(capsys, "verify", "--repair")
    assert code == 0, err
    assert "pgcdc: verify repair: replaced 0/1 chunk(s)" in err, err
    with psycopg.connect(cli_env["PGCDC_SOURCE_DSN"]) as conn:
        rows = conn.execute("SELECT count(*) FROM items").fetchone()[0]  # type: ignore[index]
    # One chunk (a small table): all its rows on the target replaced by the source's.
    assert "REPAIRED target/public/items: 1 chunk(s) at " in out, out
    assert f"{rows - 1} row(s) deleted, {rows} copied" in out, out
    assert "ok   public.items" in out, out
    code, out, err = run_cli(capsys, "verify", "--json")
    assert code == 0 and json.loads(out)["equal"] is True, out


def test_add_table_while_pgcdc_follow_runs_has_the_follow_make_way(cli_env, capsys, monkeypatch):
    """``pgcdc add-table`` while ``pgcdc follow`` runs (its Dagster run holding the range
    lock): the add does not wait for the follow to end (it never would) but has it make way,
    and the same follow then applies the added table's changes, and records the added table's
    partitions too (its code location listed only ``items``); it still stops cleanly."""
    import time

    from pgcdc_dagster.defs import instance as instance_module
    from pgcdc_dagster.defs.keys import target_key
    from pgcdc_dagster.defs.partitions import LSN_RANGES
    from pgcdc_dagster.engine.identifiers import TableName

    monkeypatch.setattr(instance_module, "_instance", None)  # this test's own storage
    _snapshot_then(
        cli_env,
        capsys,
        "CREATE TABLE later (id int PRIMARY KEY, v text)",
        "INSERT INTO later SELECT g, 'before' FROM generate_series(1, 500) g",
    )
    follow = follow_running(cli_env)
    try:
        code, out, err = run_cli(capsys, "add-table", "later", "--wait", "60")
        assert code == 0, err
        assert out.startswith("added public.later: 500 rows copied"), out
        assert "change(s) held back meanwhile applied in " in out, out
        with psycopg.connect(cli_env["PGCDC_SOURCE_DSN"], autocommit=True) as conn:
            conn.execute("UPDATE later SET v = 'after' WHERE id = 1")
        deadline = time.monotonic() + 60
        with psycopg.connect(cli_env["PGCDC_TARGET_DSN"], autocommit=True) as conn:
            while conn.execute("SELECT v FROM later WHERE id = 1").fetchone() != ("after",):
                assert follow.poll() is None and time.monotonic() < deadline
                time.sleep(0.2)
        instance = instance_module.dagster_instance()
        later = target_key(TableName("public", "later"))
        while (event := instance.get_latest_materialization_event(later)) is None:
            assert follow.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
    finally:
        err = stopped(follow)
    assert "made way for run " in err, err
    assert event.dagster_event is not None and event.asset_materialization is not None
    assert event.dagster_event.partition in instance.get_dynamic_partitions(LSN_RANGES)
    assert event.asset_materialization.metadata["dagster/row_count"].value == 500
    # The same run recorded it: the follow that made way, not a later one.
    items = instance.get_latest_materialization_event(target_key(TableName("public", "items")))
    assert items is not None and items.run_id == event.run_id
    code, out, _ = run_cli(capsys, "verify", "--json")
    assert code == 0 and json.loads(out)["equal"] is True


def follow_running(cli_env: dict[str, str]):
    """``pgcdc follow`` in a process of its own, once its Dagster run holds the range lock."""
    import subprocess
    import time

    from pgcdc_dagster.engine.control.range_lock import lock_holders

    follow = _pgcdc("follow", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not any(
        h.holder.startswith("run ")
        for h in lock_holders(cli_env["PGCDC_TARGET_DSN"], cli_env["PGCDC_SLOT"])
    ):
        assert follow.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    return follow


def stopped(follow) -> str:
    """SIGTERM the follow; it must end cleanly. Its standard error."""
    import signal

    follow.send_signal(signal.SIGTERM)
    _, err = follow.communicate(timeout=120)
    assert follow.returncode == 0, err
    return err


def test_pgcdc_cutover_while_a_follow_runs_takes_the_rest_and_the_sequences(cli_env, capsys):
    """``pgcdc cutover`` with ``pgcdc follow`` running: the follow makes way, the cutover
    catches up to the source's position, sets the target's sequences to the source's (which
    logical replication does not carry: a target promoted without would hand out used keys)
    and compares every table; the follow goes on afterwards and still stops cleanly."""
    with psycopg.connect(cli_env["PGCDC_SOURCE_DSN"], autocommit=True) as conn:
        conn.execute("CREATE TABLE orders (id serial PRIMARY KEY, v text)")
    _snapshot_then(cli_env, capsys, "INSERT INTO orders (v) VALUES ('a'), ('b'), ('c')")
    follow = follow_running(cli_env)
    try:
        with psycopg.connect(cli_env["PGCDC_SOURCE_DSN"], autocommit=True) as conn:
            conn.execute("INSERT INTO items SELECT g, 'late' FROM generate_series(101, 300) g")
        code, out, err = run_cli(capsys, "cutover", "--json", "--wait", "60")
        assert code == 0, err
        # The cutover job launched as the UI launches it (no command lending it the range):
        # the follow makes way for its run too.
        from pgcdc_dagster.runner import run_job

        ui_run = run_job("cutover_job")
    finally:
        err = stopped(follow)
    report = json.loads(out)
    assert report["made_way_by"].startswith("run ") and report["equal"] is True
    assert [t["target_rows"] for t in report["tables"] if t["table"] == "public.items"] == [300]
    assert "made way for cutover pid " in err, err
    assert f"made way for run {ui_run.run_id}" in err, err
    with (
        psycopg.connect(cli_env["PGCDC_SOURCE_DSN"]) as src,
        psycopg.connect(cli_env["PGCDC_TARGET_DSN"]) as dst,
    ):
        src.execute("SELECT nextval('orders_id_seq')")
        src.execute("SELECT nextval('orders_id_seq')")
        src.commit()
        query = "SELECT last_value, is_called FROM orders_id_seq"
        expected = src.execute(query).fetchone()
    code, out, err = run_cli(capsys, "cutover", "--json")
    assert code == 0, err
    assert json.loads(out)["made_way_by"] is None and json.loads(out)["sequences_synced"] >= 1
    with psycopg.connect(cli_env["PGCDC_TARGET_DSN"]) as dst:
        assert dst.execute(query).fetchone() == expected == (5, True)


def test_an_add_killed_is_named_by_status_and_its_keys_are_validated_by_cutover(cli_env, capsys):
    """A real SIGKILL of ``pgcdc add-table`` once its copy (and its table's key, ``NOT
    VALID``) is on the target: ``pgcdc status`` says its changes are held back and the
    command that takes them on, and lists the key; the add run again and ``pgcdc cutover``
    leave nothing of either."""
    import os
    import signal
    import subprocess

    _snapshot_then(
        cli_env,
        capsys,
        "CREATE TABLE later (id int PRIMARY KEY, item int REFERENCES items)",
        "INSERT INTO later SELECT g, g FROM generate_series(1, 50) g",
    )
    killed = _pgcdc(
        "add-table",
        "later",
        env={**os.environ, "PGCDC_FAILPOINT": "add.after_copy=kill@1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    killed.communicate(timeout=300)
    assert killed.returncode == -signal.SIGKILL
    code, out, _ = run_cli(capsys, "status", "--json")
    status = json.loads(out)
    assert code == 0 and status["adding"] == (
        "adding public.later did not finish, so their changes are held back (the other "
        "tables' are applied): run pgcdc add-table public.later again"
    )
    assert status["foreign_keys_not_valid"] == ["later_item_fkey on public.later"]
    _, out, _ = run_cli(capsys, "verify")  # equal for now; later's changes to come are not
    assert "NOTE adding public.later did not finish" in out, out
    # Not a whole copy meanwhile: a cutover refuses (it would promote the target without
    # later's changes, and its code location does not list later to compare).
    code, _, err = run_cli(capsys, "cutover", "--json")
    assert code != 0 and "adding public.later is not done" in err, err

    code, _, err = run_cli(capsys, "add-table", "later")
    assert code == 0, err
    code, out, err = run_cli(capsys, "cutover", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["equal"] is True
    assert report["foreign_keys_completed"] == "later_item_fkey on public.later: validated"
    code, out, _ = run_cli(capsys, "status", "--json")
    status = json.loads(out)
    assert status["foreign_keys_not_valid"] == [] and status["adding"] is None
    assert not status["next_step"].startswith("blocked")


def test_a_migration_ends_with_cutover_then_finish_which_stops_the_follow(cli_env, capsys):
    """The last two commands of a migration with ``pgcdc follow`` running: after ``pgcdc
    cutover``, ``pgcdc finish`` drops the slot (or the old source keeps its WAL for ever) and
    the origin; the follow that made way for it ends by itself, cleanly, and status says the
    replication is finished."""
    _snapshot_then(cli_env, capsys)
    follow = follow_running(cli_env)
    try:
        with psycopg.connect(cli_env["PGCDC_SOURCE_DSN"], autocommit=True) as src:
            src.execute("INSERT INTO items VALUES (101, 'late')")
        code, _, err = run_cli(capsys, "cutover")
        assert code == 0, err
        code, out, err = run_cli(capsys, "finish", "--json")
        assert code == 0, err
        _, err = follow.communicate(timeout=60)  # it ends by itself
    finally:
        if follow.poll() is None:
            stopped(follow)
    assert follow.returncode == 0, err
    report = json.loads(out)
    assert report["slot_dropped"] is True and report["origin_dropped"] is True
    with psycopg.connect(cli_env["PGCDC_SOURCE_DSN"]) as conn:
        assert conn.execute(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_name = %s",
            (cli_env["PGCDC_SLOT"],),
        ).fetchone() == (0,)
    code, out, _ = run_cli(capsys, "status", "--json")
    assert code == 0 and json.loads(out)["finished_at"] == report["finished_at"]
    for command in (["catchup"], ["add-table", "later"]):  # nothing more to do, and says so
        code, _, err = run_cli(capsys, *command)
        assert code != 0 and "the replication was finished at " in err, err
    code, _, err = run_cli(capsys, "snapshot", "--resnapshot")  # a new one
    assert code == 0, err
    code, out, _ = run_cli(capsys, "status", "--json")
    assert code == 0 and "finished_at" not in json.loads(out)


def test_pgcdc_finish_refuses_while_the_target_lacks_a_change(cli_env, capsys):
    _snapshot_then(cli_env, capsys, "INSERT INTO items VALUES (101, 'not yet received')")
    code, _, err = run_cli(capsys, "finish")
    assert code != 0
    assert "holds published changes the target has not received" in err, err
    assert "pgcdc cutover" in err and "--abandon" in err


def test_a_table_dropped_and_created_again_on_the_source_is_named_stale(cli_env, capsys):
    """A replicated table dropped and created again on the source is no longer in the
    publication (it lists tables by identity): its changes stop arriving, silently for the
    apply. Status and verify name it; emptied on the target and added again, it converges."""
    _snapshot_then(
        cli_env,
        capsys,
        "DROP TABLE items",
        "CREATE TABLE items (id int PRIMARY KEY, name text)",
        "INSERT INTO items VALUES (1, 'reborn')",
    )
    code, _, err = run_cli(capsys, "catchup")
    assert code == 0, err  # nothing it is sent fails

    code, out, _ = run_cli(capsys, "status", "--json")
    assert code == 0 and json.loads(out)["no_longer_published"] == ["public.items"]
    code, out, err = run_cli(capsys, "verify")
    assert code != 0 and "STALE public.items: replicated, but the publication no longer" in out, err
    assert "public.items" in err

    with psycopg.connect(cli_env["PGCDC_TARGET_DSN"], autocommit=True) as conn:
        conn.execute("TRUNCATE items")
    code, out, err = run_cli(capsys, "add-table", "items")
    assert code == 0, err
    with psycopg.connect(cli_env["PGCDC_SOURCE_DSN"], autocommit=True) as conn:
        conn.execute("INSERT INTO items VALUES (2, 'after')")
    code, _, err = run_cli(capsys, "catchup")
    assert code == 0, err
    code, out, _ = run_cli(capsys, "verify", "--json")
    report = json.loads(out)
    assert code == 0 and report["equal"] is True and report["no_longer_published"] == []


def test_a_snapshot_command_opens_dagster_once_its_head_start_copies(monkeypatch):
    """``pgcdc snapshot`` imports Dagster once its head start reports the copy, or has ended,
    or after HEAD_START_SETTLE_S (a slot waiting for the source's open transactions)."""
    import threading
    import time

    from pgcdc_dagster.cli import snapshot as cli
    from pgcdc_dagster.engine.control.head_start import Background
    from pgcdc_dagster.engine.progress import SnapshotProgress, publish

    with cli._snapshot_copying() as copying:
        publish(SnapshotProgress("schema", 0.1))
        assert not copying.is_set()
        publish(SnapshotProgress("copy", 0.2))
        assert copying.is_set()
    ended = Background(lambda: None, name="ended")
    ended.result()
    started = time.monotonic()
    cli._until_copying(threading.Event(), ended)
    assert time.monotonic() - started < 1.0
    release = threading.Event()
    waiting = Background(lambda: release.wait(30), name="waiting")
    monkeypatch.setattr(cli, "HEAD_START_SETTLE_S", 0.3)
    started = time.monotonic()
    cli._until_copying(threading.Event(), waiting)
    assert 0.3 <= time.monotonic() - started < 5.0 and waiting.running()
    release.set()
    waiting.result()
