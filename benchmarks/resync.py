"""A replicated table copied again, and source DDL followed, through the commands, against native.

Per repeat, on fresh clusters: a source database with a small table ``a`` and a table ``b`` of
``--rows`` rows (pgbench_accounts' shape: an ``int`` key ``aid``, two ``int`` columns and an
84-character filler), both replicated by ``pgcdc snapshot`` and by a native subscription
(``CREATE SUBSCRIPTION``, synced), neither timed. Then, each side measured in the same run:

1. **Resync of ``b``.** Ours: ``pgcdc resync public.b`` from a fresh process, from its start to
   its exit (``b`` dropped on the target and copied again as of a temporary slot's consistent
   point, its changes held back meanwhile). Native, the way to copy one table of a subscription
   again: ``ALTER PUBLICATION ... DROP TABLE b``, ``ALTER SUBSCRIPTION ... REFRESH
   PUBLICATION``, ``TRUNCATE b`` on the subscriber, ``ALTER PUBLICATION ... ADD TABLE b``,
   ``REFRESH PUBLICATION``, timed until ``b`` is ``ready``. Then a few changes to ``b``,
   ``pgcdc catchup`` (untimed) and native caught up, and both targets compared with the source.
2. **DDL followed during a catch-up.** With the native subscription disabled, on the source an
   ``ALTER TABLE b ...`` then ``UPDATE b SET abalance = abalance + 1 WHERE aid <= 100000``
   (both untimed). Ours: ``pgcdc catchup`` from a fresh process, which follows the DDL by
   itself. Native, which needs the DDL by hand: the same ``ALTER TABLE`` on the subscriber,
   ``ALTER SUBSCRIPTION ... ENABLE``, timed until its slot confirms the source's position as of
   before. (Disabled meanwhile, native is not in the retry loop of an apply worker that meets
   a column it lacks; and its timing starts no sooner than the launcher may start a worker
   again, at most one a ``wal_retrieve_retry_interval``, 5 s.) Ours' way is read from ``b`` on
   its target: altered in place, rewritten, or created again (a resync). Done for ``ADD COLUMN
   c text DEFAULT 'dflt'`` and then for ``ALTER COLUMN bid TYPE bigint`` (a widening: both
   sides rewrite ``b``); both targets compared with the source after each, every column
   included.

A ``CHECKPOINT`` on both clusters precedes every timed step, so neither side pays for the
dirty buffers of the one before. A comparison is the row count, a sum of a hash of each row's
text (every column) and the column names and types. The 1-minute load average
(``/proc/loadavg``) is recorded before and after each timed step.

``--server warm``: the measured commands run with the command server an earlier command left
up (started after the setup, outside the timings), as a user's later commands do.

Usage: ``SPARK_LOCAL_IP=127.0.0.1 .venv/bin/python benchmarks/resync.py [--rows 10000000]
[--repeat 1] [--server off|warm] [--json F]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import add_table
import psycopg
from add_table import caught_up, wal_position
from apply import bench_clusters, warm_command_server
from many_tables import PGCDC, emit_report, native_schema, pgcdc_env, timed_command, wait_ready
from psycopg import sql

from pgcdc_dagster.demo.local_cluster import LocalCluster

ADD_COLUMN = "ALTER TABLE b ADD COLUMN c text DEFAULT 'dflt'"
WIDEN = "ALTER TABLE b ALTER COLUMN bid TYPE bigint"
UPDATE = "UPDATE b SET abalance = abalance + 1 WHERE aid <= 100000"

launched: dict[int, float] = {}
"""Per run, when its native apply worker was last asked for (``CREATE``/``ENABLE``): the
launcher starts workers at most once a ``wal_retrieve_retry_interval`` (5 s)."""


def load1() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def make_source(source: LocalCluster, rows: int) -> str:
    """``add_table.make_source``'s database (``a``, published to ``native``), with ``b`` of
    ``rows`` rows published too: replicated from the start here."""
    dsn = add_table.make_source(source)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE b (aid int PRIMARY KEY, bid int, abalance int, filler char(84))")
        conn.execute(
            "INSERT INTO b SELECT g, (g - 1) / 100000 + 1, 0, '' "
            "FROM generate_series(1, %s::int) g",
            (rows,),
        )
        conn.execute("VACUUM ANALYZE b")
        conn.execute("ALTER PUBLICATION native ADD TABLE b")
    return dsn


def native_subscription(source_dsn: str, target: LocalCluster, run: int) -> tuple[str, float]:
    """A native subscription to ``native``, its initial sync done: the subscriber's DSN and
    the sync's seconds (``b``'s schema created first, as native replication needs)."""
    name = f"native_{run}"
    with psycopg.connect(target.dsn(), autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    dsn = target.dsn(name)
    native_schema(source_dsn, dsn, "a", "b")
    with psycopg.connect(dsn, autocommit=True) as conn:
        started = time.perf_counter()
        conn.execute(
            sql.SQL("CREATE SUBSCRIPTION {} CONNECTION {} PUBLICATION native").format(
                sql.Identifier(name), sql.Literal(source_dsn)
            )
        )
        launched[run] = time.monotonic()
        wait_ready(conn, name)
        return dsn, time.perf_counter() - started


def checkpoint(*clusters: LocalCluster) -> None:
    for cluster in clusters:
        with psycopg.connect(cluster.dsn(), autocommit=True) as conn:
            conn.execute("CHECKPOINT")


def fingerprint(dsn: str) -> dict[str, Any]:
    """``b``'s row count, a sum of its rows' text hashes, its columns; ``a``'s row count."""
    with psycopg.connect(dsn) as conn:
        count, total = conn.execute(  # type: ignore[misc]
            "SELECT count(*), coalesce(sum(hashtext(b::text)), 0) FROM b"
        ).fetchone()
        columns = conn.execute(
            "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute "
            "WHERE attrelid = 'public.b'::regclass AND attnum > 0 AND NOT attisdropped "
            "ORDER BY attnum"
        ).fetchall()
        (a_count,) = conn.execute("SELECT count(*) FROM a").fetchone()  # type: ignore[misc]
    return {"rows": count, "hash": int(total), "columns": columns, "a_rows": a_count}


