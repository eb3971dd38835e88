"""What every benchmark needs, in one place: the scripts beside it import this module and
nothing of each other.

* **Clusters** (:func:`bench_clusters`, :func:`bench_target`, :func:`demo_clusters`,
  :func:`new_cluster`): throwaway local PostgreSQL clusters under a named settings profile,
  ``production`` (the default: crash-safe, as a server a user replicates from runs) or
  ``throwaway`` (the demo's and the tests' speed over safety,
  :data:`~pgcdc_dagster.demo.local_cluster.THROWAWAY_SETTINGS`); :func:`apply_profile` gives a
  primary and its standby (the tests' ``primary_with_standby``) a profile's settings;
  :func:`describe_profile` labels a report with the one used, :func:`add_profile_flag` gives a
  script its ``--profile`` (:func:`argument_parser`: with the other flags the scripts share).
  Beside them the databases (:func:`create_database`, :func:`source_database`,
  :func:`clone_database`), ``CHECKPOINT`` (:func:`checkpoint`), the schema copied with
  ``pg_dump | psql`` (:func:`copy_schema`) and pgbench's data (:func:`fill_pgbench`).
* **Commands** (:func:`pgcdc_env`, :func:`run_command`, :func:`warm_command_server`,
  :func:`start_follow`): ``pgcdc`` run as a user runs it, Dagster on PostgreSQL storage.
* **The native peer** (:class:`Subscription`, :func:`native_peer`, :func:`wait_slot`):
  PostgreSQL's own logical replication, set up, waited for until its initial sync is done or
  its slot confirms a position, dropped; the launcher's pause between two workers
  (:func:`wait_for_launcher`) kept out of every timing.
* **The CPU meter** (:class:`CpuMeter`, :class:`Measured`): CPU seconds per process tree
  (source cluster, target cluster, this process and what it started) and the rest of the
  machine, from ``/proc``; :func:`tree_rss_mb`, memory of a tree.
* **Equality** (:func:`fingerprints`, :func:`equality`, :func:`require_equal`,
  :func:`targets_equal`): a target's tables against the source's, row count and a content hash
  per table.
* **Median** (:func:`median`, :func:`median_at`, :func:`medians`).
* **The report** (:func:`run_repeats`, :func:`summary`: repeated runs, their medians and the
  clusters' profile; :func:`emit_report`, JSON; :func:`markdown_table`; :func:`rounded`).
* **Workloads** the benchmarks share: a pgbench backlog behind a base snapshot with a native
  slot at the same point (:func:`prepare`, :class:`Setup`, :func:`native_catch_up`), account
  updates in bulk (:func:`bulk_updates`), the raw slot read (:func:`peek_slot`) and a store of
  many ranges written by hand (:func:`write_store`).

A script imports it as ``harness``, with its own folder put first on ``sys.path`` (so that it
also imports when loaded from elsewhere). Functions that Spark ships to its workers stay in the
scripts: a worker imports a ``__main__`` function by value, a module's by name, and this module
is not on a worker's path.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pickle
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from pgcdc_dagster.demo.local_cluster import (
    LOGICAL_SOURCE_SETTINGS,
    THROWAWAY_SETTINGS,
    LocalCluster,
    find_bindir,
    temporary_cluster,
)
from pgcdc_dagster.demo.run import DemoClusters, pgbench
from pgcdc_dagster.engine.identifiers import TableName
from pgcdc_dagster.engine.lsn import Lsn

if TYPE_CHECKING:
    from pgcdc_dagster_tests.support.standby import Pair

REPO = Path(__file__).resolve().parent.parent
PGCDC = str(Path(sys.executable).parent / "pgcdc")
MB = 1e6
POLL_S = 0.02
"""How often a wait polls the servers (a native slot's position, a subscription's tables)."""


# ─── clusters: settings profiles ─────────────────────────────────────────────────────────────

PRODUCTION = "production"
THROWAWAY = "throwaway"
PROFILES: dict[str, dict[str, str]] = {
    PRODUCTION: {
        "fsync": "on",
        "full_page_writes": "on",
        "synchronous_commit": "on",
        "shared_buffers": "512MB",
        "max_wal_size": "4GB",
        "checkpoint_timeout": "30min",
        "autovacuum": "off",
    },
    THROWAWAY: dict(THROWAWAY_SETTINGS),
}
"""Settings of a benchmark's clusters by profile, over :data:`THROWAWAY_SETTINGS` (which every
:class:`LocalCluster` starts from). ``production``: crash-safe writes, as the servers a user
replicates between run; autovacuum off, so that a vacuum one side's writes set off cannot land
in the other side's timing. ``throwaway``: the demo's and the tests' (``fsync`` and full page
writes off), what most figures in ``HISTORY.md`` were taken with."""
DEFAULT_PROFILE = PRODUCTION
"""Every script's ``--profile`` default: a figure is taken on servers configured as a user's are
(``HISTORY.md`` says which earlier figures were taken on throwaway clusters)."""


def profile_settings(profile: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The settings a cluster of ``profile`` is given, ``extra`` over them."""
    if profile not in PROFILES:
        raise ValueError(f"unknown cluster profile {profile!r}: one of {', '.join(PROFILES)}")
    return {**PROFILES[profile], **(extra or {})}


def describe_profile(profile: str) -> dict[str, Any]:
    """A report's label of the clusters: the profile's name and every setting it makes."""
    return {"name": profile, "settings": {**THROWAWAY_SETTINGS, **profile_settings(profile)}}


def add_profile_flag(parser: argparse.ArgumentParser, default: str = DEFAULT_PROFILE) -> None:
    """``--profile production|throwaway``: the settings of the clusters the script starts."""
    parser.add_argument(
        "--profile",
        choices=tuple(PROFILES),
        default=default,
        help="the clusters' settings: production (fsync, full page writes and synchronous "
        "commit on, shared_buffers 512MB, max_wal_size 4GB, autovacuum off) or throwaway (the "
        f"demo's: fsync and full page writes off); default {default}",
    )


SERVER_HELP = (
    "off: every command cold, a fresh process of its own (the first command on the machine); "
    "warm: the measured commands run in the command server an earlier command left up (its "
    "forked child, Dagster and the definitions already imported)"
)


def argument_parser(
    doc: str | None,
    *,
    profile: str | None = DEFAULT_PROFILE,
    repeat: int | None = None,
    json: bool = False,
    server: str | None = None,
) -> argparse.ArgumentParser:
    """A benchmark's command line: described by the first line of ``doc``, with the flags the
    benchmarks share: ``--profile`` (:func:`add_profile_flag`, default ``profile``; none when
    ``None``), ``--repeat`` (default ``repeat``), ``--json`` (a file the report is written to
    as well) and ``--server off|warm`` (its help ``server``, else :data:`SERVER_HELP`)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0] if doc else None)
    if profile is not None:
        add_profile_flag(parser, profile)
    if repeat is not None:
        parser.add_argument(
            "--repeat", type=int, default=repeat, help="how many times (see the docstring)"
        )
    if json:
        parser.add_argument("--json", type=Path, help="also write the report there")
    if server is not None:
        parser.add_argument(
            "--server", choices=("off", "warm"), default="off", help=server or SERVER_HELP
        )
    return parser


def new_cluster(
    profile: str = DEFAULT_PROFILE,
    extra: Mapping[str, str] | None = None,
    *,
    prefix: str = "pgcdc-bench-",
    password: str | None = None,
) -> LocalCluster:
    """A cluster of ``profile`` (``extra`` over it) in a fresh folder, not started."""
    return temporary_cluster(profile_settings(profile, extra), prefix=prefix, password=password)


class BenchClusters(NamedTuple):
    work: Path
    """A folder for the run's files, removed with the clusters."""
    source: LocalCluster
    target: LocalCluster


