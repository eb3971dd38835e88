"""Registering ranges as partitions: the UI's partitions stay the store's chain, and a follow
does not list every partition for every range it registers."""

from __future__ import annotations

from dagster import instance_for_test

from pgcdc_dagster.defs import range_events
from pgcdc_dagster.defs.partitions import LSN_RANGES
from pgcdc_dagster.defs.range_events import register_range
from pgcdc_dagster.engine.lsn import LsnRange
from pgcdc_dagster.engine.settings import ReplicationSettings
from pgcdc_dagster_tests.support.calls import CallCount
from pgcdc_dagster_tests.support.stores import range_manifest, store_with


def test_a_follows_ranges_drop_a_dead_runs_partition_and_then_look_once_a_minute(
    tmp_path, monkeypatch
):
    store = store_with(tmp_path, [], "0/1000")
    settings = ReplicationSettings(store=str(tmp_path / "store"))
    range_events._REGISTERED.clear()

    def stored(start: str, end: str) -> LsnRange:
        with store.writer(LsnRange(start, end)) as writer:
            writer.commit(range_manifest(start, end, None))
        return LsnRange(start, end)

    with instance_for_test() as instance:
        # A sensor registered the next range and its run died before storing it (named as
        # partitions were before they took the X/Y form: such keys stay readable).
        instance.add_dynamic_partitions(LSN_RANGES, [LsnRange("0/1000", "0/1800").key])
        listings = CallCount(monkeypatch, instance, "get_dynamic_partitions")

        # A follow resumes there with other boundaries: its first range drops the dead one.
        first = stored("0/1000", "0/2000")
        register_range(instance, settings, first)
        assert instance.get_dynamic_partitions(LSN_RANGES) == ["0/1000-0/2000"]
        listings.count = 0

        # Its next ranges start where the last one ended: nothing stale can be there.
        chain = [first]
        for start, end in [("0/2000", "0/3000"), ("0/3000", "0/4000")]:
            chain.append(stored(start, end))
            register_range(instance, settings, chain[-1])
        assert listings.count == 0
        # ...until a minute has passed; another process's dead run is dropped then.
        instance.add_dynamic_partitions(LSN_RANGES, [LsnRange("0/4000", "0/4800").partition_key])
        monkeypatch.setattr(range_events, "STALE_SCAN_S", 0.0)
        chain.append(stored("0/4000", "0/5000"))
        register_range(instance, settings, chain[-1])
        assert listings.count == 1
        assert instance.get_dynamic_partitions(LSN_RANGES) == [r.partition_key for r in chain]


def test_past_partitions_kept_the_oldest_partitions_go_and_the_store_keeps_their_ranges(
    tmp_path, monkeypatch
):
    """Dagster's UI slows past about 100,000 partitions per asset, which a follow passes in
    hours: past ``partitions_kept``, registering a range deletes the oldest partitions (never
    the one registered), and the store keeps every range."""
    store = store_with(tmp_path, [], "0/1000")
    settings = ReplicationSettings(store=str(tmp_path / "store"), partitions_kept=3)
    range_events._REGISTERED.clear()
    monkeypatch.setattr(range_events, "STALE_SCAN_S", 0.0)
    chain = []
    with instance_for_test() as instance:
        for n in range(1, 7):
            rng = LsnRange(f"0/{n}000", f"0/{n + 1}000")
            with store.writer(rng) as writer:
                writer.commit(range_manifest(rng.start, rng.end, None))
            chain.append(rng)
            register_range(instance, settings, rng)
            assert len(instance.get_dynamic_partitions(LSN_RANGES)) == min(n, 3)
        assert instance.get_dynamic_partitions(LSN_RANGES) == [r.partition_key for r in chain[-3:]]
        assert [r.key for r in store.ranges()] == [r.key for r in chain]

        # "all": no limit.
        unlimited = ReplicationSettings.from_env(
            {"PGCDC_STORE": str(tmp_path / "store"), "PGCDC_PARTITIONS_KEPT": "all"},
            require_servers=False,
        )
        assert unlimited.partitions_kept is None
        for rng in chain[:3]:
            instance.add_dynamic_partitions(LSN_RANGES, [rng.partition_key])
        nxt = LsnRange("0/7000", "0/8000")
        with store.writer(nxt) as writer:
            writer.commit(range_manifest(nxt.start, nxt.end, None))
        register_range(instance, unlimited, nxt)
        assert len(instance.get_dynamic_partitions(LSN_RANGES)) == 7
