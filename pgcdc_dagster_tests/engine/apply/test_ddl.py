"""The source's DDL on a replicated table: followed on the target by itself, or refused with
one line and nothing applied; never a target silently different
(:mod:`~pgcdc_dagster.engine.apply.ddl`).

Every case runs as a user meets it: a base snapshot, DDL and changes on the source, then a
catch-up; the target's rows and column definitions are then compared with the source's."""

from __future__ import annotations

import psycopg
import pytest

from pgcdc_dagster.engine.apply.ddl import ResyncNeeded, SchemaDriftError
from pgcdc_dagster.engine.control import pipeline
from pgcdc_dagster.engine.errors import ApplyError
from pgcdc_dagster.engine.identifiers import TableName
from pgcdc_dagster.engine.store.output_store import OutputStore
from pgcdc_dagster_tests.support.pg import run_sql
from pgcdc_dagster_tests.support.replication import catch_up, killed_at, settings_for

KEYED = "CREATE TABLE t (id int PRIMARY KEY, v int, s text)"
UNKEYED = "CREATE TABLE t (id int, v int, s text); ALTER TABLE t REPLICA IDENTITY FULL"
ROWS = "INSERT INTO t SELECT g, g, 'row ' || g FROM generate_series(1, 5) g"


def shape(dsn: str, table: str = "t") -> list[tuple]:
    """The table's columns as a user sees them: name, type, NOT NULL, default."""
    with psycopg.connect(dsn) as conn:
        return conn.execute(
            "SELECT attname, format_type(atttypid, atttypmod), attnotnull, "
            "pg_get_expr(adbin, adrelid) FROM pg_attribute LEFT JOIN pg_attrdef "
            "ON adrelid = attrelid AND adnum = attnum "
            "WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
            (table,),
        ).fetchall()


def rows(dsn: str, table: str = "t") -> list[tuple]:
    with psycopg.connect(dsn) as conn:
        return sorted(conn.execute(f"SELECT row_to_json(x)::text FROM {table} x").fetchall())


def assert_same(source_dsn: str, target_dsn: str, table: str = "t") -> None:
    assert shape(target_dsn, table) == shape(source_dsn, table)
    assert rows(target_dsn, table) == rows(source_dsn, table)


def _snapshot_of(ddl: str, source_dsn: str, target_dsn: str, tmp_path, spark):
    run_sql(source_dsn, ddl, ROWS)
    settings = settings_for(source_dsn, target_dsn, tmp_path, "ddl")
    pipeline.take_snapshot(settings, spark)
    return settings


@pytest.fixture(params=["keyed", "unkeyed"])
def replicated(request, source_dsn, target_dsn, tmp_path, spark):
    """A table ``t`` copied by a base snapshot, with a primary key or without one (its
    changes then applied one by one, in commit order); returns its settings."""
    return _snapshot_of(
        KEYED if request.param == "keyed" else UNKEYED, source_dsn, target_dsn, tmp_path, spark
    )


@pytest.fixture
def keyed(source_dsn, target_dsn, tmp_path, spark):
    """As :func:`replicated`, with a primary key only: for what the key does not change."""
    return _snapshot_of(KEYED, source_dsn, target_dsn, tmp_path, spark)


def test_add_column_with_a_constant_default_gives_existing_rows_the_source_value(
    replicated, source_dsn, target_dsn
):
    run_sql(
        source_dsn,
        "INSERT INTO t VALUES (6, 6, 'before the column')",
        "ALTER TABLE t ADD COLUMN c text DEFAULT 'dflt'",
        "UPDATE t SET v = v + 100 WHERE id = 1",
        "INSERT INTO t VALUES (7, 7, 'after', 'own')",
    )
    steps = catch_up(replicated)
    assert_same(source_dsn, target_dsn)
    changes = [line for _, applied in steps for line in applied.schema_changes]
    assert changes == ["public.t: column c text added, existing rows 'dflt'"]


def _changes(steps) -> list[str]:
    return [line for _, applied in steps for line in applied.schema_changes]