@contextlib.contextmanager
def bench_target(
    profile: str = DEFAULT_PROFILE,
    *,
    extra: Mapping[str, str] | None = None,
    logical: bool = False,
    prefix: str = "pgcdc-bench-",
) -> Iterator[tuple[Path, LocalCluster]]:
    """A work folder and a started target of ``profile`` (``extra`` over it; its WAL logical
    with ``logical``), both removed afterwards: for a script whose source is not a plain
    cluster (a primary with its standby)."""
    extra = dict(extra or {})
    with contextlib.ExitStack() as cleanup:
        work = Path(tempfile.mkdtemp(prefix=prefix))
        cleanup.callback(shutil.rmtree, work, ignore_errors=True)
        target_extra = {**LOGICAL_SOURCE_SETTINGS, **extra} if logical else extra
        target = new_cluster(profile, target_extra, prefix=f"{prefix}tgt-")
        cleanup.callback(target.destroy)
        target.start()
        note_launcher(target.dsn())  # a starting server's launcher makes its first round
        yield work, target


@contextlib.contextmanager
def bench_clusters(
    profile: str = DEFAULT_PROFILE,
    *,
    extra: Mapping[str, str] | None = None,
    logical_target: bool = False,
    prefix: str = "pgcdc-bench-",
) -> Iterator[BenchClusters]:
    """A work folder, a started source (logical WAL) and target of ``profile`` (``extra`` over
    both; the target's WAL logical too with ``logical_target``), all removed afterwards (every
    clean-up runs, even if one fails)."""
    extra = dict(extra or {})
    with contextlib.ExitStack() as cleanup:
        work, target = cleanup.enter_context(
            bench_target(profile, extra=extra, logical=logical_target, prefix=prefix)
        )
        source = new_cluster(profile, {**LOGICAL_SOURCE_SETTINGS, **extra}, prefix=f"{prefix}src-")
        cleanup.callback(source.destroy)
        source.start()
        yield BenchClusters(work, source, target)


DURABILITY = ("fsync", "full_page_writes")
"""The settings :func:`apply_profile` checks on a primary and its standby once the profile's
are in force."""


def apply_profile(pair: Pair, profile: str) -> None:
    """Restart a primary and its standby (``pgcdc_dagster_tests.support.standby.Pair``) with
    the settings of ``profile`` (``LocalCluster`` writes its settings at every start): the
    standby stopped first, started last, so it reconnects at once; :data:`DURABILITY` checked
    on both, then the standby waited for until it has replayed the primary."""
    settings = profile_settings(profile)
    for cluster in (pair.primary, pair.standby):
        cluster.settings = {**cluster.settings, **settings}  # type: ignore[misc]
    pair.standby.stop()
    pair.primary.stop()
    pair.primary.start()
    pair.standby.start()
    for cluster in (pair.primary, pair.standby):
        with psycopg.connect(cluster.dsn()) as conn:
            shown = [conn.execute(f"SHOW {name}").fetchone()[0] for name in DURABILITY]  # type: ignore[index]
        assert shown == [settings[name] for name in DURABILITY], (cluster.directory, shown)
    pair.wait_replayed(timeout=60)


def demo_clusters(base: Path, profile: str = DEFAULT_PROFILE) -> DemoClusters:
    """The demo's three clusters (:func:`pgcdc_dagster.demo.run.start_clusters`: a source with
    logical WAL and a target, both behind a password, and Dagster's storage) under ``base``,
    started, with the settings of ``profile``. :meth:`DemoClusters.stop` stops them."""
    base.mkdir(parents=True, exist_ok=True)
    password = secrets.token_urlsafe(12)
    settings = profile_settings(profile)
    source = LocalCluster(
        base / "source", {**settings, **LOGICAL_SOURCE_SETTINGS}, password=password
    ).start()
    target = LocalCluster(base / "target", settings, password=password).start()
    storage = LocalCluster(base / "storage", settings).start()
    return DemoClusters(source, target, storage)


def postmaster_pid(cluster: LocalCluster) -> int:
    return int((cluster.datadir / "postmaster.pid").read_text().split()[0])


# ─── databases, SQL and the libpq tools ──────────────────────────────────────────────────────


def execute(dsn: str, *statements: str | sql.Composable) -> None:
    """Each statement in autocommit."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement)  # type: ignore[arg-type]


def source_database(
    source: LocalCluster,
    *statements: str | sql.Composable,
    name: str = "app",
    publication: str = "native",
    tables: Iterable[str | TableName] | None = None,
) -> str:
    """A source database: ``name`` made afresh on ``source``, ``statements`` run in it (its
    tables and rows), and ``publication`` of ``tables`` (of every table when ``None``) for the
    native peer; its DSN."""
    dsn = create_database(source, name)
    execute(dsn, *statements)
    create_publication(dsn, publication, tables)
    return dsn


def create_database(cluster: LocalCluster, name: str) -> str:
    """Database ``name`` made afresh (any earlier one of that name dropped); its DSN."""
    drop_database(cluster, name)
    with psycopg.connect(cluster.dsn(), autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return cluster.dsn(name)


def drop_database(cluster: LocalCluster, name: str) -> None:
    with psycopg.connect(cluster.dsn(), autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


def clone_database(cluster: LocalCluster, template: str, name: str) -> str:
    """``CREATE DATABASE name TEMPLATE template`` once nobody is connected to the template (the
    same physical files and planner statistics); its DSN."""
    with psycopg.connect(cluster.dsn(), autocommit=True) as conn:
        deadline = time.monotonic() + 30
        while True:
            try:
                conn.execute(
                    sql.SQL("CREATE DATABASE {} TEMPLATE {} STRATEGY file_copy").format(
                        sql.Identifier(name), sql.Identifier(template)
                    )
                )
                return cluster.dsn(name)
            except psycopg.errors.ObjectInUse:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)


def checkpoint(*clusters: LocalCluster, sync: bool = False) -> None:
    """A ``CHECKPOINT`` on each cluster, so that no timed step pays for the dirty buffers of the
    one before; with ``sync``, the kernel's pending writeback flushed too."""
    for cluster in clusters:
        with psycopg.connect(cluster.dsn(), autocommit=True) as conn:
            conn.execute("CHECKPOINT")
    if sync:
        os.sync()


def wal_position(dsn: str, *, of: str = "current") -> Lsn:
    """The server's WAL position now: ``current`` (``pg_current_wal_lsn``, written), ``flush``
    (flushed: what logical decoding can read) or ``insert``."""
    function = {"current": "pg_current_wal_lsn", "flush": "pg_current_wal_flush_lsn",
                "insert": "pg_current_wal_insert_lsn"}[of]  # fmt: skip
    with psycopg.connect(dsn, autocommit=True) as conn:
        (text,) = conn.execute(f"SELECT {function}()::text").fetchone()  # type: ignore[misc]
    return Lsn.parse(text)


def tool(name: str) -> str:
    """A PostgreSQL client program of the clusters' installation (``psql``, ``pg_dump``)."""
    return str(find_bindir() / name)


def libpq_target(dsn: str) -> tuple[dict[str, str], str]:
    """The environment and the ``-d`` conninfo of a libpq tool connecting as ``dsn`` (its
    password in ``PGPASSWORD``, not on the command line); nothing else of pgcdc's sessions."""
    params = {k: str(v) for k, v in conninfo_to_dict(dsn).items() if v is not None}
    env = dict(os.environ)
    if "password" in params:
        env["PGPASSWORD"] = params.pop("password")
    return env, make_conninfo(**params)


def run_tool(name: str, dsn: str, *args: str, stdin: bytes | None = None) -> bytes:
    """``name ARGS -d DSN``; its output, or an error with its stderr."""
    env, conninfo = libpq_target(dsn)
    done = subprocess.run(
        [tool(name), *args, "-d", conninfo], input=stdin, capture_output=True, env=env
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"{name} failed ({done.returncode}): {done.stderr.decode(errors='replace')[-3000:]}"
        )
    return done.stdout


