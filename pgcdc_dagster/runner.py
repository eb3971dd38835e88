"""Running the project's jobs from a process of our own (the CLI, the demo): each run executes
in this process, recorded in the instance (:mod:`.defs.instance`), and a failed one ends the
command with one line.

This module sits above the code location (:mod:`.definitions`), which it resolves jobs from;
nothing in ``defs`` imports it. It imports the definitions when a job runs, not when it is
imported: a command that runs no job does not pay for them.
"""

from __future__ import annotations

import getpass
import os
import socket
import sys
import time
from typing import Any

from .defs.instance import dagster_instance
from .defs.storage_outage import recorded_storage_problem, unreachable_line
from .engine.errors import PgcdcError
from .engine.settings import ReplicationSettings

QUIET = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}
"""Runs started here log to the instance (and the UI) in full; the terminal gets one line."""


class RunFailedError(PgcdcError):
    """A run of the project's jobs failed or cannot start; the message is the one line."""


def load_defs() -> Any:
    from .definitions import defs

    return defs()


def _definitions_of(job: str) -> Any:
    """Where ``job`` is resolved: the op jobs alone (:func:`.definitions.op_job_definitions`)
    or the whole location."""
    from .definitions import op_job_definitions
    from .defs.jobs import OP_JOBS

    return op_job_definitions() if job in OP_JOBS else load_defs()


def run_job(
    name: str,
    *,
    partition_key: str | None = None,
    run_config: dict | None = None,
    allow_failure: bool = False,
) -> Any:
    """Execute a job of the code location in this process, recorded in the instance and tagged
    with this process's identity (so that, if this process dies, the next command sees at once
    that the run is dead), and with who launched it: ``dagster/user`` is the tag Dagster's Runs
    list shows as "Launched by" (else it reads "Manually launched"); here it is the OS account
    and host of the command, ``user@host``."""
    from .defs.run_liveness import PROCESS_TAG
    from .engine import processes

    job = _definitions_of(name).resolve_job_def(name)
    result = job.execute_in_process(
        instance=dagster_instance(),
        partition_key=partition_key,
        run_config={**QUIET, **(run_config or {})},
        tags={PROCESS_TAG: processes.identity(), LAUNCHED_BY_TAG: launched_by()},
        raise_on_error=False,
    )
    if not result.success and not allow_failure:
        raise RunFailedError(f"{name} run {result.run_id} failed: {failure_text(result)}")
    return result


LAUNCHED_BY_TAG = "dagster/user"


