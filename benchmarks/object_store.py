"""The output store on S3 (``PGCDC_STORE=s3://bucket/prefix``) against the store on the local
disk, through the commands a user runs: what a big range and a steady follow cost, and what
each range costs the object store in requests and bytes.

The S3 server is moto's (pip's ``moto[server]``), in memory on a loopback port, with its
credentials checked (:func:`pgcdc_dagster_tests.support.s3.s3_server`), one per run: its S3
application served as ``moto_server`` serves it, wrapped to log each request with its body
bytes (:func:`serve_s3`), every object kept in memory (``MOTO_S3_DEFAULT_KEY_BUFFER_SIZE``
above any object, so none spills to a temporary file). Its latency is the loopback's and its
CPU is this machine's: the figures are what S3's protocol costs pgcdc (requests, uploads,
HTTP, signing), not what a remote bucket adds.

Each side has a slot, publication, store, target database and Dagster storage of its own
(:func:`harness.pgcdc_env`; ``PGCDC_SERVER=off``: every command a fresh process), the same
source and the same data in the same run; the sides' order is reversed on every other run.

``--parts big``: one big range, ``--runs`` runs on fresh clusters (``--profile``, production
by default). pgbench at ``--scale``, then ``pgcdc snapshot`` of each side; then ``--changes``
row updates of ``pgbench_accounts`` (:func:`harness.bulk_updates`: a tenth of the table per
UPDATE, one transaction each; 3M at scale 100 is three transactions of 1M rows, written in
about a minute where a TPC-B backlog of as many changes takes several), a ``CHECKPOINT``. Then
each side's ``pgcdc catchup --endpos current --json``, timed from its start to its exit, with
``PGCDC_FOLLOW_RANGE_BYTES`` above the backlog's WAL so that it is one range. Reported: the
command's seconds; from its ``--json``, the follow's receive busy time (the peek, decode,
Parquet, and for S3 the uploads and the manifest's put, until the slot moved), the range's own
receive seconds as its manifest records them (the same, before the upload), the apply's busy
time, changes per receive-busy second; CPU seconds of the source, the target, the command's
process tree (``wait4``'s) and the S3 server. The target compared with the source after each.
``--spark``: a third side, on S3 with ``PGCDC_SPARK_MIN_CHANGES=1`` and
``PGCDC_SPARK_MASTER=local[2]``, so Spark's executors read the range from S3 with pyarrow and
stage it (against the ``s3`` side's driver path).

``--parts follow``: ``pgcdc follow`` (fresh process) under ``pgbench -b simple-update`` rate
limited to ``--tps`` for ``--seconds``, pgbench at ``--follow-scale``, ``--follow-runs``
runs; one side after the other on the same source (each side's snapshot taken just before its
follow, the probes of the side before deleted). A probe row is committed every
``--probe-interval`` s and the target polled every 20 ms for it
(:func:`pgcdc_dagster.demo.run.probe_freshness`): freshness median, p95, max; the ranges the
follow stored (its totals); CPU seconds of the servers, the follow's tree and the S3 server.
Then the follow is stopped (SIGTERM), a ``pgcdc catchup`` finishes, the target is compared.

Requests and bytes per range (the S3 sides of both parts): the requests logged while the
command ran, by method, object (``_RANGE.json``, ``part-*.parquet``, ``_CHAIN.json``, a list,
a multipart step) and status when not 2xx, divided by the ranges whose manifest was created
(``PUT _RANGE.json``); the request and response body bytes (uploads, downloads, list XML; not
HTTP headers); the objects and bytes stored, from a listing at the end. The follow's start-up
(until its run holds the range lock) is counted apart from its steady state.

Usage: ``SPARK_LOCAL_IP=127.0.0.1 .venv/bin/python benchmarks/object_store.py [--parts
big,follow] [--scale 100] [--changes 3000000] [--runs 3] [--spark] [--follow-runs 1]
[--tps 1000] [--seconds 60] [--follow-scale 10] [--profile production|throwaway]
[--json out.json]``
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
import urllib.parse
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the tests' S3 server

from pgcdc_dagster.demo.local_cluster import LocalCluster, find_bindir  # noqa: E402
from pgcdc_dagster.demo.run import Measurements, probe_freshness  # noqa: E402
from pgcdc_dagster.engine.connect import libpq_tool_environment  # noqa: E402
from pgcdc_dagster_tests.support.s3 import S3Server, s3_server  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))
import harness  # noqa: E402

TABLES = harness.PGBENCH_TABLES
PROBE_TABLE = "CREATE TABLE demo_probe (id bigint PRIMARY KEY, written_at timestamptz NOT NULL)"
ONE_RANGE = str(64 << 30)
"""``PGCDC_FOLLOW_RANGE_BYTES`` and ``PGCDC_RANGE_MAX_BYTES`` of the big range's sides: above
any backlog here, so the catch-up stores it as one range."""
KEY_BUFFER = str(4 << 30)
"""``MOTO_S3_DEFAULT_KEY_BUFFER_SIZE``: every object stays in the server's memory."""
BIG_SIDES = ("local", "s3")
SPARK_SIDE = "s3_spark"
SPARK_ENV = {"PGCDC_SPARK_MIN_CHANGES": "1", "PGCDC_SPARK_MASTER": "local[2]"}
FOLLOW_SIDES = ("local", "s3")


