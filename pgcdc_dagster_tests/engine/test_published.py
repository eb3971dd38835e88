"""A publication that narrows its tables (PostgreSQL 15's row filters and column lists): the
snapshot copies what the stream will send, no more, and the target stays equal to what is
published, as native logical replication's initial sync and apply keep it."""

from __future__ import annotations

import psycopg
import pytest

from pgcdc_dagster.engine.apply.origin import progress_of
from pgcdc_dagster.engine.apply.transaction import SchemaDriftError
from pgcdc_dagster.engine.control import pipeline
from pgcdc_dagster.engine.identifiers import TableName
from pgcdc_dagster.engine.published_columns import PublishedShape
from pgcdc_dagster.engine.snapshot import SnapshotError
from pgcdc_dagster.engine.store.output_store import OutputStore
from pgcdc_dagster_tests.support.replication import catch_up, equal_tables, killed_at, settings_for

SCHEMA = """
CREATE TABLE orders (id int PRIMARY KEY, tenant int NOT NULL, note text);
-- a filter on tenant needs tenant in the old row of an UPDATE or DELETE
ALTER TABLE orders REPLICA IDENTITY FULL;
INSERT INTO orders SELECT g, g % 3, 'n' || g FROM generate_series(1, 30) g;

CREATE TABLE users (id int PRIMARY KEY, name text, ssn text NOT NULL,
                    joined date NOT NULL DEFAULT '2000-01-01', "Odd Col" int);
INSERT INTO users SELECT g, 'u' || g, 'ssn' || g, '2020-01-01', g FROM generate_series(1, 10) g;

CREATE TABLE m (id int, k int, secret text, PRIMARY KEY (id, k)) PARTITION BY RANGE (k);
CREATE TABLE m_low PARTITION OF m FOR VALUES FROM (0) TO (10);
CREATE TABLE m_high PARTITION OF m FOR VALUES FROM (10) TO (20);
INSERT INTO m SELECT g, g % 20, 's' || g FROM generate_series(1, 40) g;

CREATE TABLE whole (id int PRIMARY KEY, v text);
INSERT INTO whole VALUES (1, 'a'), (2, 'b');

CREATE PUBLICATION mine FOR TABLE orders WHERE (tenant = 1),
    users (id, name, "Odd Col"), m (id, k) WHERE (k >= 5), whole
    WITH (publish_via_partition_root = true);
"""

CHANGES = """
UPDATE orders SET tenant = 1 WHERE id = 2;          -- enters the filter: an INSERT
UPDATE orders SET tenant = 0 WHERE id = 1;          -- leaves it: a DELETE
UPDATE orders SET note = 'in' WHERE id = 4;         -- inside it
UPDATE orders SET note = 'out' WHERE id = 5;        -- outside it: nothing
INSERT INTO orders VALUES (100, 1, 'new in'), (101, 2, 'new out');
DELETE FROM orders WHERE id IN (7, 8);              -- one inside, one outside
INSERT INTO users VALUES (11, 'eleven', 'ssn11', '2021-01-01', 11);
UPDATE users SET name = 'renamed', ssn = 'changed' WHERE id = 1;
DELETE FROM users WHERE id = 2;
INSERT INTO m VALUES (41, 3, 'low'), (42, 15, 'high');
UPDATE m SET k = 12 WHERE id = 3;                   -- partition and filter: 3 to 12, enters
UPDATE m SET k = 1 WHERE id = 6;                    -- 6 to 1: leaves the filter
DELETE FROM m WHERE id = 9;
UPDATE whole SET v = 'z';
"""

ORDERS, USERS, M, WHOLE = (TableName("public", n) for n in ("orders", "users", "m", "whole"))


def _ids(dsn: str, query: str) -> list[int]:
    with psycopg.connect(dsn) as conn:
        return [row[0] for row in conn.execute(query).fetchall()]


