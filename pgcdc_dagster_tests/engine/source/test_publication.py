"""The publication: created for the given tables, extended never shrunk, partitions through
their root, refusals that name the fix."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from pgcdc_dagster.engine.identifiers import TableName
from pgcdc_dagster.engine.source.publication import (
    PublicationError,
    ensure_publication,
    publication_tables,
)

ORDERS = TableName("public", "orders")


def published_relations(conn: psycopg.Connection[Any], publication: str) -> list[str]:
    """What the catalog says the publication lists, as regclass text (independent of our code)."""
    return [
        row[0]
        for row in conn.execute(
            "SELECT r.prrelid::regclass::text FROM pg_publication_rel r "
            "JOIN pg_publication p ON p.oid = r.prpubid WHERE p.pubname = %s ORDER BY 1",
            (publication,),
        )
    ]


def test_ensure_publication_creates_it_for_the_given_tables(source):
    source.execute(
        'CREATE SCHEMA "Odd Schema";'
        'CREATE TABLE "Odd Schema"."Mixed Case" (id int PRIMARY KEY);'
        "CREATE TABLE orders (id int PRIMARY KEY); CREATE TABLE audit (id int PRIMARY KEY);"
        "CREATE TABLE not_wanted (id int PRIMARY KEY)"
    )
    wanted = [ORDERS, TableName("Odd Schema", "Mixed Case"), TableName("public", "audit")]

    published = ensure_publication(source, "pgcdc", wanted)

    assert published == sorted(wanted)
    assert [str(t) for t in published] == [
        '"Odd Schema"."Mixed Case"',
        "public.audit",
        "public.orders",
    ]
    assert publication_tables(source, "pgcdc") == published
    assert published_relations(source, "pgcdc") == ['"Odd Schema"."Mixed Case"', "audit", "orders"]
    assert source.execute("SELECT pubviaroot FROM pg_publication").fetchone() == (True,)


def test_ensure_publication_adds_missing_tables_and_never_removes(source):
    source.execute(
        "CREATE TABLE orders (id int PRIMARY KEY); CREATE TABLE items (id int PRIMARY KEY)"
    )
    items = TableName("public", "items")
    ensure_publication(source, "pgcdc", [ORDERS])

    assert ensure_publication(source, "pgcdc", [ORDERS, items]) == [items, ORDERS]
    assert ensure_publication(source, "pgcdc", [items]) == [items, ORDERS]
    assert published_relations(source, "pgcdc") == ["items", "orders"]


def test_ensure_publication_for_all_user_tables_publishes_partition_roots(source):
    source.execute(
        "CREATE TABLE orders (id int PRIMARY KEY);"
        "CREATE TABLE events (id int, day int, PRIMARY KEY (id, day)) PARTITION BY RANGE (day);"
        "CREATE TABLE events_1 PARTITION OF events FOR VALUES FROM (0) TO (10);"
        "CREATE TABLE events_2 PARTITION OF events FOR VALUES FROM (10) TO (20);"
        "CREATE UNLOGGED TABLE scratch (id int);"
        "CREATE VIEW recent AS SELECT * FROM orders"
    )
    events = TableName("public", "events")

    published = ensure_publication(source, "pgcdc", None)

    assert published == [events, ORDERS]
    assert published_relations(source, "pgcdc") == ["events", "orders"]


def test_ensure_publication_switches_an_existing_one_to_publish_via_root(source):
    source.execute(
        "CREATE TABLE orders (id int PRIMARY KEY);"
        "CREATE TABLE events (id int, day int, PRIMARY KEY (id, day)) PARTITION BY RANGE (day);"
        "CREATE TABLE events_1 PARTITION OF events FOR VALUES FROM (0) TO (10);"
        "CREATE PUBLICATION legacy FOR TABLE events"
    )
    events = TableName("public", "events")
    assert publication_tables(source, "legacy") == [TableName("public", "events_1")]

    assert ensure_publication(source, "legacy", [events, ORDERS]) == [events, ORDERS]
    assert source.execute("SELECT pubviaroot FROM pg_publication").fetchone() == (True,)


def test_ensure_publication_covers_partitions_through_their_published_root(source):
    source.execute(
        "CREATE TABLE events (id int, day int, PRIMARY KEY (id, day)) PARTITION BY RANGE (day);"
        "CREATE TABLE events_1 PARTITION OF events FOR VALUES FROM (0) TO (10)"
    )
    events = TableName("public", "events")
    ensure_publication(source, "pgcdc", [events])

    assert ensure_publication(source, "pgcdc", [TableName("public", "events_1")]) == [events]
    assert published_relations(source, "pgcdc") == ["events"], "nothing added"


def test_ensure_publication_accepts_an_existing_for_all_tables_one(source):
    source.execute(
        "CREATE TABLE orders (id int PRIMARY KEY); CREATE PUBLICATION every FOR ALL TABLES"
    )
    assert ensure_publication(source, "every", [ORDERS]) == [ORDERS]


def test_ensure_publication_refuses_one_that_skips_updates(source):
    source.execute(
        "CREATE TABLE orders (id int PRIMARY KEY);"
        "CREATE PUBLICATION inserts_only FOR TABLE orders WITH (publish = 'insert')"
    )
    with pytest.raises(PublicationError, match="does not publish every kind of change") as raised:
        ensure_publication(source, "inserts_only", [ORDERS])
    assert "ALTER PUBLICATION inserts_only SET (publish =" in str(raised.value)


def test_ensure_publication_names_a_missing_table(source):
    with pytest.raises(PublicationError, match=r'relation "public\.nope" does not exist'):
        ensure_publication(source, "pgcdc", [TableName("public", "nope")])
    with pytest.raises(PublicationError, match="publication pgcdc does not exist"):
        publication_tables(source, "pgcdc")


def test_publication_tables_on_a_missing_publication_says_how_to_create_it(source):
    with pytest.raises(PublicationError, match="does not exist") as raised:
        publication_tables(source, "absent")
    assert "ensure_publication" in str(raised.value)
