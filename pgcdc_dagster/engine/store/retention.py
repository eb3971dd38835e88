"""The store's retention: applied ranges are removed once they are older than
``PGCDC_STORE_RETENTION``, so a follow that runs for weeks does not fill the disk.

What must hold, whatever is killed where:

* **Only what the target applied.** A range goes only when every COMMIT the chain stores up to
  its end is at or before the target's replication origin (read from the target by the caller,
  never from Dagster). A range the target has not applied is never removed, however old.
* **The chain stays walkable.** The last range whose record of its last COMMIT is at or before
  the origin is always kept: the gap check before the next apply walks back to it. Ranges are
  removed from the chain's start, oldest first, stopping at the first one too young, so the
  chain stays contiguous from its recorded start.
* **The record first.** The chain record's ``pruned_through`` (and the last COMMIT the removed
  ranges held) is written under the store's chain lock *before* any folder goes, and never moves
  backwards: a prune killed in between leaves ranges the chain already skips, which the next
  prune removes. A folder is renamed to a hidden name before it is deleted, so a reader sees a
  range whole or not at all.
* **Spaced, and beside the applies.** A prune walks the store from its first range to the
  first it keeps, so it runs at most every :func:`prune_interval` (recorded in the chain
  record, so across processes too), not per range, and an apply that finds one due starts it
  in a thread of its own.

* **Not while a table is being added.** Its add reads, once its copy is done, the ranges stored
  since the copy began (the table's changes the applies held back, see
  :func:`~..apply.transaction.apply_added_changes`): while the chain lists a table in
  ``adding``, a prune removes nothing. A prune that read the chain before it removes only
  ranges the target had applied then, all before the add's copy began.

Ranges of an earlier chain (before a re-snapshot) are history: they go by age alone.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import PgcdcError
from ..failpoints import failpoint
from ..lsn import Lsn, LsnRange
from .output_store import OutputStore, StoredRange

log = logging.getLogger(__name__)

PRUNE_EVERY_MAX_S = 600.0
"""A prune looks at most this often (a tenth of the retention when that is shorter)."""


def prune_interval(retention_s: float) -> float:
    """Seconds between two prunes: a tenth of the retention, between 1 s and 10 minutes. A
    prune walks what it removes (about 3,000 ranges in 10 minutes of a follow storing 5 ranges a
    second), not the ranges it keeps (3 million in a 7-day retention of that follow)."""
    return min(PRUNE_EVERY_MAX_S, max(1.0, retention_s / 10))


@dataclass
class PruneResult:
    """What a prune removed (or, dry, would remove)."""

    removed: list[LsnRange] = field(default_factory=list)
    """The current chain's ranges removed, in LSN order."""
    history: list[LsnRange] = field(default_factory=list)
    """Ranges of earlier chains (before a re-snapshot) removed."""
    bytes: int = 0
    """Parquet bytes removed."""
    pruned_through: Lsn | None = None
    """Where the current chain's stored ranges begin now (``None``: nothing ever pruned)."""
    kept: LsnRange | None = None
    """The oldest range kept: the first too young, not applied, or the last applied one."""
    skipped: str | None = None
    """Why nothing was looked at (no complete base snapshot), else ``None``."""
    seconds: float = 0.0


def stored_at(store: OutputStore, rng: LsnRange) -> float:
    """When the range was stored (:meth:`OutputStore.stored_at`)."""
    return store.stored_at(rng)


def prune(
    store: OutputStore,
    origin: Lsn | None,
    retention_s: float,
    *,
    now: float | None = None,
    dry_run: bool = False,
) -> PruneResult:
    """Remove the ranges older than ``retention_s`` that the target (its origin at ``origin``)
    has applied, keeping the last applied one (see the module docstring): the chain record,
    then a rename of each range out of the store, then the deletes."""
    started = time.perf_counter()
    now = time.time() if now is None else now
    cutoff = now - retention_s
    result = PruneResult()
    with store.chain_lock() as chain:
        if chain is None or not chain.complete or chain.start is None:
            result.skipped = "no complete base snapshot in the store"
            return result
        assert chain.consistent_point is not None
        if chain.adding:
            # Its add applies the tables' changes the applies held back, from the ranges
            # stored since its copy began: none may go before it is done.
            names = " ".join(str(t) for t in chain.adding)
            result.skipped = f"adding {names} (pgcdc add-table) is not done"
            if not dry_run:
                store.record_pruned(chain, None, None, now)
            return result
        point, start = chain.consistent_point, chain.start
        if not dry_run:
            store.sweep_removed()
        # Walks that stop at the first range kept: a prune lists what it removes and a range
        # more, not the week of ranges it keeps. Earlier chains' ranges go by age, and were
        # stored in LSN order: the first too young ends theirs (one stored out of order is
        # only kept longer).
        for rng in store.walk():
            if rng.start >= point or stored_at(store, rng) > cutoff:
                break
            result.history.append(rng)
        leftovers: list[LsnRange] = []
        walked: list[StoredRange] = []
        keep = -1  # walked[keep] is the last range the walks back may need
        stopped_at: LsnRange | None = None
        cursor = start
        for rng in store.walk(point):
            if rng.start < start:
                if rng.end <= start:
                    leftovers.append(rng)
                continue
            stored = store.get(rng) if rng.start == cursor else None
            if stored is None:
                stopped_at = rng
                break
            known = stored.last_commit_known
            applied = origin is not None and (known is None or known <= origin)
            if not applied or stored_at(store, rng) > cutoff:
                if applied and known is not None:
                    keep = len(walked)  # a young applied range: the walks can end there
                stopped_at = rng
                break
            walked.append(stored)
            if known is not None:
                keep = len(walked) - 1
            cursor = rng.end
        removed = walked[: max(keep, 0)]
        result.kept = walked[len(removed)].range if len(removed) < len(walked) else stopped_at
        result.removed = [s.range for s in removed]
        through = removed[-1].range.end if removed else None
        last_commit = store.last_commit_through(removed[-1]) if removed else None
        if not dry_run:
            store.record_pruned(chain, through, last_commit, now)
        result.pruned_through = through or chain.pruned_through
    if dry_run:
        result.bytes = sum(s.manifest.bytes for s in removed)
        result.seconds = round(time.perf_counter() - started, 4)
        return result
    failpoint("prune.recorded")
    hidden = [store.hide_range(rng) for rng in [*leftovers, *result.history, *result.removed]]
    failpoint("prune.removing")
    for folder in hidden:
        if folder is not None:
            result.bytes += store.remove_hidden(folder)
    if len(removed) < len(walked):  # a range of the chain's contiguous run: writers are past it
        result.bytes += store.sweep_unpublished(walked[len(removed)].range.start)
    result.seconds = round(time.perf_counter() - started, 4)
    return result