@pytest.mark.parametrize(
    ("ddl", "step"),
    [
        ("ALTER TABLE t ADD COLUMN c text", "public.t: column c text added, existing rows NULL"),
        (
            "ALTER TABLE t ADD COLUMN c int NOT NULL DEFAULT 7",
            "public.t: column c integer added, existing rows '7'",
        ),
        (
            "ALTER TABLE t ADD COLUMN at timestamptz DEFAULT now()",
            "public.t: column at timestamp with time zone added, existing rows",
        ),
    ],
    ids=["no-default", "not-null-default", "stable-default"],
)
def test_add_column_kinds(replicated, source_dsn, target_dsn, ddl, step):
    run_sql(
        source_dsn, "INSERT INTO t VALUES (6, 6, 'before')", ddl, "UPDATE t SET v = 0 WHERE id = 1"
    )
    changes = _changes(catch_up(replicated))
    assert_same(source_dsn, target_dsn)
    assert len(changes) == 1 and changes[0].startswith(step)


def test_set_default_later_changes_no_existing_row(keyed, source_dsn, target_dsn):
    run_sql(
        source_dsn,
        "ALTER TABLE t ADD COLUMN c int DEFAULT 1",
        "ALTER TABLE t ALTER COLUMN c SET DEFAULT 2",
        "INSERT INTO t (id, v, s) VALUES (6, 6, 'takes 2')",
    )
    catch_up(keyed)
    assert_same(source_dsn, target_dsn)  # the old rows 1, the new one 2, the default 2


def test_volatile_default_stops_naming_resync_with_nothing_applied(keyed, source_dsn, target_dsn):
    before = rows(target_dsn)
    run_sql(
        source_dsn,
        "UPDATE t SET v = -1 WHERE id = 2",
        "ALTER TABLE t ADD COLUMN r float8 DEFAULT random()",
        "UPDATE t SET v = v + 100 WHERE id = 1",
    )
    strict = keyed.model_copy(update={"ddl": "strict"})
    with pytest.raises(ResyncNeeded, match=r"public\.t: column r was added and the table was "
                       r"rewritten.*pgcdc resync public\.t"):  # fmt: skip
        catch_up(strict)
    assert rows(target_dsn) == before


def test_rename_column_is_renamed_on_the_target_with_its_values(replicated, source_dsn, target_dsn):
    run_sql(
        source_dsn,
        "UPDATE t SET s = 'before the rename' WHERE id = 2",
        "INSERT INTO t VALUES (6, 6, 'inserted before')",
        "ALTER TABLE t RENAME COLUMN s TO label",
        "UPDATE t SET label = 'renamed 1' WHERE id = 1",
    )
    changes = _changes(catch_up(replicated))
    assert_same(source_dsn, target_dsn)
    assert changes == ["public.t: column s renamed to label"]


def test_rename_and_add_in_one_range(keyed, source_dsn, target_dsn):
    run_sql(
        source_dsn,
        "ALTER TABLE t RENAME COLUMN s TO label",
        "ALTER TABLE t ADD COLUMN s text DEFAULT 'new s'",
        "UPDATE t SET label = 'renamed 1', s = 'own' WHERE id = 1",
    )
    changes = _changes(catch_up(keyed))
    assert_same(source_dsn, target_dsn)
    assert changes == [
        "public.t: column s renamed to label",
        "public.t: column s text added, existing rows 'new s'",
    ]


def test_two_columns_that_swap_names_keep_their_values(replicated, source_dsn, target_dsn):
    run_sql(source_dsn, "ALTER TABLE t ADD COLUMN z text DEFAULT 'zed'", "UPDATE t SET v = 1")
    catch_up(replicated)
    run_sql(
        source_dsn,
        "INSERT INTO t VALUES (6, 6, 'six s', 'six z')",
        "ALTER TABLE t RENAME COLUMN s TO tmp",
        "ALTER TABLE t RENAME COLUMN z TO s",
        "ALTER TABLE t RENAME COLUMN tmp TO z",
        "UPDATE t SET v = 0 WHERE id = 1",
    )
    changes = _changes(catch_up(replicated))
    assert_same(source_dsn, target_dsn)
    assert changes == ["public.t: column s renamed to z", "public.t: column z renamed to s"]


