"""``pgcdc verify`` (``--repair``) and ``pgcdc recover``: the compare's runs, and their verdicts
printed."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..cli_progress import shown
from ..engine.settings import ReplicationSettings
from ..runner import failure_text, run_job
from .output import CliError, metadata_value, print_tables, refuse_differing, repaired_lines
from .signals import lock_and_start


def cmd_verify(args: argparse.Namespace) -> int:
    """Runs the verify job (the ``target_matches_source`` check on every target table), or with
    ``--repair`` the repair job (the same compare, the differing chunks replaced, those tables
    compared again), and reports its evaluations: the comparison is done inside the run the UI
    shows. Then
    names the tables replicated once that the publication no longer sends (their target copy
    is stale, and no check covers them: they are no longer assets)."""
    from ..defs.jobs import REPAIR_JOB
    from ..engine.control import pipeline

    settings = ReplicationSettings.from_env()
    # No published table, no verify job (its checks are per table): only the stale ones.
    published = pipeline.replicated_tables(settings)
    result = None
    if published and args.repair:
        config = {"ops": {"repair_chunks": {"config": {"wait_s": args.wait}}}}
        with shown():
            result = run_job(REPAIR_JOB, run_config=config, allow_failure=True)
        for line in repaired_lines(result):
            print(line)
    elif published:
        with shown():
            result = run_job("verify", allow_failure=True)
    tables = []
    compared_at = None
    for evaluation in result.get_asset_check_evaluations() if result else []:
        (record,) = evaluation.metadata["tables"].value.records
        meta = evaluation.metadata
        compared_at = compared_at or metadata_value(meta.get("compared_at"))
        listed = metadata_value(meta.get("differing_chunk_list")) or ""
        tables.append(
            {
                "table": record.data["table"],
                "source_rows": record.data["source_rows"],
                "target_rows": record.data["target_rows"],
                "equal": bool(evaluation.passed),
                "missing_on": record.data.get("missing_on"),
                "chunks": metadata_value(meta.get("chunks")) or 1,
                "differing_chunks": [
                    line.removeprefix("- ") for line in listed.splitlines() if line
                ],
            }
        )
    tables.sort(key=lambda t: t["table"])
    differing = [t["table"] for t in tables if not t["equal"]]
    agreement = pipeline.tables_agreement(settings)
    stale = agreement.no_longer_published
    adding = agreement.adding_line()
    if args.json:
        print(
            json.dumps(
                {
                    "equal": not differing and not stale,
                    "compared_at": compared_at,
                    "differing_tables": differing,
                    "no_longer_published": [str(t) for t in stale],
                    "adding": adding,
                    "published_otherwise": agreement.reshaped_lines(),
                    "tables": tables,
                },
                indent=2,
            )
        )
    else:
        if compared_at:
            print(f"compared at {compared_at}, both sides at that point, chunk by chunk")
        print_tables(tables, stale)
        # Why those tables differ, and what to do.
        for note in ([adding] if adding is not None else []) + agreement.reshaped_lines():
            print(f"NOTE {note}")
    refuse_differing(tables, stale)
    if result is not None and not result.success:
        raise CliError(f"verify run {result.run_id} failed: {failure_text(result)}")
    return 0


def cmd_recover(args: argparse.Namespace) -> int:
    """Runs the recover job (:mod:`~pgcdc_dagster.engine.compare.recover`): a lost slot created
    anew, the rows changed since the target's position copied and the deleted keys removed
    (:mod:`~pgcdc_dagster.engine.compare.changed_since`), the tables that path cannot take
    compared chunk by chunk. Then a follow or a catch-up goes on from that point."""
    from ..engine.compare.recover import head_start
    from ..engine.compare.verify import DEFAULT_CHUNK_ROWS

    options: dict[str, Any] = {"wait_s": args.wait}
    if args.chunk_rows is not None:
        options["chunk_rows"] = args.chunk_rows
    if args.every_row:
        options["every_row"] = True
    config = {"ops": {"recover_slot": {"config": options}}}
    settings = ReplicationSettings.from_env()

    def start() -> Any:  # the same options as the run's, before Dagster is imported
        return head_start(
            settings,
            wait_s=args.wait,
            chunk_rows=args.chunk_rows or DEFAULT_CHUNK_ROWS,
            every_row=bool(args.every_row),
        )

    with shown(), lock_and_start(settings, "recover", start):
        from ..defs.jobs import RECOVER_JOB
        from ..defs.keys import SLOT_KEY

        result = run_job(RECOVER_JOB, run_config=config, allow_failure=True)
    if not result.success:
        raise CliError(f"recover run {result.run_id} failed: {failure_text(result)}")
    summary: dict[str, Any] = {}
    for event in result.get_asset_observation_events():
        observation = event.asset_observation_data.asset_observation
        if observation.asset_key == SLOT_KEY:
            summary = {key: entry.value for key, entry in observation.metadata.items()}
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(
        f"recovered at {summary['recovered_at']} (the target had applied "
        f"{summary['applied_before']}): {summary['rows_changed']} changed row(s) copied and "
        f"{summary['keys_deleted']} deleted key(s) removed in {summary['changed_seconds']:.1f} s; "
        f"{summary['chunks_compared']} chunk(s) compared in {summary['compare_seconds']:.1f} s, "
        f"{summary['chunks_repaired']} replaced; {summary['rows_copied']} row(s) copied in all; "
        "follow or catchup goes on from there"
    )
    if summary.get("compared_every_row"):
        print(f"compared chunk by chunk: {summary['compared_every_row']}")
    for line in repaired_lines(result):
        print(line)
    return 0