# ─── the S3 server and what it was asked ─────────────────────────────────────────────────────


def serve_s3(port: int, log: Path) -> None:
    """moto's S3 application as ``moto_server`` serves it (werkzeug, threaded, moto's request
    handler), each request written to ``log`` when its response is done: method, path, status,
    body bytes received and sent (:class:`CountingApp`); every object kept in memory."""
    os.environ["MOTO_S3_DEFAULT_KEY_BUFFER_SIZE"] = KEY_BUFFER
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import run_simple

    app = DomainDispatcherApplication(create_backend_app)
    run_simple("127.0.0.1", port, CountingApp(app, log), threaded=True,
               request_handler=MotoRequestHandler)  # fmt: skip


class CountingApp:
    """A WSGI application whose every request is logged, a line each: ``METHOD PATH?QUERY
    STATUS RECEIVED SENT MS`` (request and response body bytes, milliseconds from the call to
    the response's last byte)."""

    def __init__(self, app: Any, log: Path) -> None:
        self.app = app
        self.log = open(log, "a", buffering=1)  # noqa: SIM115 - open for the server's life
        self.lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Iterator[bytes]:
        status = ["000"]

        def start(code: str, headers: Any, exc_info: Any = None) -> Any:
            status[0] = code.split(" ", 1)[0]
            return start_response(code, headers, exc_info)

        sent, began = 0, time.perf_counter()
        body = self.app(environ, start)
        try:
            for chunk in body:
                sent += len(chunk)
                yield chunk
        finally:
            if hasattr(body, "close"):
                body.close()
            query = environ.get("QUERY_STRING")
            path = environ.get("PATH_INFO", "") + (f"?{query}" if query else "")
            received = int(environ.get("CONTENT_LENGTH") or 0)
            ms = (time.perf_counter() - began) * 1000
            with self.lock:
                self.log.write(
                    f"{environ['REQUEST_METHOD']} {path} {status[0]} {received} {sent} {ms:.2f}\n"
                )


def request_kind(method: str, path: str, status: int) -> str:
    """A request named by what it did: the method, the object (by its name in the store's
    layout), the multipart step or list, and the status when not a success."""
    url = urllib.parse.urlsplit(path)
    query = urllib.parse.parse_qs(url.query, keep_blank_values=True)
    name = url.path.rsplit("/", 1)[-1]
    if "list-type" in query:
        what = "list" + (" (folders)" if "delimiter" in query else "")
    elif "delete" in query:
        what = "delete batch"
    elif "uploads" in query:
        what = "multipart start"
    elif "partNumber" in query:
        what = "multipart part"
    elif "uploadId" in query:
        what = "multipart complete"
    elif name == "_RANGE.json":
        what = "_RANGE.json"
    elif name.startswith("part-") and name.endswith(".parquet"):
        what = "part-*.parquet"
    elif name == "_CHAIN.json":
        what = "_CHAIN.json"
    elif "/.pruned/" in url.path:
        what = "tombstone"
    elif url.path.count("/") <= 1:
        what = "bucket"
    else:
        what = "other"
    return f"{method} {what}" + ("" if status < 300 else f" ({status})")