_PRUNING: dict[Path, threading.Thread] = {}
"""Per store, this process's prune thread (one at a time)."""

_LOOKED_AT: dict[Path, float] = {}
"""Per store, the latest prune this process knows of (its ``pruned_at``, or the start of its
own): until an interval after it none is due, whatever another process did meanwhile (a
prune elsewhere only moves it later), so :func:`prune_if_due` reads the chain record once
an interval, not after every range (a GET per range on an object store)."""


def prune_if_due(
    store: OutputStore,
    origin: Callable[[], Lsn | None],
    retention_s: float | None,
    *,
    now: float | None = None,
) -> threading.Thread | None:
    """Start :func:`prune` in a thread of its own when ``retention_s`` is set, the last prune
    is :func:`prune_interval` old and none runs in this process; returns that thread.

    Called after every apply: the apply's thread goes on at once. A prune walks, renames and
    deletes per range (a follow storing 5 ranges a second has 3,000 for each 10-minute prune;
    the cost per range: ``benchmarks/retention.py`` in ``benchmarks/HISTORY.md``). ``origin()``
    reads the origin's durable progress, in the prune's thread (a round trip the apply does not
    wait for); it only grows, so one read before the prune is conservative. The thread is not a
    daemon: a process ending normally finishes the prune first (a per-range run would
    otherwise never finish a long one); a process killed leaves what the module docstring
    says. A prune that fails is logged, not raised: the range is applied and the retention is
    housekeeping (the next one tries again, and ``pgcdc prune`` says what is wrong)."""
    if retention_s is None:
        return None
    now = time.time() if now is None else now
    looked = _LOOKED_AT.get(store.root)
    if looked is not None and 0 <= now - looked < prune_interval(retention_s):
        return None  # known not due: the chain record is not read for every range
    chain = store.chain()
    if chain is None or not chain.complete:
        return None
    if chain.pruned_at is not None and now - chain.pruned_at < prune_interval(retention_s):
        _LOOKED_AT[store.root] = chain.pruned_at
        return None
    running = _PRUNING.get(store.root)
    if running is not None and running.is_alive():
        return None
    _LOOKED_AT[store.root] = now  # what the prune records (a failed one is tried again then)
    own = store.reopened()  # its manifest cache is this thread's alone

    def run() -> None:
        try:
            prune(own, origin(), retention_s, now=now)
        except (OSError, PgcdcError) as exc:
            log.warning("the store's retention could not prune %s: %s", store.where, exc)

    thread = threading.Thread(target=run, name="pgcdc-prune")
    _PRUNING[store.root] = thread
    thread.start()
    return thread


@dataclass(frozen=True)
class RetentionStatus:
    """How far the store's retention has got, for a check that a person reads."""

    ranges: int
    """Stored ranges of the current chain."""
    pruned_through: Lsn | None
    oldest_age_s: float | None
    """How long ago the chain's oldest stored range was stored."""
    last_prune_age_s: float | None
    overdue: str | None
    """Why the retention is behind (prunes failing), else ``None``."""


def retention_status(
    store: OutputStore, origin: Lsn | None, retention_s: float | None, *, now: float | None = None
) -> RetentionStatus:
    """Whether a range the prunes should have removed is still stored: the chain's oldest
    range older than the retention plus two prune intervals while the range after it is
    applied too (the last applied range always stays, so an oldest range that is the last
    applied one is not the retention's to remove: a stalled apply is ``slot_health``'s)."""
    now = time.time() if now is None else now
    chain = store.chain()
    if chain is None or not chain.complete:
        return RetentionStatus(0, None, None, None, None)
    ranges = list(itertools.islice(store.walk(store.chain_start()), 2))  # the oldest two
    oldest_age = now - stored_at(store, ranges[0]) if ranges else None
    last_prune = None if chain.pruned_at is None else now - chain.pruned_at
    overdue = None
    if retention_s is not None and oldest_age is not None and len(ranges) > 1:
        limit = retention_s + 2 * prune_interval(retention_s)
        second = store.get(ranges[1])
        known = None if second is None else second.last_commit_known
        applied = origin is not None and known is not None and known <= origin
        if oldest_age > limit and applied:
            overdue = (
                f"the output store still holds applied ranges stored {oldest_age:.0f} s ago, "
                f"past its retention of {retention_s:.0f} s (last prune "
                + ("never" if last_prune is None else f"{last_prune:.0f} s ago")
                + "): prunes are failing; run pgcdc prune to see why"
            )
    return RetentionStatus(
        store.chain_count(), chain.pruned_through, oldest_age, last_prune, overdue
    )
