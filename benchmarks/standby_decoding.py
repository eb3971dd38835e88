"""Decoding on a hot standby against decoding on the primary: what the catch-up of one backlog
costs the primary, through the commands, beside native logical replication fed both ways.

The feature: ``PGCDC_SOURCE_DSN`` may name a hot standby (PostgreSQL 16+); pgcdc then creates
its slot, takes its snapshot and decodes there, and only the publication is made on the
primary (:mod:`pgcdc_dagster.engine.source.standby`, ``docs/operations/failover.md``). Its
point is sparing the primary the decoding, so the figure that matters is the primary's CPU
while a backlog is caught up, next to the catch-up's wall time.

Set-up, fresh for every run: a PostgreSQL 18 primary and its physical standby
(:func:`pgcdc_dagster_tests.support.standby.primary_with_standby`, no slot synchronisation:
``hot_standby_feedback`` and a physical slot, as a standby that decodes needs), restarted with
the settings of ``--profile`` (:func:`harness.apply_profile`; ``production`` by default:
``fsync`` and ``full_page_writes`` on), and a target (:func:`harness.bench_target`). pgbench at
``--scale`` on the primary, a publication ``native_pub`` of its four tables for native.

Four sides, each with a slot and a target database of its own:

* ``pgcdc_primary``, ``pgcdc_standby``: ``pgcdc snapshot`` with ``PGCDC_SOURCE_DSN`` at the
  primary, then at the standby (each its own slot ``bench_<mode>``, publication, store,
  target database and Dagster storage);
* ``native_primary``, ``native_standby``: a logical slot made by
  ``pg_create_logical_replication_slot`` on the primary, and one on the standby (its creation
  waits for a running-transactions record, which the primary is asked for meanwhile with
  ``pg_log_standby_snapshot()``: :func:`~pgcdc_dagster.engine.source.standby.running_xacts_logged`);
  their target databases cloned from ``bench_primary`` (nothing writes between the
  snapshots and the slots, so every side starts from the same rows).

Then the backlog: pgbench TPC-B on the primary, 4 clients of ``--transactions`` each (4 row
changes a transaction: 62,500 a client is 1M changes), a ``CHECKPOINT``; its end is the
primary's flushed WAL, and the standby is waited for until it has replayed it. The source's
content (row count and hash per table, :func:`harness.fingerprints`) is read once.

The four catch-ups of that backlog, in an order reversed on every other run, each after a
``CHECKPOINT`` on the three servers, each inside a :class:`harness.CpuMeter` whose trees are
the primary's postmaster, the standby's, the target's and this process (``client``, which
holds the ``pgcdc`` command it starts and reaps):

* pgcdc: ``pgcdc catchup --endpos END --json`` from a fresh process (``PGCDC_SERVER=off``,
  Dagster on PostgreSQL storage), timed from its start to its exit;
* native: a disabled subscription over the side's slot (``create_slot = false``, ``copy_data
  = false``; to the standby's publication for ``native_standby``), ``ENABLE`` timed until the
  slot confirms END (:func:`harness.wait_slot` on the server holding the slot); the launcher's
  pause kept out (:func:`harness.wait_for_launcher`).

After each, its target must equal the source (:func:`harness.require_equal`). The snapshots are
metered the same way and reported too (seconds and CPU per server), untimed against native.

Reported: every run, the medians per side, the JSON (:func:`harness.emit_report`) and a
Markdown table. A side that fails is reported with its error and the others go on.

Usage: ``.venv/bin/python benchmarks/standby_decoding.py [--scale 100] [--runs 3]
[--transactions 62500] [--profile production|throwaway] [--json out.json]``
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the tests' standby helper

import psycopg  # noqa: E402

from pgcdc_dagster.demo.local_cluster import LocalCluster, cluster_major  # noqa: E402
from pgcdc_dagster.engine.lsn import Lsn  # noqa: E402
from pgcdc_dagster.engine.source.standby import running_xacts_logged  # noqa: E402
from pgcdc_dagster_tests.support.standby import Pair, primary_with_standby  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))
import harness  # noqa: E402

MAJOR = 18
TABLES = harness.PGBENCH_TABLES
MODES = ("primary", "standby")
"""Where ``PGCDC_SOURCE_DSN`` (or the native subscription's connection) points."""
SIDES = tuple(f"{tool}_{mode}" for tool in ("pgcdc", "native") for mode in MODES)
SERVERS = ("primary", "standby", "target", "client")
"""The :class:`harness.CpuMeter` roots: three postmasters and this process."""
CHANGES_PER_TRANSACTION = 4
"""pgbench's TPC-B: three updates and one insert."""


@dataclass
class Run:
    """One run's clusters and what the set-up made for each side."""

    pair: Pair
    target: LocalCluster
    work: Path
    args: argparse.Namespace
    envs: dict[str, dict[str, str]]
    """Per mode, the environment of its ``pgcdc`` commands."""
    end: Lsn = Lsn(0)  # noqa: RUF009 - an immutable value
    expected: dict[str, list[Any]] | None = None
    """The source's fingerprints once the backlog is written."""

    def server(self, mode: str) -> LocalCluster:
        return self.pair.primary if mode == "primary" else self.pair.standby

    def meter(self) -> harness.CpuMeter:
        roots = {
            "primary": harness.postmaster_pid(self.pair.primary),
            "standby": harness.postmaster_pid(self.pair.standby),
            "target": harness.postmaster_pid(self.target),
            "client": os.getpid(),
        }
        return harness.CpuMeter(roots)

    def checkpoint(self) -> None:
        """``CHECKPOINT`` on the three servers (a restartpoint on the standby), the kernel's
        writeback flushed, then the standby caught up with the primary's checkpoint record."""
        harness.checkpoint(self.pair.primary, self.pair.standby, self.target, sync=True)
        self.pair.wait_replayed(timeout=120)


def cpu_figures(meter: harness.CpuMeter) -> dict[str, Any]:
    """CPU seconds per tree, the rest of the machine, the load average at the start."""
    return {
        **{name: meter.seconds.get(name) for name in SERVERS},
        "others": meter.seconds.get("others"),
        "load_at_start": meter.load_at_start[0],
    }


# ─── set-up ──────────────────────────────────────────────────────────────────────────────────


def pgcdc_snapshot(run: Run, mode: str) -> dict[str, Any]:
    """``pgcdc snapshot`` of ``mode``'s side, metered: its seconds, CPU and warnings."""
    meter = run.meter()
    with meter:
        seconds, done = harness.run_command(run.envs[mode], run.work, "snapshot")
    warnings = [line for line in done.stderr.splitlines() if "warning" in line.lower()]
    return {"seconds": round(seconds, 2), "cpu_s": cpu_figures(meter), "warnings": warnings}


def ours(mode: str) -> str:
    """The slot, target database and Dagster storage (``dagster_<it>``) of pgcdc's side of
    ``mode`` (not ``pgcdc_standby``: the standby's physical slot on the primary has that name)."""
    return f"bench_{mode}"


def slot_exists(server: LocalCluster, slot: str) -> bool:
    """Whether ``server`` holds a logical slot ``slot``."""
    with psycopg.connect(server.dsn(), autocommit=True) as conn:
        row = conn.execute(
            "SELECT 1 FROM pg_replication_slots WHERE slot_name = %s AND slot_type = 'logical'",
            (slot,),
        )
        return row.fetchone() is not None


def native_slot(run: Run, mode: str) -> str:
    """Native's slot on ``mode``'s server, made by hand (on the standby, with the primary
    asked for running-transactions records meanwhile, else the creation waits for the
    primary's own); its consistent point."""
    server = run.server(mode)
    with (
        running_xacts_logged(server.dsn()),
        psycopg.connect(server.dsn(), autocommit=True) as conn,
    ):
        (lsn,) = conn.execute(  # type: ignore[misc]
            "SELECT lsn::text FROM pg_create_logical_replication_slot(%s, 'pgoutput')",
            (f"native_{mode}",),
        ).fetchone()
    return str(lsn)


def write_backlog(run: Run) -> dict[str, Any]:
    """pgbench TPC-B on the primary (4 clients of ``--transactions``), a ``CHECKPOINT``; the
    end of the backlog (the primary's flushed WAL), the standby waited for until it replayed
    it, the source's fingerprints read."""
    primary = run.pair.primary
    start = harness.wal_position(primary.dsn(), of="flush")
    began = time.perf_counter()
    clients = harness.CLIENTS
    workload = harness.pgbench(
        primary, "-n", "-c", str(clients), "-j", "2", "-t", str(run.args.transactions)
    )
    assert workload is not None
    _, stderr = workload.communicate()
    if workload.returncode != 0:
        raise RuntimeError(f"pgbench failed: {stderr.decode(errors='replace')[-2000:]}")
    pgbench_s = time.perf_counter() - began
    harness.checkpoint(primary)
    run.end = harness.wal_position(primary.dsn(), of="flush")
    began = time.perf_counter()
    run.pair.wait_replayed(timeout=1800)
    replay_wait_s = time.perf_counter() - began
    run.expected = harness.fingerprints(primary.dsn(), TABLES)
    transactions = clients * run.args.transactions
    return {
        "transactions": transactions,
        "changes": CHANGES_PER_TRANSACTION * transactions,
        "wal_mb": round((run.end - start) / harness.MB, 1),
        "end": str(run.end),
        "pgbench_s": round(pgbench_s, 2),
        "replay_wait_s": round(replay_wait_s, 2),
    }


def prepare(run: Run) -> dict[str, Any]:
    """pgbench and native's publication on the primary; both pgcdc snapshots; both native
    slots; native's target databases cloned from ``pgcdc_primary``'s; then the backlog."""
    primary = run.pair.primary
    harness.fill_pgbench(primary, run.args.scale)
    harness.create_publication(primary.dsn(), harness.NATIVE_PUBLICATION, TABLES)
    run.pair.wait_replayed(timeout=600)
    for mode in MODES:
        run.envs[mode] = harness.pgcdc_env(
            run.work,
            run.server(mode).dsn(),
            run.target,
            ours(mode),
            publication=f"{ours(mode)}_pub",
            tables=TABLES,
        )
    report: dict[str, Any] = {"snapshot": {}}
    for mode in MODES:
        report["snapshot"][f"pgcdc_{mode}"] = pgcdc_snapshot(run, mode)
        slot = ours(mode)
        on = [where for where in MODES if slot_exists(run.server(where), slot)]
        if on != [mode]:
            raise RuntimeError(f"pgcdc snapshot of {mode}: slot {slot} on {on}, not the {mode}")
    report["native_slots"] = {mode: native_slot(run, mode) for mode in MODES}
    template = ours("primary")
    harness.execute(run.target.dsn(template), "VACUUM ANALYZE")
    harness.execute(run.target.dsn(ours("standby")), "VACUUM ANALYZE")
    for mode in MODES:
        harness.clone_database(run.target, template, f"native_{mode}")
    report["backlog"] = write_backlog(run)
    return report


# ─── the catch-ups ───────────────────────────────────────────────────────────────────────────


def pgcdc_catch_up(run: Run, mode: str) -> dict[str, Any]:
    """``pgcdc catchup --endpos END --json`` from a fresh process, metered; the target then
    compared with the source."""
    env = run.envs[mode]
    run.checkpoint()
    meter = run.meter()
    with meter:
        seconds, done = harness.run_command(
            env, run.work, "catchup", "--endpos", str(run.end), "--json"
        )
    said = json.loads(done.stdout)
    assert run.expected is not None
    equal = harness.require_equal(run.expected, env["PGCDC_TARGET_DSN"], f"pgcdc_{mode}")
    return {
        "seconds": round(seconds, 3),
        "cpu_s": cpu_figures(meter),
        "ranges": said.get("ranges_run"),
        "equal": equal["equal"],
    }


def native_catch_up(run: Run, mode: str) -> dict[str, Any]:
    """A disabled subscription over ``native_<mode>`` (on ``mode``'s server), ``ENABLE`` timed
    until the slot confirms END, metered; the target compared with the source, the subscription
    and the slot dropped."""
    server, slot = run.server(mode), f"native_{mode}"
    target_dsn = run.target.dsn(slot)
    subscription = harness.Subscription(
        server.dsn(), target_dsn, slot, harness.NATIVE_PUBLICATION, slot=slot
    )
    subscription.create(copy_data=False, enabled=False, existing_slot=True)
    harness.wait_for_launcher(target_dsn)
    run.checkpoint()
    meter = run.meter()
    with (
        psycopg.connect(target_dsn, autocommit=True) as tgt,
        psycopg.connect(server.dsn(), autocommit=True) as src,
        meter,
    ):
        started = time.perf_counter()
        subscription.alter("ENABLE", tgt)
        harness.wait_slot(server.dsn(), slot, run.end, timeout=run.args.timeout, conn=src)
        seconds = time.perf_counter() - started
    subscription.drop(keep_slot=True)
    harness.drop_slot(server.dsn(), slot)
    assert run.expected is not None
    equal = harness.require_equal(run.expected, target_dsn, slot)
    return {"seconds": round(seconds, 3), "cpu_s": cpu_figures(meter), "equal": equal["equal"]}


CATCH_UPS: dict[str, Callable[[Run], dict[str, Any]]] = {
    "pgcdc_primary": lambda run: pgcdc_catch_up(run, "primary"),
    "pgcdc_standby": lambda run: pgcdc_catch_up(run, "standby"),
    "native_primary": lambda run: native_catch_up(run, "primary"),
    "native_standby": lambda run: native_catch_up(run, "standby"),
}


def attempt(step: Callable[[], dict[str, Any]], what: str) -> dict[str, Any]:
    """``step()``, or its error (the last line, and the traceback on stderr): one side that
    fails does not hide the others' figures."""
    try:
        return step()
    except Exception as exc:  # reported; the run goes on
        traceback.print_exc(file=sys.stderr)
        last = str(exc).strip().splitlines()[-1] if str(exc).strip() else repr(exc)
        print(f"{what} failed: {last}", file=sys.stderr, flush=True)
        return {"error": str(exc)[-3000:]}


def one_run(index: int, args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {"run": index + 1, "started": datetime.now(UTC).strftime("%H:%M:%S")}
    with (
        primary_with_standby(major=MAJOR, sync_slots=False, synchronized=False) as pair,
        harness.bench_target(args.profile, prefix="pgcdc-bench-standby-") as (work, target),
    ):
        harness.apply_profile(pair, args.profile)
        run = Run(pair, target, work, args, envs={})
        report["target_major"] = cluster_major(target.major)
        report.update(prepare(run))
        order = harness.order_of(SIDES, index)
        report["order"] = order
        report["catch_up"] = {}
        for side in order:
            print(f"  {side}", file=sys.stderr, flush=True)
            report["catch_up"][side] = attempt(functools.partial(CATCH_UPS[side], run), side)
    report["ended"] = datetime.now(UTC).strftime("%H:%M:%S")
    return report


# ─── the report ──────────────────────────────────────────────────────────────────────────────

FIGURES = {
    "catch_up_s": ("seconds",),
    "primary_cpu_s": ("cpu_s", "primary"),
    "standby_cpu_s": ("cpu_s", "standby"),
    "target_cpu_s": ("cpu_s", "target"),
    "client_cpu_s": ("cpu_s", "client"),
}
"""What the table and the medians show of each side's catch-up (its key path in a run)."""


def side_medians(runs: list[dict[str, Any]], group: str, sides: tuple[str, ...]) -> dict[str, Any]:
    """Per side of ``runs[*][group]``, the median of each figure of :data:`FIGURES` over the
    runs where that side did not fail."""
    out: dict[str, Any] = {}
    for side in sides:
        done = [r[group][side] for r in runs if "error" not in r[group].get(side, {"error": 1})]
        out[side] = {name: harness.median_at(done, *path) for name, path in FIGURES.items()}
        out[side]["runs"] = len(done)
    return out


def table(runs: list[dict[str, Any]], medians: dict[str, Any]) -> str:
    head = ["side", "run", "catch-up s", "primary CPU-s", "standby CPU-s", "target CPU-s",
            "client CPU-s", "equal"]  # fmt: skip
    rows: list[list[Any]] = []
    for side in SIDES:
        for r in runs:
            found = r.get("catch_up", {}).get(side, {"error": "not run"})
            if "error" in found:
                rows.append([side, r["run"], "failed", "", "", "", "", ""])
                continue
            figures = [harness.value_at(found, *path) for path in FIGURES.values()]
            rows.append([side, r["run"], *figures, "yes" if found["equal"] else "no"])
        m = medians[side]
        rows.append([f"**{side}**", "median", *(m[name] for name in FIGURES), ""])
    return harness.markdown_table(head, rows)


def snapshot_table(runs: list[dict[str, Any]]) -> str:
    head = ["`pgcdc snapshot`", "run", "s", "primary CPU-s", "standby CPU-s", "target CPU-s",
            "client CPU-s"]  # fmt: skip
    rows = []
    for mode in MODES:
        for r in runs:
            found = r.get("snapshot", {}).get(f"pgcdc_{mode}")
            if found is not None:
                cpu = found["cpu_s"]
                rows.append([mode, r["run"], found["seconds"], cpu["primary"], cpu["standby"],
                             cpu["target"], cpu["client"]])  # fmt: skip
    return harness.markdown_table(head, rows)


def main() -> None:
    parser = harness.argument_parser(__doc__, profile=harness.PRODUCTION, json=True)
    parser.add_argument("--scale", type=int, default=100)
    parser.add_argument("--runs", type=int, default=3, help="runs on fresh clusters")
    parser.add_argument(
        "--transactions",
        type=int,
        default=62_500,
        help=f"pgbench TPC-B transactions per client ({harness.CLIENTS} clients, "
        f"{CHANGES_PER_TRANSACTION} row changes each)",
    )
    parser.add_argument(
        "--timeout", type=float, default=1800, help="seconds a native catch-up may take"
    )
    args = parser.parse_args()

    def run(index: int) -> dict[str, Any]:
        try:
            report = one_run(index, args)
        except Exception as exc:  # its set-up failed; the next may not
            traceback.print_exc(file=sys.stderr)
            report = {"run": index + 1, "error": str(exc)[-3000:]}
        print(json.dumps(report), file=sys.stderr, flush=True)
        return report

    runs = harness.run_repeats(run, args.runs)
    done = [r for r in runs if "error" not in r]
    medians = side_medians(done, "catch_up", SIDES) if done else {}
    report = harness.summary(
        args,
        runs,
        command="pgcdc catchup --endpos END --json (fresh process, PostgreSQL-backed Dagster)",
        source=f"PostgreSQL {MAJOR} primary with a physical standby",
        scale=args.scale,
        transactions=harness.CLIENTS * args.transactions,
        medians=medians,
        snapshot_medians=harness.medians([r["snapshot"] for r in done]) if done else {},
    )
    harness.emit_report(harness.rounded(report), args.json)
    if done:
        print()
        print(table(done, medians))
        print()
        print(snapshot_table(done))


if __name__ == "__main__":
    main()
