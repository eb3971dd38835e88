"""The output store on S3 (:mod:`pgcdc_dagster.engine.store.object_store`), against a real S3
API server (``moto_server`` with credentials checked, :mod:`pgcdc_dagster_tests.support.s3`):
a range exists once its manifest does and is read back whole; a second writer of a range or
of the chain record loses its conditional put and changes nothing; a prune's tombstones are
finished by the next; each failure of the bucket is one line."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterator

import pyarrow as pa
import pytest

from pgcdc_dagster.engine.lsn import Lsn, LsnRange
from pgcdc_dagster.engine.store import open_store
from pgcdc_dagster.engine.store.errors import StoreError
from pgcdc_dagster.engine.store.object_store import ObjectOutputStore
from pgcdc_dagster.engine.store.objects import ObjectChangedError, S3Objects
from pgcdc_dagster.engine.store.range_format import CHANGE_SCHEMA
from pgcdc_dagster.engine.store.retention import prune
from pgcdc_dagster.engine.store_location import parse_location
from pgcdc_dagster_tests.support.s3 import S3Server, s3_server_reached
from pgcdc_dagster_tests.support.stores import range_manifest, store_ranges


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with s3_server_reached() as server:
        yield server


@pytest.fixture
def store(s3: S3Server, tmp_path, monkeypatch) -> ObjectOutputStore:
    monkeypatch.chdir(tmp_path)  # the store's local work folder
    opened = open_store(f"s3://{s3.new_bucket()}/store")
    assert isinstance(opened, ObjectOutputStore)
    return opened


def _changes(n: int, commit_end: int) -> pa.Table:
    stamp = dt.datetime(2026, 12, 7, tzinfo=dt.UTC)
    return pa.table(
        {
            "commit_end_lsn": [commit_end] * n,
            "commit_lsn": [commit_end - 8] * n,
            "lsn": list(range(commit_end - 1000, commit_end - 1000 + n)),
            "xid": [700] * n,
            "commit_ts": [stamp] * n,
            "seq": list(range(n)),
            "action": ["I"] * n,
            "schema_name": ["public"] * n,
            "table_name": ["t"] * n,
            "relation_version": [0] * n,
            "key": [[str(i)] for i in range(n)],
            "new_row": [[str(i), "x"] for i in range(n)],
            "unchanged_toast": [None] * n,
            "flags": [0] * n,
        },
        schema=CHANGE_SCHEMA,
    )


def test_a_range_is_there_once_its_manifest_is_and_reads_back_whole(store, s3):
    store.record_chain("slot", Lsn("0/1000"), "snap")
    rng = LsnRange("0/1000", "0/3000")
    with store.writer(rng) as writer:
        writer.write(_changes(1000, 0x2F00))
        stored = writer.commit(range_manifest("0/1000", "0/3000", "0/2F00"))
    bucket = store.location.bucket
    keys = s3.keys(bucket, "store/changes/")
    prefix = "store/changes/00000000/00/0000000000001000-0000000000003000/"
    assert keys == [prefix + "_RANGE.json", prefix + "part-00000.parquet"]
    assert stored.read_table().num_rows == 1000

    again = open_store(store.location)  # another process: nothing cached
    assert again.ranges() == [rng] and again.holds(rng)
    read = again.get(rng)
    assert read is not None and read.read_table().equals(_changes(1000, 0x2F00))
    assert read.spark_inputs() == [f"s3://{bucket}/{prefix}part-00000.parquet"]
    assert again.last_commit_before(Lsn("0/3000")) == Lsn("0/2F00")

    with pytest.raises(StoreError, match="already stored"), store.writer(rng) as second:
        second.commit(range_manifest("0/1000", "0/3000", "0/2F00"))
    assert again.get(rng).read_table().num_rows == 1000  # type: ignore[union-attr]


def test_files_without_a_manifest_are_no_range_and_a_prune_past_them_deletes_them(store, s3):
    """A writer killed before its manifest's put leaves files no walk lists; the next writer
    of that start ends elsewhere, under another prefix, so a prune deletes the killed one's
    files once a range it keeps lies past them, and never those of a range being written at
    the chain's end."""
    bucket = store.location.bucket
    store.record_chain("slot", Lsn("0/1000"), "snap")
    killed = "store/changes/00000000/00/0000000000001000-0000000000002000/"
    s3.client().put_object(Bucket=bucket, Key=killed + "part-00000.parquet", Body=b"x")
    assert store.ranges() == [] and not store.holds(LsnRange("0/1000", "0/2000"))
    assert store.chain_end() == Lsn("0/1000")

    store_ranges(
        store,
        [
            ("0/1000", "0/1800", "0/1700"),
            ("0/1800", "0/3000", "0/2F00"),
            ("0/3000", "0/4000", None),
        ],
        "0/1000",
    )
    writing = "store/changes/00000000/00/0000000000004000-0000000000005000/"
    s3.client().put_object(Bucket=bucket, Key=writing + "part-00000.parquet", Body=b"y")
    result = prune(store, Lsn("0/4000"), 0)
    assert result.kept is not None and result.kept.start > Lsn("0/1000")
    assert s3.keys(bucket, killed) == []
    assert s3.keys(bucket, writing) == [writing + "part-00000.parquet"]
    assert store.ranges()[0] == result.kept