def dump_schema(
    dsn: str, tables: Iterable[str | TableName] = (), *options: str, out: Path | None = None
) -> bytes:
    """``pg_dump --schema-only`` of ``tables`` (every table when none), without owners,
    privileges, publications or subscriptions; ``options`` added (``--section=pre-data``).
    Written to ``out`` too when given."""
    selection = [f"--table={TableName.parse(str(t))}" for t in tables]
    script = run_tool(
        "pg_dump", dsn, "--schema-only", "--no-owner", "--no-privileges", "--no-publications",
        "--no-subscriptions", *options, *selection,
    )  # fmt: skip
    if out is not None:
        out.write_bytes(script)
    return script


def psql(dsn: str, script: bytes | Path) -> None:
    """A SQL script run by ``psql`` in one transaction, stopping at the first error."""
    data = script.read_bytes() if isinstance(script, Path) else script
    run_tool("psql", dsn, "-X", "-q", "-v", "ON_ERROR_STOP=1", "-1", stdin=data)


def copy_schema(source_dsn: str, target_dsn: str, tables: Iterable[str | TableName] = ()) -> None:
    """``pg_dump --schema-only | psql``: the source's tables (``tables`` only, when named)
    created in the target database, keys included, as native replication needs them there."""
    psql(target_dsn, dump_schema(source_dsn, tables))


PGBENCH_TABLES = [
    TableName("public", name)
    for name in ("pgbench_accounts", "pgbench_branches", "pgbench_history", "pgbench_tellers")
]


def fill_pgbench(source: LocalCluster, scale: int, *, analyse: bool = True) -> None:
    """``pgbench -i`` at ``scale`` (100,000 accounts each), ``pgbench_history`` (no key) set to
    ``REPLICA IDENTITY FULL`` as the preflight requires; with ``analyse``, all vacuumed and
    analysed."""
    pgbench(source, "-i", "-q", "-s", str(scale))
    statements = ["ALTER TABLE pgbench_history REPLICA IDENTITY FULL"]
    execute(source.dsn(), *statements, *(["VACUUM ANALYZE"] if analyse else []))


# ─── commands: pgcdc as a user runs it ───────────────────────────────────────────────────────


def pgcdc_env(
    work: Path,
    source_dsn: str,
    target: LocalCluster,
    name: str,
    *,
    target_dsn: str | None = None,
    slot: str | None = None,
    publication: str | None = None,
    tables: Iterable[str | TableName] | None = None,
    store: str | Path | None = None,
    server: str = "off",
    base_env: Mapping[str, str] | None = None,
    prepare_storage: bool = True,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of a ``pgcdc`` command replicating into database ``name`` of ``target``
    (made afresh, unless ``target_dsn`` names another), with Dagster's storage in a database
    ``dagster_<name>`` of the same cluster and the shipped ``dagster.yaml``. The slot is
    ``name`` unless given; ``extra`` are further variables. With ``prepare_storage``, Dagster's
    schema is created now, outside any timing, as a user's storage already has it."""
    if target_dsn is None:
        target_dsn = create_database(target, name)
    storage = f"dagster_{name}"
    create_database(target, storage)
    home = work / f"dagster_home_{name}"
    home.mkdir()
    shutil.copy(REPO / "dagster.yaml", home / "dagster.yaml")
    env = {
        **(os.environ if base_env is None else base_env),
        "PGCDC_SOURCE_DSN": source_dsn,
        "PGCDC_TARGET_DSN": target_dsn,
        "PGCDC_SLOT": slot or name,
        "PGCDC_STORE": str(store or work / f"store_{name}"),
        "DAGSTER_HOME": str(home),
        "DAGSTER_POSTGRES_URL": (
            f"postgresql+psycopg2://postgres@127.0.0.1:{target.port}/{storage}"
        ),
        "PGCDC_SERVER": server,
        "PGCDC_SERVER_DIR": str(work / f"srv_{name}"),
        **(extra or {}),
    }
    if publication is not None:
        env["PGCDC_PUBLICATION"] = publication
    if tables is not None:
        env["PGCDC_TABLES"] = ",".join(str(t) for t in tables)
    if prepare_storage:
        subprocess.run(
            [sys.executable, "-c",
             "from pgcdc_dagster.defs.instance import dagster_instance as d; d()"],
            env=env, check=True, cwd=work, capture_output=True,
        )  # fmt: skip
    return env


def run_command(
    env: Mapping[str, str], work: Path, *args: str, check: bool = True, **popen: Any
) -> tuple[float, subprocess.CompletedProcess[str]]:
    """``pgcdc ARGS`` from a fresh process, its output captured: its seconds from start to
    exit, and the process. ``check``: a failure raises, with the end of its stderr."""
    started = time.perf_counter()
    done = subprocess.run(
        [PGCDC, *args], env=dict(env), capture_output=True, text=True, cwd=work, **popen
    )
    seconds = time.perf_counter() - started
    if check and done.returncode != 0:
        raise RuntimeError(f"pgcdc {' '.join(args)} failed: {done.stderr[-3000:]}")
    return seconds, done


def timed_command(env: Mapping[str, str], work: Path, *args: str) -> float:
    """:func:`run_command`'s seconds."""
    return run_command(env, work, *args)[0]


def json_command(
    env: Mapping[str, str], work: Path, *args: str
) -> tuple[float, dict[str, Any], str]:
    """``pgcdc ARGS --json``: its seconds, its report and its stderr."""
    seconds, done = run_command(env, work, *args, "--json")
    return seconds, json.loads(done.stdout), done.stderr


@contextlib.contextmanager
def warm_command_server(env: Mapping[str, str]) -> Iterator[int]:
    """What an earlier ``pgcdc`` command leaves up: the command server of ``env`` (its
    ``PGCDC_SERVER_DIR``), started before a measured command and stopped after it. Yields its
    pid: the measured command runs in its forked child, so that tree holds the command's CPU."""
    env = dict(env)
    subprocess.run([PGCDC, "server", "start"], env=env, check=True, capture_output=True)
    try:
        status = subprocess.run([PGCDC, "server", "status", "--json"], env=env, check=True,
                                capture_output=True, text=True)  # fmt: skip
        yield int(json.loads(status.stdout)["pid"])
    finally:
        subprocess.run([PGCDC, "server", "stop"], env=env, check=True, capture_output=True)


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def start_follow(
    env: Mapping[str, str],
    cwd: Path,
    target_dsn: str,
    slot: str,
    *args: str,
    log_dir: Path | None = None,
    new_session: bool = False,
) -> tuple[subprocess.Popen[str], float]:
    """``pgcdc follow ARGS`` started as a user starts it, waited for until its run holds the
    range lock; it and the seconds that took. Its output goes to ``follow.out`` and
    ``follow.err`` under ``log_dir`` when given, else to pipes; ``new_session``: in a session
    (and process group) of its own."""
    from pgcdc_dagster.engine.control.range_lock import lock_holders

    launched = time.monotonic()
    if log_dir is not None:
        out: Any = (log_dir / "follow.out").open("w")
        err: Any = (log_dir / "follow.err").open("w")
    else:
        out = err = subprocess.PIPE
    follow = subprocess.Popen(
        [PGCDC, "follow", *args], env=dict(env), stdout=out, stderr=err, text=True, cwd=cwd,
        start_new_session=new_session,
    )  # fmt: skip
    while not any(h.holder.startswith("run ") for h in lock_holders(target_dsn, slot)):
        if follow.poll() is not None:
            said = tail(log_dir / "follow.err") if log_dir else follow.communicate()[1][-3000:]
            raise RuntimeError(f"pgcdc follow exited: {said}")
        time.sleep(0.05)
    return follow, time.monotonic() - launched


# ─── the native peer: PostgreSQL's own logical replication ───────────────────────────────────

_launcher_rounds: dict[str, float] = {}
"""Per server (host:port), when its logical replication launcher was last woken (monotonic)."""


def _server_of(dsn: str) -> str:
    params = conninfo_to_dict(dsn)
    return f"{params.get('host')}:{params.get('port')}"


def note_launcher(dsn: str) -> None:
    """The launcher of ``dsn``'s server was woken now (a subscription created, enabled,
    refreshed or dropped; the server started)."""
    _launcher_rounds[_server_of(dsn)] = time.monotonic()


def wait_for_launcher(dsn: str) -> None:
    """PostgreSQL's launcher starts apply workers at most once per
    ``wal_retrieve_retry_interval`` (5 s), counted from its last round: a subscription created
    or enabled sooner after the previous change waits for the rest of it. A user's first
    subscription never pays that, so neither does a measurement: this sleeps it out."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        (interval,) = conn.execute(  # type: ignore[misc]
            "SELECT extract(epoch FROM current_setting('wal_retrieve_retry_interval')::interval)"
        ).fetchone()
    last = _launcher_rounds.get(_server_of(dsn))
    if last is not None:
        time.sleep(max(0.0, last + float(interval) + 0.5 - time.monotonic()))


def create_publication(
    dsn: str, name: str, tables: Iterable[str | TableName] | None = None
) -> None:
    """Publication ``name`` of ``tables``, or of every table when ``None``."""
    what = (
        sql.SQL("ALL TABLES")
        if tables is None
        else sql.SQL("TABLE {}").format(
            sql.SQL(", ").join(TableName.parse(str(t)).sql for t in tables)
        )
    )
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE PUBLICATION {} FOR {}").format(sql.Identifier(name), what))


SUBSCRIPTION_STATES = """
SELECT r.srrelid::regclass::text, r.srsubstate
FROM pg_subscription_rel r
JOIN pg_subscription s ON s.oid = r.srsubid
WHERE s.subname = %s
"""


def wait_slot(
    source_dsn: str,
    slot: str,
    end: Lsn | str | None = None,
    *,
    position: str = "confirmed_flush_lsn",
    timeout: float | None = None,
    conn: psycopg.Connection[Any] | None = None,
) -> None:
    """Until ``slot``'s ``position`` (``confirmed_flush_lsn``: what its subscriber confirmed;
    or ``restart_lsn``) is at least ``end`` (the source's WAL position as of now when not
    given), polled every :data:`POLL_S` on ``conn`` (a connection to the source in autocommit;
    one of its own when not given). ``timeout``: a :class:`TimeoutError` after that long."""
    goal = wal_position(source_dsn) if end is None else Lsn.parse(str(end))
    deadline = None if timeout is None else time.monotonic() + timeout
    query = sql.SQL("SELECT {}::text FROM pg_replication_slots WHERE slot_name = %s").format(
        sql.Identifier(position)
    )
    with _connection(source_dsn, conn) as conn:
        while True:
            (at,) = conn.execute(query, (slot,)).fetchone() or (None,)
            if at is not None and Lsn.parse(at) >= goal:
                return
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"slot {slot} at {at}, not at {goal} after {timeout} s")
            time.sleep(POLL_S)


@contextlib.contextmanager
def _connection(
    dsn: str, conn: psycopg.Connection[Any] | None
) -> Iterator[psycopg.Connection[Any]]:
    """``conn`` when given (a timed step reuses one opened before its timer), else a new one."""
    if conn is not None:
        yield conn
        return
    with psycopg.connect(dsn, autocommit=True) as new:
        yield new


def drop_slot(source_dsn: str, slot: str, timeout: float = 30.0) -> None:
    """Drop ``slot``, waiting for its walsender to exit (shortly after its worker stopped)."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        while True:
            try:
                conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
                return
            except psycopg.errors.ObjectInUse:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