def storage_of_b(dsn: str) -> tuple[int, int]:
    """``b``'s oid and relfilenode: a table created again changes the first, a rewrite the
    second."""
    with psycopg.connect(dsn) as conn:
        return conn.execute(  # type: ignore[return-value]
            "SELECT oid::bigint, relfilenode::bigint FROM pg_class WHERE oid = 'public.b'::regclass"
        ).fetchone()


def compared(source_dsn: str, ours_dsn: str, native_dsn: str) -> dict[str, Any]:
    expected = fingerprint(source_dsn)
    ours, native = fingerprint(ours_dsn), fingerprint(native_dsn)
    result: dict[str, Any] = {"ours_equal": ours == expected, "native_equal": native == expected}
    if not all(result.values()):
        result.update(source=expected, ours=ours, native=native)
    return result


def prefixed(label: str, values: dict[str, Any]) -> dict[str, Any]:
    return {f"{label}_{k}": v for k, v in values.items()}


def command(env: dict[str, str], work: Path, *args: str) -> tuple[float, dict[str, Any], str]:
    """``pgcdc ARGS --json`` from a fresh process: its seconds, its report, its stderr."""
    started = time.perf_counter()
    done = subprocess.run(
        [PGCDC, *args, "--json"], env=env, capture_output=True, text=True, cwd=work
    )
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"pgcdc {' '.join(args)} failed: {done.stderr[-3000:]}")
    return seconds, json.loads(done.stdout), done.stderr


