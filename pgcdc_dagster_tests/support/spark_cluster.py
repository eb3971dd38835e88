"""A real Spark standalone cluster on this machine, and the Pythons its executors run.

The cluster is PySpark's own jars (``SPARK_HOME`` = the installed ``pyspark`` package): one
master and two workers of one core each, every one a JVM of its own started through
``bin/spark-class`` in a process group of its own, on free loopback ports, logging into a
temporary directory. The workers' environment is scrubbed of this process's Python and
PostgreSQL variables, so what an executor can import and where it connects are the
application's business (``spark.pyspark.python``, ``spark.executorEnv.*``), as on a cluster
elsewhere.

The executors' Pythons are virtualenvs made without pip (about a second each):

- :func:`deps_python`: the project's third-party dependencies (its site-packages folder as a
  ``.pth`` line), but not ``pgcdc_dagster`` (the editable install's own ``.pth`` is not read
  from there): a cluster where the package must come with the application;
- :func:`bare_python`: nothing but the standard library (no ``psycopg``).

Spark ships ``pyspark.zip`` to the executors itself, so both can run its Python worker.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from pgcdc_dagster.engine.spark.java import NoJavaError, ensure_java
from pgcdc_dagster.engine.spark.server import free_port

WORKERS = 2
WORKER_MEMORY = "1g"
START_TIMEOUT_S = 90.0
TASK_LINE = "pgcdc task:"
"""How the engine's copy and staging tasks sign their lines on an executor's stderr."""

DAEMON_JAVA_OPTS = "-XX:+UseSerialGC -XX:TieredStopAtLevel=1"
"""Master and workers only route: C1 and the serial collector start them faster on 2 cores."""


class SparkClusterError(RuntimeError):
    """The standalone cluster could not be started (its logs are named in the message)."""


def spark_home() -> Path:
    """The installed pyspark package: it holds ``bin/spark-class`` and ``jars/``."""
    import pyspark

    home = Path(pyspark.__file__).resolve().parent
    if not (home / "bin" / "spark-class").exists() or not any((home / "jars").glob("spark-core*")):
        raise SparkClusterError(
            f"{home} has no bin/spark-class or jars/spark-core*.jar: the pyspark wheel is "
            "incomplete; reinstall pyspark"
        )
    try:
        ensure_java()
    except NoJavaError as exc:
        raise SparkClusterError(str(exc)) from None
    return home


def daemon_env(work: Path) -> dict[str, str]:
    """The environment of the master and the workers, hence of the executors they start:
    loopback, and nothing of this process's virtualenv, ``PYTHON*``, ``PG*`` or Dagster
    variables."""
    venv_bin = str(Path(sys.executable).parent)
    dropped = ("PYTHON", "PYSPARK", "PG", "DAGSTER", "SPARK", "VIRTUAL_ENV")
    env = {k: v for k, v in os.environ.items() if not k.startswith(dropped)}
    env["PATH"] = os.pathsep.join(
        p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != venv_bin
    )
    env.update(
        SPARK_HOME=str(spark_home()),
        SPARK_LOCAL_IP="127.0.0.1",
        SPARK_WORKER_DIR=str(work / "work"),
        # The executors' scratch (fetched files, shuffle) here too, not in the shared /tmp.
        SPARK_LOCAL_DIRS=str(work / "local"),
        SPARK_DAEMON_JAVA_OPTS=DAEMON_JAVA_OPTS,
        SPARK_DAEMON_MEMORY="256m",
        # Spark 4's master opens a REST submission server on the fixed port 6066 by default.
        SPARK_MASTER_OPTS="-Dspark.master.rest.enabled=false",
    )
    return env


@dataclass
class Daemon:
    name: str
    process: subprocess.Popen[bytes]
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def tail(self, lines: int = 15) -> str:
        return "\n".join(self.text().splitlines()[-lines:])


@dataclass
class StandaloneCluster:
    """A running master and its workers; :meth:`stop` ends every process they started."""

    directory: Path
    master_url: str = ""
    daemons: list[Daemon] = field(default_factory=list)
    work_dirs: list[Path] = field(default_factory=list)
    started_in_s: float = 0.0

    def applications(self) -> set[str]:
        """The ids of the applications whose executors ran on the workers (``app-...``)."""
        return {app.name for w in self.work_dirs for app in w.glob("app-*")}

    def executor_logs(self) -> list[Path]:
        """Every executor's stderr: ``<work-dir>/app-*/<executor id>/stderr``."""
        return sorted(p for w in self.work_dirs for p in w.glob("app-*/*/stderr"))

    def task_lines(self, app_id: str | None = None) -> dict[Path, list[str]]:
        """The engine's ``pgcdc task:`` lines, by the executor stderr they are in (of one
        application when ``app_id`` is given)."""
        found: dict[Path, list[str]] = {}
        for log in self.executor_logs():
            if app_id is not None and log.parent.parent.name != app_id:
                continue
            lines = [
                line[line.index(TASK_LINE) :]
                for line in log.read_text(errors="replace").splitlines()
                if TASK_LINE in line
            ]
            if lines:
                found[log] = lines
        return found

    def worker_of(self, log: Path) -> Path:
        """The work dir (one per worker) an executor's stderr is under."""
        return next(w for w in self.work_dirs if log.is_relative_to(w))

    def logs_tail(self) -> str:
        return "\n".join(f"--- {d.name} ({d.log}):\n{d.tail()}" for d in self.daemons)

    def stop(self) -> None:
        end_groups([d.process for d in self.daemons])
        self.daemons.clear()