@dataclass
class LoggedS3:
    """A running S3 server, its request log, and a bucket for the run."""

    server: S3Server
    log: Path
    bucket: str = ""

    @property
    def pid(self) -> int:
        return self.server.process.pid

    def mark(self) -> int:
        """Where the request log stands now (a response is logged once it is sent)."""
        return self.log.stat().st_size

    def since(self, start: int, end: int) -> dict[str, Any]:
        """The requests between two marks: their count by kind (:func:`request_kind`), the
        ranges created, and the body bytes the server received and sent, in all and by kind."""
        with open(self.log, "rb") as log:
            log.seek(start)
            lines = log.read(end - start).decode(errors="replace").splitlines()
        kinds: Counter[str] = Counter()
        received: Counter[str] = Counter()
        sent: Counter[str] = Counter()
        server_ms: dict[str, float] = {}
        for line in lines:
            method, path, status, got, gave, ms = line.split(" ")
            if not path.startswith(f"/{self.bucket}"):
                continue  # the IAM calls that made the user
            kind = request_kind(method, path, int(status))
            kinds[kind] += 1
            received[kind] += int(got)
            sent[kind] += int(gave)
            server_ms[kind] = server_ms.get(kind, 0.0) + float(ms)
        return {
            "requests": sum(kinds.values()),
            "ranges_created": kinds["PUT _RANGE.json"],
            "by_kind": dict(sorted(kinds.items())),
            "received_mb": round(sum(received.values()) / harness.MB, 4),
            "sent_mb": round(sum(sent.values()) / harness.MB, 4),
            "received_kb_by_kind": {
                k: round(v / 1000, 1) for k, v in sorted(received.items()) if v
            },
            "sent_kb_by_kind": {k: round(v / 1000, 1) for k, v in sorted(sent.items()) if v},
            "server_s": round(sum(server_ms.values()) / 1000, 3),
            "server_ms_by_kind": {k: round(v, 1) for k, v in sorted(server_ms.items())},
        }

    def stored(self, prefix: str) -> dict[str, Any]:
        """Objects and bytes under ``prefix`` now, by name (:func:`request_kind`'s)."""
        out: dict[str, dict[str, int]] = {}
        pages = self.server.client().get_paginator("list_objects_v2")
        for page in pages.paginate(Bucket=self.bucket, Prefix=prefix):
            for item in page.get("Contents", []):
                kind = request_kind("GET", f"/{self.bucket}/{item['Key']}", 200).split(" ", 1)[1]
                entry = out.setdefault(kind, {"objects": 0, "bytes": 0})
                entry["objects"] += 1
                entry["bytes"] += int(item["Size"])
        return out


@contextlib.contextmanager
def logged_s3(work: Path) -> Iterator[LoggedS3]:
    """An S3 server of its own for one run (:func:`serve_s3`), its log in ``work``, a bucket
    made."""
    log = work / "s3_requests.log"

    def command(port: int) -> list[str]:
        return [sys.executable, __file__, "--serve-s3", str(port), str(log)]

    with s3_server(command) as server:
        logged = LoggedS3(server, log)
        logged.bucket = server.new_bucket()
        yield logged


def per_range(requests: dict[str, Any], ranges: int) -> dict[str, Any]:
    """Requests and body bytes divided by ``ranges``."""
    if not ranges:
        return {}
    return {
        "requests": round(requests["requests"] / ranges, 2),
        "by_kind": {k: round(v / ranges, 2) for k, v in requests["by_kind"].items()},
        "received_kb": round(requests["received_mb"] * 1000 / ranges, 2),
        "sent_kb": round(requests["sent_mb"] * 1000 / ranges, 2),
    }


# ─── a side: its environment, its commands ───────────────────────────────────────────────────


