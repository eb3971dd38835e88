"""Preflight scenarios on real PostgreSQL: each problem a source can have, and its fix.

Most run on a fresh database of the shared logical source cluster; the server-setting problems
(wal_level, exhausted slots and wal senders) need their own small cluster, started in the test.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from pgcdc_dagster.demo.local_cluster import temporary_cluster
from pgcdc_dagster.engine.connect import connect
from pgcdc_dagster.engine.identifiers import TableName
from pgcdc_dagster.engine.source.preflight import PreflightError, check_source, user_tables
from pgcdc_dagster_tests.support.waits import wait_for

ORDERS = TableName("public", "orders")
EVENTS = TableName("public", "events")
EVENTS_1 = TableName("public", "events_1")


@pytest.fixture
def shop(source: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
    """A source whose tables are all replicable, plus things that are not tables to replicate."""
    source.execute(
        """
        CREATE TABLE orders (id int PRIMARY KEY);
        CREATE TABLE events (id int, day int, PRIMARY KEY (id, day)) PARTITION BY RANGE (day);
        CREATE TABLE events_1 PARTITION OF events FOR VALUES FROM (0) TO (10);
        CREATE TABLE events_2 PARTITION OF events FOR VALUES FROM (10) TO (20);
        CREATE TABLE log (line text);
        ALTER TABLE log REPLICA IDENTITY FULL;
        CREATE TABLE keyed (code text NOT NULL);
        CREATE UNIQUE INDEX keyed_code ON keyed (code);
        ALTER TABLE keyed REPLICA IDENTITY USING INDEX keyed_code;
        CREATE SCHEMA "Odd Schema";
        CREATE TABLE "Odd Schema"."Mixed Case" (id int PRIMARY KEY);
        CREATE UNLOGGED TABLE scratch (id int);
        CREATE VIEW recent_orders AS SELECT * FROM orders;
        """
    )
    return source


def problems_of(conn: psycopg.Connection[Any], tables: list[TableName] | None) -> list[str]:
    with pytest.raises(PreflightError) as raised:
        check_source(conn, tables)
    message = str(raised.value)
    assert all(problem in message for problem in raised.value.problems), "one line each"
    return raised.value.problems


def one_about(problems: list[str], needle: str) -> str:
    matching = [problem for problem in problems if needle in problem]
    assert len(matching) == 1, f"expected one problem about {needle!r} in {problems}"
    return matching[0]


# --- table resolution ---------------------------------------------------------------------------


def test_all_user_tables_are_roots_and_plain_tables_but_not_partitions_or_unlogged(shop):
    expected = [
        TableName("Odd Schema", "Mixed Case"),
        EVENTS,
        TableName("public", "keyed"),
        TableName("public", "log"),
        ORDERS,
    ]
    assert check_source(shop, None) == expected
    assert user_tables(shop) == expected


def test_a_partition_listed_with_its_root_is_covered_by_the_root(shop):
    assert check_source(shop, [EVENTS_1, ORDERS, EVENTS, ORDERS]) == [EVENTS, ORDERS]
    assert check_source(shop, [EVENTS_1]) == [EVENTS_1], "a partition alone is its own table"


def test_requested_names_that_are_not_replicable_tables_are_reported_together(shop):
    problems = problems_of(
        shop,
        [
            ORDERS,
            TableName("public", "nope"),
            TableName("public", "recent_orders"),
            TableName("public", "scratch"),
            TableName("public", "Orders"),
        ],
    )

    assert len(problems) == 4
    assert "does not exist" in one_about(problems, "table public.nope ")
    assert "does not exist" in one_about(problems, 'table public."Orders" ')
    assert "is a view, not a table" in one_about(problems, "public.recent_orders")
    assert "ALTER TABLE public.scratch SET LOGGED" in one_about(problems, "public.scratch")


# --- replica identity ---------------------------------------------------------------------------


def test_tables_without_a_replica_identity_each_get_their_fix(source):
    source.execute(
        """
        CREATE TABLE no_key (id int);
        CREATE SCHEMA "Odd Schema";
        CREATE TABLE "Odd Schema"."No Key" (id int);
        CREATE TABLE nothing (id int);
        ALTER TABLE nothing REPLICA IDENTITY NOTHING;
        CREATE TABLE keyed_nothing (id int PRIMARY KEY);
        ALTER TABLE keyed_nothing REPLICA IDENTITY NOTHING;
        CREATE TABLE deferred (id int PRIMARY KEY DEFERRABLE);
        CREATE TABLE dropped_index (code text NOT NULL);
        CREATE UNIQUE INDEX dropped_index_code ON dropped_index (code);
        ALTER TABLE dropped_index REPLICA IDENTITY USING INDEX dropped_index_code;
        DROP INDEX dropped_index_code;
        CREATE TABLE parts (id int) PARTITION BY LIST (id);
        CREATE TABLE parts_1 PARTITION OF parts FOR VALUES IN (1);
        CREATE TABLE fine (id int PRIMARY KEY);
        CREATE TABLE keyed (code text NOT NULL);
        CREATE UNIQUE INDEX keyed_code ON keyed (code);
        ALTER TABLE keyed REPLICA IDENTITY USING INDEX keyed_code;
        """
    )

    problems = problems_of(source, None)

    assert len(problems) == 8, problems
    no_key = one_about(problems, "table public.no_key ")
    assert "no primary key and REPLICA IDENTITY DEFAULT" in no_key
    assert no_key.endswith("run ALTER TABLE public.no_key REPLICA IDENTITY FULL")
    assert 'ALTER TABLE "Odd Schema"."No Key" REPLICA IDENTITY FULL' in one_about(
        problems, '"Odd Schema"."No Key"'
    )
    assert "ALTER TABLE public.nothing REPLICA IDENTITY FULL" in one_about(
        problems, "table public.nothing "
    )
    assert "ALTER TABLE public.keyed_nothing REPLICA IDENTITY DEFAULT" in one_about(
        problems, "public.keyed_nothing"
    )
    assert "primary key PostgreSQL cannot use" in one_about(problems, "public.deferred")
    assert "USING INDEX but that index is gone" in one_about(problems, "public.dropped_index")
    assert "public.parts_1 (a partition of public.parts)" in one_about(problems, "parts_1")
    # The root too: its partitions' changes are published as its own, with its identity.
    assert "ALTER TABLE public.parts REPLICA IDENTITY FULL" in one_about(
        problems, "table public.parts "
    )

    # Following the fixes, as written in the messages, makes the source pass.
    for problem in problems:
        fix = re.search(r"ALTER TABLE (.+?) REPLICA IDENTITY (FULL|DEFAULT)", problem)
        assert fix is not None, problem
        source.execute(fix.group(0).encode())
    assert TableName("public", "keyed") in check_source(source, None)


def test_a_table_without_columns_is_refused_before_its_copy_fails(source):
    source.execute(
        "CREATE TABLE empty_shape (); ALTER TABLE empty_shape REPLICA IDENTITY FULL; "
        "INSERT INTO empty_shape DEFAULT VALUES; CREATE TABLE fine (id int PRIMARY KEY)"
    )
    problems = problems_of(source, None)
    assert problems == [
        "table public.empty_shape has no columns, so there is nothing of it to copy or apply "
        "but a count of empty rows: leave it out of PGCDC_TABLES, or give it a column"
    ]
    assert check_source(source, [TableName("public", "fine")]) == [TableName("public", "fine")]


# --- privileges ---------------------------------------------------------------------------------


@pytest.fixture
def plain_role(source: psycopg.Connection[Any]) -> Iterator[str]:
    """A login role with neither REPLICATION nor any grant; dropped afterwards (roles are
    cluster-wide)."""
    role = f"pgcdc_plain_{uuid.uuid4().hex[:8]}"
    source.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
    try:
        yield role
    finally:
        source.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
        source.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_a_role_without_replication_or_select_is_told_what_to_grant(source, source_dsn, plain_role):
    source.execute(
        "CREATE TABLE orders (id int PRIMARY KEY);"
        "CREATE SCHEMA secret; CREATE TABLE secret.keys (id int PRIMARY KEY)"
    )
    tables = [ORDERS, TableName("secret", "keys")]

    with connect(source_dsn, user=plain_role, autocommit=True) as as_role:
        problems = problems_of(as_role, tables)

        assert len(problems) == 4, problems
        assert f"ALTER ROLE {plain_role} REPLICATION" in one_about(problems, "REPLICATION")
        assert f"GRANT USAGE ON SCHEMA secret TO {plain_role}" in one_about(problems, "USAGE")
        assert f"GRANT SELECT ON public.orders TO {plain_role}" in one_about(problems, "orders")
        assert f"GRANT SELECT ON secret.keys TO {plain_role}" in one_about(problems, "keys")

        for problem in problems:
            source.execute(problem.split(": run ")[1].removesuffix(" (as a superuser)").encode())
        assert check_source(as_role, tables) == tables


def test_row_level_security_over_the_role_is_refused_before_it_hides_rows(
    source, source_dsn, plain_role
):
    source.execute(
        """
        CREATE TABLE orders (id int PRIMARY KEY);
        CREATE TABLE events (id int, day int, PRIMARY KEY (id, day)) PARTITION BY RANGE (day);
        CREATE TABLE events_1 PARTITION OF events FOR VALUES FROM (0) TO (10);
        INSERT INTO orders SELECT generate_series(1, 10);
        ALTER TABLE orders ENABLE ROW LEVEL SECURITY;
        CREATE POLICY even ON orders USING (id % 2 = 0);
        ALTER TABLE events_1 ENABLE ROW LEVEL SECURITY;
        """
    )
    source.execute(
        sql.SQL("ALTER ROLE {} REPLICATION; GRANT SELECT ON orders, events, events_1 TO {}").format(
            sql.Identifier(plain_role), sql.Identifier(plain_role)
        )
    )
    tables = [EVENTS, ORDERS]
    with connect(source_dsn, user=plain_role, autocommit=True) as as_role:
        problems = problems_of(as_role, tables)
        assert len(problems) == 2, problems
        fix = f"run ALTER ROLE {plain_role} BYPASSRLS (as a superuser)"
        assert fix in one_about(problems, "table public.orders,")
        assert fix in one_about(problems, "public.events_1 (a partition of public.events)")
        # What the preflight spares the snapshot: a read under a policy fails, not filters.
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="row-level security"):
            as_role.execute("SELECT count(*) FROM orders")

        source.execute(
            sql.SQL("ALTER ROLE {} BYPASSRLS").format(sql.Identifier(plain_role)).as_bytes(source)
        )
    with connect(source_dsn, user=plain_role, autocommit=True) as as_role:
        assert check_source(as_role, tables) == tables
        assert as_role.execute("SELECT count(*) FROM orders").fetchone() == (10,)


# --- server settings ----------------------------------------------------------------------------


def test_a_source_without_logical_wal_is_refused_with_the_setting_to_change():
    cluster = temporary_cluster(prefix="pgcdc-test-replica-")  # default wal_level = replica
    try:
        cluster.start()
        with psycopg.connect(cluster.dsn(), autocommit=True) as conn:
            conn.execute("CREATE TABLE orders (id int PRIMARY KEY)")
            problems = problems_of(conn, None)
    finally:
        cluster.destroy()

    assert problems == [
        "wal_level is replica, not logical, so the WAL lacks what logical decoding needs: "
        "run ALTER SYSTEM SET wal_level = logical on the source and restart it"
    ]


def test_exhausted_slots_and_wal_senders_are_refused_naming_the_slots_in_use():
    cluster = temporary_cluster(
        {"wal_level": "logical", "max_replication_slots": "1", "max_wal_senders": "1"},
        prefix="pgcdc-test-full-",
    )
    try:
        cluster.start()
        with psycopg.connect(cluster.dsn(), autocommit=True) as conn:
            conn.execute("SELECT pg_create_logical_replication_slot('taken', 'pgoutput')")
            with connect(cluster.dsn(), replication=True):  # occupies the only wal sender
                problems = problems_of(conn, None)
            # The wal sender's backend ends a moment after its client closed the connection.
            wait_for(
                lambda: (
                    conn.execute("SELECT count(*) FROM pg_stat_get_wal_senders()").fetchone()
                    == (0,)
                ),
                "the wal sender to end with its connection",
                timeout=30,
            )
            assert check_source(conn, None, free_slots_needed=0) == []
    finally:
        cluster.destroy()

    assert len(problems) == 2, problems
    slots = one_about(problems, "no free replication slot")
    assert "max_replication_slots = 1 and 1 in use (taken (inactive))" in slots
    assert "ALTER SYSTEM SET max_replication_slots = 2" in slots
    assert "ALTER SYSTEM SET max_wal_senders = 2" in one_about(problems, "no free wal sender")