class Subscription:
    """A native subscription ``name`` in database ``target_dsn`` to publication
    ``publication`` of ``source_dsn``, over slot ``slot`` (``name`` unless given)."""

    def __init__(
        self,
        source_dsn: str,
        target_dsn: str,
        name: str,
        publication: str,
        slot: str | None = None,
    ) -> None:
        self.source_dsn = source_dsn
        self.target_dsn = target_dsn
        self.name = name
        self.publication = publication
        self.slot = slot or name

    def create(
        self,
        *,
        copy_data: bool = True,
        enabled: bool = True,
        existing_slot: bool = False,
        conn: psycopg.Connection[Any] | None = None,
    ) -> None:
        """``CREATE SUBSCRIPTION``: with ``existing_slot``, over the slot already made.
        ``conn``: a connection to the target database to run it on (in a timing, one opened
        before the timer)."""
        options: list[sql.Composable] = []
        if existing_slot:
            options.append(sql.SQL("create_slot = false"))
            options.append(sql.SQL("slot_name = {}").format(sql.Literal(self.slot)))
        if not copy_data:
            options.append(sql.SQL("copy_data = false"))
        if not enabled:
            options.append(sql.SQL("enabled = false"))
        statement = sql.SQL("CREATE SUBSCRIPTION {} CONNECTION {} PUBLICATION {}").format(
            sql.Identifier(self.name),
            sql.Literal(self.source_dsn),
            sql.Identifier(self.publication),
        )
        if options:
            statement += sql.SQL(" WITH ({})").format(sql.SQL(", ").join(options))
        with _connection(self.target_dsn, conn) as conn:
            conn.execute(statement)
        note_launcher(self.target_dsn)

    def alter(self, action: str, conn: psycopg.Connection[Any] | None = None) -> None:
        """``ALTER SUBSCRIPTION name <action>`` (``ENABLE``, ``DISABLE``, ``REFRESH
        PUBLICATION``), on ``conn`` when given."""
        with _connection(self.target_dsn, conn) as conn:
            conn.execute(
                sql.SQL("ALTER SUBSCRIPTION {} {}").format(
                    sql.Identifier(self.name),
                    sql.SQL(action),  # type: ignore[arg-type]
                )
            )
        note_launcher(self.target_dsn)

    def origin(self) -> str:
        """The subscription's replication origin on the target (``pg_<oid>``)."""
        with psycopg.connect(self.target_dsn, autocommit=True) as conn:
            (origin,) = conn.execute(  # type: ignore[misc]
                "SELECT 'pg_' || oid FROM pg_subscription WHERE subname = %s", (self.name,)
            ).fetchone()
        return str(origin)

    def wait_ready(
        self,
        *,
        timeout: float = 3600.0,
        tables: int | None = None,
        seen: Callable[[dict[str, str]], None] | None = None,
        conn: psycopg.Connection[Any] | None = None,
    ) -> None:
        """Until every table of the subscription is ``r`` (ready: its initial sync done), and
        there are ``tables`` of them when given, polled every :data:`POLL_S` (on ``conn`` when
        given). ``seen`` is handed each poll's states (table -> ``i``/``d``/``f``/``s``/``r``)."""
        started = time.monotonic()
        with _connection(self.target_dsn, conn) as conn:
            while True:
                rows = conn.execute(SUBSCRIPTION_STATES, (self.name,)).fetchall()
                states: dict[str, str] = dict(rows)  # type: ignore[arg-type]
                if seen is not None:
                    seen(states)
                if (
                    states
                    and all(s == "r" for s in states.values())
                    and (tables is None or len(states) == tables)
                ):
                    return
                if time.monotonic() - started > timeout:
                    raise TimeoutError(
                        f"native subscription {self.name} not ready after {timeout:.0f} s: {states}"
                    )
                time.sleep(POLL_S)

    def wait_confirmed(
        self,
        end: Lsn | str | None = None,
        *,
        timeout: float | None = None,
        conn: psycopg.Connection[Any] | None = None,
    ) -> None:
        """Until the subscription's slot confirms ``end`` (the source's position as of now when
        not given): :func:`wait_slot` (``conn``: to the source)."""
        wait_slot(self.source_dsn, self.slot, end, timeout=timeout, conn=conn)

    def drop(self, *, keep_slot: bool = False) -> None:
        """``DROP SUBSCRIPTION`` (which drops its slot on the source); with ``keep_slot``, the
        slot detached first and left (:func:`drop_slot` drops it)."""
        with psycopg.connect(self.target_dsn, autocommit=True) as conn:
            if keep_slot:
                self.alter("DISABLE", conn)
                self.alter("SET (slot_name = NONE)", conn)
            conn.execute(sql.SQL("DROP SUBSCRIPTION {}").format(sql.Identifier(self.name)))
        note_launcher(self.target_dsn)


