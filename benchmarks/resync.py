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
dirty buffers of the one before. A comparison is, for ``a`` and ``b``, the row count, a sum of
a hash of each row's text (every column) and the column names and types. The 1-minute load average
(``/proc/loadavg``) is recorded before and after each timed step.

``--server warm``: the measured commands run with the command server an earlier command left
up (started after the setup, outside the timings), as a user's later commands do.

The clusters, the commands, the native peer, the comparison and the table (Markdown, printed
after the JSON) are ``benchmarks/harness.py``'s.

Usage: ``SPARK_LOCAL_IP=127.0.0.1 .venv/bin/python benchmarks/resync.py [--rows 10000000]
[--repeat 1] [--server off|warm] [--json F] [--profile production|throwaway]``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from typing import Any

import psycopg

from pgcdc_dagster.demo.local_cluster import LocalCluster
from pgcdc_dagster.engine.lsn import Lsn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness

ADD_COLUMN = "ALTER TABLE b ADD COLUMN c text DEFAULT 'dflt'"
WIDEN = "ALTER TABLE b ALTER COLUMN bid TYPE bigint"
UPDATE = "UPDATE b SET abalance = abalance + 1 WHERE aid <= 100000"
TABLES = ("public.a", "public.b")


def load1() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def make_source(source: LocalCluster, rows: int) -> str:
    """A database with a small table ``a`` and ``b`` of ``rows`` rows, both published to
    ``native``."""
    return harness.source_database(
        source,
        "CREATE TABLE a (id int PRIMARY KEY, v text)",
        "INSERT INTO a SELECT g, md5(g::text) FROM generate_series(1, 1000) g",
        "CREATE TABLE b (aid int PRIMARY KEY, bid int, abalance int, filler char(84))",
        f"INSERT INTO b SELECT g, (g - 1) / 100000 + 1, 0, '' FROM generate_series(1, {rows:d}) g",
        "VACUUM ANALYZE b",
        tables=TABLES,
    )


def storage_of_b(dsn: str) -> tuple[int, int]:
    """``b``'s oid and relfilenode: a table created again changes the first, a rewrite the
    second."""
    with psycopg.connect(dsn) as conn:
        return conn.execute(  # type: ignore[return-value]
            "SELECT oid::bigint, relfilenode::bigint FROM pg_class WHERE oid = 'public.b'::regclass"
        ).fetchone()


def compared(source_dsn: str, ours_dsn: str, native_dsn: str) -> dict[str, Any]:
    expected = harness.fingerprints(source_dsn, TABLES, columns=True)
    ours = harness.equality(expected, ours_dsn, columns=True)
    native = harness.equality(expected, native_dsn, columns=True)
    result: dict[str, Any] = {"ours_equal": ours["equal"], "native_equal": native["equal"]}
    if not all(result.values()):
        result.update(
            source=expected,
            ours=harness.fingerprints(ours_dsn, TABLES, columns=True),
            native=harness.fingerprints(native_dsn, TABLES, columns=True),
        )
    return result


def prefixed(label: str, values: dict[str, Any]) -> dict[str, Any]:
    return {f"{label}_{k}": v for k, v in values.items()}


def native_resync(source_dsn: str, native: harness.Subscription) -> float:
    """``b`` copied again by the native subscription: out of the publication and the
    subscription, emptied, back in; until it is ``ready`` again."""
    with (
        psycopg.connect(source_dsn, autocommit=True) as src,
        psycopg.connect(native.target_dsn, autocommit=True) as tgt,
    ):
        started = time.perf_counter()
        src.execute("ALTER PUBLICATION native DROP TABLE b")
        native.alter("REFRESH PUBLICATION", tgt)
        tgt.execute("TRUNCATE b")
        src.execute("ALTER PUBLICATION native ADD TABLE b")
        native.alter("REFRESH PUBLICATION", tgt)
        native.wait_ready(conn=tgt)
        return time.perf_counter() - started


