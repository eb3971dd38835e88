"""``pgcdc status``: where the replication stands, and the Dagster runs in flight."""

from __future__ import annotations

import argparse

from ..defs.instance import dagster_instance
from ..engine.settings import ReplicationSettings
from .output import print_status


def cmd_status(args: argparse.Namespace) -> int:
    from ..engine.control.status import replication_status

    settings = ReplicationSettings.from_env()
    status = replication_status(settings)
    shown = status.as_dict()
    if status.finished is None:
        shown["runs_in_flight"] = _runs_in_flight(settings)  # known to Dagster only
    print_status(args, shown)
    return 0


def _runs_in_flight(settings: ReplicationSettings) -> list[str] | str:
    """Not-finished range-lock runs as ``run id (job): verdict``; empty without an instance;
    a line saying why when Dagster's storage cannot be reached."""
    from ..defs.run_liveness import judge, pgcdc_runs_not_finished
    from ..defs.storage_outage import (
        storage_name,
        storage_problem,
        storage_unreachable,
        unreachable_now,
    )
    from ..engine.control.range_lock import lock_holders

    holders = lock_holders(settings.target_dsn, settings.slot)
    # The replication's state needs no Dagster; only its runs are not known without it.
    problem = unreachable_now()
    if problem is None:
        try:
            instance = dagster_instance()
            verdicts = judge(
                instance, pgcdc_runs_not_finished(instance), holders, settings.dead_run_grace
            )
        except Exception as exc:
            if not storage_unreachable(exc):
                raise
            problem = storage_problem(exc)
    if problem is not None:
        held = "; ".join(h.holder for h in holders) or "nobody"
        return f"unknown: {storage_name()} cannot be reached: {problem} (range lock: {held})"
    return [f"{v.run.run_id} ({v.run.job_name}): {v.state}, {v.reason}" for v in verdicts]