def test_an_add_and_a_swap_in_one_range_need_a_resync(keyed, source_dsn, target_dsn):
    before = rows(target_dsn)
    run_sql(
        source_dsn,
        "ALTER TABLE t ADD COLUMN z text DEFAULT 'zed'",
        "INSERT INTO t VALUES (6, 6, 'six s', 'six z')",
        "ALTER TABLE t RENAME COLUMN s TO tmp",
        "ALTER TABLE t RENAME COLUMN z TO s",
        "ALTER TABLE t RENAME COLUMN tmp TO z",
        "UPDATE t SET v = 0 WHERE id = 1",
    )
    with pytest.raises(ResyncNeeded, match="several column changes in one range"):
        catch_up(keyed.model_copy(update={"ddl": "strict"}))
    assert rows(target_dsn) == before


def test_drop_column_is_dropped_on_the_target(replicated, source_dsn, target_dsn):
    run_sql(source_dsn, "ALTER TABLE t DROP COLUMN s", "UPDATE t SET v = 0 WHERE id = 1")
    changes = _changes(catch_up(replicated))
    assert_same(source_dsn, target_dsn)
    assert changes == ["public.t: column s dropped (as on the source)"]


def test_a_dropped_column_can_be_kept_on_the_target(keyed, source_dsn, target_dsn):
    keep = keyed.model_copy(update={"dropped_columns": "keep"})
    run_sql(source_dsn, "ALTER TABLE t DROP COLUMN s", "INSERT INTO t VALUES (6, 6)")
    assert _changes(catch_up(keep)) == [
        "public.t: column s kept (dropped on the source; PGCDC_DROPPED_COLUMNS=keep)"
    ]
    run_sql(source_dsn, "UPDATE t SET v = 0 WHERE id = 1")
    assert _changes(catch_up(keep)) == []  # a kept column is no drift
    with psycopg.connect(target_dsn) as conn:
        got = conn.execute("SELECT id, v, s FROM t ORDER BY id").fetchall()
    assert got == [(1, 0, "row 1")] + [(i, i, f"row {i}") for i in range(2, 6)] + [(6, 6, None)]


def test_widening_type_change_is_applied(replicated, source_dsn, target_dsn):
    run_sql(
        source_dsn,
        "ALTER TABLE t ALTER COLUMN v TYPE bigint",
        "UPDATE t SET v = 5000000000 WHERE id = 1",
    )
    changes = _changes(catch_up(replicated))
    assert_same(source_dsn, target_dsn)
    assert changes == ["public.t: column v widened to bigint"]


def test_narrowing_type_change_stops_in_strict_mode(keyed, source_dsn, target_dsn):
    before = rows(target_dsn)
    run_sql(source_dsn, "ALTER TABLE t ALTER COLUMN v TYPE smallint", "UPDATE t SET v = 9")
    with pytest.raises(ResyncNeeded, match="column v changed type from integer to smallint"):
        catch_up(keyed.model_copy(update={"ddl": "strict"}))
    assert rows(target_dsn) == before


def test_a_narrowed_column_list_is_refused_not_dropped(keyed, source_dsn, target_dsn):
    run_sql(
        source_dsn,
        f"ALTER PUBLICATION {keyed.publication} SET TABLE t (id, v)",
        "UPDATE t SET v = 0 WHERE id = 1",
    )
    with pytest.raises(
        SchemaDriftError, match=r"column s of table public\.t is still on the source"
    ):
        catch_up(keyed)


