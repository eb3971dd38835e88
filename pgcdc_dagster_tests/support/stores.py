"""Output stores written by hand, for tests of what is decided from a store (no database)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from pgcdc_dagster.engine.lsn import Lsn, LsnRange
from pgcdc_dagster.engine.store.output_store import (
    MANIFEST,
    EndposOutcome,
    OutputStore,
    RangeManifest,
    RangeResult,
)


def range_manifest(start: str, end: str, transform: str | None) -> RangeManifest:
    """The manifest of a range without rows, whose last commit ends at ``transform``."""
    rng = LsnRange(start, end)
    outcome = EndposOutcome.EMPTY if transform is None else EndposOutcome.AT_COMMIT_BOUNDARY
    result = RangeResult(
        range_key=rng.key,
        start_lsn=start,
        endpos=end,
        endpos_outcome=outcome,
        transform_lsn=transform,
        safe_point=end,
        last_xid=None,
        last_commit_ts_us=None,
        transactions=0 if transform is None else 1,
        changes=0,
    )
    return RangeManifest(result=result, relations=[], types={})


def store_ranges(
    store: OutputStore, ranges: list[tuple[str, str, str | None]], consistent_point: str
) -> OutputStore:
    """Record a chain at ``consistent_point`` and store ``(start, end, transform_lsn)`` ranges
    without rows: what a receive of those ranges would leave, watermarks only."""
    store.record_chain("slot", Lsn(consistent_point), "snap")
    for start, end, transform in ranges:
        with store.writer(LsnRange(start, end)) as writer:
            writer.commit(range_manifest(start, end, transform))
    return store


def store_with(
    folder: Path,
    ranges: list[tuple[str, str, str | None]],
    consistent_point: str = "0/1000",
    age_s: float | None = None,
) -> OutputStore:
    """A store at ``folder / "store"`` holding :func:`store_ranges`' ``(start, end,
    transform_lsn)`` ranges of a chain at ``consistent_point``; with ``age_s``, stored that
    long ago (their manifests' mtime) and opened again, as a new process finds it."""
    store = store_ranges(OutputStore(folder / "store"), ranges, consistent_point)
    if age_s is None:
        return store
    when = time.time() - age_s
    for rng in store.ranges():
        os.utime(store.range_path(rng) / MANIFEST, (when, when))
    return OutputStore(store.root)


def assert_chain_records(store: OutputStore, origin: Lsn | None) -> None:
    """Every range of the chain records the chain's last commit up to its end, as a walk
    forward from the consistent point (or the pruned start's record) finds it, and a converged
    target's origin stands at the last one: what a crash anywhere must leave once the next
    command has finished."""
    chain = store.chain()
    assert chain is not None
    last = chain.pruned_last_commit if chain.pruned_through else store.consistent_point()
    for rng in store.chain_ranges():
        stored = store.get(rng)
        assert stored is not None, rng.key
        last = stored.transform_lsn or last
        assert stored.chain_last_commit == last, rng.key
    assert origin == last


def on_disk(store: OutputStore) -> list[str]:
    """The names of every folder the store's ``changes/`` holds, ranges and hidden leftovers
    (``.tmp-``, ``.pruned-``), wherever they lie: directly there or in the buckets (whose own
    names are left out), sorted."""
    names: list[str] = []
    if not store.changes_dir.is_dir():
        return names
    for top in store.changes_dir.iterdir():
        if len(top.name) != 8 or top.name.startswith("."):
            names.append(top.name)
            continue
        for mid in top.iterdir():
            names.extend(p.name for p in mid.iterdir())
    return sorted(names)
