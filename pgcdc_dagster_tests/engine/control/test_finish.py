"""Ending a replication: the slot (which retains the source's WAL for as long as it exists) and
the target's origin dropped, never while the target lacks a published change unless told to,
and whatever is killed on the way, the next end finishes it."""

from __future__ import annotations

import threading

import psycopg
import pytest

from pgcdc_dagster.defs.checks import slot_health_result
from pgcdc_dagster.engine.control import pipeline
from pgcdc_dagster.engine.control.finish import FinishRefusedError, finish
from pgcdc_dagster.engine.follow.follower import Follower
from pgcdc_dagster.engine.settings import ReplicationSettings
from pgcdc_dagster.engine.store.output_store import OutputStore
from pgcdc_dagster_tests.support.pg import run_sql
from pgcdc_dagster_tests.support.replication import catch_up, killed_at, settings_for


def _replicating(source_dsn, target_dsn, tmp_path, spark, prefix) -> ReplicationSettings:
    run_sql(source_dsn, "CREATE TABLE a (id int PRIMARY KEY)", "INSERT INTO a VALUES (1)")
    settings = settings_for(source_dsn, target_dsn, tmp_path, prefix)
    pipeline.take_snapshot(settings, spark)
    return settings


def _slot_exists(settings: ReplicationSettings) -> bool:
    with psycopg.connect(settings.source_dsn) as conn:
        return (
            conn.execute(
                "SELECT 1 FROM pg_replication_slots WHERE slot_name = %s", (settings.slot,)
            ).fetchone()
            is not None
        )


def _origin_exists(settings: ReplicationSettings) -> bool:
    with psycopg.connect(settings.target_dsn) as conn:
        return (
            conn.execute(
                "SELECT 1 FROM pg_replication_origin WHERE roname = %s", (settings.origin,)
            ).fetchone()
            is not None
        )


def test_an_end_refuses_while_the_target_lacks_a_change_then_drops_slot_and_origin(
    source_dsn, target_dsn, tmp_path, spark
):
    settings = _replicating(source_dsn, target_dsn, tmp_path, spark, "finish")
    run_sql(source_dsn, "INSERT INTO a VALUES (2)")
    with pytest.raises(FinishRefusedError, match=r"holds published changes the target has not "
                       r"received: .*run pgcdc cutover"):  # fmt: skip
        finish(settings, "test", 5)
    assert _slot_exists(settings) and OutputStore(settings.store).chain().finished_at is None

    catch_up(settings)
    applied = pipeline.origin_progress(settings)
    run_sql(
        source_dsn, "CREATE TABLE not_published (id int)", "INSERT INTO not_published VALUES (1)"
    )
    result = finish(settings, "test", 5)  # WAL moved, nothing published in it: caught up
    assert (result.finished_at, result.slot_dropped, result.origin_dropped) == (applied, True, True)
    assert not _slot_exists(settings) and not _origin_exists(settings)
    with psycopg.connect(target_dsn) as conn:  # the DDL records went too
        assert conn.execute("SELECT to_regnamespace('pgcdc_ddl')").fetchone() == (None,)
    assert OutputStore(settings.store).chain().finished_at == applied
    check = slot_health_result(settings, 1 << 30)
    assert check.passed and "finished" in (check.description or "")

    again = finish(settings, "test", 5)  # nothing left: says so, changes nothing
    assert (again.finished_at, again.slot_dropped, again.origin_dropped) == (applied, False, False)


def test_an_end_with_abandon_drops_what_the_target_lacks(source_dsn, target_dsn, tmp_path, spark):
    settings = _replicating(source_dsn, target_dsn, tmp_path, spark, "finish_abandon")
    run_sql(source_dsn, "INSERT INTO a VALUES (2)")
    finish(settings, "test", 5, abandon=True)
    assert not _slot_exists(settings) and not _origin_exists(settings)


def test_an_end_refuses_while_a_table_is_being_added(source_dsn, target_dsn, tmp_path, spark):
    """An add not done (here one killed after recording its table as being added) leaves
    that table's changes held back: an end would leave the target without them for good."""
    from pgcdc_dagster.engine.identifiers import TableName

    settings = _replicating(source_dsn, target_dsn, tmp_path, spark, "finish_adding")
    OutputStore(settings.store).begin_adding([TableName("public", "b")])
    with pytest.raises(FinishRefusedError, match=r"adding public\.b is not done.*pgcdc "
                       r"add-table public\.b.*--abandon"):  # fmt: skip
        finish(settings, "test", 5)
    assert _slot_exists(settings) and OutputStore(settings.store).chain().finished_at is None
    finish(settings, "test", 5, abandon=True)
    assert not _slot_exists(settings)


FINISH_IN_CHILD = (
    "import sys; from pgcdc_dagster.engine.control.finish import finish; "
    "from pgcdc_dagster.engine.settings import ReplicationSettings; "
    "finish(ReplicationSettings.model_validate_json(sys.argv[1]), 'child', 5)"
)


def test_an_end_killed_once_recorded_is_finished_by_the_next(
    source_dsn, target_dsn, tmp_path, spark
):
    """SIGKILL of a real end once the store records it, before anything is dropped: the next
    end drops the slot and the origin without asking again whether the target is behind."""
    settings = _replicating(source_dsn, target_dsn, tmp_path, spark, "finish_kill")
    killed_at("finish.after_record", FINISH_IN_CHILD, settings)
    assert OutputStore(settings.store).chain().finished_at is not None
    assert _slot_exists(settings) and _origin_exists(settings)

    run_sql(source_dsn, "INSERT INTO a VALUES (3)")  # after the end: not for this target
    result = finish(settings, "test", 5)
    assert result.slot_dropped and result.origin_dropped
    assert not _slot_exists(settings) and not _origin_exists(settings)


def test_a_follow_makes_way_for_the_end_and_then_stops(source_dsn, target_dsn, tmp_path, spark):
    settings = _replicating(source_dsn, target_dsn, tmp_path, spark, "finish_follow")
    follower = Follower(settings)
    done: list = []

    def follow() -> None:
        with pipeline.range_lock(settings):
            for followed in follower.run():
                done.append(followed)

    thread = threading.Thread(target=follow)
    thread.start()
    try:
        run_sql(source_dsn, "INSERT INTO a VALUES (2)")
        while not done:  # the follow applied it
            thread.join(0.1)
        finish(settings, "test", 30)
        thread.join(30)
        assert not thread.is_alive()
    finally:
        follower.stop("test")
        thread.join()
    assert follower.summary.stopped_by.startswith("the replication was finished at ")
    assert not _slot_exists(settings) and not _origin_exists(settings)