@pytest.mark.parametrize(
    "ddl",
    [
        "ALTER TABLE t ALTER COLUMN v TYPE smallint",
        "ALTER TABLE t ADD COLUMN r float8 DEFAULT random()",
    ],
    ids=["narrowing", "volatile-default"],
)
def test_what_cannot_be_followed_is_resynced_by_itself(replicated, source_dsn, target_dsn, ddl):
    run_sql(
        source_dsn,
        "UPDATE t SET v = 42 WHERE id = 2",
        ddl,
        "UPDATE t SET v = 7 WHERE id = 1",
        "INSERT INTO t (id, v, s) VALUES (6, 6, 'after')",
    )
    changes = _changes(catch_up(replicated))
    assert_same(source_dsn, target_dsn)
    assert len(changes) == 1 and changes[0].startswith("public.t: re-copied (")
    run_sql(source_dsn, "UPDATE t SET v = 8 WHERE id = 1", "DELETE FROM t WHERE id = 6")
    assert _changes(catch_up(replicated)) == []  # its changes past the copy, as any table's
    assert_same(source_dsn, target_dsn)


def test_resync_repairs_a_table_edited_by_hand_on_the_target(keyed, source_dsn, target_dsn):
    run_sql(
        target_dsn, "UPDATE t SET s = 'edited by hand' WHERE id = 3", "DELETE FROM t WHERE id = 4"
    )
    run_sql(source_dsn, "UPDATE t SET v = 0 WHERE id = 1")
    catch_up(keyed)
    assert rows(target_dsn) != rows(source_dsn)
    result = pipeline.resync_tables(keyed, [TableName("public", "t")])
    assert [t.table for t in result.tables] == [TableName("public", "t")]
    run_sql(source_dsn, "UPDATE t SET v = 1 WHERE id = 1")
    catch_up(keyed)
    assert_same(source_dsn, target_dsn)


CATCH_UP_IN_CHILD = (
    "import sys; from pgcdc_dagster.engine.settings import ReplicationSettings; "
    "from pgcdc_dagster_tests.support.replication import catch_up; "
    "catch_up(ReplicationSettings.model_validate_json(sys.argv[1]))"
)


@pytest.mark.parametrize(
    ("ddl", "point"),
    [
        ("ALTER TABLE t ADD COLUMN c text DEFAULT 'dflt'", "apply.in_transaction"),
        ("ALTER TABLE t RENAME COLUMN s TO label", "apply.in_transaction"),
        ("ALTER TABLE t DROP COLUMN s", "apply.in_transaction"),
        ("ALTER TABLE t ALTER COLUMN v TYPE bigint", "apply.in_transaction"),
        ("ALTER TABLE t ALTER COLUMN v TYPE smallint", "add.after_begin"),
        ("ALTER TABLE t ALTER COLUMN v TYPE smallint", "add.after_copy"),
    ],
    ids=["add", "rename", "drop", "widen", "resync-begun", "resync-copied"],
)
def test_a_catch_up_killed_in_an_automatic_step_converges_on_the_next(
    source_dsn, target_dsn, tmp_path, spark, ddl, point
):
    """SIGKILL of a real catch-up process inside the range's transaction, DDL carried out and
    rows written, or inside the resync it started: the target is as before (or, for the
    resync, the table's changes held back), and the next plain catch-up converges."""
    run_sql(source_dsn, KEYED, ROWS)
    settings = settings_for(source_dsn, target_dsn, tmp_path, "ddlkill")
    pipeline.take_snapshot(settings, spark)
    before_shape, before_rows = shape(target_dsn), rows(target_dsn)
    run_sql(
        source_dsn, "INSERT INTO t (id, v) VALUES (6, 6)", ddl, "UPDATE t SET v = 9 WHERE id = 1"
    )
    killed_at(point, CATCH_UP_IN_CHILD, settings)
    chain = OutputStore(settings.store).chain()
    assert chain is not None
    if point == "apply.in_transaction":
        assert (shape(target_dsn), rows(target_dsn)) == (before_shape, before_rows)
    else:
        assert chain.resyncing == chain.adding == (TableName("public", "t"),)
    changes = _changes(catch_up(settings))
    assert_same(source_dsn, target_dsn)
    assert changes
    assert OutputStore(settings.store).chain().adding == ()


def test_rename_table_is_renamed_on_the_target(keyed, source_dsn, target_dsn):
    run_sql(
        source_dsn,
        "ALTER TABLE t RENAME TO renamed",
        "ALTER TABLE renamed RENAME COLUMN s TO label",
        "UPDATE renamed SET v = 0 WHERE id = 1",
    )
    changes = _changes(catch_up(keyed))
    assert_same(source_dsn, target_dsn, "renamed")
    assert changes == [
        "public.renamed: table renamed from public.t",
        "public.renamed: column s renamed to label",
    ]
    assert TableName("public", "renamed") in OutputStore(keyed.store).chain().tables