def native_peer(
    source_dsn: str,
    target: LocalCluster,
    database: str,
    publication: str,
    *,
    tables: Iterable[str | TableName] = (),
    name: str | None = None,
    timeout: float = 3600.0,
) -> tuple[Subscription, float]:
    """The usual native set-up: database ``database`` made on ``target``, the source's tables
    (``tables`` only, when named) created there from ``pg_dump --schema-only``, a subscription
    (``name``, else ``database``) to ``publication`` created and its initial sync waited out.
    The subscription, and the seconds from ``CREATE SUBSCRIPTION`` to all tables ready."""
    dsn = create_database(target, database)
    copy_schema(source_dsn, dsn, tables)
    subscription = Subscription(source_dsn, dsn, name or database, publication)
    with psycopg.connect(dsn, autocommit=True) as conn:
        started = time.perf_counter()
        subscription.create(conn=conn)
        subscription.wait_ready(timeout=timeout, conn=conn)
        return subscription, time.perf_counter() - started


# ─── the CPU meter ───────────────────────────────────────────────────────────────────────────

_TICK = os.sysconf("SC_CLK_TCK")


class _Proc(NamedTuple):
    ppid: int
    comm: str
    own: int
    """utime + stime, in clock ticks"""
    reaped: int
    """cutime + cstime: the CPU of the children this process has waited for"""


def process_table() -> dict[int, _Proc]:
    """Every process, from ``/proc/<pid>/stat``.

    Because a process's ``reaped`` ticks hold its finished children's CPU, a tree's sum of
    ``own + reaped`` stays right across processes that exit in between (backends, psql, Python
    workers).
    """
    table: dict[int, _Proc] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as stat:
                text = stat.read()
        except OSError:
            continue
        comm = text[text.index(b"(") + 1 : text.rindex(b")")].decode(errors="replace")
        fields = text[text.rindex(b")") + 2 :].split()
        own = int(fields[11]) + int(fields[12])
        table[int(entry.name)] = _Proc(int(fields[1]), comm, own, int(fields[13]) + int(fields[14]))
    return table


def descendants(table: Mapping[int, _Proc], root: int, stop: Iterable[int] = ()) -> list[int]:
    """``root`` and its live descendants, not entering the processes in ``stop``."""
    children: dict[int, list[int]] = {}
    for pid, proc in table.items():
        children.setdefault(proc.ppid, []).append(pid)
    stop = set(stop) - {root}
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in stop or pid not in table:
            continue
        found.append(pid)
        todo += children.get(pid, [])
    return found


def machine_busy_ticks() -> int:
    """Ticks the whole machine has been busy (``/proc/stat``: all but idle and iowait)."""
    with open("/proc/stat") as stat:
        # user nice system idle iowait irq softirq steal
        cpu = [int(v) for v in stat.readline().split()[1:9]]
    return sum(cpu) - cpu[3] - cpu[4]


CLIENT_PARTS = ("driver", "spark_jvm", "spark_python", "tools")


def _client_parts(table: Mapping[int, _Proc], pids: Iterable[int], me: int) -> dict[int, str]:
    """Which part of the client each process's ticks count to (``me``'s own: ``driver``, the
    children it reaped: ``tools``)."""
    pids = list(pids)
    jvm_trees: set[int] = set()
    for pid in pids:
        if pid != me and table[pid].comm == "java":
            jvm_trees.update(descendants(table, pid))
    part = {}
    for pid in pids:
        if pid == me:
            part[pid] = "driver"
        elif table[pid].comm == "java":
            part[pid] = "spark_jvm"
        elif pid in jvm_trees:
            part[pid] = "spark_python"
        else:
            part[pid] = "tools"
    return part


class CpuMeter:
    """CPU seconds spent inside a ``with`` block by each root's process tree (``roots``: name
    -> pid, e.g. the source's and the target's postmasters and this process), and ``others``:
    everything else on the machine (other people's work, kernel threads; near zero for a clean
    measurement). A tree stops at another root: a root started by this process (a ``pgcdc
    follow``, a command server) is counted as itself only, not in this process's tree too.

    A child that exits and is reaped moves its CPU into its parent's reaped ticks, so a tree's
    figure stays exact across exits; a process whose parent is gone too (orphaned, then reaped
    by init) takes its time with it: its ticks at the start are added back, so it counts zero
    for the interval instead of a negative.

    ``split``: one root (this process's) also split into :data:`CLIENT_PARTS` (``driver``:
    this interpreter, ``spark_jvm``, ``spark_python``: the JVM's children, ``tools``: the rest,
    psql, pg_dump, commands), in :attr:`parts`. ``settle``: called once the block ends, before
    the last sample (reaping adopted orphans). Roots are read at entry: add or remove one
    between blocks (``meter.roots["follow"] = pid``).

    After the block: :attr:`seconds` (per root and ``others``), :attr:`wall`, :attr:`total`
    (the roots'), :attr:`cores_busy`, :attr:`load_at_start`.
    """

    def __init__(
        self,
        roots: Mapping[str, int],
        *,
        split: str | None = None,
        settle: Callable[[], None] | None = None,
    ) -> None:
        self.roots = {name: pid for name, pid in roots.items() if pid}
        self.split = split
        self.settle = settle
        self.seconds: dict[str, float] = {}
        self.parts: dict[str, float] = {}
        self.wall = 0.0

    @classmethod
    def of(cls, source: LocalCluster, target: LocalCluster, **more: int) -> CpuMeter:
        """The usual roots: ``source``, ``target`` (their postmasters), ``driver`` (this
        process), and ``more``."""
        roots = {"source": postmaster_pid(source), "target": postmaster_pid(target)}
        return cls({**roots, "driver": os.getpid(), **more})

    def _sample(self) -> tuple[dict[str, dict[int, tuple[int, int, int, str]]], int]:
        """Per root, pid -> (parent, own ticks, reaped ticks, part); the machine's busy ticks."""
        table = process_table()
        busy = machine_busy_ticks()
        trees = {}
        for name, root in self.roots.items():
            pids = descendants(table, root, self.roots.values())
            parts = _client_parts(table, pids, root) if name == self.split else {}
            trees[name] = {
                pid: (table[pid].ppid, table[pid].own, table[pid].reaped, parts.get(pid, ""))
                for pid in pids
            }
        return trees, busy

    def __enter__(self) -> CpuMeter:
        self.load_at_start = [round(x, 2) for x in os.getloadavg()]
        self._start, self._busy = self._sample()
        self.started = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.started
        if self.settle is not None:
            self.settle()
        end, busy = self._sample()
        per_root = {name: self._between(self._start[name], end[name]) for name in self.roots}
        self.seconds = {name: round(sum(p.values()), 2) for name, p in per_root.items()}
        self.total = round(sum(self.seconds.values()), 2)
        others = (busy - self._busy) / _TICK - sum(sum(p.values()) for p in per_root.values())
        self.seconds["others"] = round(max(0.0, others), 2)
        self.cores_busy = round(self.total / self.wall, 2) if self.wall > 0 else 0.0
        if self.split in per_root:
            self.parts = {k: round(per_root[self.split].get(k, 0.0), 2) for k in CLIENT_PARTS}

    @staticmethod
    def _between(
        start: Mapping[int, tuple[int, int, int, str]], end: Mapping[int, tuple[int, int, int, str]]
    ) -> dict[str, float]:
        """CPU seconds of one tree between two samples, by part (``""`` when not split)."""
        ticks: dict[str, int] = {}

        def count(own: int, reaped: int, part: str, sign: int) -> None:
            if part == "driver":  # the interpreter's own; what it reaped is the tools'
                ticks["driver"] = ticks.get("driver", 0) + sign * own
                ticks["tools"] = ticks.get("tools", 0) + sign * reaped
            else:
                ticks[part] = ticks.get(part, 0) + sign * (own + reaped)

        for _, own, reaped, part in end.values():
            count(own, reaped, part, 1)
        for pid, (ppid, own, reaped, part) in start.items():
            # a process orphaned and gone meanwhile took its time with it: it counts zero
            if pid in end or ppid in end:
                count(own, reaped, part, -1)
        return {part: t / _TICK for part, t in ticks.items()}

    def report(self) -> dict[str, Any]:
        """Load average at the start, CPU seconds, and the rest of the machine in cores."""
        others = self.seconds.get("others", 0.0)
        return {
            "load_at_start": self.load_at_start,
            "cpu_s": self.seconds,
            "others_cores": round(others / self.wall, 2) if self.wall else 0.0,
        }


