"""The commands that change the replication's scope or end it: ``pgcdc cutover``, ``prune``,
``add-table``, ``resync``, ``finish``."""

from __future__ import annotations

import argparse
import json
import sys

from ..cli_progress import shown
from ..defs.instance import dagster_instance
from ..engine.settings import ReplicationSettings
from ..runner import (
    clear_the_way,
    fail_dead_lockless_runs,
    materialization_metadata,
    observed_metadata,
    run_job,
)
from .output import CliError, print_tables, refuse_differing


def cmd_cutover(args: argparse.Namespace) -> int:
    """Runs the cutover job (catch up to the endpos, copy sequence values, compare every
    table) under the range: a running follow makes way for it, and goes on after it (see
    :func:`~pgcdc_dagster.engine.control.range_lock.range_lock_or_way`). Exits non-zero when a table
    differs or is no longer published."""
    from ..engine.control import pipeline
    from ..engine.control.range_lock import command_holder, range_lock_or_way

    settings = ReplicationSettings.from_env()
    clear_the_way(dagster_instance(), settings, args.wait, "pgcdc cutover", waiting=False)
    holder = command_holder("cutover")
    with range_lock_or_way(
        settings.target_dsn, settings.slot, holder, args.wait, lend=True
    ) as lock:
        if lock.made_way_by and not args.json:
            print(f"pgcdc: {lock.made_way_by} made way for this cutover", file=sys.stderr)
        config = {"ops": {"cutover": {"config": {"endpos": args.endpos}}}}
        result = run_job("cutover_job", run_config=config)
    metadata = materialization_metadata(result, "cutover")
    tables = sorted(
        (record.data for record in metadata["tables"].records), key=lambda t: t["table"]
    )
    differing = [t["table"] for t in tables if not t["equal"]]
    stale = pipeline.no_longer_published(settings)
    report = {
        "endpos": metadata["endpos"],
        "endpos_outcome": metadata["endpos_outcome"],
        "ranges": metadata["ranges"],
        "sequences_synced": metadata["sequences_synced"],
        "foreign_keys_completed": metadata["foreign_keys_completed"],
        "made_way_by": lock.made_way_by,
        "equal": not differing and not stale,
        "differing_tables": differing,
        "no_longer_published": [str(t) for t in stale],
        "tables": tables,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_tables(tables, stale)
        print(
            f"cut over at {report['endpos']} ({report['endpos_outcome']}): {report['ranges']} "
            f"range(s) applied, {report['sequences_synced']} sequence(s) set to the source's; "
            f"foreign keys completed: {report['foreign_keys_completed']}"
        )
    refuse_differing(tables, stale)
    return 0


def cmd_prune(args: argparse.Namespace) -> int:
    """Runs the prune job (the store's retention, now) and reports its observation."""
    from ..defs.jobs import PRUNE_JOB
    from ..engine.settings import parse_duration

    ReplicationSettings.from_env()  # a wrong setting is one line before Dagster loads
    try:
        parse_duration(args.retention or "forever")
    except ValueError as exc:
        raise CliError(f"--retention: {exc}") from None
    config = {"retention": args.retention or "", "dry_run": bool(args.dry_run)}
    fail_dead_lockless_runs(dagster_instance(), "pgcdc prune")  # a killed prune's run
    result = run_job(PRUNE_JOB, run_config={"ops": {"prune_store": {"config": config}}})
    report = observed_metadata(result)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        verb = "would remove" if args.dry_run else "removed"
        print(
            f"{verb} {report['ranges_removed']} applied range(s) and "
            f"{report['history_ranges_removed']} of earlier snapshots "
            f"({int(report['bytes_removed']) / 1e6:.1f} MB); the chain's stored ranges begin at "
            f"{report['pruned_through'] or 'its consistent point'}, oldest kept "
            f"{report['oldest_kept'] or 'none'}"
        )
    return 0


def cmd_add_table(args: argparse.Namespace) -> int:
    """Runs the add_tables job: the tables copied as of a consistent point of their own, the
    apply then taking their changes from there (see :mod:`.engine.snapshot.added`); for
    ``pgcdc resync``, the resync_tables job: replicated tables copied again that way."""
    from ..defs.jobs import ADD_TABLES_JOB, RESYNC_TABLES_JOB
    from ..engine.identifiers import TableName

    resync = args.command == "resync"

    settings = ReplicationSettings.from_env()  # a wrong setting is one line before Dagster loads
    try:
        tables = [str(TableName.parse(name)) for name in args.tables]
    except ValueError as exc:
        raise CliError(str(exc)) from None
    # Its run waits for the range itself, up to --wait: a live follow makes way for it.
    clear_the_way(dagster_instance(), settings, args.wait, f"pgcdc {args.command}", waiting=False)
    op = "copy_resynced_tables" if resync else "copy_added_tables"
    config = {"ops": {op: {"config": {"tables": tables, "wait_s": args.wait}}}}
    with shown():  # the copy's progress, as a snapshot's
        result = run_job(RESYNC_TABLES_JOB if resync else ADD_TABLES_JOB, run_config=config)
    report = {k: v for k, v in observed_metadata(result).items() if k != "tables"}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(
            f"{'resynced' if resync else 'added'} {report['added_tables']}: {report['rows']} "
            "rows copied as of "
            f"{report['consistent_point']}, {report['held_back_changes']} change(s) held back "
            f"meanwhile applied in {report['held_back_transactions']} transaction(s) "
            f"({report['held_back_with_range']} with the range), the rest "
            "applied by the next catchup or follow"
        )
        if report.get("held_back_staged_on_driver"):
            print(
                f"warning: {report['held_back_staged_on_driver']} held-back range(s) staged on "
                f"the driver: {report['held_back_staged_on_driver_why']} "
                "(PGCDC_SPARK_STAGING=required stops instead)"
            )
    return 0


def cmd_finish(args: argparse.Namespace) -> int:
    """Runs the finish job: the replication recorded as ended, the source's slot and the
    target's origin dropped (see :mod:`.engine.control.finish`); a running follow makes way, then
    stops."""
    from ..defs.jobs import FINISH_JOB

    settings = ReplicationSettings.from_env()
    clear_the_way(dagster_instance(), settings, args.wait, "pgcdc finish", waiting=False)
    config = {"abandon": args.abandon, "wait_s": args.wait}
    result = run_job(FINISH_JOB, run_config={"ops": {"end_replication": {"config": config}}})
    report = observed_metadata(result)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(
            f"replication of slot {settings.slot} finished, the target at "
            f"{report['finished_at']}: the slot "
            f"{'dropped' if report['slot_dropped'] else 'was already gone'}, the origin "
            f"{'dropped' if report['origin_dropped'] else 'was already gone'}; publication "
            f"{report['publication_kept']} left (DROP PUBLICATION it if nothing else uses it)"
        )
    return 0
