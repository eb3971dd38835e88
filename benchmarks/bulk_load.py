"""Where a bulk load's time goes on the target: copy variants and key-build settings.

Engine only, no pgcdc code on the data path: two clusters (``--profile``, logical WAL on both),
``pgbench -i`` at ``--scale`` on the source, then per variant a fresh target database with the
pre-data section, and a ``psql | psql`` pipe per table:

* ``plain``: ``COPY ... (FORMAT binary)`` into the created table;
* ``freeze``: ``TRUNCATE`` then ``COPY ... (FORMAT binary, FREEZE)`` in one transaction, as the
  base snapshot loads a table it created (:attr:`pgcdc_dagster.engine.snapshot.CopyTask.freeze`);
* ``text``: ``COPY ... (FORMAT text)``.

After each copy (and a ``CHECKPOINT``), the post-data section (the primary keys) is built three
times, dropped in between: with the target's settings, with ``maintenance_work_mem = 1GB``, and
with that and ``max_parallel_maintenance_workers = 2``, each given to the session through
``PGOPTIONS`` (no server setting changes). Each step reports wall seconds and the CPU seconds
of the source cluster, the target cluster and the client tools (``harness.Measured``), and
the copy the target WAL it wrote.

Usage: ``.venv/bin/python benchmarks/bulk_load.py [--scale 100] [--variants plain,freeze,text]
[--profile production|throwaway]``
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg

from pgcdc_dagster.engine.identifiers import TableName

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness
from harness import Measured

TABLES = harness.PGBENCH_TABLES
KEY_SETTINGS = {
    "target's own": "",
    "maintenance_work_mem 1GB": "-c maintenance_work_mem=1GB",
    "and 2 parallel workers": "-c maintenance_work_mem=1GB -c max_parallel_maintenance_workers=2",
}


def _pipe(source_dsn: str, target_dsn: str, table: TableName, variant: str) -> None:
    name = table.sql.as_string(None)
    copy_format = "text" if variant == "text" else "binary"
    reader = subprocess.Popen(
        [harness.tool("psql"), "-X", "-q", "-d", source_dsn, "-c",
         f"COPY {name} TO STDOUT (FORMAT {copy_format})"],
        stdout=subprocess.PIPE,
    )  # fmt: skip
    assert reader.stdout is not None
    freeze = variant == "freeze"
    steps = [
        "SET synchronous_commit = off",
        "BEGIN",
        *([f"TRUNCATE ONLY {name}"] if freeze else []),
        f"COPY {name} FROM STDIN (FORMAT {copy_format}{', FREEZE' if freeze else ''})",
        "COMMIT",
    ]
    writer = subprocess.Popen(
        [harness.tool("psql"), "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", target_dsn,
         *(arg for step in steps for arg in ("-c", step))],
        stdin=reader.stdout,
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    reader.stdout.close()
    if writer.wait() or reader.wait():
        raise RuntimeError(f"the pipe of {table} failed")


def _drop_keys(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for table in TABLES:
            conn.execute(
                f"ALTER TABLE {table.sql.as_string(None)} "
                f"DROP CONSTRAINT IF EXISTS {table.name}_pkey"
            )


def main() -> None:
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--scale", type=int, default=100)
    parser.add_argument("--variants", default="plain,freeze,text")
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    results: dict[str, Any] = {}
    with harness.bench_clusters(args.profile, logical_target=True) as (_, source, target):
        harness.fill_pgbench(source, args.scale)
        pre = harness.dump_schema(source.dsn(), TABLES, "--section=pre-data")
        post = harness.dump_schema(source.dsn(), TABLES, "--section=post-data")
        for i, variant in enumerate(variants):
            database = f"bench_bulk_{i}"
            dsn = harness.create_database(target, database)
            harness.psql(dsn, pre)
            harness.checkpoint(source, target, sync=True)
            with Measured(source, target) as copy:
                for table in TABLES:
                    _pipe(source.dsn(), dsn, table, variant)
            entry: dict[str, Any] = {
                "copy_seconds": round(copy.wall, 2),
                "copy_cpu_seconds": copy.cpu,
                "target_wal_mb": copy.target_wal_mb,
                "keys": {},
            }
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("CHECKPOINT")
            for label, options in KEY_SETTINGS.items():
                _drop_keys(dsn)
                os.environ["PGOPTIONS"] = options
                try:
                    with Measured(source, target) as keys:
                        harness.psql(dsn, post)
                finally:
                    os.environ.pop("PGOPTIONS")
                entry["keys"][label] = {
                    "seconds": round(keys.wall, 2),
                    "target_cpu_seconds": keys.cpu["target_pg"],
                }
            results[variant] = entry
            harness.drop_database(target, database)
    profile = harness.describe_profile(args.profile)
    harness.emit_report({"scale": args.scale, "cluster_profile": profile, "results": results})


if __name__ == "__main__":
    main()