def native_follows(native: harness.Subscription, ddl: str, end: Lsn) -> float:
    """The disabled subscription's table altered by hand, the subscription enabled again;
    until its slot confirms ``end``. Not started before the launcher may start a worker: its
    wait for the one before is not native's work (a user's ``ENABLE`` rarely follows one)."""
    harness.wait_for_launcher(native.target_dsn)
    with psycopg.connect(native.target_dsn, autocommit=True) as tgt:
        started = time.perf_counter()
        tgt.execute(ddl)
        native.alter("ENABLE", tgt)
        native.wait_confirmed(end)
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
    native: harness.Subscription,
    label: str,
    ddl: str,
) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    native.alter("DISABLE")
    harness.execute(source_dsn, ddl, UPDATE)
    end = harness.wal_position(source_dsn)
    before = storage_of_b(env["PGCDC_TARGET_DSN"])
    harness.checkpoint(*clusters)
    ours, report, _ = timed(
        f"{label}_ours", lambda: harness.json_command(env, work, "catchup"), figures
    )
    after = storage_of_b(env["PGCDC_TARGET_DSN"])
    harness.checkpoint(*clusters)
    native_s = timed(f"{label}_native", lambda: native_follows(native, ddl, end), figures)
    how = (
        "table created again (resync)"
        if after[0] != before[0]
        else "altered, rewritten"
        if after[1] != before[1]
        else "altered in place"
    )
    return {
        f"{label}_ours_s": round(ours, 3),
        f"{label}_native_s": round(native_s, 3),
        f"{label}_ours_ranges": report.get("ranges_run"),
        f"{label}_ours_target_b": how,
        **figures,
        **prefixed(label, compared(source_dsn, env["PGCDC_TARGET_DSN"], native.target_dsn)),
    }


def one_run(args: argparse.Namespace, run: int) -> dict[str, Any]:
    with (
        harness.bench_clusters(args.profile, extra=harness.QUIET) as (work, source, target),
        contextlib.ExitStack() as stack,
    ):
        source_dsn = make_source(source, args.rows)
        env = harness.pgcdc_env(work, source_dsn, target, f"ours_{run}", publication=f"ours_{run}")
        snapshot = harness.timed_command(env, work, "snapshot")
        native, sync = harness.native_peer(source_dsn, target, f"native_{run}", "native")
        if args.server == "warm":
            env = {**env, "PGCDC_SERVER": "auto"}
            stack.enter_context(harness.warm_command_server(env))
        figures: dict[str, Any] = {
            "setup_ours_snapshot_s": round(snapshot, 3),
            "setup_native_sync_s": round(sync, 3),
        }
        clusters = (source, target)

        # 1. resync of b
        harness.checkpoint(*clusters)
        ours, report, _ = timed(
            "resync_ours", lambda: harness.json_command(env, work, "resync", "public.b"), figures
        )
        harness.checkpoint(*clusters)
        native_s = timed("resync_native", lambda: native_resync(source_dsn, native), figures)
        harness.execute(
            source_dsn,
            "UPDATE b SET abalance = abalance + 1 WHERE aid % 1000 = 0",
            "DELETE FROM b WHERE aid % 1000 = 1",
            f"INSERT INTO b SELECT g, 0, g, 'new' FROM generate_series({args.rows + 1:d}, "
            f"{args.rows + 100:d}) g",
        )
        harness.timed_command(env, work, "catchup")
        native.wait_confirmed()
        result: dict[str, Any] = {
            "resync_ours_s": round(ours, 3),
            "resync_native_s": round(native_s, 3),
            "resync_ours_rows": report.get("rows"),
            "resync_ours_held_back_changes": report.get("held_back_changes"),
            **prefixed("resync", compared(source_dsn, env["PGCDC_TARGET_DSN"], native.target_dsn)),
        }

        # 2. DDL followed during a catch-up
        for label, ddl in (("add_column", ADD_COLUMN), ("widen", WIDEN)):
            result.update(ddl_followed(env, work, clusters, source_dsn, native, label, ddl))
        return {**result, **figures}


STEPS = (("resync", "pgcdc resync public.b"), ("add_column", ADD_COLUMN), ("widen", WIDEN))


def table(runs: list[dict[str, Any]]) -> str:
    """Per step, in Markdown: the medians of both sides, the load around them, equality."""
    rows = []
    for label, what in STEPS:
        loads = [
            r[f"{label}_{side}_load_{when}"]
            for r in runs
            for side in ("ours", "native")
            for when in ("before", "after")
        ]
        equal = "/".join(
            str(all(r[f"{label}_{side}_equal"] for r in runs)) for side in ("ours", "native")
        )
        rows.append(
            [
                f"`{what}`",
                f"{harness.median_at(runs, f'{label}_ours_s'):.2f}",
                f"{harness.median_at(runs, f'{label}_native_s'):.2f}",
                f"{min(loads):.2f}-{max(loads):.2f}",
                equal,
            ]
        )
    header = ["step", "ours s", "native s", "load 1m", "equal (ours/native)"]
    return harness.markdown_table(header, rows)


def main() -> None:
    parser = harness.argument_parser(__doc__, repeat=1, json=True, server="")
    parser.add_argument("--rows", type=int, default=10_000_000)
    args = parser.parse_args()
    runs = harness.run_repeats(lambda i: one_run(args, i), args.repeat)
    medians = {
        f"{label}_median_{side}_s": f"{label}_{side}_s"
        for label, _ in STEPS
        for side in ("ours", "native")
    }
    report = harness.summary(args, runs, medians, rows=args.rows, command_server=args.server)
    harness.emit_report(report, args.json)
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
