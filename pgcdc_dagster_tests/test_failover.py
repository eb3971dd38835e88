"""The source fails over to its physical standby (PostgreSQL 18, a primary crashed for real and
the standby promoted) while the replication runs, through the commands a user runs:

- with a failover slot and ``synchronized_standby_slots``, a running ``pgcdc follow`` rides
  the failover by itself, from the promoted standby's copy of the slot, with no re-copy;
- without ``synchronized_standby_slots``, the preflight warns, a real fork (the target applied
  a transaction the standby never received) stops the catch-up naming ``pgcdc recover``, and
  the recovery ends equal;
- PostgreSQL 16 (no failover slots): after a promotion the slot is gone, the line names
  ``pgcdc recover``, and the recovery converges;
- decoding on a hot standby: the slot and snapshot there, the publication on the primary, and
  the follow rides that standby's promotion.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from dagster import AssetCheckSeverity, DagsterRunStatus, RunsFilter

from pgcdc_dagster.defs import instance as instance_module
from pgcdc_dagster.defs.checks import slot_survives_failover_result
from pgcdc_dagster.defs.instance import dagster_instance
from pgcdc_dagster.engine.control.range_lock import lock_holders
from pgcdc_dagster.engine.postgres_installs import ToolsError, server_installation
from pgcdc_dagster.engine.settings import ReplicationSettings
from pgcdc_dagster_tests.conftest import command_environment
from pgcdc_dagster_tests.support.standby import Pair, RidingWriter, primary_with_standby
from pgcdc_dagster_tests.support.waits import wait_for
from pgcdc_dagster_tests.test_cli import run_cli

PGCDC = str(Path(sys.executable).parent / "pgcdc")
REPO = Path(__file__).resolve().parent.parent
CONTENT = "SELECT count(*), coalesce(sum(hashtext(a::text)), 0) FROM accounts a"


def _content(dsn: str) -> tuple:
    with psycopg.connect(dsn) as conn:
        return conn.execute(CONTENT).fetchone()  # type: ignore[return-value]


def _app_database(pair: Pair) -> str:
    """A database ``app`` on the primary with a table of 1,000 accounts, replayed on the
    standby; the multi-host DSN that reaches whichever is the primary."""
    with psycopg.connect(pair.primary.dsn(), autocommit=True) as conn:
        conn.execute("CREATE DATABASE app")
    dsn = pair.multi_host_dsn("app")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE accounts (id int PRIMARY KEY, balance int)")
        conn.execute("INSERT INTO accounts SELECT g, 0 FROM generate_series(1, 1000) g")
    pair.wait_replayed()
    return dsn


def Writer(dsn: str) -> RidingWriter:
    """Inserts one account after another (an upsert: a commit cut by the crash may have landed
    and be retried), riding the failover."""

    def insert(conn: psycopg.Connection, n: int) -> None:
        conn.execute(
            "INSERT INTO accounts VALUES (%s, 1) ON CONFLICT (id) "
            "DO UPDATE SET balance = accounts.balance + 1",
            (100_000 + n,),
        )

    return RidingWriter(dsn, insert)


def _slot_row(dsn: str, slot: str) -> tuple | None:
    with psycopg.connect(dsn) as conn:
        return conn.execute(
            "SELECT failover, confirmed_flush_lsn::text FROM pg_replication_slots "
            "WHERE slot_name = %s",
            (slot,),
        ).fetchone()


def _synced(pair: Pair, slot: str, advance) -> None:
    """Until the standby holds a persistent copy of ``slot``: the copy stays temporary until
    the primary's slot has moved its restart point past where the copy began, which takes a
    running-transactions record (``pg_log_standby_snapshot``, flushed) decoded and confirmed
    by a consumer (``advance``), then a round of the standby's slot sync worker."""
    deadline = time.monotonic() + 120
    while True:
        with psycopg.connect(pair.primary.dsn(), autocommit=True) as conn:
            conn.execute("SELECT pg_log_standby_snapshot()")
            # Flushed at once (a running-transactions record alone waits for the WAL writer).
            conn.execute("SELECT pg_logical_emit_message(false, 'pgcdc-test', '', true)")
        advance()
        try:
            pair.wait_synced_slot(slot, timeout=5)
            return
        except TimeoutError:
            assert time.monotonic() < deadline, "the standby's copy of the slot stayed temporary"


