"""Freshness under steady load: source commit to visible on the target, with ``pgcdc follow``.

Set-up, on fresh throwaway clusters (the demo's: a source with logical WAL, a target, and a
third cluster for Dagster's PostgreSQL storage, with the shipped ``dagster.yaml``): the demo's
sample data (pgbench scale 1 and the extra tables), ``pgcdc snapshot``, then ``pgcdc follow``
started as a fresh process: one Dagster run that receives and applies continuously.

Load: ``pgbench -b simple-update`` (one UPDATE, one SELECT, one INSERT per transaction) rate
limited to ``--tps`` for ``--seconds``. Meanwhile a probe row is committed on the source every
``--probe-interval`` seconds (its own connection, synchronous commit) and the target is polled
every 20 ms for it: the probe's freshness is the time from its commit returning to the poll
that first sees it. The first probes are sent once the follow run holds the range lock (its
start-up is reported separately, not counted as freshness).

Reported: freshness median, p95 and max; the pgbench rate achieved; the follow run's totals
(ranges, receive and apply busy time); the target verified equal to the source after a final
``pgcdc catchup``.

Usage: ``.venv/bin/python benchmarks/freshness.py [--tps 1000] [--seconds 40]``
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from pgcdc_dagster.demo.local_cluster import find_bindir
from pgcdc_dagster.demo.run import (
    Measurements,
    demo_environment,
    load_sample_data,
    probe_freshness,
    start_clusters,
)
from pgcdc_dagster.engine import pipeline, verify
from pgcdc_dagster.engine.connect import libpq_tool_environment
from pgcdc_dagster.engine.range_lock import lock_holders
from pgcdc_dagster.engine.settings import ReplicationSettings

PGCDC = str(Path(sys.executable).parent / "pgcdc")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tps", type=int, default=1000)
    parser.add_argument("--seconds", type=int, default=40)
    parser.add_argument("--probe-interval", type=float, default=0.5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    base = Path(tempfile.mkdtemp(prefix="pgcdc-fresh-"))
    clusters = start_clusters(base)
    follow: subprocess.Popen[str] | None = None
    try:
        env = {
            **os.environ,
            **demo_environment(base, clusters),
            "PGCDC_MODE": "follow",
            "PGCDC_SERVER": "off",  # steady state is measured; start-up is reported apart
        }
        os.environ.update(env)
        load_sample_data(clusters.source)
        settings = ReplicationSettings.from_env()
        subprocess.run([PGCDC, "snapshot"], env=env, check=True, capture_output=True, cwd=base)
        launched = time.monotonic()
        follow = subprocess.Popen(
            [PGCDC, "follow", "--json"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=base,
            start_new_session=True,
        )
        while not lock_holders(settings.target_dsn, settings.slot):
            if follow.poll() is not None:
                raise RuntimeError(f"pgcdc follow exited: {follow.stderr.read()[-2000:]}")
            time.sleep(0.05)
        startup_s = time.monotonic() - launched

        measured = Measurements()
        writing, never = threading.Event(), threading.Event()
        writing.set()
        prober = threading.Thread(
            target=probe_freshness,
            args=(settings.source_dsn, settings.target_dsn, writing, never, measured),
            kwargs={"interval_s": args.probe_interval, "poll_s": 0.02},
        )
        prober.start()
        tool_env, extra = libpq_tool_environment(clusters.source.dsn())
        bench = subprocess.run(
            [
                str(find_bindir() / "pgbench"),
                "-n",
                "-b",
                "simple-update",
                "-c",
                "4",
                "-j",
                "2",
                "-R",
                str(args.tps),
                "-T",
                str(args.seconds),
                *extra,
            ],
            env={**os.environ, **tool_env},
            capture_output=True,
            text=True,
            check=True,
        )
        writing.clear()
        prober.join(timeout=60)
        found = re.findall(r"tps = ([0-9.]+)", bench.stdout)
        tps = float(found[-1]) if found else None

        follow.send_signal(signal.SIGTERM)
        out, ferr = follow.communicate(timeout=120)
        if follow.returncode != 0:
            raise RuntimeError(f"pgcdc follow exited {follow.returncode}: {ferr[-2000:]}")
        totals = json.loads(out).get("follow", {})
        follow = None
        done = subprocess.run([PGCDC, "catchup"], env=env, capture_output=True, text=True, cwd=base)
        if done.returncode != 0:
            raise RuntimeError(done.stderr[-2000:])
        comparisons = verify.compare_tables(settings, pipeline.replicated_tables(settings))
        fresh = sorted(measured.freshness_s)
        report: dict[str, Any] = {
            "load": f"pgbench simple-update, {args.tps} tps target, {args.seconds} s",
            "pgbench_tps": tps,
            "follow_startup_s": round(startup_s, 2),
            "probes": len(fresh),
            "freshness_median_s": round(statistics.median(fresh), 3),
            "freshness_p95_s": round(fresh[min(len(fresh) - 1, int(0.95 * len(fresh)))], 3),
            "freshness_max_s": round(fresh[-1], 3),
            "follow": totals,
            "equal": all(c.equal for c in comparisons),
        }
        print(json.dumps(report, indent=2))
        if args.json:
            args.json.write_text(json.dumps(report, indent=2))
    finally:
        if follow is not None and follow.poll() is None:
            os.killpg(follow.pid, signal.SIGKILL)
        clusters.stop()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
