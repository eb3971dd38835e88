"""``pgcdc catchup`` and ``pgcdc follow``: one pipelined follow run, to an endpos or until a
signal."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import sys
from typing import Any

from ..cli_progress import shown
from ..defs.instance import dagster_instance
from ..engine.lsn import LsnRange
from ..engine.settings import ReplicationSettings
from ..runner import clear_the_way, observed_metadata
from .output import CliError, on_spark, print_summary
from .signals import lock_and_start, run_in_worker, stop_requested, stops_at_boundary


def cmd_catchup(args: argparse.Namespace) -> int:
    """Follow with an endpos: one pipelined run up to it."""
    return _follow(args, args.endpos, "pgcdc catchup")


def cmd_follow(args: argparse.Namespace) -> int:
    """Follow until SIGTERM/SIGINT (or an endpos, when given)."""
    return _follow(args, args.endpos, "pgcdc follow")


def _follow(args: argparse.Namespace, endpos: str | None, command: str) -> int:
    from ..engine import progress
    from ..engine.control import pipeline
    from ..engine.control.next_step import CaughtUp
    from ..engine.follow.process import head_start

    settings = ReplicationSettings.from_env()
    target = pipeline.resolve_endpos(settings, endpos) if endpos else None

    def start() -> Any:
        # The follower gets a process of its own (engine/follow/process.py), so neither the
        # Dagster imports of a cold command nor the run's own work share its interpreter lock.
        return head_start(settings, target, settings.spark_session, own_process=True)

    keys: collections.deque[str] = collections.deque(maxlen=RANGES_LISTED)
    with (
        stops_at_boundary(),
        shown(),
        progress.listening(lambda report: _note_range(report, keys)),
        lock_and_start(settings, "follow", start) as started,
    ):
        # While Dagster loads, the follower is already at work (when the lock was free).
        instance = dagster_instance()
        clear_the_way(instance, settings, args.wait, command, waiting=not started)
        from ..defs.jobs import NO_ENDPOS

        config = {"endpos": str(target) if target else NO_ENDPOS}
        result = run_in_worker({"ops": {"follow_stream": {"config": config}}})
    totals = _follow_totals(result)
    if int(totals.get("staged_on_driver") or 0):
        print(
            f"pgcdc: warning: {totals['staged_on_driver']} range(s) staged on the driver, the "
            f"last: {totals.get('staged_on_driver_why')}",
            file=sys.stderr,
        )
    ran = int(totals.get("ranges", len(keys)))
    summary = _range_summary(settings, list(keys))
    summary["ranges_run"] = ran
    summary["follow"] = totals
    if target is None:
        summary["stopped"] = True
        print_summary(args, summary, f"stopped at a range boundary: {ran} range(s) run")
        return 0
    # "Caught up" is the origin's word, read again now, not the run's.
    step = pipeline.next_step(settings, target)
    if not isinstance(step, CaughtUp):
        if stop_requested():
            print_summary(args, summary, f"stopped before {target}: {ran} range(s) run")
            return 0
        raise CliError(f"not caught up to {target}: the next step is to {step.describe()}")
    summary["endpos_requested"] = str(target)
    spark = on_spark(totals, f"staged {totals.get('spark_ranges')} range(s)")
    print_summary(args, summary, f"caught up to {target}: {ran} range(s) run{spark}")
    return 0


RANGES_LISTED = 1000
"""A follow's summary lists the keys of its newest ranges, up to this many (``ranges_run``
counts them all, from the run's totals): one that runs for days takes hundreds of thousands."""


def _note_range(report: Any, keys: collections.deque[str]) -> None:
    """Keep the key of each range the follower reports (the run does not yield its ranges'
    events, see :mod:`pgcdc_dagster.defs.following`, so its result does not list them)."""
    key = getattr(report, "range_key", None)
    if key is not None:
        keys.append(LsnRange.from_key(key).partition_key)


def _follow_totals(result: Any) -> dict[str, Any]:
    """The follow run's totals (its closing observation of ``decoded_changes``)."""
    return observed_metadata(result, having="overlap_s")


def _range_summary(settings: ReplicationSettings, ran: list[str]) -> dict[str, Any]:
    from ..engine.control import pipeline

    store = pipeline.store_of(settings)
    last = store.last_stored()
    replay = pipeline.origin_progress(settings)
    last_result = dataclasses.asdict(last.manifest.result) if last else None
    if last_result is not None:
        last_result.pop("already_stored")
        last_result["replay_lsn"] = str(replay) if replay else None
    return {
        "ranges": ran,
        "last_range": last_result,
        "replay_lsn": str(replay) if replay else None,
    }