class Measured:
    """Wall time, CPU split and target WAL of one timed run: :class:`CpuMeter` over the source
    (``source_pg``), the target (``target_pg``), a warm command server when given
    (``pgcdc_server``: a command runs in its child) and this process (``client``, split into
    its parts), with the WAL the target wrote meanwhile."""

    def __init__(
        self, source: LocalCluster, target: LocalCluster, command_server: int | None = None
    ) -> None:
        roots = {"source_pg": postmaster_pid(source), "target_pg": postmaster_pid(target)}
        if command_server is not None:
            roots["pgcdc_server"] = command_server
        self.meter = CpuMeter({**roots, "client": os.getpid()}, split="client")
        self.target_dsn = target.dsn()

    def __enter__(self) -> Measured:
        self.wal_start = wal_position(self.target_dsn, of="insert")
        self.meter.__enter__()
        self.started = self.meter.started
        return self

    def __exit__(self, *exc: object) -> None:
        self.meter.__exit__(*exc)
        self.wall = self.meter.wall
        seconds = self.meter.seconds
        servers = {k: v for k, v in seconds.items() if k not in ("client", "others")}
        self.cpu: dict[str, Any] = {
            **servers,
            "client": seconds["client"],
            "client_parts": self.meter.parts,
            "total": self.meter.total,
            "cores_busy": self.meter.cores_busy,
            "other": seconds["others"],
        }
        wal_end = wal_position(self.target_dsn, of="insert")
        self.target_wal_mb = round((wal_end - self.wal_start) / MB, 1)

    def report(self) -> dict[str, Any]:
        return {"cpu_seconds": self.cpu, "target_wal_mb": self.target_wal_mb}


def tree_rss_mb(root: int) -> dict[str, float]:
    """Resident memory of process ``root`` (``command``) and of its descendants, summed by
    their command name (the follower's ``python``, a local Spark's ``java``), in MB."""

    def rss(pid: int) -> float:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return 0.0

    table = process_table()
    out = {"command": round(rss(root), 1)}
    for pid in descendants(table, root):
        if pid != root:
            name = table[pid].comm
            out[name] = round(out.get(name, 0.0) + rss(pid), 1)
    return out


# ─── equality of a target's tables with the source's ─────────────────────────────────────────

CONTENT_SQL = (
    "SELECT count(*), coalesce(sum(hashtextextended(t::text, 0)::numeric), 0)::text FROM {} t"
)
"""A table's row count and an order-free digest of its content: the sum of a 64-bit hash of
each row's text (duplicates count, order does not)."""


def user_tables(dsn: str) -> list[str]:
    """Every user table of ``dsn``'s database (none of pgcdc's own schemas)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT format('%I.%I', n.nspname, c.relname) FROM pg_class c "
            "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.relkind IN ('r', 'p') "
            "AND n.nspname NOT IN ('pg_catalog', 'information_schema', 'pgcdc_staging') "
            "AND n.nspname NOT LIKE 'pg_%' ORDER BY 1"
        ).fetchall()
    return [r[0] for r in rows]


def fingerprints(
    dsn: str,
    tables: Iterable[str | TableName],
    *,
    content: bool = True,
    columns: bool = False,
) -> dict[str, list[Any]]:
    """Per table: its row count, its content digest (:data:`CONTENT_SQL`, unless ``content``
    is off: the count alone), and with ``columns`` its column names and types. Read in a
    session that prints values the same way on every server."""
    from pgcdc_dagster.engine.compare.verify import COMPARABLE_SESSION

    out: dict[str, list[Any]] = {}
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(COMPARABLE_SESSION)  # type: ignore[arg-type]
        for item in tables:
            table = TableName.parse(str(item))
            query = CONTENT_SQL if content else "SELECT count(*) FROM {} t"
            row = conn.execute(sql.SQL(query).format(table.sql)).fetchone()  # type: ignore[arg-type]
            assert row is not None
            found: list[Any] = [int(row[0]), *(str(v) for v in row[1:])]
            if columns:
                found.append(
                    [
                        list(c)
                        for c in conn.execute(
                            "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute "
                            "WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped "
                            "ORDER BY attnum",
                            (str(table),),
                        ).fetchall()
                    ]
                )
            out[str(table)] = found
    return out


def equality(expected: Mapping[str, list[Any]], dsn: str, **how: bool) -> dict[str, Any]:
    """``dsn``'s tables against ``expected`` (the source's :func:`fingerprints`, taken the same
    way, ``how``): ``equal``, the target's ``rows``, the ``tables`` compared and those that
    ``differ``."""
    got = fingerprints(dsn, list(expected), **how)
    differ = [t for t in expected if got[t] != expected[t]]
    return {
        "equal": not differ,
        "rows": sum(v[0] for v in got.values()),
        "tables": len(got),
        "differ": differ,
    }


def require_equal(
    expected: Mapping[str, list[Any]], dsn: str, what: str, **how: bool
) -> dict[str, Any]:
    """:func:`equality`, a difference raised as an error naming ``what``."""
    found = equality(expected, dsn, **how)
    if not found["equal"]:
        got = fingerprints(dsn, found["differ"], **how)
        want = {t: expected[t] for t in found["differ"]}
        raise RuntimeError(f"{what}: the target differs from the source: {got} != {want}")
    return found


def targets_equal(
    source_dsn: str, target_dsn: str, tables: Iterable[str | TableName], **how: bool
) -> dict[str, Any]:
    """:func:`equality` of ``tables`` in ``target_dsn`` with the same in ``source_dsn``."""
    return equality(fingerprints(source_dsn, tables, **how), target_dsn, **how)


# ─── median ──────────────────────────────────────────────────────────────────────────────────


def median(values: Iterable[float | None]) -> float | None:
    """The median of the values given (``None`` ones left out); ``None`` when there are none."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def value_at(node: Any, *path: str) -> Any:
    """``node[path[0]][path[1]]...``, ``None`` where a key is missing."""
    for key in path:
        node = node.get(key) if isinstance(node, Mapping) else None
    return node


def median_at(runs: Iterable[Mapping[str, Any]], *path: str) -> float | None:
    """The median over ``runs`` of the number at ``path`` in each (runs without it left out)."""
    values = [value_at(run, *path) for run in runs]
    return median(v for v in values if isinstance(v, int | float) and not isinstance(v, bool))


def medians(runs: Sequence[Any]) -> Any:
    """Medians of runs of the same shape (dicts of numbers, nested), key by key; what is not a
    number (text, flags) is the first run's."""
    first = runs[0]
    if isinstance(first, Mapping):
        return {k: medians([r[k] for r in runs]) for k in first}
    if isinstance(first, bool) or not isinstance(first, int | float):
        return first
    return median(runs)


# ─── the report ──────────────────────────────────────────────────────────────────────────────