@dataclass
class Run:
    """One run's clusters, S3 server, and each side's environment."""

    args: argparse.Namespace
    work: Path
    source: LocalCluster
    target: LocalCluster
    s3: LoggedS3
    envs: dict[str, dict[str, str]] = field(default_factory=dict)
    expected: dict[str, list[Any]] = field(default_factory=dict)

    def store_prefix(self, side: str) -> str:
        return f"{side}/"

    def add_side(self, side: str, extra: dict[str, str]) -> dict[str, str]:
        """Side ``side``'s environment: slot, publication, target database and Dagster storage
        named after it; its store on S3 (``s3://bucket/<side>``) for an ``s3`` side, in the
        run's folder otherwise."""
        on_s3 = side.startswith("s3")
        store = f"s3://{self.s3.bucket}/{side}" if on_s3 else None
        env = harness.pgcdc_env(
            self.work,
            self.source.dsn(),
            self.target,
            f"side_{side}",
            publication=f"pub_{side}",
            store=store,
            extra={"SPARK_LOCAL_IP": "127.0.0.1", **(self.s3.server.env if on_s3 else {}), **extra},
        )
        self.envs[side] = env
        return env

    def meter(self, **more: int) -> harness.CpuMeter:
        """CPU of the source, the target, the S3 server, this process (``client``: the
        commands it starts and reaps) and ``more`` roots."""
        roots = {
            "source": harness.postmaster_pid(self.source),
            "target": harness.postmaster_pid(self.target),
            "s3_server": self.s3.pid,
            "client": os.getpid(),
            **more,
        }
        return harness.CpuMeter(roots)

    def snapshot(self, side: str) -> dict[str, Any]:
        meter = self.meter()
        with meter:
            seconds, _ = harness.run_command(self.envs[side], self.work, "snapshot")
        return {"seconds": round(seconds, 2), "cpu_s": meter.seconds}

    def verify(self, side: str) -> bool:
        env = self.envs[side]
        if self.expected:
            return bool(
                harness.require_equal(self.expected, env["PGCDC_TARGET_DSN"], side)["equal"]
            )
        found = harness.targets_equal(self.source.dsn(), env["PGCDC_TARGET_DSN"], TABLES)
        if not found["equal"]:
            raise RuntimeError(f"{side}: the target differs from the source: {found}")
        return True


def s3_figures(run: Run, side: str, start: int, end: int, ranges: int) -> dict[str, Any]:
    """What the S3 server was asked between two marks, per range too, and what is stored."""
    asked = run.s3.since(start, end)
    stored = run.s3.stored(run.store_prefix(side))
    empty = {"objects": 0, "bytes": 0}
    manifest = stored.get("_RANGE.json", empty)
    parquet = stored.get("part-*.parquet", empty)
    count = manifest["objects"] or None  # no range stored: no figure per range

    def each(value: int, scale: float = 1.0) -> float | None:
        return None if count is None else round(value / scale / count, 2)

    return {
        **asked,
        "per_range": per_range(asked, ranges),
        "stored": stored,
        "stored_per_range": {
            "parquet_objects": each(parquet["objects"]),
            "parquet_kb": each(parquet["bytes"], 1000),
            "manifest_kb": each(manifest["bytes"], 1000),
        },
    }


def attempt(step: Callable[[], dict[str, Any]], what: str) -> dict[str, Any]:
    """``step()``, or its error (its last line on stderr, the traceback too): one side that
    fails does not hide the other's figures."""
    try:
        return step()
    except Exception as exc:  # reported; the run goes on
        traceback.print_exc(file=sys.stderr)
        lines = str(exc).strip().splitlines()
        print(f"{what} failed: {lines[-1] if lines else repr(exc)}", file=sys.stderr, flush=True)
        return {"error": str(exc)[-3000:]}


# ─── part 1: one big range through `pgcdc catchup` ───────────────────────────────────────────


