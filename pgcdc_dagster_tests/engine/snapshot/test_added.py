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

from pgcdc_dagster.engine import failpoints, progress
from pgcdc_dagster.engine.apply.transaction import ApplyError
from pgcdc_dagster.engine.control import pipeline
from pgcdc_dagster.engine.control.range_lock import lock_holders
from pgcdc_dagster.engine.follow.follower import Followed, Follower
from pgcdc_dagster.engine.identifiers import TableName
from pgcdc_dagster.engine.settings import ReplicationSettings
from pgcdc_dagster.engine.snapshot import TargetNotEmptyError
from pgcdc_dagster.engine.snapshot.foreign_keys import complete
from pgcdc_dagster.engine.store.output_store import OutputStore
from pgcdc_dagster_tests.support.pg import run_sql
from pgcdc_dagster_tests.support.replication import (
    catch_up,
    equal_tables,
    following_while,
    killed_at,
    settings_for,
)
from pgcdc_dagster_tests.support.waits import wait_for

ADDED = TableName("public", "b")


def _started(source_dsn, target_dsn, tmp_path, spark, **overrides) -> ReplicationSettings:
    """A replication of ``a`` under way; then ``b`` (no key: a change applied twice would
    show as a row too many) created with rows, put in the publication by the user, written
    again, and a range that needs it refused."""
    run_sql(
        source_dsn, "CREATE TABLE a (id int PRIMARY KEY, v text)", "INSERT INTO a VALUES (1, 'x')"
    )
    settings = settings_for(source_dsn, target_dsn, tmp_path, "added", **overrides)
    pipeline.take_snapshot(settings, spark)
    run_sql(
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

    run_sql(
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


def _an_add_again_converges(settings: ReplicationSettings, spark, *, key: int, rows: int) -> None:
    """``b`` added again, then a row ``key`` inserted and caught up: both tables equal the
    source, ``b`` with ``rows`` rows (it has no key: a change applied twice is a row too many)."""
    pipeline.add_tables(settings, [ADDED], spark)
    run_sql(settings.source_dsn, f"INSERT INTO b VALUES ({int(key)}, 'after')")
    catch_up(settings)
    assert equal_tables(settings) == [("public.a", True), ("public.b", True)]
    with psycopg.connect(settings.target_dsn) as conn:
        assert conn.execute("SELECT count(*) FROM b").fetchone() == (rows,)


ADD_IN_CHILD = (
    "import sys; from pgcdc_dagster.engine.control import pipeline; "
    "from pgcdc_dagster.engine.identifiers import TableName; "
    "from pgcdc_dagster.engine.settings import ReplicationSettings; "
    "pipeline.add_tables(ReplicationSettings.model_validate_json(sys.argv[1]), "
    "[TableName('public', 'b')], None)"
)


ADD_ON_SPARK_IN_CHILD = ADD_IN_CHILD.replace(
    "[TableName('public', 'b')], None)",
    "[TableName('public', 'b')], __import__('pgcdc_dagster.engine.spark.session', "
    "fromlist=['get_spark']).get_spark)",
)


def _caught_up_three_times_while_it_copies(settings: ReplicationSettings) -> list:
    """Three catch-ups, each after changes to ``b`` (a column added to it before the second)
    and to ``a``: the applies of the ranges that held ``b`` back."""
    held = []
    for statements in (
        ["UPDATE b SET v = 'first' WHERE k = 1", "INSERT INTO a VALUES (4, 'first')"],
        [
            "ALTER TABLE b ADD COLUMN w int",
            "UPDATE b SET w = 10 WHERE k = 3",
            "INSERT INTO b VALUES (8, 'second', 20)",
            "INSERT INTO a VALUES (5, 'second')",
        ],
        ["DELETE FROM b WHERE k = 8", "UPDATE b SET v = 'third' WHERE k = 1"],
    ):
        run_sql(settings.source_dsn, *statements)
        held += [a for _, a in catch_up(settings) if a.held_back == ["public.b"]]
    return held


@pytest.mark.parametrize("batched", [True, False])
def test_held_back_changes_of_many_ranges_are_applied_together_each_in_its_own_layout(
    source_dsn, target_dsn, tmp_path, spark, monkeypatch, batched
):
    """Three catch-ups while ``b`` copies, each holding back a range of ``b``'s changes, a
    column added to ``b`` on the source between the first and the second: the add applies the
    three ranges' share in one target transaction (a range's own relation versions renumbered
    into one list, so each row lands in its own layout and ``b`` gains the column), or, with
    the batch capped at one change, one transaction a range; ``b`` (no key: in commit order)
    ends equal to the source either way."""
    from pgcdc_dagster.engine.apply import held_back

    if not batched:
        monkeypatch.setattr(held_back, "HELD_BACK_BATCH_CHANGES", 1)
    settings = _started(source_dsn, target_dsn, tmp_path, spark)
    monkeypatch.setenv(failpoints.ENV, "add.after_copy=sleep(8)")
    monkeypatch.setattr(failpoints, "_armed", None)
    monkeypatch.setattr(failpoints, "_hits", {})
    added, shown = [], []
    adder = threading.Thread(
        target=lambda: added.append(pipeline.add_tables(settings, [ADDED], spark))
    )
    with progress.listening(shown.append):
        adder.start()
        _wait_for_its_copy(source_dsn, settings)
        held = _caught_up_three_times_while_it_copies(settings)
        assert adder.is_alive()  # still in its copy's last step
        adder.join(timeout=120)
    assert len(held) >= 3  # ranges that held b back
    (result,) = added
    assert result.held_back == 5
    # Unbatched: one a range holding b's changes past its copy (one per catch-up above; the
    # range the refused apply stopped at holds only changes its copy has).
    assert result.held_back_transactions == (1 if batched else 3)
    # Shown while applied, after the copy's own progress: what, in how many transactions.
    lines = [r.line() for r in shown if r.phase == "held back"]
    assert lines and lines[0].startswith("add-table held back: pass 1: ")
    assert f"5 change(s) held back during the copy applied in {1 if batched else 3} " in lines[-1]
    expected = [
        (1, "third", None),
        (2, "before", None),
        (3, "before", 10),
        (4, "published", None),
        (5, "published", None),
    ]
    with psycopg.connect(target_dsn) as conn:
        assert conn.execute("SELECT k, v, w FROM b ORDER BY k").fetchall() == expected
    run_sql(source_dsn, "INSERT INTO b VALUES (9, 'after', 30)")
    catch_up(settings)
    assert equal_tables(settings) == [("public.a", True), ("public.b", True)]


@pytest.mark.parametrize("point", ["add.after_begin", "add.after_copy", "add.after_held_back"])
def test_an_add_killed_anywhere_holds_its_tables_back_until_an_add_again_converges(
    source_dsn, target_dsn, tmp_path, spark, point
):
    """SIGKILL of a real ``add_tables`` process before the target changes, once the copy is
    on the target, and once the changes held back meanwhile are applied, each not yet
    recorded: the applies go on with the other tables and hold the added table's changes back
    (its copy may be partial), the temporary slot is gone with its process, and the next add
    copies again, exactly once."""
    settings = _started(source_dsn, target_dsn, tmp_path, spark)
    killed_at(point, ADD_IN_CHILD, settings)
    chain = OutputStore(settings.store).chain()
    assert chain is not None and chain.adding == (ADDED,)
    assert not pipeline.tables_agreement(settings).agree  # left unfinished: nobody adds it
    done = catch_up(settings)  # a's changes applied, b's held back
    assert {tuple(applied.held_back) for _, applied in done if applied.changes} == {("public.b",)}
    with psycopg.connect(target_dsn) as conn:
        assert conn.execute("SELECT count(*) FROM a").fetchone() == (3,)
    with psycopg.connect(source_dsn) as conn:  # the temporary slot went with its session
        assert conn.execute(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_name LIKE %s",
            (f"{settings.slot}_add_%",),
        ).fetchone() == (0,)

    _an_add_again_converges(settings, spark, key=6, rows=6)


def _wait_for_its_copy(source_dsn: str, settings: ReplicationSettings) -> None:
    """Until an add's copy of ``b`` is done: its rows committed on the target and its temporary
    slot (whose snapshot it copies in) gone. (Waiting to see the slot come first could miss a
    slot that lived less than a poll.)"""
    temporary = "SELECT count(*) FROM pg_replication_slots WHERE slot_name LIKE %s"
    with (
        psycopg.connect(source_dsn, autocommit=True) as src,
        psycopg.connect(settings.target_dsn, autocommit=True) as tgt,
    ):
        pattern = (f"{settings.slot}_add_%",)

        def copied() -> bool:  # the count is not read before the table exists
            there = tgt.execute("SELECT to_regclass('public.b') IS NOT NULL").fetchone()
            return bool(there and there[0]) and tgt.execute(
                "SELECT count(*) > 0 FROM public.b"
            ).fetchone() == (True,)

        wait_for(
            lambda: copied() and src.execute(temporary, pattern).fetchone() == (0,),
            "the add's copy to end",
        )


@pytest.mark.parametrize("applied_on", ["process", "spark"])
def test_changes_held_back_while_a_table_copies_are_applied_by_its_add_exactly_once(
    source_dsn, target_dsn, tmp_path, spark, monkeypatch, applied_on
):
    """An update, a delete and an insert of ``b`` (no key) committed after its copy's
    consistent point, caught up (``a``'s changes applied, ``b``'s held back, in this process
    or by Spark's workers) while the add's copy is still under way: the add applies them once
    its copy is done (on Spark too, for ranges past the threshold), before any later
    catch-up, and records ``b`` from the origin, so the next catch-up applies none again."""
    from pgcdc_dagster.engine.apply.staging import SCHEMA, shared_name, shared_tables

    overrides = {"spark_min_changes": 1} if applied_on == "spark" else {}
    settings = _started(source_dsn, target_dsn, tmp_path, spark, **overrides)
    staging_key = f"{settings.origin} add"
    with psycopg.connect(target_dsn, autocommit=True) as conn:  # as a killed add's workers
        conn.execute(f"CREATE SCHEMA IF NOT EXISTS {SCHEMA}")  # would leave them
        conn.execute(
            psycopg.sql.SQL("CREATE TABLE {} (k int)").format(shared_name(staging_key, 0, "up"))
        )
    monkeypatch.setenv(failpoints.ENV, "add.after_copy=sleep(4)")
    monkeypatch.setattr(failpoints, "_armed", None)
    monkeypatch.setattr(failpoints, "_hits", {})
    added = []
    adder = threading.Thread(
        target=lambda: added.append(pipeline.add_tables(settings, [ADDED], spark))
    )
    adder.start()
    _wait_for_its_copy(source_dsn, settings)
    run_sql(
        source_dsn,
        "UPDATE b SET v = 'during' WHERE k = 1",
        "DELETE FROM b WHERE k = 2",
        "INSERT INTO b VALUES (7, 'during')",
        "INSERT INTO a VALUES (4, 'during')",
    )
    done = catch_up(settings, spark=spark)
    assert adder.is_alive()  # still in its copy's last step
    assert any(applied.held_back == ["public.b"] for _, applied in done)
    assert {a.compaction_path for _, a in done if a.held_back and a.changes} == {
        "spark" if applied_on == "spark" else "arrow"
    }
    with psycopg.connect(target_dsn) as conn:
        assert conn.execute("SELECT count(*) FROM a").fetchone() == (4,)
    adder.join(timeout=120)
    (result,) = added
    assert result.held_back == 3
    # By Spark's workers for a range past the threshold, as an apply would; their staging
    # tables, and those a killed add left, are gone.
    assert (result.held_back_on_spark > 0) == (applied_on == "spark")
    with psycopg.connect(target_dsn, autocommit=True) as conn:
        assert shared_tables(conn, staging_key) == []
    chain = OutputStore(settings.store).chain()
    origin = pipeline.origin_progress(settings)
    assert chain is not None and chain.adding == () and chain.synced_from == {ADDED: origin}
    expected = [(1, "during"), (3, "before"), (4, "published"), (5, "published"), (7, "during")]
    with psycopg.connect(target_dsn) as conn:
        assert conn.execute("SELECT k, v FROM b ORDER BY k").fetchall() == expected
    run_sql(source_dsn, "INSERT INTO b VALUES (8, 'after')")
    catch_up(settings)
    assert equal_tables(settings) == [("public.a", True), ("public.b", True)]


def test_an_add_killed_once_it_applied_held_back_changes_without_the_range_is_redone_once(
    source_dsn, target_dsn, tmp_path, spark
):
    """SIGKILL of a real add process once it applied, without the range, the changes of ``b``
    the applies held back while it copied (committed on the target, ``b`` not yet recorded):
    the applies go on holding ``b`` back, and the next add empties ``b`` and copies it again,
    so the changes it had applied are not applied twice."""
    settings = _started(source_dsn, target_dsn, tmp_path, spark)
    child = subprocess.Popen(
        [sys.executable, "-c", ADD_IN_CHILD, settings.model_dump_json()],
        env={**os.environ, "PGCDC_FAILPOINT": "add.after_copy=sleep(6);add.before_range=kill@1"},
        stderr=subprocess.PIPE,
    )
    _wait_for_its_copy(source_dsn, settings)
    run_sql(
        source_dsn,
        "UPDATE b SET v = 'during' WHERE k = 1",
        "INSERT INTO b VALUES (7, 'during')",
        "INSERT INTO a VALUES (4, 'during')",
    )
    catch_up(settings)  # b's held back, for the add to apply
    assert child.poll() is None  # still in its copy's last step: it reads the origin after
    _, stderr = child.communicate(timeout=120)
    assert child.returncode == -signal.SIGKILL, stderr.decode()[-2000:]
    with psycopg.connect(target_dsn) as conn:  # the add applied them, then was killed
        assert conn.execute("SELECT count(*) FROM b WHERE v = 'during'").fetchone() == (2,)
    chain = OutputStore(settings.store).chain()
    assert chain is not None and chain.adding == (ADDED,)
    run_sql(source_dsn, "INSERT INTO b VALUES (8, 'meanwhile')", "INSERT INTO a VALUES (5, 'm')")
    done = catch_up(settings)
    assert {tuple(applied.held_back) for _, applied in done if applied.changes} == {("public.b",)}

    _an_add_again_converges(settings, spark, key=9, rows=8)


@pytest.mark.long
def test_an_add_killed_while_spark_stages_its_held_back_range_is_redone_once(
    source_dsn, target_dsn, tmp_path, spark
):
    """A real add process with its own Spark (every range past the threshold), SIGKILLed with
    its JVM and Python workers once a worker committed its part of the shared staging tables
    of a range the applies held back for it: the next add, in this process, drops what the
    workers staged, empties ``b`` and copies it again, exactly once."""
    from psycopg import sql

    from pgcdc_dagster.engine.apply.staging import shared_tables

    settings = _started(source_dsn, target_dsn, tmp_path, spark, spark_min_changes=1)
    child = subprocess.Popen(
        [sys.executable, "-c", ADD_ON_SPARK_IN_CHILD, settings.model_dump_json()],
        env={**os.environ, "PGCDC_FAILPOINT": "add.after_copy=sleep(4);apply.staging=sleep(60)"},
        stderr=subprocess.PIPE,
        start_new_session=True,  # its group (the JVM, the workers) is killed, not this one
    )
    _wait_for_its_copy(source_dsn, settings)
    run_sql(source_dsn, "UPDATE b SET v = 'during' WHERE k = 1", "INSERT INTO a VALUES (4, 'd')")
    catch_up(settings)  # b's held back, for the add to stage on Spark

    def staged() -> int:
        with psycopg.connect(target_dsn, autocommit=True) as conn:
            return sum(
                conn.execute(sql.SQL("SELECT count(*) FROM {}").format(t)).fetchone()[0]
                for t in shared_tables(conn, f"{settings.origin} add")
            )

    try:
        wait_for(lambda: staged() > 0, "a worker's part committed", timeout=120)
    finally:
        os.killpg(child.pid, signal.SIGKILL)
    _, stderr = child.communicate(timeout=60)
    assert child.returncode == -signal.SIGKILL, stderr.decode()[-2000:]
    chain = OutputStore(settings.store).chain()
    assert chain is not None and chain.adding == (ADDED,)

    _an_add_again_converges(settings, None, key=9, rows=6)
    with psycopg.connect(target_dsn, autocommit=True) as conn:
        assert shared_tables(conn, f"{settings.origin} add") == []


def test_one_add_or_snapshot_at_a_time_since_an_add_copies_without_the_range(
    source_dsn, target_dsn, tmp_path, spark
):
    """An add copies its tables without the range (the applies go on), so the tables lock
    keeps a second add, which would empty the table the first one copies into, and a
    snapshot, which would copy it too, apart: each waits its ``--wait`` and then names the
    one at work; nothing has changed."""
    from pgcdc_dagster.engine.control.range_lock import RangeBusyError, tables_lock

    settings = _started(source_dsn, target_dsn, tmp_path, spark)
    with tables_lock(target_dsn, settings.slot, "run 4242"):
        with pytest.raises(RangeBusyError, match=r"another command changing the replicated "
                           r"tables of slot .* is running \(run 4242\)"):  # fmt: skip
            pipeline.add_tables(settings, [ADDED], spark, wait_s=0.3)
        with pytest.raises(RangeBusyError, match=r"\(run 4242\)"):
            pipeline.take_snapshot(settings, spark, resnapshot=True)
    chain = OutputStore(settings.store).chain()
    assert chain is not None and chain.adding == () and chain.synced_from == {}
    pipeline.add_tables(settings, [ADDED], spark)
    catch_up(settings)
    assert equal_tables(settings) == [("public.a", True), ("public.b", True)]


def test_an_apply_in_flight_when_an_add_begins_cannot_write_its_table_beside_the_copy(
    source_dsn, target_dsn, tmp_path, spark, monkeypatch
):
    """``b`` published by hand and created empty on the target by hand, so its changes stream
    and an apply writes them: an apply that read the store's chain before the add recorded
    ``b`` as being added is inside its transaction, ``b``'s rows written, not committed, when
    the add begins. The add's guard sees ``b`` empty; the add then waits for that apply (its
    moment with the range) and empties what it committed before copying, so each row is on the
    target once. Without that moment the copy and the apply's rows would both land (``b`` has
    no key: a row too many)."""
    run_sql(
        source_dsn, "CREATE TABLE a (id int PRIMARY KEY, v text)", "INSERT INTO a VALUES (1, 'x')"
    )
    settings = settings_for(source_dsn, target_dsn, tmp_path, "inflight")
    pipeline.take_snapshot(settings, spark)
    with psycopg.connect(target_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE b (k int, v text)")
    run_sql(
        source_dsn,
        "CREATE TABLE b (k int, v text)",
        "ALTER TABLE b REPLICA IDENTITY FULL",
        "INSERT INTO b SELECT g, 'before' FROM generate_series(1, 3) g",
        f"ALTER PUBLICATION {settings.publication} ADD TABLE b",
        "INSERT INTO b VALUES (4, 'published'), (5, 'published')",
        "INSERT INTO a VALUES (2, 'y')",
    )
    monkeypatch.setenv(failpoints.ENV, "apply.in_transaction=sleep(3)@1")
    monkeypatch.setattr(failpoints, "_armed", None)
    monkeypatch.setattr(failpoints, "_hits", {})
    applier = threading.Thread(target=catch_up, args=(settings,))
    applier.start()
    in_transaction = (
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
        "AND state = 'idle in transaction'"
    )
    with psycopg.connect(target_dsn, autocommit=True) as conn:
        wait_for(lambda: conn.execute(in_transaction).fetchone() != (0,), "a transaction open")
    added = pipeline.add_tables(settings, [ADDED], spark, wait_s=30)
    applier.join(timeout=60)
    assert [(t.table, t.rows) for t in added.tables] == [(ADDED, 5)]
    run_sql(source_dsn, "INSERT INTO b VALUES (6, 'after')", "INSERT INTO a VALUES (3, 'z')")
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
    run_sql(
        source_dsn, "CREATE TABLE a (id int PRIMARY KEY, v text)", "INSERT INTO a VALUES (1, 'x')"
    )
    settings = settings_for(source_dsn, target_dsn, tmp_path, prefix)
    pipeline.take_snapshot(settings, spark)
    run_sql(
        source_dsn,
        "CREATE TABLE b (k int, v text)",
        "ALTER TABLE b REPLICA IDENTITY FULL",
        "INSERT INTO b SELECT g, 'before' FROM generate_series(1, 1000) g",
    )
    with following_while(settings, _writes_to_a_and_b) as (follower, done):
        yield settings, follower, done
    catch_up(settings)


def _b_applied(done: list[Followed]) -> int:
    """Changes to ``b`` the follow applied."""
    return sum(c.changes for f in done if (c := f.done.applied.tables.get("public.b")) is not None)


def test_an_add_while_a_follow_runs_has_it_make_way_and_it_goes_on_with_the_table(
    source_dsn, target_dsn, tmp_path, spark, monkeypatch
):
    """``pgcdc add-table`` with a follow holding the range lock: the add puts ``b`` in the
    publication and copies it (2 s longer here) while the follow goes on applying ``a``'s
    changes and holding ``b``'s back; then the follow makes way at a range boundary (nothing
    applied while the add has the range), the add applies ``b``'s changes held back, and the
    same follow goes on, applying ``b``'s changes past them, each exactly once (``b`` has no
    key: a change applied twice is a row too many)."""
    monkeypatch.setenv(failpoints.ENV, "add.after_copy=sleep(2)")
    monkeypatch.setattr(failpoints, "_armed", None)  # read again here; as it was after
    monkeypatch.setattr(failpoints, "_hits", {})
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
        # While b was copied the follow applied a's changes, b's held back, and the add
        # applied those once its copy was done.
        during = [f for f in done if f.done.applied.held_back == ["public.b"]]
        assert sum(f.done.applied.tables["public.a"].changes for f in during) > 20
        assert added.held_back > 20
        wait_for(lambda: _b_applied(done) > 0, "b's changes applied")
        assert follower.summary.made_way == 1
        chain = OutputStore(settings.store).chain()
        assert chain is not None and chain.adding == () and ADDED in chain.synced_from
        # The ranges say in which session: b's changes came in the one after making way,
        # and the replication's tables past what a code location listed before are b.
        assert done[0].session == 1
        assert {f.session for f in done if "public.b" in f.done.applied.tables} == {2}
        assert pipeline.added_beyond(settings, [TableName("public", "a")]) == [ADDED]
    assert equal_tables(settings) == [("public.a", True), ("public.b", True)]
    with psycopg.connect(source_dsn) as src, psycopg.connect(target_dsn) as dst:
        assert (
            src.execute("SELECT count(*) FROM b").fetchone()
            == dst.execute("SELECT count(*) FROM b").fetchone()
        )


@pytest.mark.parametrize("point", ["add.after_copy", "add.after_held_back"])
def test_an_add_killed_while_a_follow_runs_leaves_it_applying_until_an_add_again_converges(
    source_dsn, target_dsn, tmp_path, spark, point
):
    """SIGKILL of a real add process once its copy is on the target (the follow never made
    way), and once it applied the changes held back while the follow made way for it: the
    follow neither fails (the sensor would start follow after follow, each to fail) nor stops;
    it goes on applying ``a``'s changes and holding ``b``'s back (the copy may be partial),
    and takes ``b`` on once the add is run again, exactly once."""
    with _following_while_writing(source_dsn, target_dsn, tmp_path, spark, "makeway_kill") as (
        settings,
        follower,
        done,
    ):
        killed_at(point, ADD_IN_CHILD, settings)
        applied = len(done)
        wait_for(lambda: len(done) > applied + 3, "the follow to go on")
        assert done[-1].done.applied.held_back == ["public.b"]
        assert _b_applied(done) == 0
        made_way = 0 if point == "add.after_copy" else 1
        assert follower.summary.made_way == made_way

        pipeline.add_tables(settings, [ADDED], spark, wait_s=30)
        wait_for(lambda: _b_applied(done) > 0, "b's changes applied")
        assert follower.summary.made_way == made_way + 1
    assert equal_tables(settings) == [("public.a", True), ("public.b", True)]
    with psycopg.connect(source_dsn) as src, psycopg.connect(target_dsn) as dst:
        assert (
            src.execute("SELECT count(*) FROM b").fetchone()
            == dst.execute("SELECT count(*) FROM b").fetchone()
        )


def _orders_of_customers(source_dsn, target_dsn, tmp_path, spark, prefix) -> ReplicationSettings:
    """``customers`` replicated; then ``orders`` created, referencing a customer the target
    has yet to receive and ``items`` (not replicated), and added."""
    run_sql(
        source_dsn,
        "CREATE TABLE customers (id int PRIMARY KEY, name text)",
        "CREATE TABLE items (id int PRIMARY KEY, label text)",
        "INSERT INTO customers VALUES (1, 'one')",
        "INSERT INTO items VALUES (1, 'gone soon')",
    )
    settings = settings_for(source_dsn, target_dsn, tmp_path, prefix, tables="public.customers")
    pipeline.take_snapshot(settings, spark)
    run_sql(
        source_dsn,
        "INSERT INTO customers VALUES (2, 'new')",  # not applied to the target yet
        "CREATE TABLE orders (id int PRIMARY KEY, customer int REFERENCES customers,"
        " item int REFERENCES items)",
        "INSERT INTO orders VALUES (1, 1, 1), (2, 2, NULL)",
    )
    added = pipeline.add_tables(settings, [TableName("public", "orders")], spark)
    assert added.foreign_keys.not_valid == ("orders_customer_fkey on public.orders",)
    assert added.foreign_keys.skipped == (
        "orders_item_fkey on public.orders: public.items is not replicated (add it to keep "
        "the key)",
    )
    return settings


FOREIGN_KEYS = "SELECT conname, convalidated FROM pg_constraint WHERE contype = 'f' ORDER BY 1"


def _validated_at_cutover(settings: ReplicationSettings) -> None:
    replicated = pipeline.replicated_tables(settings)
    assert complete(settings.source_dsn, settings.target_dsn, replicated) == [
        "orders_customer_fkey on public.orders: validated",
        "orders_item_fkey on public.orders: validated",
    ]
    assert complete(settings.source_dsn, settings.target_dsn, replicated) == []
    with psycopg.connect(settings.target_dsn) as conn:
        assert conn.execute(FOREIGN_KEYS).fetchall() == [
            ("orders_customer_fkey", True),
            ("orders_item_fkey", True),
        ]
    assert equal_tables(settings) == [
        ("public.customers", True),
        ("public.items", True),
        ("public.orders", True),
    ]


def test_foreign_keys_between_an_added_table_and_the_replicated_ones_hold_once_caught_up(
    source_dsn, target_dsn, tmp_path, spark
):
    """An added table is copied as of a later point than the target's: its rows may
    reference rows the target has yet to receive (a customer created since), and rows of the
    target may reference its rows the source has since deleted. Created valid, such a key
    would fail the add, and every add after it (the apply refuses while one is unfinished, so
    the missing rows would never come). So its foreign keys, both ways, are created ``NOT VALID``
    (enforced for new writes, the old rows not checked), and the cutover, once caught up,
    validates them."""
    settings = _orders_of_customers(source_dsn, target_dsn, tmp_path, spark, "addfk")
    catch_up(settings)
    with psycopg.connect(target_dsn) as conn:
        assert conn.execute(FOREIGN_KEYS).fetchall() == [("orders_customer_fkey", False)]

    # items added too: the key from orders to it, NOT VALID, though an item deleted on the
    # source meanwhile is still referenced on the target until caught up.
    run_sql(source_dsn, "UPDATE orders SET item = NULL", "DELETE FROM items")
    added = pipeline.add_tables(settings, [TableName("public", "items")], spark)
    assert added.foreign_keys.not_valid == ("orders_item_fkey on public.orders",)
    catch_up(settings)
    _validated_at_cutover(settings)


ADD_ITEMS_IN_CHILD = ADD_IN_CHILD.replace("'b'", "'items'")


def test_an_add_killed_after_creating_keys_to_its_table_is_redone(
    source_dsn, target_dsn, tmp_path, spark
):
    """SIGKILL once ``items``' copy and the key ``orders`` holds to it are on the target: the
    next add must empty ``items`` again, which that key forbids, so it drops the key first and
    creates it again; the replication converges exactly once."""
    settings = _orders_of_customers(source_dsn, target_dsn, tmp_path, spark, "addfk_kill")
    killed_at("add.after_copy", ADD_ITEMS_IN_CHILD, settings)
    with psycopg.connect(target_dsn) as conn:
        assert ("orders_item_fkey", False) in conn.execute(FOREIGN_KEYS).fetchall()

    run_sql(source_dsn, "INSERT INTO items VALUES (2, 'later')")
    added = pipeline.add_tables(settings, [TableName("public", "items")], spark)
    assert [(t.table.name, t.rows) for t in added.tables] == [("items", 2)]
    assert added.foreign_keys.not_valid == ("orders_item_fkey on public.orders",)
    catch_up(settings)
    _validated_at_cutover(settings)


FOLLOW_IN_CHILD = (
    "import sys; from pgcdc_dagster.engine.control import pipeline; "
    "from pgcdc_dagster.engine.follow.follower import Follower; "
    "from pgcdc_dagster.engine.settings import ReplicationSettings; "
    "s = ReplicationSettings.model_validate_json(sys.argv[1]); "
    "lock = pipeline.range_lock(s); lock.__enter__(); "
    "[None for _ in Follower(s).run()]"
)


def _way_made(dsn: str) -> bool:
    with psycopg.connect(dsn) as conn:
        return conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = 2"
        ).fetchone() == (1,)


def test_a_follow_killed_while_it_made_way_is_followed_by_one_that_makes_way_at_once(
    source_dsn, target_dsn, tmp_path, spark
):
    """SIGKILL of a real follow process while an add works under its range lock (it applied
    the changes held back during its copy, and has not recorded the table as added): the lock
    is free again, and the next follow (the sensor's) takes it while the add still works. It
    must make way before anything else: a range applied then would hold back the table's
    changes past the point the add records it from, and lose them."""
    run_sql(source_dsn, "CREATE TABLE a (id int PRIMARY KEY)", "INSERT INTO a VALUES (1)")
    settings = settings_for(source_dsn, target_dsn, tmp_path, "makeway_followkill")
    pipeline.take_snapshot(settings, spark)
    run_sql(
        source_dsn,
        "CREATE TABLE b (k int)",
        "ALTER TABLE b REPLICA IDENTITY FULL",
        "INSERT INTO b SELECT generate_series(1, 100)",
    )
    follow = subprocess.Popen([sys.executable, "-c", FOLLOW_IN_CHILD, settings.model_dump_json()])
    wait_for(  # the follow runs first
        lambda: lock_holders(target_dsn, settings.slot) != [], "the follow to take the range"
    )
    adder = subprocess.Popen(
        [sys.executable, "-c", ADD_IN_CHILD, settings.model_dump_json()],
        env={**os.environ, "PGCDC_FAILPOINT": "add.after_held_back=sleep(10)@1"},
    )
    try:
        wait_for(lambda: _way_made(target_dsn), "the follow to make way")
        # The add looks for the way every 0.1 s: killed sooner, the follow would leave the
        # range lock free for the add to take itself (then the next follow waits for it).
        time.sleep(1.0)
        follow.kill()
        follow.wait()
        run_sql(source_dsn, "INSERT INTO a VALUES (2)", "INSERT INTO b VALUES (101)")
        follower, done = Follower(settings), []

        def follow_again() -> None:
            with pipeline.range_lock(settings):
                for followed in follower.run():
                    done.append(followed)

        thread = threading.Thread(target=follow_again)
        thread.start()
        try:
            wait_for(lambda: _way_made(target_dsn), "the follow to make way at once")
            assert adder.poll() is None and done == []
            assert adder.wait(timeout=120) == 0
            run_sql(source_dsn, "INSERT INTO b VALUES (102)")  # past the copy, surely
            wait_for(lambda: _b_applied(done) > 0, "b's changes applied")
            assert follower.summary.made_way == 1
        finally:
            follower.stop("test")
            thread.join()
    finally:
        for child in (follow, adder):
            if child.poll() is None:
                child.kill()
    catch_up(settings)
    assert equal_tables(settings) == [("public.a", True), ("public.b", True)]
    with psycopg.connect(target_dsn) as conn:
        assert conn.execute("SELECT count(*) FROM b").fetchone() == (102,)
