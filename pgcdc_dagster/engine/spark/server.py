"""A warm local Spark: one Spark Connect server that outlives the commands and runs using it.

Why: every process that starts a local SparkSession waits for its JVM, Spark context and first
job; a Connect client attaches to a running server much sooner (see ``benchmarks/HISTORY.md``,
``benchmarks/spark_paths.py`` and "Spark's fixed costs and the driver/Spark split").
``pgcdc spark start`` starts the server that ships inside the pyspark wheel
(``sbin/start-connect-server.sh``) on a free loopback port and records where it listens in the
output store (``<store>/spark-connect.json``), the one place every ``pgcdc`` command and every
run of the daemon already shares. A command or run with no ``PGCDC_SPARK_MASTER`` /
``PGCDC_SPARK_REMOTE`` of its own then uses that server (:func:`running_url`), as if
``PGCDC_SPARK_REMOTE`` were set to it; ``pgcdc spark stop`` stops it.

What must hold: a record is trusted only while its process is alive *and* its port accepts a
connection, so a server that died (or a reboot) falls back to local Spark, never to an error.
The server's Python workers run this interpreter (``PYSPARK_PYTHON``), so they import
``pgcdc_dagster`` as the driver does.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import PgcdcError
from ..processes import pid_running
from .java import ensure_java

RECORD = "spark-connect.json"
START_TIMEOUT_S = 120.0


class SparkServerError(PgcdcError):
    """The Spark Connect server could not be started or stopped."""


@dataclass(frozen=True)
class SparkServer:
    url: str
    """``sc://127.0.0.1:<port>``."""
    pid: int
    master: str
    started: float
    work_dir: str
    """The server's pid and log files."""


def record_path(store: Path) -> Path:
    return store / RECORD


def running(store: Path) -> SparkServer | None:
    """The recorded server, if it is alive and listening; ``None`` otherwise."""
    try:
        server = SparkServer(**json.loads(record_path(store).read_text()))
    except (OSError, ValueError, TypeError):
        return None
    if not pid_running(server.pid) or not _listening(_port(server.url)):
        return None
    return server


def running_url(store: Path) -> str | None:
    server = running(store)
    return server.url if server else None


def spark_target(master: str | None, remote: str | None, store: Path) -> dict[str, str | None]:
    """``master`` and ``remote`` as configured; with neither, the recorded server's URL when
    it runs (``remote``), else nothing (local Spark)."""
    if master or remote:
        return {"master": master or None, "remote": remote or None}
    return {"master": None, "remote": running_url(store)}


def cores_are_local(master: str | None, remote: str | None, store: Path) -> bool:
    """Whether Spark's executors would run on this machine's cores, which the snapshot's
    driver-side copy processes use as well: a configured local master, no Spark configured at
    all, or (with neither configured) a warm server recorded here that runs a local master.
    A configured ``remote`` is taken for a cluster: where it runs cannot be known from here."""
    if remote:
        return False
    if master:
        return master.startswith("local")
    server = running(store)
    return server is None or server.master.startswith("local")


def start(store: Path, master: str = "local[*]") -> tuple[SparkServer, bool]:
    """Start the server (or find the one already running); returns it and whether it was
    started now. Blocks until it accepts connections."""
    found = running(store)
    if found is not None:
        return found, False
    import pyspark

    ensure_java()
    home = Path(pyspark.__file__).parent
    work = store / "spark-connect"
    work.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {
        **os.environ,
        "SPARK_HOME": str(home),
        "SPARK_LOCAL_IP": os.environ.get("SPARK_LOCAL_IP", "127.0.0.1"),
        "PYSPARK_PYTHON": sys.executable,
        "SPARK_PID_DIR": str(work),
        "SPARK_LOG_DIR": str(work),
        "SPARK_IDENT_STRING": f"pgcdc-{port}",
    }
    args = [
        "--master", master,
        "--conf", "spark.connect.grpc.binding.address=127.0.0.1",
        "--conf", f"spark.connect.grpc.binding.port={port}",
        "--conf", "spark.ui.enabled=false",
        "--conf", "spark.speculation=false",
        "--conf", "spark.sql.shuffle.partitions=4",
    ]  # fmt: skip
    done = subprocess.run(
        [str(home / "sbin" / "start-connect-server.sh"), *args],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SparkServerError(
            f"start-connect-server.sh failed ({done.returncode}): "
            f"{(done.stderr or done.stdout).strip()[-300:]}"
        )
    pid_files = list(work.glob(f"*pgcdc-{port}*.pid"))
    pid = int(pid_files[0].read_text().strip()) if pid_files else 0
    deadline = time.monotonic() + START_TIMEOUT_S
    while not _listening(port):
        if time.monotonic() > deadline or (pid and not pid_running(pid)):
            logs = sorted(work.glob(f"*pgcdc-{port}*.out"))
            tail = logs[-1].read_text()[-400:] if logs else ""
            raise SparkServerError(
                f"the Spark Connect server did not listen on 127.0.0.1:{port}; its log "
                f"({logs[-1] if logs else work}) ends: {tail.strip()}"
            )
        time.sleep(0.25)
    server = SparkServer(f"sc://127.0.0.1:{port}", pid, master, time.time(), str(work))
    tmp = record_path(store).with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(server)))
    os.replace(tmp, record_path(store))
    return server, True


def stop(store: Path) -> SparkServer | None:
    """Stop the recorded server (SIGTERM, then SIGKILL after 20 s) and forget it."""
    server = running(store)
    record_path(store).unlink(missing_ok=True)
    if server is None:
        return None
    os.kill(server.pid, signal.SIGTERM)
    deadline = time.monotonic() + 20
    while pid_running(server.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if pid_running(server.pid):
        os.kill(server.pid, signal.SIGKILL)
    return server


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/")[0])


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1.0)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