@pytest.mark.parametrize("copied_by", ["driver", "spark"])
def test_a_narrowed_table_is_copied_and_kept_as_it_is_published(
    source_dsn, target_dsn, tmp_path, spark, copied_by
):
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute(SCHEMA)
    settings = settings_for(
        source_dsn, target_dsn, tmp_path, "narrow", publication="mine",
        **({"snapshot_driver_rows": 0} if copied_by == "spark" else {}),
    )  # fmt: skip
    result = pipeline.take_snapshot(settings, spark)

    assert result.shapes == {
        ORDERS: PublishedShape(("id", "tenant", "note"), (), "(tenant = 1)"),
        USERS: PublishedShape(("id", "name", "Odd Col"), ("ssn", "joined"), None),
        M: PublishedShape(("id", "k"), ("secret",), "(k >= 5)"),
    }
    assert {t.table: t.copied_by for t in result.tables}[ORDERS] == copied_by
    # Only the published rows and columns were copied: no row outside a filter, no value of a
    # column left out (ssn was NOT NULL without a default, so the target lets it be empty;
    # joined has a default, which the target's rows take).
    assert {t.table: t.rows for t in result.tables} == {ORDERS: 10, USERS: 10, M: 30, WHOLE: 2}
    assert result.not_null_dropped == ("public.users.ssn",)
    with psycopg.connect(target_dsn) as conn:
        users = conn.execute(
            "SELECT count(*), count(ssn), min(joined)::text, bool_or(a.attnotnull) "
            "FROM users, pg_attribute a WHERE a.attrelid = 'users'::regclass "
            "AND a.attname = 'ssn'"
        ).fetchone()
        secrets = conn.execute("SELECT count(secret) FROM m").fetchone()
    assert users == (10, 0, "2000-01-01", False)
    assert secrets == (0,)
    chain = OutputStore(settings.store).chain()
    assert chain is not None and chain.unpublished == {USERS: ("ssn", "joined"), M: ("secret",)}

    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute(CHANGES)
    catch_up(settings)

    # Equal as published: the rows the filter passes, over the columns the list sends.
    assert equal_tables(settings) == [
        ("public.m", True), ("public.orders", True), ("public.users", True), ("public.whole", True)
    ]  # fmt: skip
    assert _ids(target_dsn, "SELECT id FROM orders ORDER BY id") == _ids(
        source_dsn, "SELECT id FROM orders WHERE tenant = 1 ORDER BY id"
    )
    assert 2 in _ids(target_dsn, "SELECT id FROM orders") and 1 not in _ids(
        target_dsn, "SELECT id FROM orders"
    )
    assert _ids(target_dsn, "SELECT id FROM m ORDER BY id") == _ids(
        source_dsn, "SELECT id FROM m WHERE k >= 5 ORDER BY id"
    )
    with psycopg.connect(target_dsn) as conn:
        assert conn.execute("SELECT count(ssn) FROM users").fetchone() == (0,)
        assert conn.execute("SELECT name FROM users WHERE id = 1").fetchone() == ("renamed",)
        assert conn.execute("SELECT count(secret) FROM m").fetchone() == (0,)


def test_a_column_list_that_shrinks_midstream_stops_the_apply_naming_the_column(
    source_dsn, target_dsn, tmp_path, spark
):
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute(SCHEMA)
    settings = settings_for(source_dsn, target_dsn, tmp_path, "shrink", publication="mine")
    pipeline.take_snapshot(settings, spark)
    before = progress_of(target_dsn, settings.origin)
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute('ALTER PUBLICATION mine SET TABLE users (id, "Odd Col")')  # name is out
        conn.execute("UPDATE users SET name = 'lost?' WHERE id = 1")

    with pytest.raises(SchemaDriftError, match=r"column name of table public\.users is still on "
                       r"the source but the publication no longer sends it"):  # fmt: skip
        catch_up(settings)
    # Nothing of the range was applied: the target still has the value it had.
    assert progress_of(target_dsn, settings.origin) == before
    with psycopg.connect(target_dsn) as conn:
        assert conn.execute("SELECT name FROM users WHERE id = 1").fetchone() == ("u1",)


def test_a_column_list_without_a_key_column_is_refused_before_the_target_changes(
    source_dsn, target_dsn, tmp_path, spark
):
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE people (id int PRIMARY KEY, email text NOT NULL, name text);"
            "CREATE UNIQUE INDEX people_email ON people (email);"
            "ALTER TABLE people REPLICA IDENTITY USING INDEX people_email;"
            "INSERT INTO people VALUES (1, 'a@x', 'a');"
            "CREATE PUBLICATION mine FOR TABLE people (email, name)"
        )
    settings = settings_for(source_dsn, target_dsn, tmp_path, "nokey", publication="mine")

    with pytest.raises(SnapshotError, match=r"column list of public\.people leaves out id, "
                       r"which the target cannot leave empty \(it is in the table.s primary key\): "
                       r"add id to the column list"):  # fmt: skip
        pipeline.take_snapshot(settings, spark)
    with psycopg.connect(source_dsn) as conn:  # the slot went with the failed snapshot
        assert conn.execute(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_name = %s", (settings.slot,)
        ).fetchone() == (0,)
    with psycopg.connect(target_dsn) as conn:  # refused before the schema was copied
        assert conn.execute("SELECT to_regclass('people')").fetchone() == (None,)


SNAPSHOT_IN_CHILD = (
    "import sys; from pgcdc_dagster.engine.control import pipeline; "
    "from pgcdc_dagster.engine.settings import ReplicationSettings; "
    "pipeline.take_snapshot(ReplicationSettings.model_validate_json(sys.argv[1]), None)"
)


