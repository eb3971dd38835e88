"""Databases in an encoding other than UTF-8, on either side: the snapshot and the change
stream carry their text exactly (names too), and a character the target cannot hold stops the
work with the fix named, losing nothing."""

from __future__ import annotations

import json
import uuid

import psycopg
import pytest

from pgcdc_dagster.engine import pipeline, staging, verify
from pgcdc_dagster.engine.apply import ApplyError
from pgcdc_dagster.engine.settings import ReplicationSettings
from pgcdc_dagster.engine.snapshot.common import SnapshotError

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


def _settings(source_dsn: str, target_dsn: str, tmp_path) -> ReplicationSettings:
    return ReplicationSettings(
        source_dsn=source_dsn,
        target_dsn=target_dsn,
        slot=f"enc_{uuid.uuid4().hex[:8]}",
        store=str(tmp_path / "store"),
    )


def _catch_up(settings: ReplicationSettings) -> None:
    endpos = pipeline.resolve_endpos(settings, "current")
    with pipeline.range_lock(settings):
        for _ in pipeline.catch_up(
            settings, endpos, run_step=lambda step: pipeline.run_step_in_process(settings, step)
        ):
            pass


@pytest.mark.parametrize("staged", ["inline", "temp_tables"])
@pytest.mark.parametrize(
    ("source_encoding", "target_encoding"), [("LATIN1", "UTF8"), ("UTF8", "LATIN1")]
)
def test_text_and_names_cross_between_encodings_exactly(
    encoded_databases, spark, tmp_path, monkeypatch, source_encoding, target_encoding, staged
):
    if staged == "temp_tables":
        monkeypatch.setattr(staging, "INLINE_MAX_VALUES", 0)
    source_dsn = encoded_databases("source", source_encoding)
    target_dsn = encoded_databases("target", target_encoding)
    with psycopg.connect(source_dsn, autocommit=True, client_encoding="UTF8") as conn:
        conn.execute(SCHEMA)
        with conn.cursor() as cur:
            cur.executemany(
                'INSERT INTO "größe" VALUES (%s, %s, %s, %s, %s::jsonb, %s)',
                [(*row[:4], psycopg.types.json.Json(row[4]), row[5]) for row in SNAPSHOT_ROWS],
            )
    settings = _settings(source_dsn, target_dsn, tmp_path)
    pipeline.take_snapshot(settings, spark)
    with psycopg.connect(source_dsn, autocommit=True, client_encoding="UTF8") as conn:
        for statement in CHANGES:
            conn.execute(statement)
    _catch_up(settings)

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
    comparisons = verify.compare_tables(settings, pipeline.replicated_tables(settings))
    assert [(str(c.table), c.equal) for c in comparisons] == [('public."größe"', True)]
    assert pipeline.origin_progress(settings) == pipeline.expected_origin_progress(settings)


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
    settings = _settings(source_dsn, target_dsn, tmp_path)
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
        _catch_up(settings)
    message = str(refused.value)
    assert "public.notes" in message and "LATIN1" in message and fix in message
    # The whole transaction is refused, the origin stays where it was, and the range stays
    # stored for a re-run once the target can hold it.
    assert pipeline.origin_progress(settings) == applied
    with psycopg.connect(target_dsn, client_encoding="UTF8") as conn:
        assert conn.execute("SELECT id, body FROM notes").fetchall() == [(1, "é")]
    assert pipeline.expected_origin_progress(settings) > applied