def launched_by() -> str:
    """``user@host`` of this command, for the Runs list's "Launched by"."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    return f"{user}@{socket.gethostname()}"


def failure_text(result: Any) -> str:
    for event in result.all_events:
        if event.is_step_failure:
            data = event.step_failure_data
            if data.user_failure_data and data.user_failure_data.description:
                return str(data.user_failure_data.description)
            return _error_line(data.error) or "step failed"
        if event.is_resource_init_failure or event.is_run_failure:
            line = _error_line(getattr(event.event_specific_data, "error", None))
            if line:
                return line
    return "see the run in the Dagster UI"


def _error_line(error: Any) -> str | None:
    """The line to show of a chain of errors: the deepest of ours (a :class:`PgcdcError`
    names the problem and the fix), else Dagster's storage named when it could not be reached
    (a write of Dagster's own, outside what a follow rides through), else the deepest one's
    last line."""
    first = error
    ours, deepest = None, None
    while error is not None:
        if error.cls_name in _pgcdc_error_names():
            ours = error
        deepest, error = error, error.cause
    if ours is None and (problem := recorded_storage_problem(first)) is not None:
        return unreachable_line(problem)
    chosen = ours or deepest
    if chosen is None:
        return None
    text = chosen.message.strip()
    if ours is None:
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        if len(lines) > 1 and lines[-1].startswith(("HINT:", "DETAIL:")):
            return f"{lines[0]} ({lines[-1]})"  # a server error: its message, then its hint
        return lines[-1] if lines else None
    head, sep, rest = text.partition(": ")
    return rest if sep and head.rsplit(".", 1)[-1] == chosen.cls_name else text


def _pgcdc_error_names() -> set[str]:
    names, todo = set(), [PgcdcError]
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return names


def say_failed(dead: list[Any]) -> None:
    """One line per dead run marked failed (:func:`~.defs.run_liveness.fail_dead_runs`)."""
    for verdict in dead:
        print(
            f"pgcdc: run {verdict.run.run_id} ({verdict.run.job_name}) was left unfinished: "
            f"{verdict.reason}; marked it failed",
            file=sys.stderr,
        )


def fail_dead_lockless_runs(instance: Any, command: str) -> None:
    """Mark failed the runs that hold no range lock (a prune) whose process is gone, saying
    so: nothing else ever ends them."""
    from .defs.run_liveness import fail_dead_runs, lockless_runs_gone

    say_failed(fail_dead_runs(instance, lockless_runs_gone(instance), command))


def clear_the_way(
    instance: Any,
    settings: ReplicationSettings,
    wait_s: float,
    command: str,
    *,
    waiting: bool = True,
) -> None:
    """Before a run that takes the range lock: fail the runs whose worker died (saying so),
    cancel queued per-range runs (this command does their work), and wait for a live run to
    finish, or refuse after ``wait_s`` seconds. Runs started here and runs the daemon launches
    obey the same rule: one holder of the range lock at a time.

    ``waiting=False``: nothing to wait for here. Either this process already holds the lock (a
    head start), so no other run can be alive (a run launched meanwhile fails at once on the
    lock), or the command takes the range in its run, where a live follow makes way for it
    (``pgcdc add-table``, see
    :func:`~pgcdc_dagster.engine.control.range_lock.range_lock_or_way`)."""
    from dagster import DagsterRunStatus

    from .defs.run_liveness import ALIVE, QUEUED, fail_dead_runs, judge, pgcdc_runs_not_finished
    from .engine.control.range_lock import lock_holders

    grace = settings.dead_run_grace
    deadline = time.monotonic() + wait_s
    while True:
        holders = lock_holders(settings.target_dsn, settings.slot)
        verdicts = judge(instance, pgcdc_runs_not_finished(instance), holders, grace)
        say_failed(fail_dead_runs(instance, verdicts, command))
        fail_dead_lockless_runs(instance, command)
        live = []
        for verdict in verdicts:
            if verdict.state == QUEUED and verdict.run.job_name == "catchup":
                if verdict.run.status == DagsterRunStatus.QUEUED:
                    instance.report_run_canceled(
                        verdict.run,
                        message=f"superseded by {command}, which takes the range itself",
                    )
            elif verdict.state in (ALIVE, QUEUED):
                live.append(verdict)
        if not waiting or (not live and not holders):
            return
        if time.monotonic() > deadline:
            who = (
                f"run {live[0].run.run_id} ({live[0].reason})"
                if live
                else f"{holders[0].holder}, holding the range lock"
            )
            raise RunFailedError(
                f"a catch-up is still in flight after {wait_s:.0f} s: {who}; wait for it (see "
                "the Dagster UI) or pass a longer --wait"
            )
        time.sleep(1)


def observed_metadata(result: Any, having: str | None = None) -> dict[str, Any]:
    """The metadata values of the run's last asset observation (with the key ``having``, when
    given): what an ops job reports (prune, add-table, finish; a follow's totals)."""
    observed: dict[str, Any] = {}
    for event in result.all_events:
        if event.is_asset_observation:
            metadata = event.asset_observation_data.asset_observation.metadata
            if having is None or having in metadata:
                observed = {k: v.value for k, v in metadata.items()}
    return observed


def materialization_metadata(result: Any, key: str) -> dict[str, Any]:
    for event in result.get_asset_materialization_events():
        mat = event.step_materialization_data.materialization
        if mat.asset_key.to_user_string() == key:
            return {k: getattr(v, "value", v) for k, v in mat.metadata.items()}
    return {}
