"""A table added to a running replication: copied as of a consistent point of its own, its
changes in the stream applied only past it, exactly once, whatever happens in between."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest

from pgcdc_dagster.engine import pipeline
from pgcdc_dagster.engine.apply import ApplyError
from pgcdc_dagster.engine.follow import Followed, Follower
from pgcdc_dagster.engine.identifiers import TableName
from pgcdc_dagster.engine.settings import ReplicationSettings
from pgcdc_dagster.engine.snapshot import TargetNotEmptyError
from pgcdc_dagster.engine.store import OutputStore
from pgcdc_dagster_tests.replication import catch_up, equal_tables, settings_for

ADDED = TableName("public", "b")


def _source(dsn: str, *statements: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement)


def _started(source_dsn, target_dsn, tmp_path, spark, **overrides) -> ReplicationSettings:
    """A replication of ``a`` under way; then ``b`` (no key: a change applied twice would
    show as a row too many) created with rows, put in the publication by the user, written
    again, and a range that needs it refused."""
    _source(
        source_dsn, "CREATE TABLE a (id int PRIMARY KEY, v text)", "INSERT INTO a VALUES (1, 'x')"
    )
    settings = settings_for(source_dsn, target_dsn, tmp_path, "added", **overrides)
    pipeline.take_snapshot(settings, spark)
    _source(
        source_dsn,
        "CREATE TABLE b (k int, v text)",
        "ALTER TABLE b REPLICA IDENTITY FULL",
        "INSERT INTO b SELECT g, 'before' FROM generate_series(1, 3) g",
        "INSERT INTO a VALUES (2, 'y')",
        f"ALTER PUBLICATION {settings.publication} ADD TABLE b",
        # In the stream and, once added, in its copy too: applied once.
        "INSERT INTO b VALUES (4, 'published'), (5, 'published')",
        "INSERT INTO a VALUES (3, 'z')",
    )
    with pytest.raises(ApplyError, match=r"public\.b of the range do not exist on the target: "
                       r".*run pgcdc add-table public\.b"):  # fmt: skip
        catch_up(settings)
    return settings


@pytest.mark.parametrize("applied_on", ["process", "spark"])
def test_an_added_table_is_copied_and_then_takes_only_the_changes_past_its_copy(
    source_dsn, target_dsn, tmp_path, spark, applied_on
):
    overrides = {"spark_min_changes": 1} if applied_on == "spark" else {}
    settings = _started(source_dsn, target_dsn, tmp_path, spark, **overrides)

    added = pipeline.add_tables(settings, [ADDED], spark)
    assert [(t.table, t.rows) for t in added.tables] == [(ADDED, 5)]
    chain = OutputStore(settings.store).chain()
    assert chain is not None and chain.adding == ()
    assert chain.synced_from == {ADDED: added.consistent_point}

    _source(
        source_dsn,
        "INSERT INTO b VALUES (6, 'after')",
        "UPDATE b SET v = 'changed' WHERE k = 1",
        "DELETE FROM b WHERE k = 2",
        "INSERT INTO a VALUES (4, 'w')",
    )
    # The range the apply stopped at holds b's first changes: now applied past b's copy only.
    done = catch_up(settings, spark=spark)
    assert {a.compaction_path for _, a in done if a.changes} == {
        "spark" if applied_on == "spark" else "arrow"
    }
    assert equal_tables(settings) == [("public.a", True), ("public.b", True)]
    with psycopg.connect(target_dsn) as conn:
        rows = conn.execute("SELECT k, v FROM b ORDER BY k").fetchall()
    assert rows == [(1, "changed"), (3, "before"), (4, "published"), (5, "published"), (6, "after")]


def test_adding_a_table_the_target_already_holds_is_refused_before_anything_changes(
    source_dsn, target_dsn, tmp_path, spark
):
    settings = _started(source_dsn, target_dsn, tmp_path, spark)
    with psycopg.connect(target_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE b (k int, v text)")
        conn.execute("INSERT INTO b VALUES (99, 'by hand')")

    with pytest.raises(TargetNotEmptyError, match=r"public\.b already hold rows"):
        pipeline.add_tables(settings, [ADDED], spark)
    chain = OutputStore(settings.store).chain()
    assert chain is not None and chain.adding == () and chain.synced_from == {}
    with psycopg.connect(target_dsn) as conn:
        assert conn.execute("SELECT k FROM b").fetchall() == [(99,)]


ADD_IN_CHILD = (
    "import sys; from pgcdc_dagster.engine import pipeline; "
    "from pgcdc_dagster.engine.identifiers import TableName; "
    "from pgcdc_dagster.engine.settings import ReplicationSettings; "
    "pipeline.add_tables(ReplicationSettings.model_validate_json(sys.argv[1]), "
    "[TableName('public', 'b')], None)"
)


@pytest.mark.parametrize("point", ["add.after_begin", "add.after_copy"])
def test_an_add_killed_anywhere_holds_the_apply_until_an_add_again_converges(
    source_dsn, target_dsn, tmp_path, spark, point
):
    """SIGKILL of a real ``add_tables`` process before the target changes, and once the copy
    is on the target but not yet recorded: every apply refuses (the copy may be partial), the
    temporary slot is gone with its process, and the next add copies again, exactly once."""
    settings = _started(source_dsn, target_dsn, tmp_path, spark)
    child = subprocess.run(
        [sys.executable, "-c", ADD_IN_CHILD, settings.model_dump_json()],
        env={**os.environ, "PGCDC_FAILPOINT": f"{point}=kill@1"},
        capture_output=True,
        timeout=300,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()[-2000:]
    chain = OutputStore(settings.store).chain()
    assert chain is not None and chain.adding == (ADDED,)
    with pytest.raises(ApplyError, match=r"adding table\(s\) public\.b .* did not finish.*"
                       r"run pgcdc add-table public\.b again"):  # fmt: skip
        catch_up(settings)
    with psycopg.connect(source_dsn) as conn:  # the temporary slot went with its session
        assert conn.execute(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_name LIKE %s",
            (f"{settings.slot}_add_%",),
        ).fetchone() == (0,)

    pipeline.add_tables(settings, [ADDED], spark)
    _source(source_dsn, "INSERT INTO b VALUES (6, 'after')")
    catch_up(settings)
    assert equal_tables(settings) == [("public.a", True), ("public.b", True)]
    with psycopg.connect(target_dsn) as conn:
        assert conn.execute("SELECT count(*) FROM b").fetchone() == (6,)


def _writes_to_a_and_b(dsn: str, stop: threading.Event) -> None:
    """One transaction after another writing ``a`` and ``b`` together, published or not."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        n = 1000
        while not stop.is_set():
            n += 1
            with conn.transaction():
                conn.execute("INSERT INTO a VALUES (%s, 'w')", (n,))
                conn.execute("INSERT INTO b VALUES (%s, 'w')", (n,))
            time.sleep(0.005)


