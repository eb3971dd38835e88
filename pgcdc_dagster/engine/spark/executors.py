"""Spark's executors made ready for the engine's tasks: our code shipped to them, then checked.

The copy tasks of a snapshot and the staging tasks of a big range are plain Python functions
that import ``pgcdc_dagster`` and ``psycopg`` on the executors and talk to PostgreSQL from
there. On a cluster the executors run the cluster's Python, which has neither, and their
network is the cluster's, not the driver's. Without this module the first sign of either is a
task failure after Spark's retries, with rows already moving.

What must hold:

* **The code ships itself.** A zip of the package, built once per code version (its name
  carries a hash of the files, so an upgrade ships a new one and nothing is ever reinstalled
  on the workers), is added to every session that is not local: ``addPyFile`` on a classic
  session, ``addArtifacts(..., pyfile=True)`` on Spark Connect. Third-party packages are the
  cluster's: a packed virtualenv through ``spark.archives``, or what the cluster provides
  (``docs/spark-cluster.md``).
* **Checked before the first row moves.** One tiny job, a task per executor core, imports what
  the tasks import, names the versions, and connects to the servers the tasks will connect to
  (:mod:`.probe`, pickled by value so it runs where nothing of ours imports). Any
  finding is one :class:`SparkExecutorError` line that names what is missing, where, and the
  fix. A job that cannot run at all (no Python on the workers, a Python of another version,
  no executor within :data:`EXECUTOR_WAIT_S`) is one line too.
* A local session (``local[*]``) runs this interpreter: nothing to ship or check there.
* A session is checked once per set of servers (a follow's Spark ranges do not repeat it).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import sys
import tempfile
import threading
import time
import uuid
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..connect import describe_dsn, redact
from ..errors import PgcdcError
from . import probe as spark_probe

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

PACKAGE = Path(__file__).resolve().parents[2]
"""The ``pgcdc_dagster`` package folder: what the zip holds."""
TASK_MODULES = (
    "psycopg",
    "pyarrow",
    "numpy",
    "pandas",
    "pydantic",
    "pgcdc_dagster.engine.snapshot.copy",
    "pgcdc_dagster.engine.apply.spark_staging",
)
"""What the executors' tasks import: the third-party packages first, so that a missing one is
named as itself rather than as the engine module that needs it."""
EXECUTOR_WAIT_S = 180.0
"""How long the check waits for executors: a cluster that grants none in this time (all cores
taken, no worker registered) is named rather than waited on for ever."""
FIX = "see docs/spark-cluster.md"


class SparkExecutorError(PgcdcError):
    """Spark's executors cannot run the engine's tasks; one line names what and the fix."""


class StoreUnreadableError(SparkExecutorError):
    """Spark's executors cannot read the output store's files (it is not on storage they
    mount at the same path): a range's staging can fall back to the driver
    (``PGCDC_SPARK_STAGING``)."""


@dataclass(frozen=True)
class SparkApp:
    """Where a user finds the Spark application that ran the work."""

    application_id: str | None
    ui_url: str | None
    master: str | None
    executors: str | None = None
    """What the check found on the executors (:meth:`ExecutorCheck.summary`), once it ran."""


@dataclass(frozen=True)
class ExecutorCheck:
    """What the check found on the executors."""

    app: SparkApp
    tasks: int
    hosts: tuple[str, ...]
    python: str
    versions: Mapping[str, str]
    seconds: float

    def summary(self) -> str:
        """``2 task(s) on host-a, host-b: Python 3.11.2, psycopg 3.3.9, ...; 0.9 s``."""
        third_party = ", ".join(
            f"{name} {version}"
            for name, version in self.versions.items()
            if not name.startswith("pgcdc_dagster")
        )
        return (
            f"{self.tasks} task(s) on {', '.join(self.hosts)}: Python {self.python}, "
            f"{third_party}; checked in {self.seconds:.1f} s"
        )


def is_connect_session(spark: SparkSession) -> bool:
    """Whether ``spark`` is a Spark Connect client (no ``sparkContext``, no RDDs).

    Tested by module name so that the check works without the Connect extras installed.
    """
    return type(spark).__module__.startswith("pyspark.sql.connect")


def is_local(spark: SparkSession) -> bool:
    """A classic session on a ``local`` master: its workers run this interpreter."""
    if is_connect_session(spark):
        return False
    return str(spark.sparkContext.master).startswith("local")


# ─── the code ─────────────────────────────────────────────────────────────────────────────────


@functools.cache
def package_zip() -> Path:
    """The zip of this package's code, named by a hash of its files: built once per code
    version into the temporary directory, and written whole (renamed into place) so that a
    concurrent build or a kill midway never leaves a partial zip under the final name."""
    files = sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts and p.is_file())
    digest = hashlib.sha256()
    for path in files:
        digest.update(str(path.relative_to(PACKAGE.parent)).encode())
        digest.update(path.read_bytes())
    folder = Path(tempfile.gettempdir()) / "pgcdc-code"
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"pgcdc_dagster-{digest.hexdigest()[:16]}.zip"
    if not final.exists():
        partial = folder / f".{final.name}.{uuid.uuid4().hex}"
        with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as archive:
            for path in files:
                archive.write(path, str(path.relative_to(PACKAGE.parent)))
        partial.replace(final)
    return final


_shipped: set[tuple[int, str]] = set()


def ship_code(spark: SparkSession) -> Path | None:
    """Add the package's zip to ``spark`` (once) unless it is local; the zip, or ``None``."""
    if is_local(spark):
        return None
    archive = package_zip()
    shipped = (id(spark), archive.name)
    if shipped in _shipped:
        return archive
    if is_connect_session(spark):
        spark.addArtifacts(str(archive), pyfile=True)
    else:
        from pyspark import SparkFiles

        spark.sparkContext.addPyFile(str(archive))
        # addPyFile also puts the zip on this process's path, ahead of the installed package:
        # modules imported later would come from the zip (the same code, but their __file__
        # inside an archive). The executors get it from the session, not from this list.
        with contextlib.suppress(ValueError):
            sys.path.remove(os.path.join(SparkFiles.getRootDirectory(), archive.name))
    _shipped.add(shipped)
    return archive


