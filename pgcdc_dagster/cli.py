"""``pgcdc``: the command line, a thin layer that runs everything through Dagster.

Every command that changes something launches a run of a job of
``pgcdc_dagster.definitions:defs`` against the Dagster instance of ``DAGSTER_HOME``, so each
run shows in the UI beside the sensor's. Errors are one line (``--debug`` for the traceback).

Why one module: each command is a short function over the engine and the runner, and the
argument parser beside them is what the CLI reference is generated from
(``docs/reference/cli.md``); the commands share its error and output conventions.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from .cli_progress import shown
from .defs.instance import dagster_instance
from .engine.errors import PgcdcError
from .engine.lsn import LsnRange
from .engine.settings import ReplicationSettings, SettingsError
from .runner import (
    clear_the_way,
    failure_text,
    materialization_metadata,
    observed_metadata,
    run_job,
)

if TYPE_CHECKING:
    from .engine.identifiers import TableName


class CliError(PgcdcError):
    """A usage problem, reported as one line and exit status 2."""


# -- commands ---------------------------------------------------------------------------------


def cmd_snapshot(args: argparse.Namespace) -> int:
    from .engine.control import pipeline
    from .engine.control.head_start import Background, offer

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
        _head_start(settings, "snapshot", start) as started,
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
        f"{meta.get('rows')} rows, {meta.get('seconds')} s{_on_spark(meta, 'copied tables')}; "
        f"PostgreSQL {meta.get('source_version')} to {meta.get('target_version')}"
    )
    return 0


HEAD_START_SETTLE_S = 3.0
"""How long ``pgcdc snapshot`` lets its head start reach the copy before it imports Dagster and
creates the run (:func:`_until_copying`)."""


@contextlib.contextmanager
def _snapshot_copying() -> Iterator[threading.Event]:
    """An event set once this process's snapshot reports its copy (or a later phase)."""
    from .engine import progress

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
    for a core) while Dagster's import (about 1.5 CPU-s of Python) holds it; importing after
    them starts the copy about half a second sooner, and the import then overlaps the copy,
    whose work is in other processes (``benchmarks/HISTORY.md``, the snapshot's time to its
    first row). The bound keeps a snapshot waiting for its slot (open transactions on the
    source) from hiding its run in the UI for long."""
    deadline = time.monotonic() + HEAD_START_SETTLE_S
    while not copying.is_set() and work.running() and time.monotonic() < deadline:
        copying.wait(0.05)


def _on_spark(meta: dict[str, Any], did: str) -> str:
    """``; Spark application <id> <did> (UI <url>)`` when Spark did some of the work."""
    app = meta.get("spark_application_id")
    if not app:
        return ""
    ui = meta.get("spark_ui")
    return f"; Spark application {app} {did}" + (f" (UI {ui})" if ui else "")


def cmd_catchup(args: argparse.Namespace) -> int:
    """Follow with an endpos: one pipelined run up to it."""
    return _follow(args, args.endpos, "pgcdc catchup")


def cmd_follow(args: argparse.Namespace) -> int:
    """Follow until SIGTERM/SIGINT (or an endpos, when given)."""
    return _follow(args, args.endpos, "pgcdc follow")


def _follow(args: argparse.Namespace, endpos: str | None, command: str) -> int:
    from .engine import progress
    from .engine.control import pipeline
    from .engine.control.next_step import CaughtUp
    from .engine.follow.process import head_start

    settings = ReplicationSettings.from_env()
    target = pipeline.resolve_endpos(settings, endpos) if endpos else None

    def start() -> Any:
        # The follower gets a process of its own (engine/follow/process.py), so neither the
        # Dagster imports of a cold command nor the run's own work share its interpreter lock.
        return head_start(settings, target, settings.spark_session, own_process=True)

    keys: collections.deque[str] = collections.deque(maxlen=RANGES_LISTED)
    with (
        _stops_at_boundary(),
        shown(),
        progress.listening(lambda report: _note_range(report, keys)),
        _head_start(settings, "follow", start) as started,
    ):
        # While Dagster loads, the follower is already at work (when the lock was free).
        instance = dagster_instance()
        clear_the_way(instance, settings, args.wait, command, waiting=not started)
        from .defs.jobs import NO_ENDPOS

        config = {"endpos": str(target) if target else NO_ENDPOS}
        result = _run_in_worker({"ops": {"follow_stream": {"config": config}}})
    totals = _follow_totals(result)
    ran = int(totals.get("ranges", len(keys)))
    summary = _range_summary(settings, list(keys))
    summary["ranges_run"] = ran
    summary["follow"] = totals
    if target is None:
        summary["stopped"] = True
        _print_summary(args, summary, f"stopped at a range boundary: {ran} range(s) run")
        return 0
    # "Caught up" is the origin's word, read again now, not the run's.
    step = pipeline.next_step(settings, target)
    if not isinstance(step, CaughtUp):
        if _stop_requested:
            _print_summary(args, summary, f"stopped before {target}: {ran} range(s) run")
            return 0
        raise CliError(f"not caught up to {target}: the next step is to {step.describe()}")
    summary["endpos_requested"] = str(target)
    spark = _on_spark(totals, f"staged {totals.get('spark_ranges')} range(s)")
    _print_summary(args, summary, f"caught up to {target}: {ran} range(s) run{spark}")
    return 0


@contextlib.contextmanager
def _head_start(settings: ReplicationSettings, kind: str, start: Any) -> Iterator[bool]:
    """Take the range lock and ``start()`` the work at once, before Dagster is even imported;
    the run adopts both (see :mod:`pgcdc_dagster.engine.control.head_start`). Yields whether it did:
    with the lock held elsewhere it does nothing, and :func:`clear_the_way` waits as usual.
    On the way out it waits for the work to end (adopted or not) before the lock goes."""
    from .engine.control.head_start import adopt
    from .engine.control.range_lock import RangeBusyError, command_holder, range_lock

    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(
                range_lock(settings.target_dsn, settings.slot, command_holder(), lend=True)
            )
        except RangeBusyError:
            yield False
            return
        work = start()
        try:
            yield True
        finally:
            adopt(kind, settings.slot)  # not adopted if the run never started: it ends here
            work.close("the command ended")  # the run has closed it when it ran


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


def _print_summary(args: argparse.Namespace, summary: dict[str, Any], headline: str) -> None:
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    last = summary.get("last_range") or {}
    key = last.get("range_key")
    print(
        f"{headline}; last range {LsnRange.from_key(key).partition_key if key else '-'} outcome "
        f"{last.get('endpos_outcome', '-')}, transform_lsn {last.get('transform_lsn', '-')}, "
        f"replay_lsn {summary.get('replay_lsn')}"
    )


_stop_requested = False


@contextlib.contextmanager
def _stops_at_boundary() -> Iterator[None]:
    """SIGTERM and SIGINT stop the follow at a range boundary (exit 0): the first one sets the
    stop, a second one interrupts as usual."""

    from .engine.follow.follower import stop_all

    def handler(signum: int, frame: Any) -> None:
        global _stop_requested
        if _stop_requested:
            raise KeyboardInterrupt
        _stop_requested = True
        stop_all(f"stopped by {signal.Signals(signum).name}")  # a head start's follower too
        print(
            f"pgcdc: {signal.Signals(signum).name}: stopping at the next range boundary",
            file=sys.stderr,
        )

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _run_in_worker(run_config: dict[str, Any]) -> Any:
    """Run the follow job on a worker thread: Dagster installs its own SIGINT/SIGTERM handlers
    only on the main thread (they turn a signal into an interrupted, failed step), so here the
    signals stay ours (:func:`_stops_at_boundary`), and a stop reaches the follower once it
    runs."""
    from .defs.storage_outage import given_up
    from .engine.follow.follower import stop_all

    outcome: dict[str, Any] = {}

    def work() -> None:
        try:
            outcome["result"] = run_job("follow", run_config=run_config)
        except BaseException as exc:  # re-raised on the main thread
            outcome["error"] = exc

    worker = threading.Thread(target=work, name="pgcdc-follow-run", daemon=True)
    worker.start()
    while worker.is_alive():
        if _stop_requested:
            stop_all("stopped by a signal")  # again each turn: the follower may start late
        if (gone := given_up()) is not None:
            raise gone  # the follower has stopped; Dagster cannot record the run's end
        worker.join(timeout=0.2)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def _range_summary(settings: ReplicationSettings, ran: list[str]) -> dict[str, Any]:
    from .engine.control import pipeline

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


def _print_status(args: argparse.Namespace, status: dict[str, Any]) -> None:
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        width = max(len(k) for k in status)
        for key, value in status.items():
            print(f"{key.ljust(width)}  {value}")


def cmd_status(args: argparse.Namespace) -> int:
    from .engine.control.status import replication_status

    settings = ReplicationSettings.from_env()
    status = replication_status(settings)
    shown = status.as_dict()
    if status.finished is None:
        shown["runs_in_flight"] = _runs_in_flight(settings)  # known to Dagster only
    _print_status(args, shown)
    return 0


def _runs_in_flight(settings: ReplicationSettings) -> list[str] | str:
    """Not-finished range-lock runs as ``run id (job): verdict``; empty without an instance;
    a line saying why when Dagster's storage cannot be reached."""
    from .defs.run_liveness import judge, pgcdc_runs_not_finished
    from .defs.storage_outage import (
        storage_name,
        storage_problem,
        storage_unreachable,
        unreachable_now,
    )
    from .engine.control.range_lock import lock_holders

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