@pytest.fixture
def for_all_tables(source_dsn, target_dsn, tmp_path, spark):
    """``t`` copied by a base snapshot of a ``FOR ALL TABLES`` publication."""
    run_sql(source_dsn, KEYED, ROWS, "CREATE PUBLICATION every FOR ALL TABLES")
    settings = settings_for(source_dsn, target_dsn, tmp_path, "ddlall", publication="every")
    pipeline.take_snapshot(settings, spark)
    return settings


def test_drop_table_and_create_it_again_resyncs_it(for_all_tables, source_dsn, target_dsn):
    run_sql(
        source_dsn,
        "DROP TABLE t",
        "CREATE TABLE t (id int PRIMARY KEY, v int, s text)",  # the same shape, other rows
        "INSERT INTO t VALUES (10, 10, 'new table')",
    )
    changes = _changes(catch_up(for_all_tables))
    assert_same(source_dsn, target_dsn)
    assert len(changes) == 1 and "dropped and created again" in changes[0]


def test_a_new_table_of_a_for_all_tables_publication_is_added_when_asked(
    for_all_tables, source_dsn, target_dsn
):
    run_sql(
        source_dsn,
        "CREATE TABLE fresh (id int PRIMARY KEY, v text)",
        "INSERT INTO fresh VALUES (1, 'before its first range')",
        "INSERT INTO t VALUES (6, 6, 'six')",
    )
    with pytest.raises(ApplyError, match=r"public\.fresh of the range do not exist on the target"):
        catch_up(for_all_tables)  # PGCDC_AUTO_ADD is off by default
    changes = _changes(catch_up(for_all_tables.model_copy(update={"auto_add": True})))
    assert len(changes) == 1 and changes[0].startswith("public.fresh: re-copied (")
    run_sql(source_dsn, "INSERT INTO fresh VALUES (2, 'after')")
    catch_up(for_all_tables)
    assert_same(source_dsn, target_dsn, "fresh")
    assert_same(source_dsn, target_dsn)


@pytest.fixture
def reconcile_every_apply(monkeypatch):
    """What the stream never shows is looked for at every apply (in production, once a minute
    per process)."""
    monkeypatch.setattr(pipeline, "RECONCILE_EVERY_S", 0.0)


def test_a_default_set_later_follows_on_the_target(
    keyed, reconcile_every_apply, source_dsn, target_dsn
):
    run_sql(source_dsn, "ALTER TABLE t ALTER COLUMN v SET DEFAULT 42", "UPDATE t SET v = 0")
    changes = _changes(catch_up(keyed))
    assert changes == ["public.t: column v default set to 42"]
    assert_same(source_dsn, target_dsn)  # no row took it: defaults change no existing row


def test_a_generated_column_added_on_the_source_is_added_on_the_target(
    keyed, reconcile_every_apply, source_dsn, target_dsn
):
    run_sql(
        source_dsn,
        "ALTER TABLE t ADD COLUMN twice int GENERATED ALWAYS AS (v * 2) STORED",
        "UPDATE t SET v = 100 WHERE id = 1",
    )
    changes = _changes(catch_up(keyed))
    assert changes == ["public.t: generated column twice added ((v * 2))"]
    assert_same(source_dsn, target_dsn)


def test_a_column_dropped_and_added_again_under_its_name_is_resynced(
    keyed, reconcile_every_apply, source_dsn, target_dsn
):
    run_sql(
        source_dsn,
        "ALTER TABLE t DROP COLUMN s",
        "ALTER TABLE t ADD COLUMN s text",  # the same name and type: the stream cannot tell
        "UPDATE t SET v = 0 WHERE id = 1",
    )
    changes = _changes(catch_up(keyed))
    assert_same(source_dsn, target_dsn)
    assert any("dropped and added again" in line for line in changes), changes