Process = subprocess.Popen[bytes] | subprocess.Popen[str]


def end_groups(processes: list[Process], grace_s: float = 5.0) -> None:
    """End each process and everything in its process group (a JVM's executors and their
    Python workers): SIGTERM to all, then SIGKILL to what is left after ``grace_s``."""
    for process in processes:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for process in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
    for process in processes:
        # The leader may be gone while its children live on in the group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=grace_s)


def kill_group(process: Process, grace_s: float = 5.0) -> None:
    """End ``process`` and everything in its process group."""
    end_groups([process], grace_s)


def _spark_class(
    home: Path,
    name: str,
    args: list[str],
    env: dict[str, str],
    log: Path,
    hidden: Path | None = None,
) -> Daemon:
    """A Spark daemon; with ``hidden``, in a mount namespace of its own where an empty tmpfs
    lies over that folder (as on another host that does not mount it): it and every process
    it starts (executors, their Python workers) see the folder empty."""
    command = [str(home / "bin" / "spark-class"), *args]
    if hidden is not None:
        hidden.mkdir(parents=True, exist_ok=True)
        command = [
            "unshare", "-m", "--propagation", "private", "sh", "-c",
            'mount -t tmpfs pgcdc-hidden "$0" && exec "$@"', str(hidden), *command,
        ]  # fmt: skip
    with open(log, "wb") as sink:
        process = subprocess.Popen(
            command,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a group of its own: killed whole at teardown
            cwd=log.parent,
        )
    return Daemon(name, process, log)


T = TypeVar("T")


def _wait_for(cluster: StandaloneCluster, what: str, ready: Callable[[], T], deadline: float) -> T:
    """``ready()``'s first true answer; one error with the logs when a daemon exits first or
    the deadline passes."""
    while True:
        found = ready()
        if found:
            return found
        for daemon in cluster.daemons:
            if daemon.process.poll() is not None:
                raise SparkClusterError(
                    f"{daemon.name} exited with {daemon.process.returncode} while waiting "
                    f"for {what}:\n{cluster.logs_tail()}"
                )
        if time.monotonic() > deadline:
            raise SparkClusterError(
                f"no {what} within {START_TIMEOUT_S:.0f} s:\n{cluster.logs_tail()}"
            )
        time.sleep(0.1)


