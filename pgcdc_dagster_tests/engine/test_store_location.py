"""``PGCDC_STORE`` read as a place: a local folder, a ``file://`` URL, an S3 bucket and
prefix; every other URL refused in one line, never taken for a local folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from pgcdc_dagster.engine.store_location import StoreLocationError, parse_location


def test_a_path_and_a_file_url_are_a_local_folder(tmp_path: Path) -> None:
    assert parse_location(str(tmp_path)).path == tmp_path
    local = parse_location(f"file://{tmp_path}/store")
    assert local.is_local and local.path == tmp_path / "store"
    assert local.work_folder == tmp_path / "store"
    assert local.url == (tmp_path / "store").as_uri()


def test_an_s3_url_is_a_bucket_and_a_prefix_with_a_local_work_folder_of_its_own() -> None:
    store = parse_location("s3://my-bucket/replicas/orders/")
    assert not store.is_local and store.path is None
    assert (store.bucket, store.prefix) == ("my-bucket", "replicas/orders/")
    assert store.key("changes", "00000000") == "replicas/orders/changes/00000000"
    assert store.url == "s3://my-bucket/replicas/orders/"
    assert parse_location("s3://my-bucket").prefix == ""
    other = parse_location("s3://my-bucket/other")
    assert store.work_folder != other.work_folder  # scratch of one store is not another's
    assert store.work_folder.name.startswith("my-bucket-")


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("gs://bucket/x", "a gs:// output store is not supported yet"),
        ("abfs://c@a/x", "abfs:// output store"),
        ("s3://key:secret@bucket/x", "holds credentials"),
        ("s3://Bucket_1/x", "names no valid bucket"),
        ("file://", "names no path"),
    ],
)
def test_a_url_that_names_no_usable_store_is_refused_in_one_line(value: str, said: str) -> None:
    with pytest.raises(StoreLocationError) as refused:
        parse_location(value)
    message = str(refused.value)
    assert said in message and "\n" not in message
    assert "secret" not in message
