"""A transaction of millions of rows through ``pgcdc follow``, in memory the kernel bounds.

The follow (the command and every process it starts) runs in a cgroup of its own whose limit
is ``PGCDC_MEMORY_LIMIT``: past it the kernel OOM-kills, so a follow that held the
transaction's rows would die here, as it would under a systemd unit's ``MemoryMax=`` or a
container's limit. It is SIGKILLed once mid-apply (inside the target transaction, partitions
staged), and the next plain ``pgcdc follow`` converges exactly once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest

from pgcdc_dagster.engine.control.range_lock import lock_holders
from pgcdc_dagster.engine.identifiers import origin_name
from pgcdc_dagster_tests.support.procs import MemoryCap

PGCDC = str(Path(sys.executable).parent / "pgcdc")
ROWS = 3_000_000
"""Inserted in the one transaction, beside an update of every row there was before."""
BEFORE = 200_000
LIMIT = 1024 * 1024 * 1024
CONTENT = "SELECT count(*), sum(id), sum(v), sum(hashtext(pad)) FROM big"


def _follow(env: dict[str, str], cap: MemoryCap) -> subprocess.Popen[str]:
    follow = subprocess.Popen(
        [PGCDC, "follow"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=cap.preexec,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while not any(
        h.holder.startswith("run ")
        for h in lock_holders(env["PGCDC_TARGET_DSN"], env["PGCDC_SLOT"])
    ):
        assert follow.poll() is None, follow.stderr.read() if follow.stderr else ""
        assert time.monotonic() < deadline, "the follow did not take the range"
        time.sleep(0.2)
    return follow


def _content(dsn: str) -> tuple:
    with psycopg.connect(dsn) as conn:
        return conn.execute(CONTENT).fetchone()  # type: ignore[return-value]


def _origin(dsn: str, slot: str) -> str:
    with psycopg.connect(dsn) as conn:
        (progress,) = conn.execute(  # type: ignore[misc]
            "SELECT pg_replication_origin_progress(%s, true)::text", (origin_name(slot),)
        ).fetchone()
    return progress


@pytest.mark.long
def test_a_transaction_of_millions_of_rows_is_followed_within_the_memory_limit_and_a_kill(
    cli_env,
):
    cap = MemoryCap(LIMIT)
    if not cap.enforced:
        pytest.fail("no memory cgroup can be made here: the limit would not be enforced")
    source, target, slot = (
        cli_env["PGCDC_SOURCE_DSN"],
        cli_env["PGCDC_TARGET_DSN"],
        cli_env["PGCDC_SLOT"],
    )
    with psycopg.connect(source, autocommit=True) as conn:
        conn.execute("CREATE TABLE big (id bigint PRIMARY KEY, v int NOT NULL, pad text)")
        conn.execute(
            "INSERT INTO big SELECT g, 0, md5(g::text) FROM generate_series(1, %s) g", (BEFORE,)
        )
    subprocess.run([PGCDC, "snapshot"], check=True, capture_output=True)
    env = {**os.environ, "PGCDC_SERVER": "off", "PGCDC_MEMORY_LIMIT": str(LIMIT)}
    with cap:
        # Killed inside the apply's transaction, three partitions staged (of about ten).
        follow = _follow({**env, "PGCDC_FAILPOINT": "apply.staging=kill-group@3"}, cap)
        applied_before = _origin(target, slot)
        with psycopg.connect(source) as conn:
            conn.execute(
                "INSERT INTO big SELECT g, 1, md5(g::text) FROM generate_series(%s, %s) g",
                (BEFORE + 1, BEFORE + ROWS),
            )
            conn.execute("UPDATE big SET v = v + 2")
        expected = _content(source)
        assert follow.wait(timeout=600) == -signal.SIGKILL
        assert _content(target)[0] == BEFORE  # nothing of the transaction was committed
        assert _origin(target, slot) == applied_before

        follow = _follow(env, cap)
        deadline = time.monotonic() + 600
        while _content(target)[0] != BEFORE + ROWS:
            assert follow.poll() is None, follow.stderr.read() if follow.stderr else ""
            assert time.monotonic() < deadline, "the follow did not apply the transaction"
            time.sleep(0.5)
        follow.send_signal(signal.SIGTERM)
        _, err = follow.communicate(timeout=120)
        assert follow.returncode == 0, err
        assert cap.oom_kills() == 0
        assert cap.peak() <= LIMIT
    assert _content(target) == expected  # every row once, every update once