def catch_up(run: Run, side: str) -> dict[str, Any]:
    """``pgcdc catchup --endpos current --json`` of ``side`` from a fresh process, timed from
    its start to its exit and metered; its follow totals; the target compared."""
    env = run.envs[side]
    harness.checkpoint(run.source, run.target, sync=True)
    out_path, err_path = run.work / f"catchup_{side}.out", run.work / f"catchup_{side}.err"
    meter = run.meter()
    start = run.s3.mark()
    with open(out_path, "w") as out, open(err_path, "w") as err, meter:
        began = time.perf_counter()
        proc = subprocess.Popen(
            [harness.PGCDC, "catchup", "--endpos", "current", "--json"],
            env=env, stdout=out, stderr=err, cwd=run.work,
        )  # fmt: skip
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - began
    end = run.s3.mark()
    if os.waitstatus_to_exitcode(status) != 0:
        said = err_path.read_text(errors="replace").strip().splitlines()
        raise RuntimeError(f"pgcdc catchup ({side}) failed: {said[-1] if said else status}")
    output = out_path.read_text()
    summary, _ = json.JSONDecoder().raw_decode(output, output.index("{"))
    follow, last = summary.get("follow", {}), summary.get("last_range") or {}
    cpu = dict(meter.seconds)
    cpu["command"] = round(usage.ru_utime + usage.ru_stime, 2)
    cpu["client"] = round(cpu["client"] - cpu["command"], 2)  # this script alone
    changes = int(follow.get("changes") or 0)
    receive_busy = float(follow.get("receive_busy_s") or 0)
    result = {
        "seconds": round(seconds, 2),
        "ranges": summary.get("ranges_run"),
        "changes": changes,
        "transactions": follow.get("transactions"),
        "receive_busy_s": receive_busy,
        "range_receive_s": last.get("seconds"),
        "apply_busy_s": follow.get("apply_busy_s"),
        "follow_s": follow.get("seconds"),
        "receive_cpu_s": follow.get("receive_cpu_s"),
        "changes_per_s": round(changes / receive_busy) if receive_busy else None,
        "stored_mb": round(int(last.get("bytes") or 0) / harness.MB, 1),
        "spark_ranges": follow.get("spark_ranges"),
        "spark_s": follow.get("spark_seconds"),
        "cpu_s": cpu,
        "load_1m": meter.load_at_start[0],
    }
    if side.startswith("s3"):
        result["s3"] = s3_figures(run, side, start, end, int(summary.get("ranges_run") or 0))
    result["equal"] = run.verify(side)
    return result


