"""Which of Dagster's range-lock runs are alive, and failing the dead ones so nothing waits on them.

Dagster's run records are a view for people: a run worker that is SIGKILLed (or OOM-killed, or
whose machine reboots) stays ``STARTED`` there for ever, because nothing watches an in-process
run and the default run launcher cannot check a worker's health. The range lock
(:mod:`.range_lock`) is the truth: every run that receives, applies or snapshots holds it for
its whole life, under its run id, and the server frees it the moment the process dies.

A not-finished run is judged, in this order:

1. *queued*: the run coordinator has not launched it; it holds nothing yet (but a run a
   command created for itself, tagged with that command's process, is *dead* once that
   process is gone: a command killed between creating its run and starting it);
2. *alive*: a session holds the range lock as ``run <its id>``;
3. *alive* or *dead* by its process: the run carries ``pgcdc/process`` (host, pid and the
   process's start time, so a recycled pid is not mistaken for it); on this host that process
   either exists or not;
4. otherwise *dead* once it has shown no sign of life (no event, no lock) for ``grace_s``
   seconds; a run that is merely starting (spawning a worker, importing code) logs its launch
   and holds the lock within a few seconds.

Dead runs are marked failed through the instance (``report_run_failed``) with a message that
says why, so the UI shows it; then whoever found them (the CLI or the slot sensor) carries on
from the durable facts. Marking a run that was in fact alive failed would be harmless to data:
the origin, the slot and the store each refuse a second writer on their own.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from dagster import DagsterInstance, DagsterRunStatus, RunsFilter
from dagster._core.storage.dagster_run import NOT_FINISHED_STATUSES, DagsterRun

from ..engine import processes
from ..engine.control.range_lock import LockHolder

RANGE_LOCK_TAG = "pgcdc/range_lock"
"""Carried by every run that holds the range lock; ``dagster.yaml`` runs them one at a time."""
PROCESS_TAG = "pgcdc/process"
"""The process executing the run, named by :func:`~pgcdc_dagster.engine.processes.identity`."""
DEFAULT_GRACE_S = 10.0

QUEUED = "queued"
ALIVE = "alive"
DEAD = "dead"


@dataclass(frozen=True)
class RunVerdict:
    run: DagsterRun
    state: str
    reason: str


def lock_holder_name(run_id: str) -> str:
    """How a run names itself as the range lock's holder."""
    return f"run {run_id}"


def pgcdc_runs_not_finished(instance: DagsterInstance) -> list[DagsterRun]:
    """Every not-finished run that holds, or will hold, the range lock."""
    runs = instance.get_runs(RunsFilter(statuses=list(NOT_FINISHED_STATUSES)))
    return [run for run in runs if RANGE_LOCK_TAG in run.tags]


def judge(
    instance: DagsterInstance,
    runs: Sequence[DagsterRun],
    holders: Sequence[LockHolder],
    grace_s: float,
) -> list[RunVerdict]:
    """The verdict on each run (see the module docstring)."""
    holding = {h.holder for h in holders}
    verdicts = []
    now = time.time()
    for run in runs:
        identity = run.tags.get(PROCESS_TAG)
        if run.status in (DagsterRunStatus.QUEUED, DagsterRunStatus.NOT_STARTED):
            if identity and processes.alive(identity) is False:  # created, then its process died
                verdicts.append(
                    RunVerdict(run, DEAD, f"its process ({identity}) is gone before it started")
                )
            else:
                verdicts.append(RunVerdict(run, QUEUED, "queued"))
            continue
        if lock_holder_name(run.run_id) in holding:
            verdicts.append(RunVerdict(run, ALIVE, "holds the range lock"))
            continue
        alive = processes.alive(identity)
        if alive is True:
            verdicts.append(RunVerdict(run, ALIVE, f"its process ({identity}) is running"))
            continue
        if alive is False:
            verdicts.append(
                RunVerdict(run, DEAD, f"its process ({identity}) is gone and it holds no lock")
            )
            continue
        quiet = now - _last_sign_of_life(instance, run)
        if quiet > grace_s:
            verdicts.append(
                RunVerdict(
                    run, DEAD, f"it has held no range lock and logged nothing for {quiet:.0f} s"
                )
            )
        else:
            verdicts.append(RunVerdict(run, ALIVE, "starting"))
    return verdicts


def _last_sign_of_life(instance: DagsterInstance, run: DagsterRun) -> float:
    record = instance.get_run_record_by_id(run.run_id)
    stamps = [] if record is None else [record.create_timestamp.timestamp()]
    if record is not None and record.start_time:
        stamps.append(record.start_time)
    records = instance.get_records_for_run(run.run_id, ascending=False, limit=1).records
    if records:
        stamps.append(records[0].event_log_entry.timestamp)
    return max(stamps, default=time.time())


def lockless_runs_gone(instance: DagsterInstance) -> list[RunVerdict]:
    """The started runs that take no range lock (a prune, a verify...) whose process on this
    host is gone: dead, since nothing else would ever end them. A run of another host, or
    without a process tag, is left alone: no lock tells whether it lives."""
    started = [DagsterRunStatus.STARTING, DagsterRunStatus.STARTED]
    verdicts = []
    for run in instance.get_runs(RunsFilter(statuses=started)):
        identity = run.tags.get(PROCESS_TAG)
        if RANGE_LOCK_TAG in run.tags or not identity:
            continue
        if processes.alive(identity) is False:
            verdicts.append(RunVerdict(run, DEAD, f"its process ({identity}) is gone"))
    return verdicts


def fail_dead_runs(
    instance: DagsterInstance, verdicts: Sequence[RunVerdict], found_by: str
) -> list[RunVerdict]:
    """Mark every dead run failed, saying why; returns them."""
    dead = [v for v in verdicts if v.state == DEAD]
    for verdict in dead:
        instance.report_run_failed(
            verdict.run,
            message=(
                f"pgcdc: this run's worker is gone ({verdict.reason}); marked failed by "
                f"{found_by}. Nothing is lost: the next catch-up resumes from the output store "
                "and the target's replication origin."
            ),
        )
    return dead