def rounded(value: Any, digits: int = 3) -> Any:
    """``value`` with every float in it rounded to ``digits``."""
    if isinstance(value, float):
        return round(value, digits)
    if isinstance(value, Mapping):
        return {k: rounded(v, digits) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [rounded(v, digits) for v in value]
    return value


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A Markdown table (``None`` shown as ``-``), to paste into ``HISTORY.md``."""

    def cell(value: Any) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:g}"
        return str(value).replace("|", "\\|")

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def emit_report(report: Any, path: str | Path | None = None, *, indent: int = 2) -> None:
    """Print ``report`` as JSON, and write it to ``path`` too when given."""
    text = json.dumps(report, indent=indent, default=str)
    print(text, flush=True)
    if path:
        Path(path).write_text(text + "\n")


def run_repeats(one_run: Callable[[int], dict[str, Any]], count: int) -> list[dict[str, Any]]:
    """``one_run(i)`` for ``i`` in ``range(count)``, a line on stderr as each starts."""
    runs = []
    for i in range(count):
        print(f"run {i + 1}/{count}", file=sys.stderr, flush=True)
        runs.append(one_run(i))
    return runs


def summary(
    args: argparse.Namespace,
    runs: list[dict[str, Any]],
    median_of: Mapping[str, str] | None = None,
    **head: Any,
) -> dict[str, Any]:
    """A report of repeated runs: ``head`` (what was measured), the clusters' profile (of
    ``args.profile``), the median over the runs of each figure of ``median_of`` (its name in
    the report -> its key in a run), and every run."""
    return {
        **head,
        "cluster_profile": describe_profile(args.profile),
        **{name: median_at(runs, key) for name, key in (median_of or {}).items()},
        "runs": runs,
    }


def order_of(items: Sequence[Any], index: int) -> list[Any]:
    """``items`` in order on even ``index``, reversed on odd: no side always runs first."""
    return list(items) if index % 2 == 0 else list(reversed(items))


def alternating(
    sides: Mapping[str, Callable[[], dict[str, Any]]], index: int
) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """Run each side one after the other, the order alternating with ``index``."""
    order = order_of(list(sides), index)
    return order, {side: sides[side]() for side in order}


# ─── a pgbench backlog behind a base snapshot, native at the same point ──────────────────────

CLIENTS = 4
SLOT = "bench"
PUBLICATION = "bench_pub"
NATIVE_SLOT = "native"
NATIVE_PUBLICATION = "native_pub"
NATIVE_SUBSCRIPTION = "native_sub"
DB_OURS = "bench_a"
DB_NATIVE = "bench_b"
QUIET = {"autovacuum": "off"}
"""Added to both clusters of a backlog benchmark whatever the profile: a vacuum one side's
writes set off must not land in the other side's timing."""

INSERT_LOG_SCRIPT = """\\set aid random(1, 100000 * :scale)
\\set bid random(1, :scale)
\\set tid random(1, 10 * :scale)
\\set delta random(-5000, 5000)
INSERT INTO pgbench_history (tid, bid, aid, delta, mtime)
  SELECT :tid, :bid, :aid + g, :delta, now() FROM generate_series(0, 3) g;
"""
"""``--workload insert-log``: each transaction inserts 4 rows into ``pgbench_history`` (no
key, identity FULL) and changes nothing else: a log or audit table's stream, with as many row
changes per transaction as TPC-B's."""

WORKLOADS = ("tpcb", "insert-log")


class Setup(NamedTuple):
    settings: Any
    """The :class:`~pgcdc_dagster.engine.settings.ReplicationSettings` into ``bench_a``."""
    start: Lsn
    """The source's flushed WAL just before the backlog."""
    end: Lsn
    pgbench_s: float
    setup_s: float
    snapshot_s: float
    snapshot: Any = None
    """The base snapshot's result (:func:`record_snapshot` records it for a command)."""


def record_snapshot(env: Mapping[str, str], work: Path, snapshot: Any) -> None:
    """The base snapshot's materialisation, in the Dagster storage of the command ``env``
    runs, as ``pgcdc snapshot`` leaves it there (the first apply after it carries the
    snapshot's rows per table, :mod:`pgcdc_dagster.defs.row_counts`). Outside any timing."""
    path = work / "snapshot.pickle"
    path.write_bytes(pickle.dumps(snapshot))
    script = (
        "import pickle, sys\n"
        "from dagster import AssetMaterialization\n"
        "from pgcdc_dagster.defs.instance import dagster_instance\n"
        "from pgcdc_dagster.defs.keys import BASE_SNAPSHOT_KEY\n"
        "from pgcdc_dagster.defs.metadata import snapshot_metadata\n"
        "result = pickle.loads(open(sys.argv[1], 'rb').read())\n"
        "dagster_instance().report_runless_asset_event(\n"
        "    AssetMaterialization(BASE_SNAPSHOT_KEY, metadata=snapshot_metadata(result)))\n"
    )
    subprocess.run(
        [sys.executable, "-c", script, str(path)],
        env=dict(env), check=True, cwd=work, capture_output=True,
    )  # fmt: skip


def prepare(
    source: LocalCluster, target: LocalCluster, spark: Any, store: Path, args: argparse.Namespace
) -> Setup:
    """pgbench at ``args.scale`` and a ``FOR ALL TABLES`` publication for native; the base
    snapshot into ``bench_a`` (ranges capped at ``args.range_mb``); the native slot made right
    after it; ``bench_a`` analysed and cloned into ``bench_b``, so both sides start from the
    same rows, files and statistics; then the backlog: ``args.transactions`` per client, 4
    clients, TPC-B or ``args.workload`` ``insert-log``, ended by a ``CHECKPOINT``."""
    from pgcdc_dagster.engine.control import pipeline
    from pgcdc_dagster.engine.settings import ReplicationSettings

    t0 = time.perf_counter()
    fill_pgbench(source, args.scale, analyse=False)
    create_publication(source.dsn(), NATIVE_PUBLICATION)
    create_database(target, DB_OURS)
    settings = ReplicationSettings(
        source_dsn=source.dsn(),
        target_dsn=target.dsn(DB_OURS),
        slot=SLOT,
        publication=PUBLICATION,
        store=str(store),
        range_max_bytes=args.range_mb * 1024 * 1024,
    )
    snapshot = pipeline.take_snapshot(settings, spark)
    with psycopg.connect(source.dsn(), autocommit=True) as conn:
        (native_lsn,) = conn.execute(
            "SELECT lsn::text FROM pg_create_logical_replication_slot(%s, 'pgoutput')",
            (NATIVE_SLOT,),
        ).fetchone()  # type: ignore[misc]
    start = wal_position(source.dsn(), of="flush")
    execute(target.dsn(DB_OURS), "VACUUM ANALYZE")
    clone_database(target, DB_OURS, DB_NATIVE)
    if Lsn.parse(native_lsn) < snapshot.consistent_point:
        raise RuntimeError(f"native slot at {native_lsn}, before {snapshot.consistent_point}")

    t1 = time.perf_counter()
    script: list[str] = []
    if getattr(args, "workload", "tpcb") == "insert-log":
        path = store.parent / "insert_log.sql"
        path.write_text(INSERT_LOG_SCRIPT)
        script = ["-f", str(path)]
    workload = pgbench(
        source, "-n", *script, "-c", str(CLIENTS), "-j", "2", "-t", str(args.transactions)
    )
    assert workload is not None
    _, stderr = workload.communicate()
    if workload.returncode != 0:
        raise RuntimeError(f"pgbench failed: {stderr.decode(errors='replace')[-2000:]}")
    pgbench_s = time.perf_counter() - t1
    checkpoint(source)
    end = wal_position(source.dsn(), of="flush")
    return Setup(
        settings,
        start,
        end,
        pgbench_s=pgbench_s,
        setup_s=time.perf_counter() - t0,
        snapshot_s=snapshot.seconds,
        snapshot=snapshot,
    )


def replication_equal(settings: Any, target_dsn: str | None = None) -> dict[str, Any]:
    """:func:`targets_equal` over the tables ``settings`` (a ``ReplicationSettings``)
    replicates, in its target database or ``target_dsn`` (a native peer's)."""
    from pgcdc_dagster.engine.control import pipeline

    tables = pipeline.replicated_tables(settings)
    return targets_equal(settings.source_dsn, target_dsn or settings.target_dsn, tables)