def subscription(conn: psycopg.Connection[Any], run: int, action: str) -> None:
    conn.execute(
        sql.SQL("ALTER SUBSCRIPTION {} {}").format(sql.Identifier(f"native_{run}"), sql.SQL(action))
    )


def native_resync(source_dsn: str, native_dsn: str, run: int) -> float:
    """``b`` copied again by the native subscription: out of the publication and the
    subscription, emptied, back in; until it is ``ready`` again."""
    with (
        psycopg.connect(source_dsn, autocommit=True) as src,
        psycopg.connect(native_dsn, autocommit=True) as tgt,
    ):
        started = time.perf_counter()
        src.execute("ALTER PUBLICATION native DROP TABLE b")
        subscription(tgt, run, "REFRESH PUBLICATION")
        tgt.execute("TRUNCATE b")
        src.execute("ALTER PUBLICATION native ADD TABLE b")
        subscription(tgt, run, "REFRESH PUBLICATION")
        wait_ready(tgt, f"native_{run}")
        return time.perf_counter() - started


def native_follows(source_dsn: str, native_dsn: str, run: int, ddl: str, end: str) -> float:
    """The disabled subscription's table altered by hand, the subscription enabled again;
    until its slot confirms ``end``. Not started before the launcher may start a worker: its
    wait for the one before is not native's work (a user's ``ENABLE`` rarely follows one)."""
    with psycopg.connect(native_dsn, autocommit=True) as tgt:
        (interval,) = tgt.execute(  # type: ignore[misc]
            "SELECT setting::float / 1000 FROM pg_settings "
            "WHERE name = 'wal_retrieve_retry_interval'"
        ).fetchone()
        time.sleep(max(0.0, launched[run] + interval + 0.2 - time.monotonic()))
        started = time.perf_counter()
        tgt.execute(ddl)
        subscription(tgt, run, "ENABLE")
        launched[run] = time.monotonic()
        caught_up(source_dsn, f"native_{run}", end=end)
        return time.perf_counter() - started


def timed(name: str, step: Any, figures: dict[str, Any]) -> Any:
    """``step()`` with the 1-minute load average before and after it noted in ``figures``."""
    figures[f"{name}_load_before"] = load1()
    value = step()
    figures[f"{name}_load_after"] = load1()
    return value


def ddl_followed(
    env: dict[str, str],
    work: Path,
    clusters: tuple[LocalCluster, LocalCluster],
    source_dsn: str,
    native_dsn: str,
    run: int,
    label: str,
    ddl: str,
) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    with psycopg.connect(native_dsn, autocommit=True) as tgt:
        subscription(tgt, run, "DISABLE")
    with psycopg.connect(source_dsn, autocommit=True) as src:
        src.execute(ddl)
        src.execute(UPDATE)
    end = wal_position(source_dsn)
    before = storage_of_b(env["PGCDC_TARGET_DSN"])
    checkpoint(*clusters)
    ours, report, _ = timed(f"{label}_ours", lambda: command(env, work, "catchup"), figures)
    after = storage_of_b(env["PGCDC_TARGET_DSN"])
    checkpoint(*clusters)
    native = timed(
        f"{label}_native",
        lambda: native_follows(source_dsn, native_dsn, run, ddl, end),
        figures,
    )
    how = (
        "table created again (resync)"
        if after[0] != before[0]
        else "altered, rewritten"
        if after[1] != before[1]
        else "altered in place"
    )
    return {
        f"{label}_ours_s": round(ours, 3),
        f"{label}_native_s": round(native, 3),
        f"{label}_ours_ranges": report.get("ranges_run"),
        f"{label}_ours_target_b": how,
        **figures,
        **prefixed(label, compared(source_dsn, env["PGCDC_TARGET_DSN"], native_dsn)),
    }