def test_a_narrowed_snapshot_killed_after_its_copy_is_resumed_and_converges(
    source_dsn, target_dsn, tmp_path, spark
):
    """SIGKILL of a real snapshot process once the narrowed copy is on the target (the left-out
    column's NOT NULL dropped, the filtered rows in): the next snapshot resumes it, keeping
    every table (each was copied whole), and the target converges to what is published, each
    row once."""
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute(SCHEMA)
    settings = settings_for(source_dsn, target_dsn, tmp_path, "killed", publication="mine")
    killed_at("snapshot.after_copy", SNAPSHOT_IN_CHILD, settings)
    with psycopg.connect(target_dsn) as conn:  # what the killed snapshot left
        assert conn.execute("SELECT count(*) FROM orders").fetchone() == (10,)

    result = pipeline.take_snapshot(settings, spark)  # finds the unfinished one: resumed
    assert {t.table: t.rows for t in result.tables} == {ORDERS: 10, USERS: 10, M: 30, WHOLE: 2}
    assert {t.copied_by for t in result.tables} == {"kept"}
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute(CHANGES)
    catch_up(settings)
    assert all(equal for _, equal in equal_tables(settings))
    with psycopg.connect(target_dsn) as conn:
        assert conn.execute("SELECT count(*), count(ssn) FROM users").fetchone() == (10, 0)


def test_a_table_published_otherwise_midstream_is_named_with_its_fix_and_a_resync_converges(
    source_dsn, target_dsn, tmp_path, spark
):
    """The publication's row filter of ``orders`` changed after its copy, and its column list
    of ``users`` now sends ``ssn``: the stream follows the publication from there, but the
    rows only the new filter passes were never copied, those only the old one passed stay,
    and the users copied before have no ``ssn``, as with native replication, and nothing
    fails. The chain recorded each table's filter and left-out columns at its copy, so status,
    verify and the ``replicated_tables`` check name the change and the fix; the fix (``pgcdc
    resync``) copies them as now published and records that."""
    from pgcdc_dagster.defs.checks import replicated_tables_result
    from pgcdc_dagster.engine.control.pipeline import Reshaped

    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute(SCHEMA)
    settings = settings_for(source_dsn, target_dsn, tmp_path, "reshape", publication="mine")
    pipeline.take_snapshot(settings, spark)
    chain = OutputStore(settings.store).chain()
    assert chain is not None
    assert chain.row_filters == {ORDERS: "(tenant = 1)", USERS: None, M: "(k >= 5)", WHOLE: None}
    assert pipeline.tables_agreement(settings).agree

    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute(
            "ALTER PUBLICATION mine SET TABLE orders WHERE (tenant = 2), "
            'users (id, name, "Odd Col", ssn), m (id, k) WHERE (k >= 5), whole'
        )
        conn.execute("INSERT INTO orders VALUES (200, 2, 'two'), (201, 1, 'one')")
        conn.execute("UPDATE users SET name = 'sent' WHERE id = 3")
    catch_up(settings)  # nothing fails

    agreement = pipeline.tables_agreement(settings)
    assert not agreement.agree
    assert agreement.reshaped == (
        Reshaped(ORDERS, "(tenant = 1)", "(tenant = 2)"),
        Reshaped(USERS, None, None, ("ssn",)),
    )
    lines = agreement.reshaped_lines()
    assert lines == [
        "public.orders: the publication's row filter is WHERE (tenant = 2), it was WHERE "
        "(tenant = 1) when the table was copied, so the target lacks the rows only the new one "
        "passes and keeps those only the old one did (as with native replication): pgcdc "
        "resync public.orders copies it again as now published",
        "public.users: the publication now sends column(s) ssn, left out when the table was "
        "copied, so they are empty in the rows copied then (as with native replication): "
        "pgcdc resync public.users copies it again as now published",
    ]
    evaluation = replicated_tables_result(settings)
    assert not evaluation.passed and evaluation.severity.value == "WARN"
    assert evaluation.description == "; ".join(lines)
    equal = dict(equal_tables(settings))
    assert equal["public.orders"] is False and equal["public.users"] is False

    added = pipeline.resync_tables(settings, [ORDERS, USERS], spark)  # the fix named
    assert added.shapes[ORDERS].row_filter == "(tenant = 2)"
    assert added.shapes[USERS].unpublished == ("joined",)
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO orders VALUES (202, 2, 'after')")
        conn.execute("UPDATE orders SET tenant = 2 WHERE id = 1")  # enters the new filter
        conn.execute("UPDATE users SET ssn = 'new' WHERE id = 4")
    catch_up(settings)
    assert pipeline.tables_agreement(settings).agree
    assert all(equal for _, equal in equal_tables(settings))
    assert _ids(target_dsn, "SELECT id FROM orders ORDER BY id") == _ids(
        source_dsn, "SELECT id FROM orders WHERE tenant = 2 ORDER BY id"
    )
    with psycopg.connect(target_dsn) as conn:
        assert conn.execute("SELECT count(ssn) FROM users").fetchone() == (10,)
