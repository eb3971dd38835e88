"""How Dagster's UI answers as ``lsn_ranges`` partitions pile up: the asset page's queries at
10,000 to 200,000 partitions.

Why: a follow under steady load cuts about 5 ranges a second (432,000 a day), every range a
partition of every asset, and the store keeps a week of them; Dagster recommends 100,000
partitions or fewer per asset ("assets with partition counts exceeding this limit will likely
have slower load times in the UI"). ``PGCDC_PARTITIONS_KEPT`` (default 50,000) bounds them.

Set-up: a PostgreSQL cluster for Dagster's storage (``--profile``: ``benchmarks/harness.py``'s
settings, production by default; the shipped ``dagster.yaml``),
partitions registered as a follow registers them, each with a ``decoded_changes``
materialisation (written in batches through Dagster's event storage, as runless events:
the UI reads them the same way), then ``dagster-webserver`` on the project's workspace.

Measured, at each count, through the webserver's GraphQL endpoint (what the UI's asset page
asks): the partition stats and statuses of ``decoded_changes`` and of a target table (the
first the code location defines, none of its partitions materialised), the first time
(Dagster computes and caches the statuses) and again; and the size of Dagster's event log.

Each printed row (JSON) names the profile.

Usage: ``.venv/bin/python benchmarks/partitions_ui.py [--counts 10000,50000,100000,200000]
[--profile production|throwaway]``
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import psycopg

from pgcdc_dagster.demo.local_cluster import LocalCluster
from pgcdc_dagster.demo.run import stop_process
from pgcdc_dagster.engine.lsn import LsnRange

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness

REPO = harness.REPO
BATCH = 1000
QUERY = """
query ($key: AssetKeyInput!) {
  assetNodeOrError(assetKey: $key) {
    ... on AssetNode {
      partitionStats { numMaterialized numPartitions numFailed numMaterializing }
      assetPartitionStatuses {
        ... on DefaultPartitionStatuses { materializedPartitions unmaterializedPartitions }
      }
    }
  }
}
"""


def add_ranges(instance: Any, first: int, count: int) -> None:
    """Partitions ``first`` to ``first + count`` (8 KiB each), each with a materialisation of
    ``decoded_changes``, a thousand per write."""
    from dagster import AssetKey, AssetMaterialization, DagsterEvent, DagsterEventType
    from dagster._core.events import StepMaterializationData
    from dagster._core.events.log import EventLogEntry
    from dagster._core.instance.utils import RUNLESS_JOB_NAME, RUNLESS_RUN_ID

    from pgcdc_dagster.defs.partitions import LSN_RANGES

    for start in range(first, first + count, BATCH):
        keys = [
            LsnRange(0x1000000 + n * 8192, 0x1000000 + (n + 1) * 8192).partition_key
            for n in range(start, min(start + BATCH, first + count))
        ]
        instance.add_dynamic_partitions(LSN_RANGES, keys)
        entries = [
            EventLogEntry(
                error_info=None,
                level=logging.DEBUG,
                user_message="",
                run_id=RUNLESS_RUN_ID,
                timestamp=time.time(),
                dagster_event=DagsterEvent(
                    event_type_value=DagsterEventType.ASSET_MATERIALIZATION.value,
                    job_name=RUNLESS_JOB_NAME,
                    event_specific_data=StepMaterializationData(
                        AssetMaterialization(
                            AssetKey("decoded_changes"),
                            partition=key,
                            metadata={"changes": 40, "endpos_outcome": "at_commit_boundary"},
                        )
                    ),
                ),
            )
            for key in keys
        ]
        instance.event_log_storage.store_event_batch(entries)


def graphql(port: int, key: list[str]) -> tuple[float, dict[str, Any]]:
    body = json.dumps({"query": QUERY, "variables": {"key": {"path": key}}}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/graphql", body, {"Content-Type": "application/json"}
    )
    started = time.monotonic()
    with urllib.request.urlopen(request, timeout=600) as response:
        answer = json.loads(response.read())
    seconds = time.monotonic() - started
    node = answer["data"]["assetNodeOrError"]
    if "partitionStats" not in node:
        raise RuntimeError(f"unexpected answer: {json.dumps(answer)[:500]}")
    return seconds, node["partitionStats"]


def asset_keys(port: int) -> list[list[str]]:
    body = json.dumps({"query": "{ assetNodes { assetKey { path } } }"}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/graphql", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        answer = json.loads(response.read())
    return [node["assetKey"]["path"] for node in answer["data"]["assetNodes"]]


def wait_for_webserver(port: int, process: subprocess.Popen[bytes]) -> list[list[str]]:
    """Once the webserver answers with the project's code location loaded: its asset keys."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError("dagster-webserver exited")
        try:
            keys = asset_keys(port)
        except OSError:
            keys = []
        if ["decoded_changes"] in keys:
            return keys
        time.sleep(0.5)
    raise RuntimeError("dagster-webserver did not answer")


def main() -> None:
    parser = harness.argument_parser(__doc__, json=True)
    parser.add_argument("--counts", default="10000,50000,100000,200000")
    parser.add_argument("--port", type=int, default=3391)
    args = parser.parse_args()
    counts = [int(c) for c in args.counts.split(",")]

    base = Path(tempfile.mkdtemp(prefix="pgcdc-partitions-ui-"))
    storage = LocalCluster(base / "storage", harness.profile_settings(args.profile)).start()
    home = base / "dagster_home"
    home.mkdir()
    shutil.copy(REPO / "dagster.yaml", home / "dagster.yaml")
    os.environ.update(
        {
            "DAGSTER_HOME": str(home),
            "DAGSTER_POSTGRES_URL": (
                f"postgresql+psycopg2://postgres@127.0.0.1:{storage.port}/postgres"
            ),
            "PGCDC_STORE": str(base / "store"),
            "PGCDC_TABLES": "public.pgbench_accounts,public.pgbench_history",
        }
    )
    from dagster import DagsterInstance

    results = []
    try:
        with DagsterInstance.get() as instance:
            have = 0
            for count in counts:
                started = time.monotonic()
                add_ranges(instance, have, count - have)
                have = count
                added_s = time.monotonic() - started
                with psycopg.connect(storage.dsn(), autocommit=True) as conn:
                    (size,) = conn.execute("SELECT pg_total_relation_size('event_logs')").fetchone()  # type: ignore[misc]
                web = subprocess.Popen(
                    [
                        str(Path(sys.executable).parent / "dagster-webserver"),
                        *("-h", "127.0.0.1", "-p", str(args.port)),
                        *("-w", str(REPO / "workspace.yaml")),
                    ],
                    cwd=REPO,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
                try:
                    keys = wait_for_webserver(args.port, web)
                    targets = sorted(k for k in keys if k[0] == "target")
                    row: dict[str, Any] = {
                        "profile": args.profile,
                        "partitions": count,
                        "add_s": round(added_s, 1),
                        "event_logs_mb": round(size / 1e6, 1),
                    }
                    assets = {"decoded_changes": ["decoded_changes"]}
                    if targets:
                        assets["target_table"] = targets[0]
                    for name, key in assets.items():
                        first_s, stats = graphql(args.port, key)
                        again_s, _ = graphql(args.port, key)
                        row[name] = {
                            "first_s": round(first_s, 2),
                            "again_s": round(again_s, 2),
                            "materialized": stats["numMaterialized"],
                            "partitions": stats["numPartitions"],
                        }
                finally:
                    stop_process(web)
                print(json.dumps(row), flush=True)
                results.append(row)
    finally:
        storage.stop()
        shutil.rmtree(base, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
