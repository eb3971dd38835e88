"""The output store on S3 (``PGCDC_STORE=s3://bucket/prefix``), against a real S3 API server
(``moto_server``, :mod:`.support.s3`), through the commands a user runs in fresh processes:
snapshot, catch-up, follow, prune and status; a SIGKILL at each of the store's durable steps,
then a plain catch-up converges; bad input in one line with nothing written.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pgcdc_dagster.engine.control import pipeline
from pgcdc_dagster.engine.settings import ReplicationSettings
from pgcdc_dagster_tests.support.s3 import S3Server, s3_server_reached
from pgcdc_dagster_tests.support.waits import wait_for
from pgcdc_dagster_tests.test_resume import PGCDC, Clusters, Site, clusters, make_site

__all__ = ["clusters"]  # the module's own clusters (a fixture of test_resume's making)


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    """The S3 server, and this process reaching it as the commands do (for the checks)."""
    with s3_server_reached() as server:
        yield server


def s3_site(clusters: Clusters, tmp: Path, s3: S3Server) -> tuple[Site, str]:
    """A replication whose store is a bucket of its own on the S3 server; the bucket."""
    site = make_site(clusters, tmp)
    bucket = s3.new_bucket()
    site.env.update(s3.env, PGCDC_STORE=f"s3://{bucket}/replica")
    site.settings = ReplicationSettings.from_env(site.env)
    return site, bucket


@pytest.fixture(scope="module")
def site(clusters: Clusters, s3: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Site:
    made, _ = s3_site(clusters, tmp_path_factory.mktemp("s3"), s3)
    taken = made.pgcdc("snapshot")
    assert taken.returncode == 0, taken.stderr
    return made


def test_snapshot_catchup_follow_and_prune_keep_the_store_on_s3(site: Site, s3: S3Server):
    bucket = site.settings.store_location.bucket
    with site.writer(seed=1):
        time.sleep(1.0)
    done = site.pgcdc("catchup", "--endpos", "current")
    assert done.returncode == 0, done.stderr
    site.assert_converged()
    keys = s3.keys(bucket, "replica/")
    assert "replica/_CHAIN.json" in keys
    manifests = [k for k in keys if k.endswith("/_RANGE.json")]
    assert manifests and all(k.startswith("replica/changes/") for k in manifests)
    assert not (Path(site.settings.store_path) / "changes").exists() or not any(
        (Path(site.settings.store_path) / "changes").rglob("_RANGE.json")
    )  # nothing of the ranges on this disk

    follow = subprocess.Popen(
        [PGCDC, "follow"],
        env={**os.environ, **site.env, "PGCDC_PROGRESS": "lines"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        with site.writer(seed=2) as writer:
            wait_for(lambda: writer.committed > 50, "writes", alive=follow)
        before = len(manifests)
        wait_for(
            lambda: (
                len([k for k in s3.keys(bucket, "replica/") if k.endswith("_RANGE.json")]) > before
            ),
            "the follow to store a range on S3",
            alive=follow,
        )
    finally:
        follow.send_signal(signal.SIGTERM)
        _, err = follow.communicate(timeout=120)
    assert follow.returncode == 0, err
    done = site.pgcdc("catchup", "--endpos", "current")
    assert done.returncode == 0, done.stderr
    site.assert_converged()

    status = site.pgcdc("status", "--json")
    assert status.returncode == 0, status.stderr
    stored = json.loads(status.stdout)["ranges_stored"]
    assert json.loads(status.stdout)["store"] == f"s3://{bucket}/replica/"
    pruned = site.pgcdc("prune", "--retention", "0", "--json")
    assert pruned.returncode == 0, pruned.stderr
    report = json.loads(pruned.stdout)
    assert report["ranges_removed"] == stored - 1, report  # the last applied one is kept
    assert report["bytes_removed"] > 0, report
    left = [k for k in s3.keys(bucket, "replica/") if k.endswith("_RANGE.json")]
    assert len(left) == 1
    assert not [k for k in s3.keys(bucket, "replica/changes/.pruned/")]  # no tombstone left
    with site.writer(seed=3):
        time.sleep(0.5)
    done = site.pgcdc("catchup", "--endpos", "current")
    assert done.returncode == 0, done.stderr
    site.assert_converged()
    uri = pipeline.store_of(site.settings).range_uri(pipeline.store_of(site.settings).ranges()[-1])
    assert uri.startswith(f"s3://{bucket}/replica/changes/"), uri


STORE_POINTS = [
    "store.uploaded",  # the files are up, the manifest is not
    "store.renamed",  # the manifest is up, the slot not yet confirmed
    "receive.after_store",
    "prune.recorded",
    "prune.removing",
]


@pytest.mark.parametrize("point", STORE_POINTS)
def test_a_kill_at_a_durable_step_of_the_s3_store_then_a_plain_catchup_converges(
    site: Site, s3: S3Server, point: str
):
    bucket = site.settings.store_location.bucket
    with site.writer(seed=10 + STORE_POINTS.index(point)):
        time.sleep(1.0)
        if not point.startswith("prune."):
            killed = site.pgcdc("catchup", "--endpos", "current", failpoint=f"{point}=kill-group")
    if point.startswith("prune."):
        # Two catch-ups, so that the prune has a range to remove beside the last applied one
        # it keeps, whichever tests of this module ran before.
        for again in range(2):
            if again:
                with site.writer(seed=20 + STORE_POINTS.index(point)):
                    time.sleep(0.5)
            done = site.pgcdc("catchup", "--endpos", "current")
            assert done.returncode == 0, done.stderr
        killed = site.pgcdc("prune", "--retention", "0", failpoint=f"{point}=kill-group")
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr)
    if point.startswith("prune."):  # the next prune finishes what the killed one began
        if point == "prune.removing":
            assert s3.keys(bucket, "replica/changes/.pruned/")  # its tombstones
        again = site.pgcdc("prune", "--retention", "0")
        assert again.returncode == 0, again.stderr
        assert not s3.keys(bucket, "replica/changes/.pruned/")
    done = site.pgcdc("catchup", "--endpos", "current")
    assert done.returncode == 0, done.stderr
    site.assert_converged()


@pytest.mark.parametrize(
    "point", ["snapshot.after_marker", "snapshot.after_slot", "snapshot.after_origin"]
)
def test_a_snapshot_killed_at_a_chain_write_on_s3_is_refused_by_catchup_and_redone(
    clusters: Clusters, s3: S3Server, tmp_path: Path, point: str
):
    """The chain record's writes (snapshot begun, slot created, snapshot recorded) are
    conditional puts on S3: a snapshot killed after each is refused by catch-up in one line
    and redone by the next plain snapshot."""
    fresh, _ = s3_site(clusters, tmp_path, s3)
    killed = fresh.pgcdc("snapshot", failpoint=f"{point}=kill-group")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    refused = fresh.pgcdc("catchup", "--endpos", "current")
    assert refused.returncode != 0 and "pgcdc snapshot" in refused.stderr, refused.stderr
    redone = fresh.pgcdc("snapshot")
    assert redone.returncode == 0, redone.stderr
    with fresh.writer(seed=31):
        time.sleep(0.5)
    done = fresh.pgcdc("catchup", "--endpos", "current")
    assert done.returncode == 0, done.stderr
    fresh.assert_converged()


def test_a_store_on_s3_that_cannot_be_used_is_named_in_one_line_and_nothing_is_written(
    clusters: Clusters, s3: S3Server, tmp_path: Path
):
    site, bucket = s3_site(clusters, tmp_path, s3)
    cases = {
        "missing bucket": ({"PGCDC_STORE": "s3://pgcdc-no-such-bucket/x"}, "does not exist"),
        "wrong credentials": ({"AWS_SECRET_ACCESS_KEY": "wrong"}, "refused the credentials"),
        "no server": ({"AWS_ENDPOINT_URL": "http://127.0.0.1:9"}, "cannot reach"),
        "unsupported scheme": ({"PGCDC_STORE": f"gs://{bucket}/x"}, "gs:// output store"),
        "credentials in the URL": (
            {"PGCDC_STORE": f"s3://key:secret@{bucket}/x"},
            "holds credentials",
        ),
    }
    for case, (env, said) in cases.items():
        failed = site.pgcdc("snapshot", env=env)
        assert failed.returncode != 0, (case, failed.stderr)
        line = failed.stderr.strip().splitlines()[-1]
        assert said in line, (case, line)
        assert "Traceback" not in failed.stderr, (case, failed.stderr)
        assert s3.secret not in failed.stderr and "wrong" not in failed.stderr, case
    assert s3.keys(bucket) == []
