"""Shared fixtures: one source and one target throwaway cluster for the whole test session.

Clusters are real PostgreSQL servers (never mocks). They are shared across tests for speed;
each test that needs isolation gets its own database on them (``source_db`` / ``target_db``),
so slots, publications and tables of one test never leak into another.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from pgcdc_dagster.demo.local_cluster import (
    LOGICAL_SOURCE_SETTINGS,
    LocalCluster,
    origin_room,
    temporary_cluster,
)

REPO = Path(__file__).resolve().parent.parent

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
# Every `pgcdc` a test starts runs in its own process and leaves no command server behind;
# test_command_server.py runs them through one on purpose.
os.environ["PGCDC_SERVER"] = "off"


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> Iterator[None]:
    """Tests marked ``long`` first: ``make test`` hands tests to its workers in this order, so
    the minute-long ones start early and the short ones fill the gaps, rather than one worker
    running a long test alone at the end. A wrapper that sorts once every other hook is done:
    the random order (pytest-randomly) shuffles first, and the sort keeps it within each
    kind."""
    result = yield
    items.sort(key=lambda item: item.get_closest_marker("long") is None)
    return result


@pytest.fixture(scope="session")
def source_cluster() -> Iterator[LocalCluster]:
    cluster = temporary_cluster(LOGICAL_SOURCE_SETTINGS, prefix="pgcdc-test-source-")
    with cluster:
        yield cluster
    cluster.destroy()


@pytest.fixture(scope="session")
def target_cluster() -> Iterator[LocalCluster]:
    # Every test's snapshot leaves a replication origin with progress on this shared cluster;
    # each takes one of the origin state slots (default 10).
    cluster = temporary_cluster(origin_room(100), prefix="pgcdc-test-target-")
    with cluster:
        yield cluster
    cluster.destroy()


def fresh_database(cluster: LocalCluster, label: str, encoding: str | None = None) -> Iterator[str]:
    """A database of its own on ``cluster`` (in ``encoding``, from template0, when given),
    dropped with its slots afterwards."""
    name = f"{label}_{uuid.uuid4().hex[:10]}"
    create = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
    if encoding is not None:
        create += sql.SQL(" ENCODING {} TEMPLATE template0 LOCALE 'C'").format(
            sql.Literal(encoding)
        )
    with psycopg.connect(cluster.dsn(), autocommit=True) as conn:
        conn.execute(create)
        origins = {r for (r,) in conn.execute("SELECT roname FROM pg_replication_origin")}
    try:
        yield cluster.dsn(name)
    finally:
        with psycopg.connect(cluster.dsn(), autocommit=True) as conn:
            # Origins belong to the cluster, not the database: each test's go with it, or the
            # cluster runs out of them (max_replication_slots) over a session.
            for (origin,) in conn.execute("SELECT roname FROM pg_replication_origin").fetchall():
                if origin not in origins:
                    with contextlib.suppress(psycopg.Error):
                        conn.execute("SELECT pg_replication_origin_drop(%s)", (origin,))
            # Slots pin a database: drop this database's slots before the database.
            conn.execute(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
                "WHERE database = %s AND NOT active",
                (name,),
            )
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


@pytest.fixture
def source_dsn(source_cluster: LocalCluster) -> Iterator[str]:
    """A fresh database on the logical source cluster."""
    yield from fresh_database(source_cluster, "src")


@pytest.fixture
def target_dsn(target_cluster: LocalCluster) -> Iterator[str]:
    """A fresh database on the target cluster."""
    yield from fresh_database(target_cluster, "tgt")


@pytest.fixture
def encoded_databases(source_cluster, target_cluster) -> Iterator[Callable[[str, str], str]]:
    """``make(side, encoding)``: the DSN of a fresh database in ``encoding`` on the source
    (``side="source"``) or target cluster, dropped after the test."""
    with contextlib.ExitStack() as stack:

        def make(side: str, encoding: str) -> str:
            cluster = source_cluster if side == "source" else target_cluster
            made = fresh_database(cluster, side[:3], encoding)
            stack.callback(made.close)
            return next(made)

        yield make


@pytest.fixture(scope="session")
def spark():
    """One local SparkSession for the whole test session (a cold start costs seconds)."""
    from pgcdc_dagster.engine.spark.session import get_spark

    session = get_spark(master="local[2]")
    yield session
    session.stop()


@contextlib.contextmanager
def command_environment(
    source_dsn: str, target_dsn: str, storage: LocalCluster, tmp_path: Path, monkeypatch
) -> Iterator[dict[str, str]]:
    """The environment of a `pgcdc` command (set in this process, so subprocesses inherit
    it): a slot and store of its own, the shipped dagster.yaml on a storage database of its
    own on ``storage``; the slot dropped afterwards."""
    storage_db = f"dagster_cli_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(storage.dsn(), autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(storage_db)))
    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copy(REPO / "dagster.yaml", home / "dagster.yaml")
    slot = f"cli_{uuid.uuid4().hex[:8]}"
    env = {
        "PGCDC_SOURCE_DSN": source_dsn,
        "PGCDC_TARGET_DSN": target_dsn,
        "PGCDC_STORE": str(tmp_path / "store"),
        "PGCDC_SLOT": slot,
        "DAGSTER_HOME": str(home),
        "DAGSTER_POSTGRES_URL": (
            f"postgresql+psycopg2://postgres@127.0.0.1:{storage.port}/{storage_db}"
        ),
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    yield env
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
            "WHERE slot_name = %s AND NOT active",
            (slot,),
        )


@contextlib.contextmanager
def databases_environment(
    source_side: LocalCluster,
    target_side: LocalCluster,
    storage: LocalCluster,
    tmp_path: Path,
    monkeypatch,
) -> Iterator[dict[str, str]]:
    """:func:`command_environment` on a fresh database of ``source_side`` and one of
    ``target_side``, both dropped afterwards."""
    source = fresh_database(source_side, "src")
    target = fresh_database(target_side, "tgt")
    try:
        with command_environment(next(source), next(target), storage, tmp_path, monkeypatch) as env:
            yield env
    finally:
        source.close()
        target.close()


@pytest.fixture
def cli_env(source_dsn, target_dsn, target_cluster, tmp_path, monkeypatch):
    """:func:`command_environment` with a table `items` of 100 rows on the source."""
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute(
            """
            CREATE TABLE items (id int PRIMARY KEY, name text);
            INSERT INTO items SELECT g, 'i' || g FROM generate_series(1, 100) g;
            """
        )
    with command_environment(source_dsn, target_dsn, target_cluster, tmp_path, monkeypatch) as env:
        yield env