def _follow() -> subprocess.Popen:
    """``pgcdc follow`` in a process group of its own, its progress as lines on stderr."""
    return subprocess.Popen(
        [PGCDC, "follow"],
        env={**os.environ, "PGCDC_PROGRESS": "lines"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _more_writes_then_equal(
    writer: RidingWriter, follow: subprocess.Popen, target_dsn: str, promoted: str
) -> None:
    """A hundred more commits on the promoted standby, the writer stopped, then the target
    equal to it, the running follow still alive."""
    committed = writer.committed
    wait_for(lambda: writer.committed > committed + 100, "more writes")
    writer.finish()
    wait_for(
        lambda: _content(target_dsn) == _content(promoted),
        "the target to equal the promoted standby",
        timeout=120,
    )
    assert follow.poll() is None, "the follow ended at the failover"


def _ok(capsys, *args: str) -> str:
    """``pgcdc args`` in this process, which must exit 0; its standard output."""
    code, out, err = run_cli(capsys, *args)
    assert code == 0, err
    return out


def _promoted_after(pair: Pair, source: str, statement: str, then: Callable[[], None]) -> str:
    """A fork made for real: the standby stops, ``statement`` commits on the primary and
    ``then()`` runs (the replication takes it), the primary crashes and the standby, which
    never received it, is promoted. The new primary's DSN (database ``app``)."""
    pair.stop_standby()
    with psycopg.connect(source, autocommit=True) as conn:
        conn.execute(statement)
    then()
    pair.crash_primary()
    pair.start_standby()
    pair.promote()
    return pair.standby.dsn("app")


@pytest.fixture
def failover_pair() -> Iterator[Pair]:
    with primary_with_standby(major=18) as pair:
        yield pair


def test_a_failover_under_writes_is_followed_from_the_promoted_standby_without_a_recopy(
    failover_pair, target_dsn, target_cluster, tmp_path, monkeypatch, capsys
):
    pair = failover_pair
    source = _app_database(pair)
    with command_environment(source, target_dsn, target_cluster, tmp_path, monkeypatch) as env:
        slot = env["PGCDC_SLOT"]
        code, _, err = run_cli(capsys, "snapshot")
        assert code == 0, err
        assert "synchronized_standby_slots" not in err, err  # the source is set up for it
        assert _slot_row(pair.primary.dsn("app"), slot)[0] is True  # a failover slot

        writer = Writer(source)
        writer.start()
        follow = _follow()
        try:
            wait_for(
                what="the follow to take the range",
                condition=lambda: (
                    follow.poll() is None
                    and any(h.holder.startswith("run ") for h in lock_holders(target_dsn, slot))
                ),
                timeout=120,
            )
            _synced(pair, slot, lambda: None)  # the follow advances the slot
            check = slot_survives_failover_result(ReplicationSettings.from_env())
            assert check.passed, check.description
            assert "synced" in check.metadata["standby copies"].value, check.metadata
            wait_for(what="applies", condition=lambda: _content(target_dsn)[0] > 1_050)
            pair.crash_primary()
            pair.promote()
            promoted = pair.standby.dsn("app")
            wait_for(
                what="writes on the new primary", condition=lambda: _content(promoted)[0] > 1_050
            )
            _more_writes_then_equal(writer, follow, target_dsn, promoted)
        finally:
            writer.stop.set()
            follow.send_signal(signal.SIGTERM)
            _, follow_err = follow.communicate(timeout=60)
        assert follow.returncode == 0, follow_err
        assert "the source failed over: timeline 1 -> 2" in follow_err, follow_err
        code, out, err = run_cli(capsys, "verify", "--json")
        assert code == 0, err
        assert json.loads(out)["equal"] is True, out


def test_the_sensors_follow_run_rides_a_failover_with_no_hands(
    failover_pair, target_dsn, target_cluster, tmp_path, monkeypatch, capsys
):
    """dagster-daemon with the slot sensor in follow mode (the shipped dagster.yaml): the
    primary crashes and the standby is promoted under writes; the sensor's follow run goes on
    from the promoted standby by itself, and the target ends equal to it."""
    pair = failover_pair
    source = _app_database(pair)
    # This test reads its own storage: not the instance an earlier test left to the process.
    monkeypatch.setattr(instance_module, "_instance", None)
    with command_environment(source, target_dsn, target_cluster, tmp_path, monkeypatch) as env:
        slot = env["PGCDC_SLOT"]
        code, _, err = run_cli(capsys, "snapshot")
        assert code == 0, err
        daemon = subprocess.Popen(
            [str(Path(sys.executable).parent / "dagster-daemon"), "run", "-w", "workspace.yaml"],
            cwd=REPO,
            env={**os.environ, "PGCDC_MODE": "follow", "PGCDC_SENSOR_INTERVAL": "1"},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        writer = Writer(source)
        writer.start()
        try:
            wait_for(
                what="the sensor's follow run to apply",
                condition=lambda: _content(target_dsn)[0] > 1_050,
                timeout=180,
            )
            _synced(pair, slot, lambda: None)  # the follow run advances the slot
            pair.crash_primary()
            pair.promote()
            promoted = pair.standby.dsn("app")
            wait_for(
                what="writes on the new primary", condition=lambda: _content(promoted)[0] > 1_100
            )
            writer.finish()
            wait_for(
                what="the target to equal the new primary",
                condition=lambda: _content(target_dsn) == _content(promoted),
                timeout=120,
            )
            runs = dagster_instance().get_runs(RunsFilter(job_name="follow"))
            assert [r.status for r in runs] == [DagsterRunStatus.STARTED], runs
        finally:
            writer.stop.set()
            os.killpg(daemon.pid, signal.SIGTERM)
            try:
                daemon.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(daemon.pid, signal.SIGKILL)


def test_a_follow_killed_in_the_failover_window_is_finished_by_the_next_catchup(
    failover_pair, target_dsn, target_cluster, tmp_path, monkeypatch, capsys
):
    """SIGKILL of the follow while the primary is down and the standby not yet promoted (the
    follow retrying); after the promotion, a plain ``pgcdc catchup`` converges."""
    pair = failover_pair
    source = _app_database(pair)
    with command_environment(source, target_dsn, target_cluster, tmp_path, monkeypatch) as env:
        slot = env["PGCDC_SLOT"]
        code, _, err = run_cli(capsys, "snapshot")
        assert code == 0, err
        writer = Writer(source)
        writer.start()
        follow = subprocess.Popen(
            [PGCDC, "follow"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            _synced(pair, slot, lambda: None)
            wait_for(what="applies", condition=lambda: _content(target_dsn)[0] > 1_050)
            pair.crash_primary()
            time.sleep(1.0)  # the follow has lost its source and is retrying
            assert follow.poll() is None
            os.killpg(follow.pid, signal.SIGKILL)
            follow.wait(30)
            pair.promote()
            promoted = pair.standby.dsn("app")
            wait_for(
                what="writes on the new primary", condition=lambda: _content(promoted)[0] > 1_100
            )
            writer.finish()
        finally:
            writer.stop.set()
            if follow.poll() is None:
                os.killpg(follow.pid, signal.SIGKILL)
            follow.communicate(timeout=30)
        code, _, err = run_cli(capsys, "catchup")
        assert code == 0, err
        assert _content(target_dsn) == _content(pair.standby.dsn("app"))
        code, out, err = run_cli(capsys, "verify", "--json")
        assert code == 0 and json.loads(out)["equal"] is True, out


def test_a_failover_that_forks_stops_naming_recover_and_the_recovery_ends_equal(
    target_dsn, target_cluster, tmp_path, monkeypatch, capsys
):
    with primary_with_standby(major=18, synchronized=False) as pair:
        source = _app_database(pair)
        with command_environment(source, target_dsn, target_cluster, tmp_path, monkeypatch) as env:
            slot = env["PGCDC_SLOT"]
            code, _, err = run_cli(capsys, "snapshot")
            assert code == 0, err
            assert "synchronized_standby_slots" in err and "warning" in err, err
            check = slot_survives_failover_result(ReplicationSettings.from_env())
            assert not check.passed and check.severity == AssetCheckSeverity.WARN
            assert "synchronized_standby_slots = 'pgcdc_standby'" in check.description, check
            with psycopg.connect(source, autocommit=True) as conn:
                conn.execute("UPDATE accounts SET balance = 1 WHERE id <= 10")
            _ok(capsys, "catchup")
            _synced(pair, slot, lambda: _ok(capsys, "catchup"))
            # The fork: the target applies what the standby never got.
            promoted = _promoted_after(
                pair,
                source,
                "UPDATE accounts SET balance = 2 WHERE id <= 20; "
                "INSERT INTO accounts VALUES (5001, 5)",
                lambda: _ok(capsys, "catchup"),
            )
            with psycopg.connect(promoted, autocommit=True) as conn:
                conn.execute("UPDATE accounts SET balance = 3 WHERE id BETWEEN 900 AND 910")

            code, _, err = run_cli(capsys, "catchup")
            assert code != 0
            assert "failed over" in err and "pgcdc recover" in err, err
            assert "\n" not in err.strip().removeprefix("pgcdc: "), err
            code, out, err = run_cli(capsys, "status", "--json")
            assert code == 0, err
            assert "pgcdc recover" in json.loads(out)["next_step"], out

            # Killed once the chain says recovering, before the new timeline is recorded.
            killed = subprocess.run(
                [PGCDC, "recover"],
                env={**os.environ, "PGCDC_FAILPOINT": "recover.after_begin=kill"},
                capture_output=True,
                text=True,
            )
            assert killed.returncode == -signal.SIGKILL, killed.stderr
            code, out, err = run_cli(capsys, "recover", "--json")
            assert code == 0, err
            # A fork: the target's position says nothing of what it lacks, so every row is
            # compared (the killed recovery removed the bounds before it began).
            recovered = json.loads(out)
            assert "fork removes them" in recovered["bound"], recovered
            assert _content(target_dsn) == _content(promoted)
            with psycopg.connect(promoted, autocommit=True) as conn:
                conn.execute("UPDATE accounts SET balance = 4 WHERE id <= 5")
            code, _, err = run_cli(capsys, "catchup")
            assert code == 0, err
            code, out, err = run_cli(capsys, "verify", "--json")
            assert code == 0 and json.loads(out)["equal"] is True, out


def test_a_range_stored_past_the_switch_point_is_dropped_and_never_applied(
    target_dsn, target_cluster, tmp_path, monkeypatch, capsys
):
    """A catch-up stores a range the standby never received and is SIGKILLed before it
    applies it; the standby is promoted. The next catch-up drops that range (its transaction
    is on no timeline the new primary has), reads again from the promoted standby's copy of the
    slot, and the target ends equal to the new primary, without that transaction."""
    with primary_with_standby(major=18, synchronized=False) as pair:
        source = _app_database(pair)
        with command_environment(source, target_dsn, target_cluster, tmp_path, monkeypatch) as env:
            slot = env["PGCDC_SLOT"]
            _ok(capsys, "snapshot")
            _synced(pair, slot, lambda: _ok(capsys, "catchup"))

            def killed_before_its_apply() -> None:
                killed = subprocess.run(
                    [PGCDC, "catchup"],
                    env={**os.environ, "PGCDC_FAILPOINT": "catchup.before_apply=kill"},
                    capture_output=True,
                    text=True,
                )
                assert killed.returncode == -signal.SIGKILL, killed.stderr

            promoted = _promoted_after(
                pair, source, "INSERT INTO accounts VALUES (7001, 7)", killed_before_its_apply
            )
            with psycopg.connect(promoted, autocommit=True) as conn:
                conn.execute("INSERT INTO accounts VALUES (7002, 8)")
            # Killed between dropping the range and recording the timeline: the next redoes it.
            killed = subprocess.run(
                [PGCDC, "catchup"],
                env={**os.environ, "PGCDC_FAILPOINT": "failover.after_drop=kill"},
                capture_output=True,
                text=True,
            )
            assert killed.returncode == -signal.SIGKILL, killed.stderr

            code, out, err = run_cli(capsys, "catchup")
            assert code == 0, err
            with psycopg.connect(target_dsn) as conn:
                ids = [r[0] for r in conn.execute("SELECT id FROM accounts WHERE id > 7000")]
            assert ids == [7002], ids
            assert _content(target_dsn) == _content(promoted)
            code, out, err = run_cli(capsys, "verify", "--json")
            assert code == 0 and json.loads(out)["equal"] is True, out


def test_a_slot_made_without_failover_is_named_and_switched_by_the_next_catchup(
    failover_pair, target_dsn, target_cluster, tmp_path, monkeypatch, capsys
):
    pair = failover_pair
    source = _app_database(pair)
    with command_environment(source, target_dsn, target_cluster, tmp_path, monkeypatch) as env:
        slot = env["PGCDC_SLOT"]
        monkeypatch.setenv("PGCDC_SLOT_FAILOVER", "off")
        code, _, err = run_cli(capsys, "snapshot")
        assert code == 0, err
        assert f"slot {slot} is not a failover slot" in err, err
        assert _slot_row(pair.primary.dsn("app"), slot)[0] is False
        code, out, err = run_cli(capsys, "status", "--json")
        assert code == 0, err
        assert any("PGCDC_SLOT_FAILOVER" in gap for gap in json.loads(out)["failover_gaps"])

        monkeypatch.setenv("PGCDC_SLOT_FAILOVER", "auto")
        code, _, err = run_cli(capsys, "catchup")
        assert code == 0, err
        assert _slot_row(pair.primary.dsn("app"), slot)[0] is True


def _has_16_with_basebackup() -> bool:
    try:
        return server_installation(16).has("pg_basebackup")
    except ToolsError:
        return False


@pytest.mark.skipif(not _has_16_with_basebackup(), reason="no PostgreSQL 16 with pg_basebackup")
def test_a_postgres_16_source_that_fails_over_names_recover_and_converges(
    target_dsn, target_cluster, tmp_path, monkeypatch, capsys
):
    with primary_with_standby(major=16, sync_slots=False, synchronized=False) as pair:
        source = _app_database(pair)
        with command_environment(source, target_dsn, target_cluster, tmp_path, monkeypatch) as env:
            code, _, err = run_cli(capsys, "snapshot")
            assert code == 0, err
            assert "PostgreSQL 16" in err and "pgcdc recover" in err, err
            with psycopg.connect(source, autocommit=True) as conn:
                conn.execute("UPDATE accounts SET balance = 1 WHERE id <= 10")
            code, _, err = run_cli(capsys, "catchup")
            assert code == 0, err
            pair.wait_replayed()
            pair.crash_primary()
            pair.promote()
            with psycopg.connect(source, autocommit=True) as conn:
                conn.execute("UPDATE accounts SET balance = 2 WHERE id <= 20")

            code, _, err = run_cli(capsys, "catchup")
            assert code != 0
            assert f"slot {env['PGCDC_SLOT']} does not exist" in err, err
            assert "pgcdc recover" in err and "pgcdc snapshot)" in err, err
            code, out, err = run_cli(capsys, "recover", "--json")
            assert code == 0, err
            # No fork: the bound read on the old timeline serves, and only what changed is
            # copied (changed_since's docstring gives the argument).
            recovered = json.loads(out)
            assert recovered["bound"].startswith("the bound"), recovered
            assert recovered["tables_by_fallback"] == 0 and recovered["rows_changed"] >= 20
            assert _content(target_dsn) == _content(pair.standby.dsn("app"))
            code, out, err = run_cli(capsys, "verify", "--json")
            assert code == 0 and json.loads(out)["equal"] is True, out


def test_a_follow_that_decodes_on_a_hot_standby_rides_that_standbys_promotion(
    target_dsn, target_cluster, tmp_path, monkeypatch, capsys
):
    """``PGCDC_SOURCE_DSN`` names the hot standby: the slot, the snapshot and the stream are
    there, the publication is made on its primary; the primary crashes, the standby is
    promoted under writes, and the running follow goes on from its own slot."""
    with primary_with_standby(major=18, sync_slots=False, synchronized=False) as pair:
        writes = _app_database(pair)  # the multi-host DSN: whichever accepts writes
        source = pair.standby.dsn("app")
        with command_environment(source, target_dsn, target_cluster, tmp_path, monkeypatch) as env:
            slot = env["PGCDC_SLOT"]
            monkeypatch.setenv("PGCDC_SLOT_FAILOVER", "on")
            code, _, err = run_cli(capsys, "snapshot")
            assert code != 0 and "the source is a hot standby" in err, err
            with psycopg.connect(writes) as conn:  # refused before anything was written
                assert conn.execute("SELECT count(*) FROM pg_publication").fetchone() == (0,)
            monkeypatch.setenv("PGCDC_SLOT_FAILOVER", "auto")
            with psycopg.connect(writes, autocommit=True) as conn:
                conn.execute("CREATE ROLE reader LOGIN REPLICATION")
                conn.execute("GRANT SELECT ON accounts TO reader")
            pair.wait_replayed()
            monkeypatch.setenv("PGCDC_SOURCE_DSN", f"{source} user=reader")
            code, _, err = run_cli(capsys, "snapshot")
            assert code != 0 and "GRANT pg_read_all_stats to the source role" in err, err
            monkeypatch.setenv("PGCDC_SOURCE_DSN", source)
            code, _, err = run_cli(capsys, "snapshot")
            assert code == 0, err
            assert "warning" not in err, err  # feedback on, a physical slot: nothing missing
            assert _slot_row(source, slot) is not None
            assert _slot_row(pair.primary.dsn("app"), slot) is None
            status = json.loads(_ok(capsys, "status", "--json"))
            assert "a hot standby of" in status["failover: decoding on"], status
            assert status["failover_gaps"] == []
            with psycopg.connect(source, autocommit=True) as conn:
                conn.execute("ALTER SYSTEM SET hot_standby_feedback = off")
                conn.execute("SELECT pg_reload_conf()")
                show = "SHOW hot_standby_feedback"
                wait_for(
                    what="the reload", condition=lambda: conn.execute(show).fetchone()[0] == "off"
                )
                status = json.loads(_ok(capsys, "status", "--json"))
                assert any("hot_standby_feedback" in gap for gap in status["failover_gaps"])
                conn.execute("ALTER SYSTEM RESET hot_standby_feedback")
                conn.execute("SELECT pg_reload_conf()")

            writer = Writer(writes)
            writer.start()
            follow = _follow()
            try:
                wait_for(
                    what="applies", condition=lambda: _content(target_dsn)[0] > 1_050, timeout=120
                )
                pair.crash_primary()
                pair.promote()
                wait_for(
                    what="writes on the new primary", condition=lambda: writer.back_at is not None
                )
                _more_writes_then_equal(writer, follow, target_dsn, source)
            finally:
                writer.stop.set()
                follow.send_signal(signal.SIGTERM)
                _, follow_err = follow.communicate(timeout=60)
            assert follow.returncode == 0, follow_err
            code, out, err = run_cli(capsys, "verify", "--json")
            assert code == 0, err
            assert json.loads(out)["equal"] is True, out