@contextmanager
def _following_while_writing(
    source_dsn, target_dsn, tmp_path, spark, prefix
) -> Iterator[tuple[ReplicationSettings, Follower, list[Followed]]]:
    """A follow (no endpos, under the range lock, on a thread) of ``a`` only, with ``b``
    (no key) on the source and not published, while both are written; on the way out the
    writes stop, the follow is stopped, and a catch-up takes the rest."""
    _source(
        source_dsn, "CREATE TABLE a (id int PRIMARY KEY, v text)", "INSERT INTO a VALUES (1, 'x')"
    )
    settings = settings_for(source_dsn, target_dsn, tmp_path, prefix)
    pipeline.take_snapshot(settings, spark)
    _source(
        source_dsn,
        "CREATE TABLE b (k int, v text)",
        "ALTER TABLE b REPLICA IDENTITY FULL",
        "INSERT INTO b SELECT g, 'before' FROM generate_series(1, 1000) g",
    )
    follower, done = Follower(settings), []

    def follow() -> None:
        with pipeline.range_lock(settings):
            for followed in follower.run():
                done.append(followed)

    stop_writing = threading.Event()
    threads = [
        threading.Thread(target=_writes_to_a_and_b, args=(source_dsn, stop_writing)),
        threading.Thread(target=follow),
    ]
    for thread in threads:
        thread.start()
    try:
        _wait_for(lambda: follower.summary.ranges >= 3)
        yield settings, follower, done
        assert threads[1].is_alive(), "the follow ended while tables were added"
    finally:
        stop_writing.set()
        threads[0].join()
        follower.stop("test")
        threads[1].join(timeout=120)
    catch_up(settings)


