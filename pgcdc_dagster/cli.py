"""``pgcdc``: the command line, a thin layer that runs everything through Dagster.

Every command that changes something launches a run of a job of
``pgcdc_dagster.definitions:defs`` against the Dagster instance of ``DAGSTER_HOME``, so each
run shows in the UI beside the sensor's. Errors are one line (``--debug`` for the traceback).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from .config import ReplicationSettings, SettingsError
from .lsn import LsnRange

QUIET = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}
"""Runs started here log to the instance (and the UI) in full; the terminal gets one line."""


class CliError(RuntimeError):
    """A failure to report as one line and a non-zero exit."""


def dagster_instance() -> Any:
    from dagster import DagsterInstance

    if not os.environ.get("DAGSTER_HOME"):
        raise CliError(
            "DAGSTER_HOME is not set: point it at a directory holding the project's dagster.yaml "
            "(and set DAGSTER_POSTGRES_URL for its storage); 'pgcdc demo' sets both up"
        )
    return DagsterInstance.get()


def load_defs() -> Any:
    from .definitions import defs

    return defs()


def run_job(
    name: str,
    *,
    partition_key: str | None = None,
    run_config: dict | None = None,
    allow_failure: bool = False,
) -> Any:
    """Execute a job of the code location in this process, recorded in the instance."""
    job = load_defs().resolve_job_def(name)
    result = job.execute_in_process(
        instance=dagster_instance(),
        partition_key=partition_key,
        run_config={**QUIET, **(run_config or {})},
        raise_on_error=False,
    )
    if not result.success and not allow_failure:
        raise CliError(f"{name} run {result.run_id} failed: {_failure_text(result)}")
    return result


def _failure_text(result: Any) -> str:
    for event in result.all_events:
        if event.is_step_failure:
            data = event.step_failure_data
            if data.user_failure_data and data.user_failure_data.description:
                return str(data.user_failure_data.description)
            error = data.error
            while error is not None and error.cause is not None:
                error = error.cause
            return error.message.strip() if error is not None else "step failed"
    return "see the run in the Dagster UI"


def wait_for_catchup_runs(instance: Any, wait_s: float) -> None:
    """The CLI and the sensor never race: wait for an in-flight catch-up run, or refuse."""
    from .sensors import catchup_in_flight

    deadline = time.monotonic() + wait_s
    while catchup_in_flight(instance):
        if time.monotonic() > deadline:
            raise CliError(
                f"a catch-up run is still in flight after {wait_s:.0f} s: wait for it (see the "
                "Dagster UI) or pass a longer --wait"
            )
        time.sleep(1)


# -- commands ---------------------------------------------------------------------------------


def cmd_snapshot(args: argparse.Namespace) -> int:
    config = {"ops": {"base_snapshot": {"config": {"resnapshot": bool(args.resnapshot)}}}}
    result = run_job("snapshot", run_config=config)
    meta = materialization_metadata(result, "base_snapshot")
    print(
        f"base snapshot taken: consistent point {meta.get('consistent_point')}, "
        f"{meta.get('rows')} rows, {meta.get('seconds')} s"
    )
    return 0


def cmd_catchup(args: argparse.Namespace) -> int:
    from . import pipeline
    from .partitions import LSN_RANGES, registered_ranges

    settings = ReplicationSettings.from_env()
    instance = dagster_instance()
    wait_for_catchup_runs(instance, args.wait)
    target = pipeline.resolve_endpos(settings, args.endpos)
    ran: list[str] = []

    def run_range(rng: LsnRange) -> str:
        run_job("catchup", partition_key=rng.key)
        ran.append(rng.key)
        return rng.key

    list(
        pipeline.catch_up(
            settings,
            target,
            registered=registered_ranges(instance),
            register=lambda key: instance.add_dynamic_partitions(LSN_RANGES, [key]),
            run_range=run_range,
        )
    )
    summary = _range_summary(settings, ran)
    summary["endpos_requested"] = str(target)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        last = summary.get("last_range") or {}
        print(
            f"caught up to {target}: {len(ran)} range(s) run; last range "
            f"{last.get('range_key', '-')} outcome {last.get('endpos_outcome', '-')}, "
            f"transform_lsn {last.get('transform_lsn', '-')}, replay_lsn "
            f"{summary.get('replay_lsn')}"
        )
    return 0


def _range_summary(settings: ReplicationSettings, ran: list[str]) -> dict[str, Any]:
    from . import pipeline

    store = pipeline.store_of(settings)
    chain = store.chain_ranges()
    last = store.get(chain[-1]) if chain else None
    replay = pipeline.origin_progress(settings)
    last_result = dict(last.manifest["result"]) if last else None
    if last_result is not None:
        last_result["bytes"] = last.manifest.get("bytes", 0)  # type: ignore[union-attr]
        last_result["replay_lsn"] = str(replay) if replay else None
    return {
        "ranges": ran,
        "last_range": last_result,
        "replay_lsn": str(replay) if replay else None,
    }


def cmd_status(args: argparse.Namespace) -> int:
    from . import pipeline

    settings = ReplicationSettings.from_env()
    positions = pipeline.source_positions(settings)
    store = pipeline.store_of(settings)
    chain = store.chain_ranges() if store.chain() else []
    replay = pipeline.origin_progress(settings)
    status = {
        "slot": settings.slot,
        "confirmed_flush_lsn": str(positions.slot.confirmed_flush_lsn),
        "restart_lsn": str(positions.slot.restart_lsn),
        "wal_status": positions.slot.wal_status,
        "active": positions.slot.active,
        "flush_lsn": str(positions.flush_lsn),
        "lag_bytes": positions.lag_bytes,
        "retained_wal_bytes": positions.slot.retained_wal_bytes,
        "consistent_point": (store.chain() or {}).get("consistent_point"),
        "ranges_stored": len(chain),
        "last_range": chain[-1].key if chain else None,
        "replay_lsn": str(replay) if replay else None,
    }
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        width = max(len(k) for k in status)
        for key, value in status.items():
            print(f"{key.ljust(width)}  {value}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """Runs the verify job (the ``target_matches_source`` check on every target table) and
    reports its evaluations: the comparison is done once, inside the run the UI shows."""
    result = run_job("verify", allow_failure=True)
    tables = []
    for evaluation in result.get_asset_check_evaluations():
        (record,) = evaluation.metadata["tables"].value.records
        tables.append(
            {
                "table": record.data["table"],
                "source_rows": record.data["source_rows"],
                "target_rows": record.data["target_rows"],
                "equal": bool(evaluation.passed),
            }
        )
    tables.sort(key=lambda t: t["table"])
    differing = [t["table"] for t in tables if not t["equal"]]
    if args.json:
        print(
            json.dumps(
                {"equal": not differing, "differing_tables": differing, "tables": tables}, indent=2
            )
        )
    else:
        for t in tables:
            mark = "ok  " if t["equal"] else "DIFF"
            print(
                f"{mark} {t['table']}: source {t['source_rows']} rows, "
                f"target {t['target_rows']} rows"
            )
    if differing:
        raise CliError(f"tables differ between source and target: {', '.join(differing)}")
    if not result.success:
        raise CliError(f"verify run {result.run_id} failed: {_failure_text(result)}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(ui=args.ui, seconds=args.seconds, tps=args.tps)


def materialization_metadata(result: Any, key: str) -> dict[str, Any]:
    for event in result.get_asset_materialization_events():
        mat = event.step_materialization_data.materialization
        if mat.asset_key.to_user_string() == key:
            return {k: getattr(v, "value", v) for k, v in mat.metadata.items()}
    return {}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pgcdc", description="PostgreSQL to PostgreSQL replication as Dagster assets."
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("snapshot", help="materialise base_snapshot (the initial copy)")
    p.add_argument("--resnapshot", action="store_true", help="re-copy a populated target")
    p.set_defaults(func=cmd_snapshot)
    p = sub.add_parser("catchup", help="receive and apply ranges up to endpos")
    p.add_argument("--endpos", default="current", help="an LSN X/Y, or 'current' (default)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--wait", type=float, default=120.0, help="seconds to wait for a run in flight")
    p.set_defaults(func=cmd_catchup)
    p = sub.add_parser("status", help="slot positions, lag, last range, replay LSN")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)
    p = sub.add_parser("verify", help="compare every table on source and target")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_verify)
    p = sub.add_parser("demo", help="the embedded default: local clusters, workload, cutover")
    p.add_argument("--ui", action="store_true", help="leave the webserver running afterwards")
    p.add_argument("--seconds", type=float, default=30.0, help="workload duration")
    p.add_argument("--tps", type=int, default=300, help="workload transactions per second")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (CliError, SettingsError) as exc:
        print(f"pgcdc: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        if args.debug:
            raise
        print(f"pgcdc: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