def big_run(index: int, args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {"run": index + 1, "started": datetime.now(UTC).strftime("%H:%M:%S")}
    sides = BIG_SIDES + ((SPARK_SIDE,) if args.spark else ())
    with (
        harness.bench_clusters(args.profile, extra=harness.QUIET) as (work, source, target),
        logged_s3(work) as s3,
    ):
        run = Run(args, work, source, target, s3)
        began = time.perf_counter()
        harness.fill_pgbench(source, args.scale)
        report["pgbench_init_s"] = round(time.perf_counter() - began, 1)
        one_range = {"PGCDC_FOLLOW_RANGE_BYTES": ONE_RANGE, "PGCDC_RANGE_MAX_BYTES": ONE_RANGE}
        report["snapshot"] = {}
        for side in sides:
            run.add_side(side, {**one_range, **(SPARK_ENV if side == SPARK_SIDE else {})})
            report["snapshot"][side] = run.snapshot(side)
        start = harness.wal_position(source.dsn(), of="flush")
        began = time.perf_counter()
        report["changes_written"] = harness.bulk_updates(source.dsn(), args.changes)
        report["write_s"] = round(time.perf_counter() - began, 1)
        harness.checkpoint(source)
        report["wal_mb"] = round((harness.wal_position(source.dsn(), of="flush") - start) / 1e6)
        run.expected = harness.fingerprints(source.dsn(), TABLES)
        report["order"] = harness.order_of(sides, index)
        report["catch_up"] = {}
        for side in report["order"]:
            print(f"  catchup {side}", file=sys.stderr, flush=True)
            report["catch_up"][side] = attempt(functools.partial(catch_up, run, side), side)
    report["ended"] = datetime.now(UTC).strftime("%H:%M:%S")
    return report


# ─── part 2: a follow under a steady load ────────────────────────────────────────────────────


def freshness_figures(seconds: list[float]) -> dict[str, Any]:
    fresh = sorted(seconds)
    if not fresh:
        return {"probes": 0}
    return {
        "probes": len(fresh),
        "freshness_median_s": round(harness.median(fresh) or 0.0, 3),
        "freshness_p95_s": round(fresh[min(len(fresh) - 1, int(0.95 * len(fresh)))], 3),
        "freshness_max_s": round(fresh[-1], 3),
    }


def load_window(run: Run, meter: harness.CpuMeter, target_dsn: str) -> dict[str, Any]:
    """``pgbench -b simple-update -R tps -T seconds`` (4 clients) with a probe every
    ``--probe-interval`` polled on ``target_dsn``, inside ``meter``."""
    args, source_dsn = run.args, run.source.dsn()
    measured = Measurements()
    writing, never = threading.Event(), threading.Event()
    writing.set()
    prober = threading.Thread(
        target=probe_freshness,
        args=(source_dsn, target_dsn, writing, never, measured),
        kwargs={"interval_s": args.probe_interval, "poll_s": 0.02},
    )
    tool_env, extra = libpq_tool_environment(source_dsn)
    command = [str(find_bindir() / "pgbench"), "-n", "-b", "simple-update", "-c", "4", "-j", "2",
               "-R", str(args.tps), "-T", str(args.seconds), *extra]  # fmt: skip
    with meter:
        prober.start()
        bench = subprocess.run(
            command, env={**os.environ, **tool_env}, capture_output=True, text=True, check=True
        )
        writing.clear()
        prober.join(timeout=120)
    found = re.findall(r"tps = ([0-9.]+)", bench.stdout)
    return {
        "pgbench_tps": float(found[-1]) if found else None,
        **freshness_figures(measured.freshness_s),
        "probes_sent": measured.probes_sent,
    }


def follow_side(run: Run, side: str) -> dict[str, Any]:
    """``side``'s snapshot, then its ``pgcdc follow`` under the load; stopped, caught up,
    compared."""
    harness.execute(run.source.dsn(), "DELETE FROM demo_probe")  # the probes count from 1
    env = run.add_side(side, {})
    snapshot = run.snapshot(side)
    slot, target_dsn = env["PGCDC_SLOT"], env["PGCDC_TARGET_DSN"]
    before = run.s3.mark()
    follow, startup_s = harness.start_follow(
        env, run.work, target_dsn, slot, "--json", new_session=True
    )
    try:
        started = run.s3.mark()
        meter = run.meter(follow=follow.pid)
        report = load_window(run, meter, target_dsn)
        report["cpu_s"] = dict(meter.seconds)
        report["load_1m"] = meter.load_at_start[0]
        follow.send_signal(signal.SIGTERM)
        out, err = follow.communicate(timeout=600)
        if follow.returncode != 0:
            said = err.strip().splitlines()
            raise RuntimeError(f"pgcdc follow ({side}) exited {follow.returncode}: {said[-1:]}")
    finally:
        if follow.poll() is None:
            os.killpg(follow.pid, signal.SIGKILL)
            follow.wait()
    stopped = run.s3.mark()
    totals = json.loads(out[out.index("{") :]).get("follow", {})
    ranges = int(totals.get("ranges") or 0)
    report.update(
        snapshot_s=snapshot["seconds"],
        follow_startup_s=round(startup_s, 2),
        ranges=ranges,
        changes=totals.get("changes"),
        receive_busy_s=totals.get("receive_busy_s"),
        apply_busy_s=totals.get("apply_busy_s"),
        follow_s=totals.get("seconds"),
    )
    harness.run_command(env, run.work, "catchup")
    report["equal"] = run.verify(side)
    if side.startswith("s3"):
        report["s3_startup"] = run.s3.since(before, started)
        report["s3"] = s3_figures(run, side, started, stopped, ranges)
    return report


def follow_run(index: int, args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {"run": index + 1, "started": datetime.now(UTC).strftime("%H:%M:%S")}
    with (
        harness.bench_clusters(args.profile, extra=harness.QUIET) as (work, source, target),
        logged_s3(work) as s3,
    ):
        run = Run(args, work, source, target, s3)
        harness.fill_pgbench(source, args.follow_scale)
        harness.execute(source.dsn(), PROBE_TABLE)
        report["order"] = harness.order_of(FOLLOW_SIDES, index)
        report["follow"] = {}
        for side in report["order"]:
            print(f"  follow {side}", file=sys.stderr, flush=True)
            report["follow"][side] = attempt(functools.partial(follow_side, run, side), side)
    report["ended"] = datetime.now(UTC).strftime("%H:%M:%S")
    return report


# ─── the report ──────────────────────────────────────────────────────────────────────────────

BIG_FIGURES = {
    "catchup_s": ("seconds",),
    "receive_busy_s": ("receive_busy_s",),
    "range_receive_s": ("range_receive_s",),
    "apply_busy_s": ("apply_busy_s",),
    "changes_per_s": ("changes_per_s",),
    "command_cpu_s": ("cpu_s", "command"),
    "source_cpu_s": ("cpu_s", "source"),
    "target_cpu_s": ("cpu_s", "target"),
    "s3_server_cpu_s": ("cpu_s", "s3_server"),
}
FOLLOW_FIGURES = {
    "pgbench_tps": ("pgbench_tps",),
    "freshness_median_s": ("freshness_median_s",),
    "freshness_p95_s": ("freshness_p95_s",),
    "freshness_max_s": ("freshness_max_s",),
    "ranges": ("ranges",),
    "follow_cpu_s": ("cpu_s", "follow"),
    "source_cpu_s": ("cpu_s", "source"),
    "s3_server_cpu_s": ("cpu_s", "s3_server"),
}


def side_medians(
    runs: list[dict[str, Any]], group: str, figures: dict[str, tuple[str, ...]]
) -> dict[str, Any]:
    """Per side of ``runs[*][group]``, the median of each figure over the runs it did not fail."""
    sides = sorted({side for r in runs for side in r.get(group, {})})
    out: dict[str, Any] = {}
    for side in sides:
        done = [r[group][side] for r in runs if "error" not in r[group].get(side, {"error": 1})]
        out[side] = {name: harness.median_at(done, *path) for name, path in figures.items()}
        out[side]["runs"] = len(done)
    return out


def side_table(
    runs: list[dict[str, Any]], group: str, figures: dict[str, tuple[str, ...]],
    medians: dict[str, Any],
) -> str:  # fmt: skip
    rows: list[list[Any]] = []
    for side in medians:
        for r in runs:
            found = r.get(group, {}).get(side, {"error": "not run"})
            if "error" in found:
                rows.append([side, r["run"], "failed", *[""] * len(figures)])
                continue
            values = [harness.value_at(found, *path) for path in figures.values()]
            rows.append([side, r["run"], *values, "yes" if found.get("equal") else "no"])
        rows.append([f"**{side}**", "median", *(medians[side][n] for n in figures), ""])
    return harness.markdown_table(["side", "run", *figures, "equal"], harness.rounded(rows, 2))


def request_table(runs: list[dict[str, Any]]) -> str:
    """Per S3 side of each part, by request kind: the count, per range, the body KB uploaded
    and downloaded per range and the server's milliseconds per range (medians over the runs);
    then totals and what is stored per range."""
    rows: list[list[Any]] = []
    for group in ("catch_up", "follow"):
        sides = sorted({s for r in runs for s in r.get(group, {}) if s.startswith("s3")})
        for side in sides:
            done = [r[group][side]["s3"] for r in runs if "s3" in r.get(group, {}).get(side, {})]
            if not done:
                continue
            where = f"{group} {side}"
            ranges = harness.median(d["ranges_created"] for d in done) or 0

            def each(values: Iterator[float], ranges: float = ranges) -> float | None:
                total = harness.median(values)
                return None if total is None or not ranges else total / ranges

            for kind in sorted({k for d in done for k in d["by_kind"]}):
                rows.append([where, kind, harness.median(d["by_kind"].get(kind, 0) for d in done),
                             each(d["by_kind"].get(kind, 0) for d in done),
                             each(d["received_kb_by_kind"].get(kind, 0) for d in done),
                             each(d["sent_kb_by_kind"].get(kind, 0) for d in done),
                             each(d["server_ms_by_kind"].get(kind, 0) for d in done)])  # fmt: skip
            rows.append([where, "**all**", harness.median(d["requests"] for d in done),
                         each(d["requests"] for d in done),
                         each(d["received_mb"] * 1000 for d in done),
                         each(d["sent_mb"] * 1000 for d in done),
                         each(d["server_s"] * 1000 for d in done)])  # fmt: skip
            stored = [harness.median(d["stored_per_range"][k] for d in done)
                      for k in ("parquet_objects", "parquet_kb", "manifest_kb")]  # fmt: skip
            said = f"stored per range: {stored[0]} Parquet object(s), {stored[1]} KB; manifest"
            rows.append([where, f"{said} {stored[2]} KB", None, None, None, None, None])
    head = ["where", "request", "count", "per range", "KB up per range", "KB down per range",
            "server ms per range"]  # fmt: skip
    return harness.markdown_table(head, harness.rounded(rows, 3))


def run_part(
    one: Callable[[int, argparse.Namespace], dict[str, Any]], count: int, args: argparse.Namespace
) -> list[dict[str, Any]]:
    def run(index: int) -> dict[str, Any]:
        try:
            report = one(index, args)
        except Exception as exc:  # its set-up failed; the next may not
            traceback.print_exc(file=sys.stderr)
            report = {"run": index + 1, "error": str(exc)[-3000:]}
        print(json.dumps(report, default=str), file=sys.stderr, flush=True)
        return report

    return harness.run_repeats(run, count)


def main() -> None:
    parser = harness.argument_parser(__doc__, profile=harness.PRODUCTION, json=True)
    parser.add_argument("--parts", default="big,follow", help="big, follow, or both (comma)")
    parser.add_argument("--scale", type=int, default=100, help="pgbench scale of the big range")
    parser.add_argument("--changes", type=int, default=3_000_000, help="the big range's updates")
    parser.add_argument("--runs", type=int, default=3, help="runs of the big range")
    parser.add_argument("--spark", action="store_true", help="the big range also on local[2] Spark")
    parser.add_argument("--follow-runs", type=int, default=1)
    parser.add_argument("--follow-scale", type=int, default=10)
    parser.add_argument("--tps", type=int, default=1000)
    parser.add_argument("--seconds", type=int, default=60)
    parser.add_argument("--probe-interval", type=float, default=0.5)
    args = parser.parse_args()
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if not parts <= {"big", "follow"}:
        parser.error(f"--parts: big, follow or both, not {args.parts}")

    big = run_part(big_run, args.runs, args) if "big" in parts else []
    follow = run_part(follow_run, args.follow_runs, args) if "follow" in parts else []
    big_done = [r for r in big if "error" not in r]
    follow_done = [r for r in follow if "error" not in r]
    big_medians = side_medians(big_done, "catch_up", BIG_FIGURES)
    follow_medians = side_medians(follow_done, "follow", FOLLOW_FIGURES)
    report = harness.summary(
        args,
        [*big, *follow],
        command="pgcdc catchup --endpos current --json / pgcdc follow --json (fresh processes, "
        "PostgreSQL-backed Dagster), PGCDC_STORE local against s3:// on moto_server",
        scale=args.scale,
        changes=args.changes,
        follow_load=f"pgbench simple-update, {args.tps} tps, {args.seconds} s, "
        f"scale {args.follow_scale}",
        big_medians=big_medians,
        follow_medians=follow_medians,
    )
    harness.emit_report(harness.rounded(report), args.json)
    if big_done:
        print("\n" + side_table(big_done, "catch_up", BIG_FIGURES, big_medians))
    if follow_done:
        print("\n" + side_table(follow_done, "follow", FOLLOW_FIGURES, follow_medians))
    if big_done or follow_done:
        print("\n" + request_table([*big_done, *follow_done]))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve-s3"]:
        serve_s3(int(sys.argv[2]), Path(sys.argv[3]))
    else:
        main()
