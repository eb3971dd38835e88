"""A range's trace in Dagster: its ``lsn_ranges`` partition and the events of one range.

Partitions are a view of the store's chain, never a cursor: a range is registered (idempotently)
right before a run is requested for it or its events are logged, and a registered range that
is not stored (its run died first, or the store's retention removed it) is removed the next
time a range at or after its place is registered, so the UI's partitions stay the chain, or
its newest ``partitions_kept`` ranges (:func:`trim_partitions`).
Deleting them all, or wiping Dagster's storage, changes nothing the engine does: the next
ranges register again.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dagster import (
    AssetCheckEvaluation,
    AssetCheckResult,
    AssetCheckSeverity,
    AssetKey,
    AssetMaterialization,
    DagsterInstance,
)

from ..engine.control import pipeline
from ..engine.identifiers import TableName
from ..engine.lsn import Lsn, LsnRange
from .keys import DECODED_CHANGES_KEY, target_key
from .metadata import apply_metadata, receive_metadata, text
from .partition_history import forget_partitions
from .partitions import LSN_RANGES

NO_GAP = "no_gap"


STALE_SCAN_S = 60.0
"""How often a run that registers range after range (a follow) still looks for registered
ranges that were never stored, and for the oldest past ``partitions_kept``."""


@dataclass
class _Registered:
    end: Lsn
    scanned_at: float


_REGISTERED: dict[Path, _Registered] = {}
"""Per store, the last range this process registered and when it last looked for stale ones."""


def register_range(
    instance: DagsterInstance, settings: pipeline.ReplicationSettings, rng: LsnRange
) -> None:
    """Make ``rng`` a partition (``rng`` starts at the chain's end or is stored), and trim the
    registered ones before it (:func:`trim_partitions`): those not stored, and the oldest past
    ``partitions_kept``.

    That look lists every partition and looks each up in the store, which a follow (a range
    every few hundred milliseconds, for as long as it runs) cannot afford per range: with a
    long follow's partitions, the listing alone takes about as long as the time between two
    ranges (see ``benchmarks/HISTORY.md``, "A follow that runs for days"). Nothing stale can
    appear at the start of a range that begins where this process's last registered range
    ended, except by another process, so a follow's ranges look once a minute (the partitions
    may then pass the limit by a minute's ranges); any other registration (a sensor tick, a
    run's first range) looks every time."""
    if instance.has_dynamic_partition(LSN_RANGES, rng.partition_key):
        return
    now = time.monotonic()
    last = _REGISTERED.get(settings.store_path)
    scanned_at = last.scanned_at if last is not None and last.end == rng.start else None
    if scanned_at is None or now - scanned_at >= STALE_SCAN_S:
        trim_partitions(instance, settings, through=rng)
        scanned_at = now
    instance.add_dynamic_partitions(LSN_RANGES, [rng.partition_key])
    _REGISTERED[settings.store_path] = _Registered(rng.end, scanned_at)


def trim_partitions(
    instance: DagsterInstance,
    settings: pipeline.ReplicationSettings,
    through: LsnRange | None = None,
) -> list[str]:
    """Delete, with their history on PostgreSQL storage (:mod:`.partition_history`), the
    ``lsn_ranges`` partitions that start at or before ``through``'s start (any, without it),
    other than ``through``, and are either

    - not in the store: ranges a dead run registered and never stored (the chain has passed
      their start with other boundaries, so none of them will ever be stored), and ranges the
      store's retention removed; or
    - the oldest beyond ``partitions_kept`` (counting ``through``): Dagster's UI slows past
      about 100,000 partitions per asset, which a follow under steady load passes in under six
      hours, while the store keeps a week of ranges. The ranges stay in the store, applied or
      not: partitions are a view, and a range's run registers it again before it runs.

    Each registered key is looked up in the store on its own (:meth:`~.store.OutputStore.holds`)
    rather than against a listing of the store, which holds a week of ranges (about 3 million
    at 5 a second) against at most about ``partitions_kept`` partitions. Returns the keys
    deleted."""
    store = pipeline.store_of(settings)
    others = {  # each registered key (in either form, see LsnRange.partition_key): its range
        k: LsnRange.from_partition_key(k)
        for k in instance.get_dynamic_partitions(LSN_RANGES)
        if through is None or k != through.partition_key
    }
    eligible = [k for k, r in others.items() if through is None or r.start <= through.start]
    unstored = [k for k in eligible if not store.holds(others[k])]
    kept = len(others) - len(unstored) + (1 if through is not None else 0)
    oldest: list[str] = []
    if settings.partitions_kept is not None and kept > settings.partitions_kept:
        gone = set(unstored)
        oldest = sorted((k for k in eligible if k not in gone), key=lambda k: others[k].start)
        oldest = oldest[: kept - settings.partitions_kept]
    dropped = unstored + oldest
    forget_partitions(instance, dropped)
    return dropped


@dataclass(frozen=True)
class NoGap:
    """The ``no_gap`` outcome of one range, recorded on every target table the range
    materialises (the check judges the apply, which is all of them at once)."""

    partition: str
    passed: bool
    metadata: dict[str, Any]
    description: str | None

    def evaluation(self, key: AssetKey) -> AssetCheckEvaluation:
        """As a follow records it (an event of its own)."""
        return AssetCheckEvaluation(partition=self.partition, **self._fields(key))

    def result(self, key: AssetKey) -> AssetCheckResult:
        """As a per-range run's step yields it (the run knows its partition)."""
        return AssetCheckResult(**self._fields(key))

    def _fields(self, key: AssetKey) -> dict[str, Any]:
        return {
            "asset_key": key,
            "check_name": NO_GAP,
            "passed": self.passed,
            "severity": AssetCheckSeverity.ERROR,
            "metadata": self.metadata,
            "description": self.description,
        }


def no_gap(
    settings: pipeline.ReplicationSettings,
    rng: LsnRange,
    origin_progress: Lsn | None = None,
    already_applied: bool = False,
) -> NoGap:
    """Whether the target's origin stands exactly at the last commit stored up to ``rng``: no
    range before it skipped, none half applied. Blocking: a failure stops the run.

    ``origin_progress`` is the origin's progress as the apply of ``rng`` left it, read in its
    transaction (a follower passes it instead of asking the target again for every range).
    ``already_applied``: a range run again on its own (from the UI) found every transaction of
    it applied: then the origin may stand past it, where later ranges left it."""
    expected = pipeline.expected_origin_progress(settings, through=rng)
    actual = origin_progress or pipeline.origin_progress(settings)
    passed = (
        expected is None
        or actual == expected
        or (already_applied and actual is not None and actual > expected)
    )
    return NoGap(
        partition=rng.partition_key,
        passed=passed,
        metadata={
            "origin_progress": text(actual),
            "last_applied_transform_lsn": text(expected),
            "already_applied": already_applied,
        },
        description=None if passed else no_gap_failure(expected, actual),
    )


def no_gap_failure(expected: Any, actual: Any) -> str:
    return (
        f"the target's replication origin is at {actual}, but the stored ranges up to this one "
        f"end with the commit at {expected}: a range was skipped or applied elsewhere; run "
        "'pgcdc status' to see the next step and 'pgcdc catchup' to take it"
    )


def range_events(
    tables: Sequence[TableName],
    settings: pipeline.ReplicationSettings,
    done: pipeline.RangeDone,
    lag_bytes: int | None,
    row_counts: Mapping[TableName, int | None],
    table_events: str | None = None,
) -> list[AssetMaterialization]:
    """The materialisations of one range, as the per-range job records them: the decoded
    changes partition and the partitions of ``tables`` (a follow's choice, ``table_events``
    says which, see :class:`~.following.TableEvents`), with the same metadata."""
    received, applied = done.received, done.applied
    rng = LsnRange.from_key(received.range_key)
    uri = pipeline.store_of(settings).range_uri(rng)
    decoded = receive_metadata(received, lag_bytes, uri)
    if table_events is not None:
        decoded["table_events"] = text(table_events)
    events = [
        AssetMaterialization(DECODED_CHANGES_KEY, partition=rng.partition_key, metadata=decoded)
    ]
    reshaped = pipeline.reshaped_columns(settings, applied)
    events += [
        AssetMaterialization(
            target_key(table),
            partition=rng.partition_key,
            metadata=apply_metadata(
                table, received, applied, row_counts.get(table), reshaped.get(table)
            ),
        )
        for table in tables
    ]
    return events
