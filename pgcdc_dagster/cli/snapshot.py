"""``pgcdc snapshot``: the base snapshot, its copy begun before Dagster is imported."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from ..cli_progress import shown
from ..defs.instance import dagster_instance
from ..engine.settings import ReplicationSettings
from ..runner import clear_the_way, materialization_metadata, run_job
from .output import on_spark
from .signals import lock_and_start


def cmd_snapshot(args: argparse.Namespace) -> int:
    from ..engine.control import pipeline
    from ..engine.control.head_start import Background, offer

    settings = ReplicationSettings.from_env()
    resnapshot = bool(args.resnapshot)

    def notify(line: str) -> None:  # what it does about an earlier, unfinished snapshot
        print(f"pgcdc: {line}", file=sys.stderr, flush=True)

    begun: list[Background[Any]] = []

    def start() -> Background[Any]:
        work = Background(
            lambda: pipeline.take_snapshot(
                settings, settings.spark_session, resnapshot=resnapshot, notify=notify
            ),
            name="pgcdc-snapshot",
        )
        offer("snapshot", settings.slot, work)
        begun.append(work)
        return work

    config = {"ops": {"base_snapshot": {"config": {"resnapshot": resnapshot}}}}
    with (
        shown(),
        _snapshot_copying() as copying,
        lock_and_start(settings, "snapshot", start) as started,
    ):
        if started:
            _until_copying(copying, begun[0])
        clear_the_way(
            dagster_instance(), settings, args.wait, "pgcdc snapshot", waiting=not started
        )
        result = run_job("snapshot", run_config=config)
    meta = materialization_metadata(result, "base_snapshot")
    if args.json:
        plain = {k: v for k, v in meta.items() if isinstance(v, str | int | float | bool)}
        print(json.dumps(plain, indent=2))
        return 0
    print(
        f"base snapshot taken: consistent point {meta.get('consistent_point')}, "
        f"{meta.get('rows')} rows, {meta.get('seconds')} s{on_spark(meta, 'copied tables')}; "
        f"PostgreSQL {meta.get('source_version')} to {meta.get('target_version')}"
    )
    return 0


HEAD_START_SETTLE_S = 3.0
"""How long ``pgcdc snapshot`` lets its head start reach the copy before it imports Dagster and
creates the run (:func:`_until_copying`)."""


@contextlib.contextmanager
def _snapshot_copying() -> Iterator[threading.Event]:
    """An event set once this process's snapshot reports its copy (or a later phase)."""
    from ..engine import progress

    copying = threading.Event()

    def listener(report: progress.Progress) -> None:
        if isinstance(report, progress.SnapshotProgress) and report.phase in (
            "copy",
            "keys",
            "done",
        ):
            copying.set()

    with progress.listening(listener):
        yield copying


def _until_copying(copying: threading.Event, work: Any) -> None:
    """Wait, at most :data:`HEAD_START_SETTLE_S`, for the head start to reach its copy (or end).

    Why: until its rows flow, the head start's thread runs many short steps (connections, the
    slot, ``pg_dump``, the plan), each of which waits for the interpreter lock (and on 2 cores
    for a core) while Dagster's import (seconds of pure Python) holds it; importing after
    them starts the copy sooner, and the import then overlaps the copy, whose work is in other
    processes (``benchmarks/HISTORY.md``, "A command's start-up and teardown", and the
    snapshot's time to its first row). The bound keeps a snapshot waiting for its slot (open
    transactions on the source) from hiding its run in the UI for long."""
    deadline = time.monotonic() + HEAD_START_SETTLE_S
    while not copying.is_set() and work.running() and time.monotonic() < deadline:
        copying.wait(0.05)
