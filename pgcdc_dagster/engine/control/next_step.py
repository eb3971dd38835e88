"""What a catch-up does next, decided from the durable facts only.

Every path that moves replication forward (``pgcdc catchup``, the slot sensor, the cutover,
``pgcdc status``) asks :func:`next_step` and nothing else. It reads the three durable places
that own progress and no record of Dagster's:

- the output store's chain (:mod:`..store.output_store`): which ranges are stored, what each holds
(its last
  commit, ``transform_lsn``), and where the chain begins (the base snapshot's consistent point);
- the target's replication origin (:mod:`..apply.origin`): what the target has applied;
- the source slot (:mod:`..source.slot`): what the source may discard;

and the requested endpos. The answer is one of:

``ApplyStored(R)``
    R is the first stored range holding a transaction the target has not applied (its
    ``transform_lsn`` is past the origin). A run that stored R and died before applying it
    leaves exactly this; it is never skipped, and nothing after it is received first.
``ReceiveNext(R)``
    Every stored transaction is applied, and the chain ends before endpos: receive R, from the
    chain's end, capped in WAL bytes.
``CaughtUp``
    Every transaction committing at or before endpos is applied: the chain covers endpos and the
    origin has reached the last commit stored in it. (The origin itself may stay below endpos:
    after an endpos between or inside transactions it rests at the last complete commit.)

Why this is exact: ranges tile the WAL from the consistent point, or from where the store's
retention removed applied ranges up to (the chain record's ``pruned_through``; each starts where
the previous ended, checked here from the range the origin falls in: the ones before it are
applied, and the gap check before each apply walks back from its own range), a range holds
exactly the transactions whose COMMIT ends in it, and the apply advances the origin to a range's
last commit in the range's own transaction. So
"origin >= transform_lsn" is "that range is applied", and the first range failing it is where
the target stands. Dagster's partitions may be deleted or wiped without changing any answer.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import PgcdcError
from ..lsn import Lsn, LsnRange
from ..store.output_store import OutputStore, StoredRange


class CatchUpStateError(PgcdcError):
    """The durable facts contradict each other: data was lost or changed outside pgcdc."""


@dataclass(frozen=True)
class ApplyStored:
    stored: StoredRange

    @property
    def range(self) -> LsnRange:
        return self.stored.range

    def describe(self) -> str:
        last = self.stored.transform_lsn
        return f"apply stored range {self.range.key} (transactions up to {last})"


@dataclass(frozen=True)
class ReceiveNext:
    range: LsnRange

    def describe(self) -> str:
        return f"receive range {self.range.key} ({self.range.start} to {self.range.end})"


@dataclass(frozen=True)
class CaughtUp:
    endpos: Lsn
    replay_lsn: Lsn
    """The origin's progress: the last commit applied."""
    chain_end: Lsn

    def describe(self) -> str:
        return f"caught up to {self.endpos} (target applied through {self.replay_lsn})"


Step = ApplyStored | ReceiveNext | CaughtUp


def decide(
    store: OutputStore,
    origin: Lsn | None,
    slot_confirmed: Lsn | None,
    endpos: Lsn,
    max_bytes: int,
) -> Step:
    """The next step from the facts (see the module docstring)."""
    consistent_point = store.consistent_point()  # refuses a missing or unfinished snapshot
    if origin is None:
        raise CatchUpStateError(
            "the target has no replication origin for this slot although the store records a "
            f"complete base snapshot at {consistent_point}: the target was reset or is another "
            "database; re-take the base snapshot (pgcdc snapshot --resnapshot)"
        )
    if origin < consistent_point:
        raise CatchUpStateError(
            f"the target's replication origin is at {origin}, before the base snapshot's "
            f"consistent point {consistent_point}: it belongs to another snapshot; re-take the "
            "base snapshot (pgcdc snapshot --resnapshot)"
        )
    record = store.chain()
    pruned = None if record is None else record.pruned_last_commit
    if pruned is not None and origin < pruned:
        raise CatchUpStateError(
            f"the target's replication origin is at {origin}, before {pruned}, the last commit "
            "of the ranges the store's retention removed as applied: the target went back (a "
            "restore?) and those changes are gone from the store; re-take the base snapshot "
            "(pgcdc snapshot --resnapshot)"
        )
    # The ranges from the one the origin falls in: those before it are applied, and a walk of
    # the whole chain (a week of a follow's holds millions) is not needed to go on from here.
    chain = store.chain_from(origin)
    chain_end = chain[0].start if chain and chain[0].start <= origin else store.chain_start()
    for rng in chain:
        if rng.start != chain_end:
            raise CatchUpStateError(
                f"the output store {store.where} has a hole: its ranges end at {chain_end} and the "
                f"next one starts at {rng.start}; a range folder was removed by hand. Restore it, "
                "or re-take the base snapshot (pgcdc snapshot --resnapshot)"
            )
        chain_end = rng.end
    if slot_confirmed is not None and slot_confirmed > chain_end:
        raise CatchUpStateError(
            f"the slot's confirmed position {slot_confirmed} is past the end of the stored "
            f"ranges {chain_end}: changes in between were consumed by something else and are "
            "not in the store; run pgcdc recover, which compares the target with the source "
            "and copies what differs"
        )
    first = _first_unapplied(store, chain, origin)
    if first is not None:
        return ApplyStored(first)
    planned = plan_next_range(consistent_point, chain_end, endpos, max_bytes)
    if planned is None:
        return CaughtUp(endpos, origin, chain_end)
    return ReceiveNext(planned)


def plan_next_range(
    consistent_point: Lsn, last_end: Lsn | None, endpos: Lsn, max_bytes: int
) -> LsnRange | None:
    """The next range after ``last_end`` (or from the consistent point), capped in bytes.

    Ranges ending before the current consistent point belong to an earlier snapshot and are
    ignored: the chain restarts there. ``None`` when the chain already reaches ``endpos``.
    """
    start = consistent_point if last_end is None or last_end < consistent_point else last_end
    if endpos <= start:
        return None
    return LsnRange(start, min(int(endpos), int(start) + max_bytes))


def _first_unapplied(store: OutputStore, chain: list[LsnRange], origin: Lsn) -> StoredRange | None:
    """The first range whose last commit is past ``origin``. Only ranges ending after the
    origin can hold one, so the walk reads the manifests of those alone."""
    start = len(chain)
    while start > 0 and chain[start - 1].end > origin:
        start -= 1
    for rng in chain[start:]:
        stored = store.get(rng)
        if stored is None:  # removed since the walk: pruned (applied), or a hole
            if store.chain_start() >= rng.end:
                continue
            raise CatchUpStateError(f"range {rng.key} vanished from the output store {store.where}")
        transform = stored.transform_lsn
        if transform is not None and transform > origin:
            return stored
    return None
