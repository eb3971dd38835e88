"""What a follow yields and reports: each range through it, its heartbeat, its totals, how it
ended; the interface a follow run uses of a follower, on threads or in a process of its own."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, overload

from ..control.pipeline import RangeDone
from ..errors import PgcdcError
from ..lsn import Lsn
from ..spark.executors import SparkApp
from ..store.output_store import RangeResult
from .backlog import Backlog
from .busy_time import BusyTime

if TYPE_CHECKING:
    from ..apply.results import ApplyResult


class Followed(NamedTuple):
    """One range through the follower: what was stored and applied, the source's WAL not
    yet received when it was cut (``None`` for a range found stored, from an earlier run), and
    when its apply ended (``time.monotonic()``: one clock for every process of the machine, so
    a consumer in another process can tell how far it trails), and in which of the follower's
    sessions (from 1). A new session may follow the follower making way for ``pgcdc
    add-table``, so its ranges may hold tables the earlier sessions' did not."""

    done: RangeDone
    lag_bytes: int | None
    applied_at: float = 0.0
    session: int = 1


@dataclass
class FollowSummary:
    """How a follow ended, and where its time went (for the CLI, the run log, benchmarks)."""

    stopped_by: str = ""
    """``endpos``, or why it was stopped (``SIGTERM``, ``terminated``...)."""
    ranges: int = 0
    transactions: int = 0
    changes: int = 0
    last: RangeResult | None = None
    """The last range applied."""
    seconds: float = 0.0
    receive_busy_s: float = 0.0
    apply_busy_s: float = 0.0
    overlap_s: float = 0.0
    """Seconds during which a receive and an apply ran at the same time."""
    target_reconnects: int = 0
    """Times the applier's target connection, kept across ranges, was lost and replaced."""
    outages: int = 0
    """Times a server went away under the follow and it waited until it was back."""
    outage_s: float = 0.0
    """Seconds spent waiting for servers that went away."""
    made_way: int = 0
    """Times it made way for ``pgcdc add-table`` (or waited for an unfinished add to be run
    again), running no session meanwhile."""
    made_way_s: float = 0.0
    """Seconds it ran no session for those."""
    streams: int = 0
    """Times it read the slot by stream once it kept up (``follow_read``)."""
    spark_ranges: int = 0
    """Ranges whose changes Spark's executors staged (:mod:`..apply.spark_staging`)..."""
    spark_tasks: int = 0
    spark_changes: int = 0
    spark_seconds: float = 0.0
    """... in this many tasks, this many changes, and seconds from the check to the counts."""
    spark_app: SparkApp | None = None
    """The Spark application that staged them."""
    driver_staged: int = 0
    """Ranges big enough for Spark that were staged on the driver instead (the executors
    could not read the store, ``PGCDC_SPARK_STAGING=auto``)..."""
    driver_staged_why: str = ""
    """... and the last one's warning."""
    receive_cpu_s: float = 0.0
    apply_cpu_s: float = 0.0
    """CPU seconds of the receiving and the applying thread (this process's own work: decode,
    Parquet, compaction; the servers' work is theirs)."""
    busy: BusyTime = field(default_factory=BusyTime, repr=False)
    """The receiver's (side :data:`RECEIVING`) and the applier's (:data:`APPLYING`) busy
    intervals, folded into totals as they settle."""

    def note_spark(self, applied: ApplyResult) -> None:
        """Count a range that Spark's executors staged."""
        self.spark_ranges += 1
        self.spark_tasks += applied.spark_tasks
        self.spark_changes += applied.changes
        self.spark_seconds = round(self.spark_seconds + applied.staging_seconds, 3)
        self.spark_app = applied.spark_app

    def close(self, started: float) -> None:
        self.seconds = round(time.monotonic() - started, 3)
        self.receive_busy_s = round(self.busy.busy_s(RECEIVING), 3)
        self.apply_busy_s = round(self.busy.busy_s(APPLYING), 3)
        self.overlap_s = round(self.busy.both_s(), 3)


RECEIVING, APPLYING = 0, 1


class FinishedError(PgcdcError):
    """A catch-up of a replication that was ended (``pgcdc finish``)."""


class RangeTakenError(PgcdcError):
    """While a follow waited for a server, another catch-up of its slot took the range lock."""


class Following(Protocol):
    """What a follow run uses of a follower: one on threads (:class:`Follower`) or one in a
    process of its own (:class:`~.process.ProcessFollower`)."""

    summary: FollowSummary
    interrupts: tuple[type[BaseException], ...]

    @property
    def stopping(self) -> bool:
        """A stop was asked for (the follower ends at its next boundary)."""
        ...

    @property
    def endpos(self) -> Lsn | None: ...

    def start(self) -> Any: ...

    @overload
    def run(self) -> Iterator[Followed]: ...

    @overload
    def run(self, idle_s: float) -> Iterator[Followed | Idle]: ...

    def stop(self, reason: str) -> None: ...

    def pace(self, min_cut_s: float) -> None:
        """Cut a range when the applier is ready only once ``min_cut_s`` went by since the
        last cut (0: at once): fewer ranges while the run's records trail the applies."""
        ...

    def close(self, reason: str) -> None: ...


class _End:
    """The type of :data:`END`: one object, pickled by name, so it stays itself through a
    backlog's file (:mod:`.backlog`) and a forked follower's pipe."""

    def __reduce__(self) -> str:
        return "END"

    def __repr__(self) -> str:
        return "END"


END = _End()
"""Ends a queue of done ranges (:func:`done_ranges`)."""


STOPPED_BY_INTERRUPT = "stopped by an interrupt (Ctrl-C or SIGINT)"


STOPPED_BY_RUN = "stopped with its run (terminated from the UI, or SIGTERM to the command)"
"""How a follow stopped on purpose reads in its totals: a stop, not an error."""


class Idle(NamedTuple):
    """Nothing was applied for ``seconds`` (a follow's heartbeat: alive, not hung)."""

    seconds: float


def done_ranges(
    done: Backlog,
    interrupts: tuple[type[BaseException], ...],
    stop: Callable[[str], None],
    idle_s: float | None = None,
) -> Iterator[Followed | Idle]:
    """The ranges put in ``done`` until :data:`END`. An interrupt (one of ``interrupts``: the
    run's SIGINT or Dagster's termination) raised while waiting is taken as ``stop``: the
    follower stops at its next boundary, and what it finishes is still yielded. With
    ``idle_s``, an :class:`Idle` each time that long went by with no range."""
    last = time.monotonic()
    while True:
        try:
            item = done.get(timeout=0.2)
        except queue.Empty:
            if idle_s is not None and time.monotonic() - last >= idle_s:
                yield Idle(round(time.monotonic() - last, 1))
                last = time.monotonic()
            continue
        except interrupts as exc:
            stop(STOPPED_BY_INTERRUPT if isinstance(exc, KeyboardInterrupt) else STOPPED_BY_RUN)
            continue
        if item is END:
            return
        last = time.monotonic()
        yield item