def native_catch_up(
    setup: Setup,
    source: LocalCluster,
    target: LocalCluster,
    meter: CpuMeter,
    timeout_s: float,
) -> dict[str, Any]:
    """Native's catch-up of the backlog: a subscription in ``bench_b`` over the slot made right
    after the snapshot (no copy, disabled), timed inside ``meter`` from ``ENABLE`` until the
    slot's ``confirmed_flush_lsn`` reaches the backlog's end. The same poll reads the
    subscription origin's progress on the target, so ``applied_s`` says when the last
    transaction was applied as opposed to confirmed back (``seconds``). Then ``bench_b``
    compared with the source, the subscription and the slot dropped."""
    target_dsn = target.dsn(DB_NATIVE)
    subscription = Subscription(
        source.dsn(), target_dsn, NATIVE_SUBSCRIPTION, NATIVE_PUBLICATION, slot=NATIVE_SLOT
    )
    subscription.create(copy_data=False, enabled=False, existing_slot=True)
    origin = subscription.origin()
    poll_source = "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s"
    poll_target = "SELECT pg_replication_origin_progress(%s, false)::text"
    timeline: list[tuple[float, Lsn | None]] = []
    with (
        psycopg.connect(target_dsn, autocommit=True) as tgt,
        psycopg.connect(source.dsn(), autocommit=True) as src,
    ):
        checkpoint(source, target, sync=True)
        with meter:
            started = time.perf_counter()
            subscription.alter("ENABLE", tgt)
            while True:
                (confirmed,) = src.execute(poll_source, (NATIVE_SLOT,)).fetchone()  # type: ignore[misc]
                (applied,) = tgt.execute(poll_target, (origin,)).fetchone()  # type: ignore[misc]
                now = time.perf_counter() - started
                timeline.append((now, None if applied is None else Lsn.parse(applied)))
                if confirmed is not None and Lsn.parse(confirmed) >= setup.end:
                    break
                if now > timeout_s:
                    raise RuntimeError(
                        f"native subscription not caught up after {timeout_s} s: slot confirmed "
                        f"at {confirmed}, backlog ends at {setup.end}; the target's server log "
                        "(deleted with the cluster) ends with:\n"
                        + target.logfile.read_text(errors="replace")[-3000:]
                    )
                time.sleep(POLL_S)
            seconds = time.perf_counter() - started
    final = timeline[-1][1]
    result = {
        "seconds": seconds,
        "applied_s": next(t for t, lsn in timeline if lsn == final),
        "first_commit_s": next((t for t, lsn in timeline if lsn is not None), None),
        "polls": len(timeline),
        "cpu_s": meter.seconds,
        "verify": replication_equal(setup.settings, target_dsn),
    }
    subscription.drop(keep_slot=True)
    drop_slot(source.dsn(), NATIVE_SLOT)
    return result


def bulk_updates(dsn: str, changes: int) -> int:
    """``changes`` row updates of ``pgbench_accounts``, one tenth of the table a transaction
    (so every account ends as one net row); how many were made."""
    written = 0
    with psycopg.connect(dsn, autocommit=True) as conn:
        (accounts,) = conn.execute("SELECT count(*) FROM pgbench_accounts").fetchone()  # type: ignore[misc]
        k = 0
        while written < changes:
            cur = conn.execute(
                "UPDATE pgbench_accounts SET abalance = abalance + 1 WHERE aid %% 10 = %s",
                (k % 10,),
            )
            written += cur.rowcount
            k += 1
    assert accounts > 0
    return written


def apply_split(result: Any) -> dict[str, Any]:
    """Where an ``apply_range`` result says its time went, and what it applied."""
    return {
        "compaction_path": result.compaction_path,
        "staged_by": result.staged_by,
        "compaction_s": result.compaction_seconds,
        "staging_s": result.staging_seconds,
        "apply_s": result.apply_seconds,
        "changes": result.changes,
        "net_rows": result.net_rows,
    }


# ─── the slot read raw, and a store written by hand ──────────────────────────────────────────

PEEK_SQL = (
    "SELECT data FROM pg_logical_slot_peek_binary_changes(%s, %s::pg_lsn, NULL, "
    "'proto_version', '1', 'publication_names', %s)"
)
"""Every pgoutput message of a slot up to a position, as ``receive`` reads them (no decoding)."""


def make_slots(dsn: str, names: Sequence[str]) -> Lsn:
    """Logical slots ``names`` (pgoutput), made back to back then all moved to the newest's
    start, so that each sees the same changes; that start."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        starts = [
            Lsn.parse(
                conn.execute(  # type: ignore[index]
                    "SELECT lsn::text FROM pg_create_logical_replication_slot(%s, 'pgoutput')",
                    (name,),
                ).fetchone()[0]
            )
            for name in names
        ]
        start = max(starts)
        for name in names:
            conn.execute("SELECT pg_replication_slot_advance(%s, %s::pg_lsn)", (name, str(start)))
    return start


def peek_slot(dsn: str, slot: str, upto: Lsn, publication: str) -> tuple[float, int, int]:
    """The slot's messages up to ``upto`` through a binary server-side cursor in batches of
    20,000, no decoding (the ceiling: what the server can hand us): seconds, messages, bytes."""
    started = time.perf_counter()
    rows = wire = 0
    with psycopg.connect(dsn) as conn, conn.cursor(name="raw", binary=True) as cur:
        cur.execute(PEEK_SQL, (slot, str(upto), publication))
        while batch := cur.fetchmany(20_000):
            rows += len(batch)
            wire += sum(len(r[0]) for r in batch)
    return time.perf_counter() - started, rows, wire


STORE_START = 0x1_0000_0000
STORE_STEP = 0x4000


def write_store(root: Path, ranges: int, age_s: float, step: int = STORE_STEP) -> Lsn:
    """A store of ``ranges`` ranges of one transaction each (``step`` bytes of WAL, a manifest
    and a 2 KB Parquet file, stored ``age_s`` seconds ago), in the layout of the code under
    test; returns the last one's commit."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    sys.path.insert(0, str(REPO))  # the tests' store helpers
    from pgcdc_dagster.engine.lsn import LsnRange
    from pgcdc_dagster.engine.store.output_store import CHANGE_SCHEMA, MANIFEST, OutputStore
    from pgcdc_dagster_tests.support.stores import range_manifest

    store = OutputStore(root)
    store.record_chain("bench", Lsn(STORE_START), "snap")
    sample = root / "sample.parquet"
    rows: dict[str, list[Any]] = {f.name: [None] * 20 for f in CHANGE_SCHEMA}
    rows.update(commit_end_lsn=[1] * 20, commit_lsn=[1] * 20, lsn=[1] * 20, xid=[1] * 20)
    rows.update(commit_ts=[0] * 20, seq=list(range(20)), action=["I"] * 20)
    rows.update(schema_name=["public"] * 20, table_name=["t"] * 20, relation_version=[0] * 20)
    rows.update(flags=[0] * 20, new_row=[["x" * 40]] * 20)
    pq.write_table(pa.table(rows, schema=CHANGE_SCHEMA), sample, compression="zstd")
    when = time.time() - age_s
    last = Lsn(STORE_START)
    for i in range(ranges):
        start, end = STORE_START + i * step, STORE_START + (i + 1) * step
        last = Lsn(end - 0x100)
        manifest = range_manifest(str(Lsn(start)), str(Lsn(end)), str(last))
        manifest = manifest.__class__(
            result=manifest.result,
            relations=[],
            types={},
            bytes=sample.stat().st_size,
            chain_last_commit=str(last),
        )
        folder = store.range_path(LsnRange(Lsn(start), Lsn(end)))  # in the store's layout
        folder.mkdir(parents=True)
        shutil.copyfile(sample, folder / "part-00000.parquet")
        (folder / MANIFEST).write_text(manifest.to_json())
        os.utime(folder / MANIFEST, (when, when))
    sample.unlink()
    return last