def test_a_chain_write_based_on_a_stale_read_loses_and_changes_nothing(store):
    """Another process writes the chain record between this one's read and write (a second
    command on the same store): this one's conditional put loses, in one line."""
    store.record_chain("slot", Lsn("0/1000"), "snap")
    elsewhere = S3Objects(store.location)
    key = store.location.key("_CHAIN.json")
    with store.chain_lock() as chain:
        assert chain is not None
        found = elsewhere.get(key)
        assert found is not None
        record = {**json.loads(found[0]), "slot": "other"}
        elsewhere.put(key, json.dumps(record).encode())
        with pytest.raises(ObjectChangedError, match="changed by another writer meanwhile"):
            store.record_pruned(chain, None, None, 1.0)
    after = open_store(store.location).chain()
    assert after is not None and after.slot == "other" and after.pruned_at is None


def test_a_prune_takes_ranges_out_and_its_tombstones_are_finished_by_the_next(store, s3):
    bucket = store.location.bucket
    ranges = [
        ("0/1000", "0/2000", "0/1F00"),
        ("0/2000", "0/3000", "0/2F00"),
        ("0/3000", "0/4000", None),
    ]
    store_ranges(store, ranges, "0/1000")
    result = prune(store, Lsn("0/4000"), 0)
    gone = [LsnRange("0/1000", "0/2000"), LsnRange("0/2000", "0/3000")]
    assert result.removed == gone  # the last applied one is kept
    assert store.ranges() == [LsnRange("0/3000", "0/4000")]
    assert all(not s3.keys(bucket, store.range_prefix(rng)) for rng in gone)
    assert store.stored_at(gone[0]) == float("inf")
    assert s3.keys(bucket, "store/changes/.pruned/") == []

    last = LsnRange("0/3000", "0/4000")
    assert store.hide_range(last) is not None  # as a prune killed before deleting its files
    assert store.ranges() == [] and s3.keys(bucket, "store/changes/.pruned/")
    store.sweep_removed()  # what the next prune does first
    assert s3.keys(bucket, "store/changes/") == []


def test_a_bucket_that_cannot_be_used_is_one_line(s3, monkeypatch):
    missing = S3Objects(parse_location("s3://pgcdc-no-such-bucket/x"))
    with pytest.raises(StoreError, match=r"pgcdc-no-such-bucket .* does not exist: create it"):
        missing.check()
    bucket = s3.new_bucket()
    assert S3Objects(parse_location(f"s3://{bucket}/x")).get("x/none") is None
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-key")
    with pytest.raises(StoreError, match="refused the credentials") as refused:
        S3Objects(parse_location(f"s3://{bucket}/x")).check()
    assert "not-the-key" not in str(refused.value) and s3.secret not in str(refused.value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    with pytest.raises(StoreError, match="cannot reach the object store"):
        S3Objects(parse_location(f"s3://{bucket}/x")).check()
