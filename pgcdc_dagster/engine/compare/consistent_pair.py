"""A source snapshot and a target snapshot that stand at one consistent point, taken while the
replication goes on: what an online verify compares (:mod:`.verify`).

How, in this order, all under the range (:func:`~.range_lock.range_lock_or_way`: a running
follow makes way at a range boundary, as for a cutover):

1. The origin stands still at ``O`` (nothing applies without the range).
2. A temporary slot on the source gives an exported snapshot at its consistent point ``C``
   (``C`` is past ``O``: the slot is created after ``O`` stood still). A session of this
   process imports it and exports it again, so it outlives the temporary slot, which goes at
   once.
3. The target catches up from ``O`` to exactly ``C`` (:func:`~.pipeline.catch_up` with
   ``endpos = C``): the transactions committed before ``C`` are applied, whole, and none
   after it (the endpos rule of :mod:`.next_step`).
4. A session on the target opens a ``REPEATABLE READ`` transaction and exports its snapshot.
5. The range is released: the follow goes on from ``C``.

What must hold: the exported source snapshot sees exactly the transactions that committed
before ``C``, the same rule the base snapshot's copy and its slot meet at; and the target's
snapshot is taken with the origin at ``C``'s last commit and nothing applying. So both
snapshots hold the same transactions, and any difference between them is a real one, never
lag. Both sessions stay open (idle in their transactions) while the compare reads; the
source's holds back vacuum there meanwhile, as a base snapshot's copy does.

Crash anywhere: the temporary slot goes with its connection; the catch-up is an ordinary one
(its ranges and the origin are durable); the held snapshots go with their sessions.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import psycopg

from ..connect import connect
from ..control import pipeline
from ..control.range_lock import range_lock_or_way
from ..lsn import Lsn
from ..settings import ReplicationSettings
from ..snapshot.common import snapshot_transaction
from ..source.slot import create_slot_with_snapshot


@dataclass(frozen=True)
class ConsistentPair:
    """Two exported snapshots at ``point``: import each with ``SET TRANSACTION SNAPSHOT`` in
    a ``REPEATABLE READ`` transaction on its side while the pair is held."""

    point: Lsn
    """``C``: the temporary slot's consistent point, which the target caught up to."""
    source_snapshot: str
    target_snapshot: str
    applied_through: Lsn | None
    """The target's origin as its snapshot was taken: the last commit before ``C``."""
    ranges_caught_up: int
    """Ranges the catch-up to ``C`` applied (0 when the target stood there already)."""
    made_way_by: str | None
    """The follow that made way for the pair, if one ran."""


def temporary_slot_name(slot: str) -> str:
    """The pair's own slot: temporary, named after the chain's slot and this process."""
    return f"{slot}_verify_{os.getpid()}"[:63]


@contextlib.contextmanager
def consistent_pair(
    settings: ReplicationSettings,
    holder: str,
    *,
    wait_s: float = 120.0,
    spark: Any = None,
    caught_up: Callable[[int], None] | None = None,
    hold_range: bool = False,
) -> Iterator[ConsistentPair]:
    """Hold a :class:`ConsistentPair` (see the module docstring) for the ``with`` block. The
    range is held only while the pair is made, not during the block, unless ``hold_range``:
    then nothing applies until the block ends, and the target stands at ``C`` throughout (a
    repair, :mod:`.repair`). ``caught_up`` is told how many ranges the catch-up to ``C``
    applied, once it has."""
    with contextlib.ExitStack() as held:
        src = held.enter_context(connect(settings.source_dsn, role="source"))
        tgt = held.enter_context(connect(settings.target_dsn, role="target"))
        the_range = range_lock_or_way(settings.target_dsn, settings.slot, holder, wait_s)
        with contextlib.ExitStack() as ranged:
            lock = (held if hold_range else ranged).enter_context(the_range)
            with create_slot_with_snapshot(
                settings.source_dsn, temporary_slot_name(settings.slot), temporary=True
            ) as exported:
                point = exported.slot.consistent_point
                held.enter_context(snapshot_transaction(src, exported.slot.snapshot_name))
                source_snapshot = export_snapshot(src)
            # The temporary slot is gone; the snapshot lives on in src's transaction.
            ranges = sum(
                1
                for _ in pipeline.catch_up(
                    settings,
                    point,
                    run_step=lambda step: pipeline.run_step_in_process(settings, step, spark),
                )
            )
            if caught_up is not None:
                caught_up(ranges)
            held.enter_context(snapshot_transaction(tgt, None))
            target_snapshot = export_snapshot(tgt)
            applied = pipeline.origin_progress(settings)
            made_way_by = lock.made_way_by
        yield ConsistentPair(point, source_snapshot, target_snapshot, applied, ranges, made_way_by)


def export_snapshot(conn: psycopg.Connection[Any]) -> str:
    row = conn.execute("SELECT pg_export_snapshot()").fetchone()
    assert row is not None
    return str(row[0])