MASTER_STARTED = re.compile(r"Starting Spark master at (spark://\S+)")
MASTER_ALIVE = "I have been elected leader! New state: ALIVE"
WORKER_REGISTERED = "Registering worker"


@contextlib.contextmanager
def standalone_cluster(
    directory: Path, workers: int = WORKERS, hidden: Path | None = None
) -> Iterator[StandaloneCluster]:
    """A master and ``workers`` workers of one core and :data:`WORKER_MEMORY` each, up and
    registered; every process is ended on the way out, whatever happened. ``hidden``: a folder
    the workers and their executors see empty (needs root, for a mount namespace)."""
    home = spark_home()
    directory.mkdir(parents=True, exist_ok=True)
    env = daemon_env(directory)
    cluster = StandaloneCluster(directory)
    started = time.monotonic()
    deadline = started + START_TIMEOUT_S
    try:
        master = _spark_class(
            home,
            "master",
            ["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
             "--port", str(free_port()), "--webui-port", str(free_port())],
            env,
            directory / "master.log",
        )  # fmt: skip
        cluster.daemons.append(master)
        # The master takes the next port when its chosen one got taken meanwhile: the URL
        # it logs is the one to give the workers. They start once it is ALIVE: a master still
        # in STANDBY ignores a registration, and a worker retries only after 5-15 s.
        found = _wait_for(
            cluster, "master start", lambda: MASTER_STARTED.search(master.text()), deadline
        )
        assert found is not None
        cluster.master_url = found.group(1)
        _wait_for(cluster, "master elected", lambda: MASTER_ALIVE in master.text(), deadline)
        for n in range(workers):
            work_dir = directory / f"worker-{n}"
            work_dir.mkdir()
            cluster.work_dirs.append(work_dir)
            cluster.daemons.append(
                _spark_class(
                    home,
                    f"worker-{n}",
                    ["org.apache.spark.deploy.worker.Worker", cluster.master_url,
                     "--cores", "1", "--memory", WORKER_MEMORY, "--work-dir", str(work_dir),
                     "--host", "127.0.0.1", "--webui-port", str(free_port())],
                    env,
                    directory / f"worker-{n}.log",
                    hidden,
                )
            )  # fmt: skip
        _wait_for(
            cluster,
            f"{workers} workers registered",
            lambda: master.text().count(WORKER_REGISTERED) >= workers,
            deadline,
        )
        cluster.started_in_s = time.monotonic() - started
        yield cluster
    finally:
        cluster.stop()


def _make_venv(directory: Path) -> Path:
    """A virtualenv without pip on the interpreter this process's virtualenv is built on;
    its ``python``."""
    base = (
        Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    )
    done = subprocess.run(
        [str(base), "-m", "venv", "--without-pip", str(directory)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SparkClusterError(f"python -m venv {directory} failed: {done.stderr.strip()}")
    return directory / "bin" / "python"


def _site_packages(python: Path) -> Path:
    out = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(out.stdout.strip())


def imports(python: Path, module: str) -> subprocess.CompletedProcess[str]:
    """``python -c 'import module'`` from ``/`` (no project folder on ``sys.path``)."""
    return subprocess.run(
        [str(python), "-c", f"import {module}"],
        cwd="/",
        env={k: v for k, v in os.environ.items() if not k.startswith("PYTHON")},
        capture_output=True,
        text=True,
        check=False,
    )


def deps_python(directory: Path) -> Path:
    """A Python with the project's dependencies and without ``pgcdc_dagster``."""
    python = _make_venv(directory)
    ours = Path(sysconfig.get_paths()["purelib"])
    (_site_packages(python) / "project_dependencies.pth").write_text(f"{ours}\n")
    return python


def bare_python(directory: Path) -> Path:
    """A Python with the standard library only."""
    return _make_venv(directory)