def _wait_for(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def _b_applied(done: list[Followed]) -> int:
    """Changes to ``b`` the follow applied."""
    return sum(c.changes for f in done if (c := f.done.applied.tables.get("public.b")) is not None)


def test_an_add_while_a_follow_runs_has_it_make_way_and_it_goes_on_with_the_table(
    source_dsn, target_dsn, tmp_path, spark
):
    """``pgcdc add-table`` with a follow holding the range lock: the follow makes way at a
    range boundary (nothing applied while the add has the range), the add puts ``b`` in the
    publication and copies it, and the same follow goes on, applying ``b``'s changes past the
    copy exactly once (``b`` has no key: a change applied twice is a row too many)."""
    with _following_while_writing(source_dsn, target_dsn, tmp_path, spark, "makeway") as (
        settings,
        follower,
        done,
    ):
        began = time.monotonic()
        added = pipeline.add_tables(settings, [ADDED], spark, wait_s=30)
        took = time.monotonic() - began
        assert added.tables[0].rows > 1000
        assert took < 15, took  # a second to be seen, the ranges in hand applied, the copy
        _wait_for(lambda: _b_applied(done) > 0)
        assert follower.summary.made_way == 1
        chain = OutputStore(settings.store).chain()
        assert chain is not None and chain.adding == () and ADDED in chain.synced_from
    assert equal_tables(settings) == [("public.a", True), ("public.b", True)]
    with psycopg.connect(source_dsn) as src, psycopg.connect(target_dsn) as dst:
        assert (
            src.execute("SELECT count(*) FROM b").fetchone()
            == dst.execute("SELECT count(*) FROM b").fetchone()
        )


def test_an_add_killed_while_a_follow_made_way_holds_that_follow_until_an_add_again_converges(
    source_dsn, target_dsn, tmp_path, spark
):
    """SIGKILL of a real add process once its copy is on the target, while a follow made way
    for it: the follow neither fails (the sensor would start follow after follow, each to
    fail) nor applies anything (the copy may be partial); it waits, saying what to run, and
    goes on once the add is run again, exactly once."""
    with _following_while_writing(source_dsn, target_dsn, tmp_path, spark, "makeway_kill") as (
        settings,
        follower,
        done,
    ):
        child = subprocess.run(
            [sys.executable, "-c", ADD_IN_CHILD, settings.model_dump_json()],
            env={**os.environ, "PGCDC_FAILPOINT": "add.after_copy=kill@1"},
            capture_output=True,
            timeout=300,
        )
        assert child.returncode == -signal.SIGKILL, child.stderr.decode()[-2000:]
        ranges = follower.summary.ranges
        time.sleep(3)  # the writes go on; the follow applies none of them
        assert follower.summary.ranges == ranges
        assert follower.summary.made_way == 0  # still waiting: counted once it goes on

        pipeline.add_tables(settings, [ADDED], spark, wait_s=30)
        _wait_for(lambda: _b_applied(done) > 0)
        assert follower.summary.made_way == 1
    assert equal_tables(settings) == [("public.a", True), ("public.b", True)]
    with psycopg.connect(source_dsn) as src, psycopg.connect(target_dsn) as dst:
        assert (
            src.execute("SELECT count(*) FROM b").fetchone()
            == dst.execute("SELECT count(*) FROM b").fetchone()
        )