def one_run(args: argparse.Namespace, run: int) -> dict[str, Any]:
    with bench_clusters() as (work, source, target), contextlib.ExitStack() as stack:
        source_dsn = make_source(source, args.rows)
        env = pgcdc_env(work, source_dsn, target, run)
        snapshot = timed_command(env, work, "snapshot")
        native_dsn, sync = native_subscription(source_dsn, target, run)
        if args.server == "warm":
            env = {**env, "PGCDC_SERVER": "auto"}
            stack.enter_context(warm_command_server(env))
        figures: dict[str, Any] = {
            "setup_ours_snapshot_s": round(snapshot, 3),
            "setup_native_sync_s": round(sync, 3),
        }
        clusters = (source, target)

        # 1. resync of b
        checkpoint(*clusters)
        ours, report, _ = timed(
            "resync_ours", lambda: command(env, work, "resync", "public.b"), figures
        )
        checkpoint(*clusters)
        native = timed("resync_native", lambda: native_resync(source_dsn, native_dsn, run), figures)
        with psycopg.connect(source_dsn, autocommit=True) as conn:
            conn.execute("UPDATE b SET abalance = abalance + 1 WHERE aid % 1000 = 0")
            conn.execute("DELETE FROM b WHERE aid % 1000 = 1")
            conn.execute(
                "INSERT INTO b SELECT g, 0, g, 'new' FROM generate_series(%s::int, %s::int) g",
                (args.rows + 1, args.rows + 100),
            )
        timed_command(env, work, "catchup")
        caught_up(source_dsn, f"native_{run}")
        result: dict[str, Any] = {
            "resync_ours_s": round(ours, 3),
            "resync_native_s": round(native, 3),
            "resync_ours_rows": report.get("rows"),
            "resync_ours_held_back_changes": report.get("held_back_changes"),
            **prefixed("resync", compared(source_dsn, env["PGCDC_TARGET_DSN"], native_dsn)),
        }

        # 2. DDL followed during a catch-up
        for label, ddl in (("add_column", ADD_COLUMN), ("widen", WIDEN)):
            result.update(
                ddl_followed(env, work, clusters, source_dsn, native_dsn, run, label, ddl)
            )
        return {**result, **figures}


STEPS = (("resync", "pgcdc resync public.b"), ("add_column", ADD_COLUMN), ("widen", WIDEN))


def table(runs: list[dict[str, Any]]) -> str:
    lines = [
        f"{'step':<48} {'ours s':>8} {'native s':>9} {'load 1m':>12}  equal (ours/native)",
    ]
    for label, what in STEPS:
        ours = statistics.median(r[f"{label}_ours_s"] for r in runs)
        native = statistics.median(r[f"{label}_native_s"] for r in runs)
        loads = [
            r[f"{label}_{side}_load_{when}"]
            for r in runs
            for side in ("ours", "native")
            for when in ("before", "after")
        ]
        equal = "/".join(
            str(all(r[f"{label}_{side}_equal"] for r in runs)) for side in ("ours", "native")
        )
        lines.append(
            f"{what:<48} {ours:>8.2f} {native:>9.2f} {min(loads):>5.2f}-{max(loads):<5.2f}  {equal}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument(
        "--server",
        choices=("off", "warm"),
        default="off",
        help="warm: the measured commands run in the command server an earlier one left up",
    )
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    runs = [one_run(args, i) for i in range(args.repeat)]
    report: dict[str, Any] = {"rows": args.rows, "command_server": args.server, "runs": runs}
    for label, _ in STEPS:
        report[f"{label}_median_ours_s"] = statistics.median(r[f"{label}_ours_s"] for r in runs)
        report[f"{label}_median_native_s"] = statistics.median(r[f"{label}_native_s"] for r in runs)
    emit_report(report, args.json)
    print(table(runs))
    failed = [
        f"{label} {side}"
        for r in runs
        for label, _ in STEPS
        for side in ("ours", "native")
        if not r[f"{label}_{side}_equal"]
    ]
    assert not failed, f"targets differ from the source: {failed}"


if __name__ == "__main__":
    main()