def cmd_verify(args: argparse.Namespace) -> int:
    """Runs the verify job (the ``target_matches_source`` check on every target table), or with
    ``--repair`` the repair job (the same compare, the differing chunks replaced, those tables
    compared again), and reports its evaluations: the comparison is done inside the run the UI
    shows. Then
    names the tables replicated once that the publication no longer sends (their target copy
    is stale, and no check covers them: they are no longer assets)."""
    from .defs.jobs import REPAIR_JOB
    from .engine.control import pipeline

    settings = ReplicationSettings.from_env()
    # No published table, no verify job (its checks are per table): only the stale ones.
    published = pipeline.replicated_tables(settings)
    result = None
    if published and args.repair:
        config = {"ops": {"repair_chunks": {"config": {"wait_s": args.wait}}}}
        with shown():
            result = run_job(REPAIR_JOB, run_config=config, allow_failure=True)
        for line in _repaired_lines(result):
            print(line)
    elif published:
        with shown():
            result = run_job("verify", allow_failure=True)
    tables = []
    compared_at = None
    for evaluation in result.get_asset_check_evaluations() if result else []:
        (record,) = evaluation.metadata["tables"].value.records
        meta = evaluation.metadata
        compared_at = compared_at or _value(meta.get("compared_at"))
        listed = _value(meta.get("differing_chunk_list")) or ""
        tables.append(
            {
                "table": record.data["table"],
                "source_rows": record.data["source_rows"],
                "target_rows": record.data["target_rows"],
                "equal": bool(evaluation.passed),
                "missing_on": record.data.get("missing_on"),
                "chunks": _value(meta.get("chunks")) or 1,
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
        _print_tables(tables, stale)
        # Why those tables differ, and what to do.
        for note in ([adding] if adding is not None else []) + agreement.reshaped_lines():
            print(f"NOTE {note}")
    _refuse_differing(tables, stale)
    if result is not None and not result.success:
        raise CliError(f"verify run {result.run_id} failed: {failure_text(result)}")
    return 0


def cmd_recover(args: argparse.Namespace) -> int:
    """Runs the recover job (:mod:`~pgcdc_dagster.engine.compare.recover`): a lost slot created
    anew, the target compared with the source at its point, only the differing chunks copied.
    Then a follow or a catch-up goes on from that point."""
    from .defs.jobs import RECOVER_JOB
    from .defs.keys import SLOT_KEY

    options: dict[str, Any] = {"wait_s": args.wait}
    if args.chunk_rows is not None:
        options["chunk_rows"] = args.chunk_rows
    config = {"ops": {"recover_slot": {"config": options}}}
    with shown():
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
        f"{summary['applied_before']}): {summary['chunks_compared']} chunk(s) compared in "
        f"{summary['compare_seconds']:.1f} s, {summary['chunks_repaired']} replaced, "
        f"{summary['rows_copied']} row(s) copied; follow or catchup goes on from there"
    )
    for line in _repaired_lines(result):
        print(line)
    return 0


def _repaired_lines(result: Any) -> list[str]:
    """A line per table a repair run replaced chunks of."""
    lines = []
    for event in result.get_asset_observation_events() if result.success else []:
        observation = event.asset_observation_data.asset_observation
        meta = observation.metadata
        if "repaired_at" not in meta:  # not a table's (a recovery's own observation)
            continue
        lines.append(
            f"REPAIRED {observation.asset_key.to_user_string()}: "
            f"{meta['chunks_repaired'].value} chunk(s) at {meta['repaired_at'].value}, "
            f"{meta['rows_deleted'].value} row(s) deleted, {meta['rows_copied'].value} copied"
        )
    return lines


def _value(entry: Any) -> Any:
    """A metadata entry's plain value (``None`` for an absent one)."""
    return None if entry is None else entry.value


def _print_tables(tables: list[dict[str, Any]], stale: Sequence[TableName]) -> None:
    """A line a table compared (``ok``, ``DIFF``), and one a table no longer published."""
    from .defs.metadata import no_longer_published

    for t in tables:
        mark = "ok  " if t["equal"] else "DIFF"
        if t["missing_on"] == "target":
            print(f"{mark} {t['table']}: not on the target (pgcdc add-table {t['table']})")
            continue
        rows = f"source {t['source_rows']} rows, target {t['target_rows']} rows"
        fix = "" if t["equal"] else f" (pgcdc resync {t['table']} copies it again)"
        chunks = f", {t['chunks']} chunks" if t.get("chunks", 1) > 1 else ""
        print(f"{mark} {t['table']}: {rows}{chunks}{fix}")
        for line in t.get("differing_chunks", []):
            print(f"       chunk {line}")
    for table in stale:
        print(f"STALE {no_longer_published(table)}")


def _refuse_differing(tables: Sequence[dict[str, Any]], stale: Sequence[TableName]) -> None:
    differing = [t["table"] for t in tables if not t["equal"]]
    if differing or stale:
        names = ", ".join([*differing, *map(str, stale)])
        # A table on both sides that differs is repaired by copying it again.
        both = [t["table"] for t in tables if not t["equal"] and t.get("missing_on") is None]
        fix = f": pgcdc resync {' '.join(both)} copies them again" if both else ""
        raise CliError(f"tables differ between source and target: {names}{fix}")


def cmd_cutover(args: argparse.Namespace) -> int:
    """Runs the cutover job (catch up to the endpos, copy sequence values, compare every
    table) under the range: a running follow makes way for it, and goes on after it (see
    :func:`~pgcdc_dagster.engine.control.range_lock.range_lock_or_way`). Exits non-zero when a table
    differs or is no longer published."""
    from .engine.control import pipeline
    from .engine.control.range_lock import command_holder, range_lock_or_way

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
        _print_tables(tables, stale)
        print(
            f"cut over at {report['endpos']} ({report['endpos_outcome']}): {report['ranges']} "
            f"range(s) applied, {report['sequences_synced']} sequence(s) set to the source's; "
            f"foreign keys completed: {report['foreign_keys_completed']}"
        )
    _refuse_differing(tables, stale)
    return 0


def cmd_prune(args: argparse.Namespace) -> int:
    """Runs the prune job (the store's retention, now) and reports its observation."""
    from .defs.jobs import PRUNE_JOB
    from .engine.settings import parse_duration

    ReplicationSettings.from_env()  # a wrong setting is one line before Dagster loads
    try:
        parse_duration(args.retention or "forever")
    except ValueError as exc:
        raise CliError(f"--retention: {exc}") from None
    config = {"retention": args.retention or "", "dry_run": bool(args.dry_run)}
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
    from .defs.jobs import ADD_TABLES_JOB, RESYNC_TABLES_JOB
    from .engine.identifiers import TableName

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
    return 0


def cmd_finish(args: argparse.Namespace) -> int:
    """Runs the finish job: the replication recorded as ended, the source's slot and the
    target's origin dropped (see :mod:`.engine.control.finish`); a running follow makes way, then
    stops."""
    from .defs.jobs import FINISH_JOB

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


def cmd_spark(args: argparse.Namespace) -> int:
    """Start, stop or show the warm Spark Connect server recorded in the store (see
    :mod:`pgcdc_dagster.engine.spark.server`)."""
    from .engine.spark import server as spark_server

    store = ReplicationSettings.from_env(require_servers=False).store_path  # only the store
    if args.action == "start":
        store.mkdir(parents=True, exist_ok=True)
        server, started = spark_server.start(store, args.master)
        state = "started" if started else "already running"
        print(f"Spark Connect server {state} at {server.url} (pid {server.pid})")
    elif args.action == "stop":
        stopped = spark_server.stop(store)
        print(f"stopped {stopped.url}" if stopped else "no Spark Connect server was running")
    else:
        found = spark_server.running(store)
        print(f"running at {found.url} (pid {found.pid})" if found else "not running")
    return 0


def cmd_server(args: argparse.Namespace) -> int:
    """Start, stop or show the warm command server (see :mod:`pgcdc_dagster.launcher`)."""
    from . import server_client

    try:
        if args.action == "start":
            if server_client.server_mode() == "off":
                raise CliError("PGCDC_SERVER=off: commands would not use the server; unset it")
            status = server_client.start_server(wait_s=60.0)
            assert status is not None  # with a wait: the status, or ServerUnavailable
            print(_server_line(status))
        elif args.action == "stop":
            reply = server_client.ask("stop")
            running = reply["commands_running"]
            print(
                f"stopped the command server (pid {reply['pid']})"
                + (f"; {running} command(s) under way finish first" if running else "")
            )
        elif args.json:
            print(json.dumps(server_client.ask("status")))
        else:
            print(_server_line(server_client.ask("status")))
    except server_client.ServerUnavailable as exc:
        if args.action == "start":
            raise CliError(str(exc)) from None
        print("no command server is running")
    return 0


def _server_line(status: dict[str, Any]) -> str:
    return (
        f"command server running (pid {status['pid']}): {status['commands_served']} command(s) "
        f"served, {status['commands_running']} running, stops after {status['idle_s']:.0f} s idle"
    )


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo.run import run_demo

    return run_demo(ui=args.ui, seconds=args.seconds, tps=args.tps)


def _asks_for_the_range(p: argparse.ArgumentParser) -> None:
    """The options of a command that needs the range to itself for a while (add-table,
    cutover, finish): a running follow makes way for it."""
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--wait",
        type=float,
        default=120.0,
        help="seconds to wait for the range (a running follow makes way in about a second)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pgcdc", description="PostgreSQL to PostgreSQL replication as Dagster assets."
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("snapshot", help="materialise base_snapshot (the initial copy)")
    p.add_argument("--resnapshot", action="store_true", help="re-copy a populated target")
    p.add_argument("--json", action="store_true", help="the snapshot's metadata, as JSON")
    p.add_argument("--wait", type=float, default=120.0, help="seconds to wait for a run in flight")
    p.set_defaults(func=cmd_snapshot)
    p = sub.add_parser("catchup", help="receive and apply up to endpos (follow with an endpos)")
    p.add_argument("--endpos", default="current", help="an LSN X/Y, or 'current' (default)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--wait", type=float, default=120.0, help="seconds to wait for a run in flight")
    p.set_defaults(func=cmd_catchup)
    p = sub.add_parser(
        "follow",
        help="receive and apply continuously, until SIGTERM/SIGINT; without --endpos it waits "
        "out a source, target or Dagster storage that went away (PGCDC_FOLLOW_RETRY, default "
        "10m)",
    )
    p.add_argument("--endpos", default=None, help="stop at this LSN X/Y, or 'current'")
    p.add_argument("--json", action="store_true")
    p.add_argument("--wait", type=float, default=120.0, help="seconds to wait for a run in flight")
    p.set_defaults(func=cmd_follow)
    p = sub.add_parser("status", help="slot positions, lag, last range, replay LSN")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)
    p = sub.add_parser(
        "verify",
        help="compare every table on source and target at one consistent point, chunk by "
        "chunk, while the replication goes on (a follow makes way for a moment)",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--repair",
        action="store_true",
        help="replace the differing chunks on the target with the source's rows, then compare "
        "those tables again (the repair job)",
    )
    p.add_argument("--wait", type=float, default=120.0, help="seconds to wait for the range")
    p.set_defaults(func=cmd_verify)
    p = sub.add_parser(
        "recover",
        help="after the slot was lost (invalidated or dropped): create it anew, compare every "
        "table with the source at its point and copy only the chunks that differ",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument("--wait", type=float, default=120.0, help="seconds to wait for the range")
    p.add_argument(
        "--chunk-rows",
        type=int,
        default=None,
        help="about how many rows a compared chunk holds (default 100000); a differing one is "
        "copied whole",
    )
    p.set_defaults(func=cmd_recover)
    p = sub.add_parser(
        "cutover",
        help="catch up to endpos, copy sequence values, compare every table (a follow makes way)",
    )
    p.add_argument("--endpos", default="current", help="LSN X/Y or 'current' (default)")
    _asks_for_the_range(p)
    p.set_defaults(func=cmd_cutover)
    p = sub.add_parser(
        "finish",
        help="end the replication: drop the source's slot and the target's origin",
    )
    p.add_argument(
        "--abandon",
        action="store_true",
        help="end it though the target lacks changes the source published (they are lost)",
    )
    _asks_for_the_range(p)
    p.set_defaults(func=cmd_finish)
    p = sub.add_parser("prune", help="remove applied ranges older than the store's retention")
    p.add_argument("--retention", help="instead of PGCDC_STORE_RETENTION: 7d, 12h, 30m, 0")
    p.add_argument("--dry-run", action="store_true", help="say what would go, remove nothing")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_prune)
    for name, what in (
        ("add-table", "add tables to the running replication: copied as of now, their changes "
         "from then"),
        ("resync", "copy replicated tables again while replication goes on (a drifted table's "
         "repair)"),
    ):  # fmt: skip
        p = sub.add_parser(name, help=what)
        p.add_argument("tables", nargs="+", help="schema.table (or table, in public)")
        _asks_for_the_range(p)
        p.set_defaults(func=cmd_add_table)
    p = sub.add_parser("spark", help="a warm local Spark Connect server every run then uses")
    p.add_argument("action", choices=["start", "stop", "status"])
    p.add_argument("--master", default="local[*]", help="the server's master (local[*])")
    p.set_defaults(func=cmd_spark)
    p = sub.add_parser("server", help="the warm process commands run in (PGCDC_SERVER=off: none)")
    p.add_argument("action", choices=["start", "stop", "status"])
    p.add_argument("--json", action="store_true", help="status as JSON (pid, commands served)")
    p.set_defaults(func=cmd_server)
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
        from .defs.storage_outage import as_storage_error

        shown = as_storage_error(exc)  # Dagster's storage away: one line whatever raised it
        if isinstance(shown, PgcdcError):
            print(f"pgcdc: {shown}", file=sys.stderr)
        else:
            print(f"pgcdc: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