# ─── the check ────────────────────────────────────────────────────────────────────────────────

_checked: dict[tuple[str, tuple[str, ...], bool], ExecutorCheck] = {}
_checking = threading.Lock()


def check_executors(
    spark: SparkSession,
    servers: Mapping[str, str],
    paths: Sequence[str] = (),
    *,
    wait_s: float = EXECUTOR_WAIT_S,
) -> ExecutorCheck | None:
    """Run the check on ``spark``'s executors against ``servers`` (``role: dsn``) and the
    files the tasks will read (``paths``: a range's Parquet in the store, which must be on
    storage every executor mounts), once per session and servers, with files or without (one
    range's file read says the store is shared: a follow's later big ranges are not checked
    again); ``None`` for a local session. Raises :class:`SparkExecutorError` with one line
    when the executors cannot run the tasks."""
    if is_local(spark):
        return None
    app = spark_app(spark)
    key = (
        f"{app.application_id}:{id(spark)}",
        tuple(sorted(hashlib.sha256(f"{r}={d}".encode()).hexdigest() for r, d in servers.items())),
        bool(paths),
    )
    with _checking:
        if key in _checked:
            return _checked[key]
        started = time.monotonic()
        reports = [json.loads(r) for r in _run_probe(spark, dict(servers), list(paths), wait_s)]
        check = _verdict(reports, servers, app, time.monotonic() - started)
        _checked[key] = check
        return check


def _run_probe(
    spark: SparkSession, servers: dict[str, str], paths: list[str], wait_s: float
) -> list[str]:
    """The probe's reports, one per task; the job is cancelled after ``wait_s``."""
    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(spark_probe)
    connect = is_connect_session(spark)
    tasks = 2 if connect else max(1, int(spark.sparkContext.defaultParallelism))
    work = functools.partial(spark_probe.probe, list(TASK_MODULES), servers, paths)
    tag = f"pgcdc-executor-check-{uuid.uuid4().hex[:8]}"
    outcome: dict[str, Any] = {}

    def job() -> None:
        try:
            if connect:
                from pyspark.sql import functions as F
                from pyspark.sql.types import StringType

                spark.addTag(tag)
                run = F.udf(work, StringType(), useArrow=False).asNondeterministic()
                rows = spark.range(tasks, numPartitions=tasks).select(run("id")).collect()
                outcome["reports"] = [row[0] for row in rows]
            else:
                sc = spark.sparkContext
                sc.setJobGroup(tag, "pgcdc: check the executors", interruptOnCancel=True)
                outcome["reports"] = sc.parallelize(range(tasks), tasks).map(work).collect()
        except BaseException as exc:
            outcome["error"] = exc

    runner = threading.Thread(target=job, name="pgcdc-executor-check", daemon=True)
    runner.start()
    runner.join(wait_s)
    if runner.is_alive():
        if connect:
            spark.interruptTag(tag)
        else:
            spark.sparkContext.cancelJobGroup(tag)
        raise SparkExecutorError(
            f"no Spark executor ran pgcdc's check within {wait_s:.0f} s on "
            f"{_where(spark_app(spark))}: the cluster granted no executor (no worker, or every "
            "core taken); give the application executors (spark.executor.cores, "
            f"spark.cores.max through PGCDC_SPARK_CONF) or free the cluster; {FIX}"
        )
    if "error" in outcome:
        line = redact_all(task_error_line(outcome["error"]), servers.values())
        raise SparkExecutorError(
            f"Spark's executors could not run pgcdc's check: {line}: the executors need a "
            f"Python of the driver's version with pgcdc's dependencies (set "
            f"spark.pyspark.python, or ship a packed virtualenv with spark.archives, through "
            f"PGCDC_SPARK_CONF); {FIX}"
        ) from None
    return list(outcome["reports"])


