"""What the store's retention costs on a store that ran for a long time.

A store of ``--ranges`` ranges is written by hand (``harness.write_store``: a manifest and a 2 KB
Parquet file each, as
a follow's small steady-state ranges are; stored ``--age`` seconds ago), with a target whose
replication origin stands at the last range's commit (an origin created on the server
``--dsn`` for the run, dropped after), and every range registered as an ``lsn_ranges``
partition in Dagster's PostgreSQL storage (a database of its own on the same server).

Measured:

* ``not_due_ms``: :func:`prune_if_due` when the last prune is recent: what every apply pays.
* ``listing_only_s``: a prune that finds nothing old enough (one listing of the store).
* ``command_s``: ``pgcdc prune --retention 1h`` from a fresh process (Python, Dagster and the
  definitions load, the run, the prune, the partitions dropped), as a user runs it, with the
  run's own figures: the prune's seconds and the partitions dropped.
* ``disk_before`` and ``disk_after``: bytes under the store.

Usage: ``.venv/bin/python benchmarks/retention.py [--ranges 20000] [--dsn host=127.0.0.1]``.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psycopg
from psycopg import sql

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's code, whatever the virtualenv installed
sys.path.insert(0, str(REPO / "benchmarks"))

import harness  # noqa: E402

from pgcdc_dagster.engine.store.output_store import OutputStore  # noqa: E402
from pgcdc_dagster.engine.store.retention import prune, prune_if_due  # noqa: E402


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    parser = harness.argument_parser(__doc__, profile=None)
    parser.add_argument("--ranges", type=int, default=20_000)
    parser.add_argument("--age", type=float, default=2 * 86400)
    parser.add_argument("--dsn", default="host=127.0.0.1 port=5432 user=postgres dbname=postgres")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pgcdc-retention-"))
    slot = f"bench_{uuid.uuid4().hex[:6]}"
    storage_db = f"dagster_{slot}"
    origin = f"pgcdc_{slot}"
    report: dict[str, object] = {"ranges": args.ranges}
    with psycopg.connect(args.dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(storage_db)))
    try:
        began = time.perf_counter()
        last = harness.write_store(work / "store", args.ranges, args.age)
        report["write_s"] = round(time.perf_counter() - began, 2)
        with psycopg.connect(args.dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_replication_origin_create(%s)", (origin,))
            conn.execute(
                "SELECT pg_replication_origin_advance(%s, %s::pg_lsn)", (origin, str(last))
            )
        home = work / "dagster_home"
        home.mkdir()
        shutil.copy(REPO / "dagster.yaml", home / "dagster.yaml")
        host = dict(p.split("=") for p in args.dsn.split())
        env = {
            **os.environ,
            "PGCDC_SOURCE_DSN": args.dsn,
            "PGCDC_TARGET_DSN": args.dsn,
            "PGCDC_SLOT": slot,
            "PGCDC_STORE": str(work / "store"),
            "PGCDC_SERVER": "off",
            "DAGSTER_HOME": str(home),
            "DAGSTER_POSTGRES_URL": f"postgresql+psycopg2://{host.get('user', 'postgres')}@"
            f"{host.get('host', '127.0.0.1')}:{host.get('port', '5432')}/{storage_db}",
        }
        os.environ.update(env)
        from pgcdc_dagster.defs.instance import dagster_instance
        from pgcdc_dagster.defs.partitions import LSN_RANGES

        instance = dagster_instance()
        keys = [r.key for r in OutputStore(work / "store").ranges()]
        began = time.perf_counter()
        for i in range(0, len(keys), 1000):
            instance.add_dynamic_partitions(LSN_RANGES, keys[i : i + 1000])
        report["register_s"] = round(time.perf_counter() - began, 2)
        report["disk_before"] = du(work / "store")

        store = OutputStore(work / "store")
        result = prune(store, last, 10 * 86400)  # nothing old enough: the listing alone
        report["listing_only_s"] = result.seconds
        store = OutputStore(work / "store")
        began = time.perf_counter()
        for _ in range(1000):
            prune_if_due(store, last, 3600.0)
        report["not_due_ms"] = round((time.perf_counter() - began), 4)  # 1000 calls: s = ms each

        seconds, run, _ = harness.json_command(env, work, "prune", "--retention", "1h")
        report["command_s"] = round(seconds, 2)
        report["prune_s"] = run["seconds"]
        report["ranges_removed"] = run["ranges_removed"]
        report["partitions_dropped"] = run["partitions_dropped"]
        report["disk_after"] = du(work / "store")
        harness.emit_report(report, indent=1)
    finally:
        with psycopg.connect(args.dsn, autocommit=True) as conn:
            conn.execute(
                "SELECT pg_replication_origin_drop(roname) FROM pg_replication_origin "
                "WHERE roname = %s",
                (origin,),
            )
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                    sql.Identifier(storage_db)
                )
            )
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
