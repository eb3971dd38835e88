"""The one place that builds the SparkSession the engine schedules its work on.

Spark is the scheduler of the bulk work (the base snapshot's table copy, and later the transforms),
not a data path of its own: tasks are plain Python functions that talk to PostgreSQL directly.
What must hold for that to work:

- the Python workers of a ``local`` master run the interpreter of this process
  (``PYSPARK_PYTHON``), or they cannot import ``pgcdc_dagster`` and ``psycopg``; Spark's own
  default is whatever ``python3`` is on the PATH, which on this kind of machine is a different
  interpreter. On a cluster the executors run the Python that ``spark.pyspark.python`` names
  (else the workers' ``python3``); the package is shipped to them and checked there
  (:mod:`.executors`);
- ``conf`` (the settings' ``spark_conf``, a Dagster run's ``spark_config``) reaches the builder,
  so settings Spark reads only at start-up (executor memory and cores, ``spark.archives``)
  take effect;
- a local Spark binds loopback (``SPARK_LOCAL_IP``) unless told otherwise, so a laptop or CI box
  with odd interfaces neither warns nor exposes ports; a driver on a cluster binds where Spark
  chooses, since the executors connect back to it;
- one process uses one session: ``getOrCreate`` hands back the running session, so a second call
  with other arguments does **not** change its master (stop the session first to switch).

The master comes from the argument (the settings' ``spark_master``), else ``local[*]``. A Spark
Connect URL (``sc://host:port``, the settings' ``spark_remote``) wins over a master:
a Connect session attaches in under a second to a running server, but has no ``sparkContext``
(callers that need RDDs must check :func:`~.executors.is_connect_session`).
"""

from __future__ import annotations

import atexit
import os
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

from pyspark.sql import SparkSession

from .executors import ship_code
from .java import ensure_java

DEFAULT_MASTER = "local[*]"
LOCAL_SHUFFLE_PARTITIONS = 4
"""Spark's default of 200 shuffle partitions makes every small local job pay 200 empty tasks."""


def get_spark(
    master: str | None = None,
    remote: str | None = None,
    app_name: str = "pgcdc_dagster",
    conf: Mapping[str, str] | None = None,
) -> SparkSession:
    """The process's SparkSession: created on first call, reused afterwards; on a cluster,
    with the package's code added to it (:func:`~.executors.ship_code`)."""
    conf = dict(conf or {})
    if remote:
        connect_builder = SparkSession.builder.remote(remote).appName(app_name)
        for key, value in conf.items():
            connect_builder = connect_builder.config(key, value)
        connect_session = connect_builder.getOrCreate()
        ship_code(connect_session)
        return connect_session

    master = master or DEFAULT_MASTER
    ensure_java()
    if master.startswith("local"):
        # Only here: on a cluster the executors connect back to the driver, so it must not
        # bind loopback.
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    builder = (
        SparkSession.builder.master(master)
        .appName(app_name)
        .config("spark.log.level", "WARN")
        # A copy task may run for minutes and must never be duplicated behind our back.
        .config("spark.speculation", "false")
    )
    if master.startswith("local"):
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
        builder = (
            builder.config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.shuffle.partitions", str(LOCAL_SHUFFLE_PARTITIONS))
            .config("spark.default.parallelism", str(_local_cores(master)))
            .config("spark.driver.host", os.environ["SPARK_LOCAL_IP"])
            .config("spark.driver.bindAddress", os.environ["SPARK_LOCAL_IP"])
        )
    if "spark.pyspark.python" in conf:
        # PySpark names the executors' Python from this variable alone, not from the setting.
        os.environ["PYSPARK_PYTHON"] = conf["spark.pyspark.python"]
    for key, value in conf.items():
        builder = builder.config(key, value)
    _launch_jvm_quietly(builder, Path(tempfile.gettempdir()) / f"pgcdc-spark-{os.getpid()}.log")
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("WARN")
    ship_code(session)
    return session


def _launch_jvm_quietly(builder: SparkSession.Builder, log: Path) -> None:
    """Start the JVM (PySpark's gateway, with the builder's settings) writing its output to
    ``log``, not to our terminal: its start-up banner and log lines would otherwise interleave
    with the one line a command prints. The JVM gets its own stdout and stderr, so the
    process's stay untouched (pointing file descriptors 1 and 2 elsewhere while it starts
    would also swallow what other threads print meanwhile: the CLI starts Spark on a worker
    thread while the main thread reports). ``getOrCreate`` then finds the gateway running.
    The log goes when this process ends normally (a command per process would leave one
    each); a process that dies keeps it for whoever looks into why.
    """
    from pyspark import SparkConf, SparkContext
    from pyspark.java_gateway import launch_gateway

    with SparkContext._lock:
        if SparkContext._gateway is not None:
            return
        conf = SparkConf()
        for key, value in builder._options.items():
            conf.set(key, str(value))
        with open(log, "ab") as sink:
            gateway = launch_gateway(conf, popen_kwargs={"stdout": sink, "stderr": sink})
        atexit.register(log.unlink, missing_ok=True)
        SparkContext._gateway = gateway
        SparkContext._jvm = gateway.jvm


def _local_cores(master: str) -> int:
    """The worker threads of a ``local``, ``local[N]``, ``local[*]`` or ``local[N,F]`` master."""
    inner = master[len("local") :].strip("[]").split(",")[0]
    if inner == "":
        return 1
    if inner == "*":
        return os.cpu_count() or 1
    try:
        return max(1, int(inner))
    except ValueError:
        return os.cpu_count() or 1