def _verdict(
    reports: list[dict[str, Any]], servers: Mapping[str, str], app: SparkApp, seconds: float
) -> ExecutorCheck:
    """The check's result, or the first problem found as one line."""
    for report in reports:
        where = f"on {report['host']} (Python {report['python']} at {report['executable']})"
        missing = report["missing"]
        if missing:
            names = ", ".join(sorted(set(missing.values())))
            raise SparkExecutorError(
                f"Spark's executors cannot import {names} {where}: ship pgcdc's dependencies "
                "to them as a packed virtualenv (spark.archives=<env>.tar.gz#env and "
                "spark.pyspark.python=./env/bin/python through PGCDC_SPARK_CONF) or install "
                f"them on every worker; {FIX}"
            )
        for role, error in report["connections"].items():
            if error is not None:
                dsn = servers[role]
                raise SparkExecutorError(
                    f"Spark's executors cannot connect to the {role} {describe_dsn(dsn)} "
                    f"{where}: {redact(error, dsn)}: the {role} must be reachable from inside "
                    "the cluster under the address its connection string names (check the "
                    f"cluster's network, firewall and pg_hba.conf); {FIX}"
                )
        if report["unreadable"] and str(report["unreadable"][0]).startswith("s3://"):
            raise StoreUnreadableError(
                f"Spark's executors cannot read {report['unreadable'][0]} {where}: give them "
                "credentials for the bucket (spark.executorEnv.AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY through PGCDC_SPARK_CONF, or an instance role) and a "
                f"route to its endpoint; {FIX}"
            )
        if report["unreadable"]:
            raise StoreUnreadableError(
                f"Spark's executors cannot read {report['unreadable'][0]} {where}: the output "
                "store (PGCDC_STORE) must be on storage every executor mounts at the same "
                f"path (NFS, a cloud file system) for Spark to stage a range; {FIX}"
            )
    first = reports[0]
    return ExecutorCheck(
        app=app,
        tasks=len(reports),
        hosts=tuple(sorted({r["host"] for r in reports})),
        python=first["python"],
        versions=dict(first["versions"]),
        seconds=seconds,
    )


# ─── where the application is ────────────────────────────────────────────────────────────────


def spark_app(spark: SparkSession) -> SparkApp:
    """The application's id, its UI's address (``None`` where the UI is off or unknown, as on
    Spark Connect) and its master."""
    if is_connect_session(spark):
        try:
            app_id = spark.conf.get("spark.app.id")
        except Exception:
            app_id = None
        return SparkApp(app_id, None, None, _checked_summary(spark))
    sc = spark.sparkContext
    return SparkApp(sc.applicationId, sc.uiWebUrl, str(sc.master), _checked_summary(spark))


def _checked_summary(spark: SparkSession) -> str | None:
    """The summary of the newest check of ``spark``'s executors, if one ran."""
    found = [c for key, c in list(_checked.items()) if key[0].endswith(f":{id(spark)}")]
    return found[-1].summary() if found else None


def _where(app: SparkApp) -> str:
    return " ".join(p for p in (app.master, app.application_id) if p) or "the Spark cluster"


def task_error_line(exc: BaseException) -> str:
    """The Python error line of a failed Spark job, without the JVM stack around it."""
    text = str(exc)
    lines = [ln.strip() for ln in text.splitlines() if "Error:" in ln or "Exception:" in ln]
    python_lines = [ln for ln in lines if not ln.startswith(("org.", "java.", "at ", "py4j"))]
    return (python_lines or lines or [text.strip().splitlines()[0] if text.strip() else ""])[-1]


def redact_all(text: str, dsns: Any) -> str:
    for dsn in dsns:
        text = redact(text, dsn)
    return text


def task_log(line: str) -> None:
    """Inside a Spark task, one line on the executor's stderr (``pgcdc task: ...``): where a
    cluster's operator finds, in the worker's logs, what each of the engine's tasks did. The
    same task code run by the driver says nothing (its command reports)."""
    if "pyspark" not in sys.modules:  # the driver's own copies: no Spark here at all
        return
    from pyspark import TaskContext

    context = TaskContext.get()
    if context is None:
        return
    print(
        f"pgcdc task: {line} (stage {context.stageId()}, partition {context.partitionId()}, "
        f"attempt {context.attemptNumber()}, pid {os.getpid()})",
        file=sys.stderr,
        flush=True,
    )
