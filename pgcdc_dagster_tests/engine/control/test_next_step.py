"""The next-step decision from the durable facts: a real output store on disk, LSNs for the
origin and the slot (the database side of those facts is exercised in test_resume)."""

import pytest

from pgcdc_dagster.engine.control.next_step import (
    ApplyStored,
    CatchUpStateError,
    CaughtUp,
    ReceiveNext,
    decide,
)
from pgcdc_dagster.engine.lsn import Lsn, LsnRange
from pgcdc_dagster.engine.store.output_store import OutputStore, StoreError
from pgcdc_dagster_tests.support.stores import store_with

CAP = 0x1000


def test_a_stored_range_the_target_lacks_is_applied_before_anything_is_received(tmp_path):
    store = store_with(tmp_path, [("0/1000", "0/2000", "0/1F00"), ("0/2000", "0/3000", "0/2E00")])
    step = decide(store, Lsn("0/1F00"), Lsn("0/3000"), Lsn("0/9000"), CAP)
    assert isinstance(step, ApplyStored)
    assert step.range == LsnRange("0/2000", "0/3000")


def test_the_first_unapplied_range_wins_even_after_empty_ranges(tmp_path):
    # A crash stored range 2 and 3; range 2 holds nothing, range 3 holds transactions.
    store = store_with(
        tmp_path,
        [
            ("0/1000", "0/2000", "0/1F00"),
            ("0/2000", "0/2800", None),
            ("0/2800", "0/3000", "0/2F00"),
        ],
    )
    step = decide(store, Lsn("0/1F00"), Lsn("0/3000"), Lsn("0/3000"), CAP)
    assert isinstance(step, ApplyStored) and step.range == LsnRange("0/2800", "0/3000")


def test_everything_applied_means_receive_from_the_chain_end_capped(tmp_path):
    store = store_with(tmp_path, [("0/1000", "0/2000", "0/1F00")])
    step = decide(store, Lsn("0/1F00"), Lsn("0/2000"), Lsn("0/9000"), CAP)
    assert step == ReceiveNext(LsnRange("0/2000", "0/3000"))


def test_caught_up_when_the_chain_covers_endpos_and_the_origin_has_its_last_commit(tmp_path):
    # Endpos fell between transactions: the origin rests at the last commit, below endpos.
    store = store_with(tmp_path, [("0/1000", "0/2000", "0/1E00")])
    step = decide(store, Lsn("0/1E00"), Lsn("0/2000"), Lsn("0/2000"), CAP)
    assert isinstance(step, CaughtUp)
    assert step.replay_lsn == Lsn("0/1E00") and step.chain_end == Lsn("0/2000")


def test_no_snapshot_or_an_unfinished_one_is_refused_naming_the_fix(tmp_path):
    store = OutputStore(tmp_path / "store")
    with pytest.raises(StoreError, match="take one first"):
        decide(store, None, None, Lsn("0/9000"), CAP)
    store.begin_snapshot("slot")
    with pytest.raises(StoreError, match=r"did not finish.*run pgcdc snapshot"):
        decide(store, Lsn("0/1000"), None, Lsn("0/9000"), CAP)


def test_a_hole_in_the_store_is_refused(tmp_path):
    store = store_with(tmp_path, [("0/1000", "0/2000", None), ("0/2800", "0/3000", None)])
    with pytest.raises(CatchUpStateError, match="has a hole"):
        decide(store, Lsn("0/1000"), Lsn("0/3000"), Lsn("0/9000"), CAP)


def test_a_slot_past_the_store_or_an_origin_of_another_snapshot_is_refused(tmp_path):
    store = store_with(tmp_path, [("0/1000", "0/2000", "0/1F00")])
    with pytest.raises(CatchUpStateError, match="consumed by something else"):
        decide(store, Lsn("0/1F00"), Lsn("0/2500"), Lsn("0/9000"), CAP)
    with pytest.raises(CatchUpStateError, match="before the base snapshot"):
        decide(store, Lsn("0/800"), Lsn("0/2000"), Lsn("0/9000"), CAP)
    with pytest.raises(CatchUpStateError, match="no replication origin"):
        decide(store, None, Lsn("0/2000"), Lsn("0/9000"), CAP)
