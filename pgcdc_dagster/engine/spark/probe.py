"""What one Spark task finds on an executor: the modules the engine's tasks import, and
whether the source and the target answer from there.

This module imports nothing but the standard library, and :mod:`.executors` has it
pickled by value: the check must run on an executor where nothing of ours can be imported,
since that is one of the things it reports. It never raises (Spark would retry a failed task
``spark.task.maxFailures`` times before anyone hears of it): every finding is in the report.
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import sys
import time

CONNECT_TIMEOUT_S = 5


def probe(modules: list[str], servers: dict[str, str], paths: list[str], index: int) -> str:
    """A JSON report of this executor: host, Python, the version of each module of
    ``modules`` that imports (the error of each that does not), for each ``role: dsn`` of
    ``servers`` the first line of the connection error (``null`` when it answered), and which
    of ``paths`` it cannot read."""
    report: dict[str, object] = {
        "task": index,
        "host": socket.gethostname(),
        "work_dir": os.getcwd(),
        "python": sys.version.split()[0],
        "executable": sys.executable,
    }
    versions: dict[str, str] = {}
    missing: dict[str, str] = {}
    for name in modules:
        try:
            module = importlib.import_module(name)
        except BaseException as exc:  # a module's own import error is a finding too
            missing[name] = _missing_name(exc, name)
            continue
        versions[name] = str(getattr(module, "__version__", "") or getattr(module, "__file__", ""))
    report["versions"] = versions
    report["missing"] = missing
    connections: dict[str, str | None] = {}
    if "psycopg" not in missing:
        import psycopg

        for role, dsn in servers.items():
            started = time.monotonic()
            try:
                with psycopg.connect(dsn, connect_timeout=CONNECT_TIMEOUT_S, autocommit=True) as c:
                    c.execute("SELECT 1")
                connections[role] = None
            except BaseException as exc:
                text = str(exc).strip().splitlines()
                connections[role] = (text[0] if text else type(exc).__name__) + (
                    f" (after {time.monotonic() - started:.1f} s)"
                )
    report["connections"] = connections
    report["unreadable"] = [why for why in map(_unreadable, paths) if why is not None]
    return json.dumps(report)


def _unreadable(path: str) -> str | None:
    """Why this executor cannot read ``path`` (``None``: it can): a local file, or an object
    store's URL with pyarrow's S3 options as its query (the first bytes read with them)."""
    if not path.startswith("s3://"):
        return None if os.access(path, os.R_OK) else path
    from urllib.parse import parse_qsl, urlsplit

    parts = urlsplit(path)
    url = f"s3://{parts.netloc}{parts.path}"
    try:
        from pyarrow import fs

        s3 = fs.S3FileSystem(**dict(parse_qsl(parts.query)))
        with s3.open_input_file(parts.netloc + parts.path) as opened:
            opened.read(4)
    except BaseException as exc:  # every failure is a finding
        text = str(exc).strip().splitlines()
        return f"{url} ({text[0] if text else type(exc).__name__})"
    return None


def _missing_name(exc: BaseException, wanted: str) -> str:
    """The module that is missing (``psycopg``, not ``pgcdc_dagster.engine.snapshot.copy``,
    when the latter fails on the former), else the error's first line."""
    name = getattr(exc, "name", None)
    if isinstance(exc, ImportError) and name:
        return str(name).split(".")[0]
    text = str(exc).strip().splitlines()
    return f"{wanted}: {type(exc).__name__}: {text[0] if text else ''}"
