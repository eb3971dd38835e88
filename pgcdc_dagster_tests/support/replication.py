"""Replication in this process, as the engine's end-to-end tests run it: the settings of a
fresh slot and store, a catch-up under the range lock, every table compared, a follow while
writes go on, and a step killed at a failpoint in a child process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pgcdc_dagster.engine.compare import verify
from pgcdc_dagster.engine.control import pipeline
from pgcdc_dagster.engine.follow.follower import Followed, Follower
from pgcdc_dagster.engine.lsn import Lsn
from pgcdc_dagster.engine.settings import ReplicationSettings


def settings_for(
    source_dsn: str, target_dsn: str, tmp_path: Path, prefix: str, **overrides: Any
) -> ReplicationSettings:
    """A slot of its own (``prefix`` and a random tail) and a store under ``tmp_path``."""
    return ReplicationSettings(
        source_dsn=source_dsn,
        target_dsn=target_dsn,
        slot=f"{prefix}_{uuid.uuid4().hex[:8]}",
        store=str(tmp_path / "store"),
        **overrides,
    )


def catch_up(
    settings: ReplicationSettings, endpos: Lsn | str = "current", spark: Any = None
) -> list[Any]:
    """Every step to ``endpos`` (``current``: the source's position now), in this process
    (``spark``: for the ranges of at least ``settings.spark_min_changes``); each step's
    ``(received, applied)``."""
    target = pipeline.resolve_endpos(settings, endpos) if isinstance(endpos, str) else endpos
    with pipeline.range_lock(settings):
        return list(
            pipeline.catch_up(
                settings,
                target,
                run_step=lambda step: pipeline.run_step_in_process(settings, step, spark),
            )
        )


def equal_tables(settings: ReplicationSettings) -> list[tuple[str, bool]]:
    """Each replicated table and whether the target's equals the source's."""
    comparisons = verify.compare_tables(settings, pipeline.replicated_tables(settings))
    return [(str(c.table), c.equal) for c in comparisons]


@contextmanager
def following_while(
    settings: ReplicationSettings,
    writes: Callable[[str, threading.Event], None],
    ranges: int = 3,
) -> Iterator[tuple[Follower, list[Followed]]]:
    """A follow (no endpos, under the range lock, on a thread) while ``writes(source_dsn,
    stop)`` commits on another thread until ``stop`` is set; entered once the follow has
    applied ``ranges`` ranges, with the follower and what it has followed (a list that grows).
    On the way out the follow must still be running; the writes stop, then the follow."""
    follower, done = Follower(settings), []

    def follow() -> None:
        with pipeline.range_lock(settings):
            for followed in follower.run():
                done.append(followed)

    stop = threading.Event()
    threads = [
        threading.Thread(target=writes, args=(settings.source_dsn, stop)),
        threading.Thread(target=follow),
    ]
    for thread in threads:
        thread.start()
    try:
        deadline = time.monotonic() + 60
        while follower.summary.ranges < ranges:
            assert time.monotonic() < deadline, f"the follow applied fewer than {ranges} ranges"
            time.sleep(0.1)
        yield follower, done
        assert threads[1].is_alive(), "the follow ended while the test ran"
    finally:
        stop.set()
        threads[0].join()
        follower.stop("test")
        threads[1].join(timeout=120)


def killed_at(failpoint: str, script: str, settings: ReplicationSettings) -> None:
    """``python -c script`` (``sys.argv[1]``: the settings' JSON) in a child process that
    ``failpoint`` kills the first time it is reached; fails unless the child died there."""
    child = subprocess.run(
        [sys.executable, "-c", script, settings.model_dump_json()],
        env={**os.environ, "PGCDC_FAILPOINT": f"{failpoint}=kill@1"},
        capture_output=True,
        timeout=300,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()[-2000:]
