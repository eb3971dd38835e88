"""The settings: one validated object, and the one place that reads ``PGCDC_*`` variables.

The CLI, the Dagster definitions (and through them every resource, sensor and check), the demo
and the benchmarks all build a :class:`ReplicationSettings`; nothing else parses the
environment. Two exceptions by design: ``PGCDC_FAILPOINT``, a test instrument read by
:mod:`.failpoints` alone, absent in production; and ``PGCDC_SERVER*``, read by
:mod:`pgcdc_dagster.server_client` before anything else is imported (the ``pgcdc`` entry
point imports the standard library only, and validating here needs pydantic).

Every field is the lower-case name of its variable without the prefix: ``PGCDC_RANGE_MAX_BYTES``
is ``range_max_bytes``. Values are validated here, so a wrong one is one line naming the
variable, and nothing downstream re-checks them. Connection strings hold passwords: they are
kept out of ``repr`` and every message names servers with
:func:`~pgcdc_dagster.engine.connect.describe_dsn` only.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    field_validator,
)

from .errors import PgcdcError
from .identifiers import TableName, origin_name
from .store_location import StoreLocation, parse_location

PREFIX = "PGCDC_"
SNAPSHOT_RANGE_ROWS = 500_000
"""About one to two seconds of COPY per range: big enough that a range's start-up (two
connections, a snapshot import) is noise, small enough that a large table spreads over every
core."""
SPARK_TABLE_ROWS = 2_000_000
"""With a Spark cluster, tables past this many rows are copied by Spark."""
DEFAULT_SPARK_MIN_CHANGES = 2_000_000
"""Ranges with fewer changes are compacted in this process even when a SparkSession is given;
from this many on, Spark's workers compact them and stage the net rows on the target
(:mod:`.apply.spark_staging`).

Why: on one machine Spark never wins. The Arrow kernel compacts a pgbench backlog in a
fraction of a second, Spark pays seconds for each crossing of a few hundred thousand rows
between the JVM and Python, and executor-side staging is slower than this process on the same
cores. Spark is there for ranges whose changes would not fit the driver's memory (several
hundred bytes per change while compacting) and for clusters with many cores: the threshold is
about memory, not speed (``benchmarks/spark_staging.py``; figures in ``benchmarks/HISTORY.md``,
"Spark's fixed costs and the driver/Spark split")."""
MiB = 1024 * 1024
DEFAULT_MEMORY_LIMIT = 1024 * MiB
DEFAULT_DECODING_WORK_MEM = 0
PROCESS_BASE_BYTES = 400 * MiB
"""What a follow's process holds before any range (Python, Dagster, psycopg, Arrow, the
receiver's buffers), with a margin (``benchmarks/big_transaction.py``: RSS before)."""
COMPACTING_BYTES_PER_CHANGE = 1_000
"""Peak memory of compacting one change (the routed rows read, sorted, gathered into net rows
and formatted for COPY), with a margin (``benchmarks/big_transaction.py``: peak RSS)."""
MIN_PARTITION_CHANGES = 50_000
"""Below this, a partition's fixed costs (a transaction and a COPY per staging table) show."""
DAY = 86400.0
DEFAULT_STORE_RETENTION_S = 7 * DAY
DEFAULT_FOLLOW_RETRY_S = 600.0
DEFAULT_PARTITIONS_KEPT = 50_000
"""Half of the 100,000 partitions per asset Dagster recommends at most."""
DURATION_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": DAY}
SECRET_FIELDS = frozenset({"source_dsn", "target_dsn", "spark_conf"})


class SettingsError(PgcdcError, ValueError):
    """A required setting is missing or malformed."""


class ReplicationSettings(BaseModel):
    """What the project needs to find its servers, slot and store, and how it behaves."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    source_dsn: str = Field(default="", repr=False)
    """libpq connection string of the source (``PGCDC_SOURCE_DSN``; a secret)."""
    target_dsn: str = Field(default="", repr=False)
    """libpq connection string of the target (``PGCDC_TARGET_DSN``; a secret)."""
    slot: str = "pgcdc_slot"
    publication: str = "pgcdc_pub"
    tables: tuple[TableName, ...] | None = None
    """``None``: every user table of the source. From a comma list of ``schema.table``."""
    store: str = ".pgcdc/store"
    """Where the output store (decoded ranges, the chain record) lives: a local path, a
    ``file://`` URL, or ``s3://bucket/prefix`` (:mod:`.store.object_store`; credentials and
    endpoint from the ``AWS_*`` variables). Another object store's URL (``gs://``,
    ``abfs://``...) is refused in one line, never taken for a local folder."""
    owners: tuple[str, ...] = ()
    """Who answers for this replication, shown as the owners of every asset in the Dagster UI
    (``PGCDC_OWNERS``: a comma list, each an email address or ``team:name``)."""
    spark_master: str | None = None
    """Spark master URL (``local[*]`` when neither this nor ``spark_remote`` is set)."""
    spark_remote: str | None = None
    """Spark Connect URL ``sc://host:port``; wins over ``spark_master``."""
    spark_conf: dict[str, str] = Field(default_factory=dict, repr=False)
    """Any ``spark.*`` setting for the session, from ``key=value`` pairs separated by ``;``
    (``PGCDC_SPARK_CONF="spark.executor.memory=4g; spark.archives=env.tar.gz#env"``): executor
    memory and cores, a packed virtualenv, the executors' Python. Kept out of ``repr``: a
    cluster's settings may hold credentials (object store keys)."""
    range_max_bytes: PositiveInt = 256 * MiB
    """One range holds at most this much WAL, so one run stays a bounded amount of work."""
    snapshot_parquet: bool = False
    """Also write the base snapshot as Parquet into the store; off unless asked for, since it
    adds much to the copy's time (``benchmarks/HISTORY.md``, "The snapshot's Parquet export")."""
    snapshot_driver_rows: NonNegativeInt | None = None
    """Tables estimated at or below this many rows are copied by ``pgcdc`` itself while Spark
    starts in the background; bigger ones by Spark (never started when none is bigger). 0: every
    table on Spark. Unset: see :meth:`driver_max_rows`."""
    snapshot_jobs: PositiveInt | None = None
    """How many copy streams ``pgcdc`` itself runs at once in a snapshot, an add or a resync
    (its tables, and the block ranges of a big one: a table is cut into about as many as
    there are streams). Unset: half the cores (each stream keeps two server backends busy).
    More helps when the servers are on other machines than ``pgcdc``."""
    snapshot_range_rows: PositiveInt | None = None
    """About how many rows one copy range holds at most: a bigger table is cut into block
    ranges, each copied, and recorded for a resume, in one target transaction. Unset:
    :data:`SNAPSHOT_RANGE_ROWS` for Spark's tasks, and ``pgcdc``'s own streams join
    neighbours into one range per stream (fewer, longer copies are faster). Set: every copier
    keeps ranges of this size, so a snapshot killed in a big table loses at most a range per
    stream (a resume continues the table from the others: ``docs/operations/outages.md``)."""

    def range_options(self) -> dict[str, Any]:
        """How a copy cuts tables (:func:`~.snapshot.scheduling.copy_tables`'s options)."""
        return {
            "parallelism": self.snapshot_jobs,
            "target_rows_per_task": self.snapshot_range_rows or SNAPSHOT_RANGE_ROWS,
            "fine_ranges": self.snapshot_range_rows is not None,
        }

    spark_min_changes: PositiveInt | None = None
    """Ranges with at least this many changes are compacted by Spark's workers, which stage the
    net rows on the target themselves; smaller ones in this process. Unset: see
    :attr:`spark_range_changes`."""
    decoding_work_mem: NonNegativeInt = DEFAULT_DECODING_WORK_MEM
    """``logical_decoding_work_mem`` of the sessions that read the slot, on the source
    (``PGCDC_DECODING_WORK_MEM``: a size; 0, the default, keeps the server's): how much of the
    transactions being decoded the source holds in memory before it spills them to disk (a
    peek), or sends them before their COMMIT (a follow's stream, PostgreSQL 14 and later:
    :mod:`.source.streamed`). The source's memory, one session's, only while it decodes. Not
    raised by default: through ``pgcdc follow`` a big transaction is received no faster with
    more than the server's default (``benchmarks/HISTORY.md``, big_transaction), although a
    lone peek on a loaded machine decodes it faster."""
    memory_limit: PositiveInt = DEFAULT_MEMORY_LIMIT
    """About how much memory the process that applies may use (``PGCDC_MEMORY_LIMIT``: bytes,
    or with a unit, ``1GB``, ``512MB``): a range too big to compact whole within it is
    compacted and staged one key-hash partition at a time (:attr:`partition_changes`,
    :mod:`.apply.partitioned_staging`), so a transaction of any size is applied in bounded
    memory."""
    sensor_interval: PositiveInt = 5
    """Seconds between slot sensor ticks (Dagster's daemon evaluates sensors every 5 s at
    most)."""
    dead_run_grace: PositiveFloat = 10.0
    """Seconds a run may show no sign of life (no range lock, no event) before it is taken for
    dead, when its process cannot be checked directly (another host)."""
    retained_wal_limit: PositiveInt = 8 * 1024 * MiB
    """``slot_health`` fails above this many bytes of WAL retained by the slot."""
    ddl: Literal["auto", "strict"] = "auto"
    """What the apply does with a source's DDL it cannot follow column by column (a narrowing
    type change, a volatile default, a rewritten table; :mod:`.apply.ddl`): ``auto`` re-copies the
    table by itself (a resync, while the other tables go on); ``strict`` stops with one line
    naming ``pgcdc resync``. Either way nothing of the range is applied before."""
    auto_add: bool = False
    """A table the publication sends that the target lacks (one created on the source after
    the base snapshot, in a ``FOR ALL TABLES`` or ``FOR TABLES IN SCHEMA`` publication) is
    copied in by the apply that first meets its changes, as ``pgcdc add-table`` would
    (``PGCDC_AUTO_ADD=on``). Off by default: that copy runs inside the catch-up, whose other
    tables wait for it (hours, for a big table; ``pgcdc add-table`` copies beside the
    applies), and ``FOR ALL TABLES`` also sends a migration's scratch tables; off, the apply
    stops with one line naming ``pgcdc add-table``, losing nothing, as native replication
    waits for ``REFRESH PUBLICATION``."""
    auto_recover: bool = False
    """A lost slot (invalidated, or dropped) is recovered by the slot sensor with no hands: it
    runs the ``recover`` job (``pgcdc recover``: a new slot, the target compared with the
    source at its point, only the differing chunks copied) as soon as it sees the loss, and
    again after a recovery that did not finish (``PGCDC_AUTO_RECOVER=on``). Off by default: a
    recovery reads every row on both sides, and a user may rather take a new snapshot, or first
    learn why the slot was lost (``max_slot_wal_keep_size``); off, the sensor skips, naming
    ``pgcdc recover``."""
    spark_staging: Literal["auto", "required"] = "auto"
    """A range big enough for Spark (``PGCDC_SPARK_MIN_CHANGES``) whose files Spark's
    executors cannot read (the output store is not on storage they mount at the same path):
    ``auto`` stages it on the driver instead, with one warning, and the range's metadata says
    so (``staged_by``); ``required`` stops the apply in one line, nothing applied
    (``PGCDC_SPARK_STAGING``)."""
    slot_failover: Literal["auto", "on", "off"] = "auto"
    """Whether the slot is a failover slot (PostgreSQL 17+): synchronised to the source's
    physical standbys that have ``sync_replication_slots`` on, so that a promoted standby has
    it and the replication goes on from there with no recovery (``PGCDC_SLOT_FAILOVER``).
    ``auto``: wherever the source supports it; ``on``: fail on a source that does not;
    ``off``: never. An existing slot is switched to what this says by the next catch-up or
    follow. What else a safe failover needs: ``docs/operations/failover.md``."""
    dropped_columns: Literal["drop", "keep"] = "drop"
    """A column dropped on the source: ``drop`` drops it on the target too, in the
    transaction of the range that shows it gone (the target keeps the source's shape);
    ``keep`` leaves it on the target, NULL in rows inserted after (an audit copy's history)."""
    mode: Literal["follow", "range"] = "range"
    """What the slot sensor keeps going: one long-lived ``follow`` run, or one run per range."""
    apply_synchronous_commit: Literal["off", "local", "remote_write", "remote_apply", "on"] = "off"
    """The apply transactions' ``synchronous_commit`` on the target (as a subscription's option
    of the same name, and its default): ``off``, a COMMIT returns before its WAL is on disk, and
    a crash of the target loses its last fraction of a second of applied ranges, rows and origin
    together, applied again from the store (:func:`~.apply.origin.read_progress`); ``on`` and
    the rest wait for the disk, or the target's standbys, at every range."""
    follow_cut_ms: PositiveInt = 200
    """Reading by stream, ``follow`` cuts a range as soon as its applier is free, and at the
    latest this long after the last cut while the applier is busy (the range then waits in the
    queue); reading by peeks, it cuts one this often while changes flow (milliseconds)."""
    follow_read: Literal["stream", "peek"] = "stream"
    """How ``follow`` reads the slot once it keeps up (no endpos, less than
    :data:`~.follow.follower.STREAM_WITHIN_BYTES` behind): a ``START_REPLICATION`` stream
    (:mod:`.source.stream`: each transaction a few milliseconds after its COMMIT, each WAL
    record decoded once) or a peek every ``follow_cut_ms``. A backlog is always read by peeks."""
    follow_range_bytes: PositiveInt = 32 * MiB
    """``follow``'s cap on one range's WAL: small enough that applying a range overlaps
    receiving the next one on a backlog, large enough to amortise each range's fixed cost."""
    follow_idle_s: PositiveFloat = 10.0
    """On a source with no published change, ``follow`` still stores an (empty) range this
    often, or once 16 MiB of WAL went by, so the slot keeps moving and retained WAL stays
    bounded."""
    follow_table_events: Literal["all", "changed"] = "all"
    """Which target tables a follow materialises for each range: ``all`` (every replicated
    table's partition, as a per-range run does, while the run's events keep up with the apply;
    for the ranges they trail on by more than 2 s, only the tables the range changed) or
    ``changed`` (always only the tables the range changed). Each materialisation is a Dagster
    event of a few milliseconds: with hundreds of tables, every table for every range is more
    than Dagster keeps up with at a range every 200 ms."""
    store_retention: NonNegativeFloat | None = DEFAULT_STORE_RETENTION_S
    """Seconds an applied range stays in the store after it was stored (its ``lsn_ranges``
    partition goes with it); ``None`` (``forever``): every range stays. From ``90s``, ``30m``,
    ``12h``, ``7d`` or plain seconds. The last applied range always stays (see
    :mod:`.store.retention`)."""

    partitions_kept: PositiveInt | None = DEFAULT_PARTITIONS_KEPT
    """At most about this many ``lsn_ranges`` partitions stay registered in Dagster (``all``:
    no limit): past it, the oldest go, with their materialisations and checks, while the
    store keeps the ranges themselves for ``store_retention``. Dagster recommends 100,000
    partitions or fewer per asset (its UI slows beyond), and a follow under steady load cuts
    about 5 ranges a second, 432,000 a day; see :mod:`pgcdc_dagster.defs.range_events`."""

    follow_retry: NonNegativeFloat | None = DEFAULT_FOLLOW_RETRY_S
    """How long a follow without an endpos rides through a source or target that went away
    (a restart, a failover, a network failure) before it fails: it retries with growing
    pauses (0.5 s, then every second) and resumes from the durable state, as a new follow
    would. The same budget covers Dagster's own storage: the follow goes on applying and
    records its ranges' events once the storage is back. ``0``: fail at once, as
    ``catchup`` always does; ``forever``: never give up. From ``90s``, ``30m``, ``12h``,
    ``7d`` or plain seconds. A follow that never reached its
    servers fails at once whatever this says: that is a setting to fix, not an outage."""

    def driver_max_rows(self) -> int:
        """The snapshot's driver/Spark split. Unset, it depends on where Spark's executors run.
        On this machine's cores (local Spark, or the warm local server of ``pgcdc spark
        start``) they compete with the driver's copy processes, which move rows faster than
        Spark's JDBC path on the same cores, cold or warm (``benchmarks/snapshot.py``; figures
        in ``benchmarks/HISTORY.md``). So every table is the driver's then;
        with a Spark cluster (``spark_master`` not local, ``spark_remote``, or a recorded server
        on a cluster master), tables past :data:`SPARK_TABLE_ROWS` go to Spark."""
        if self.snapshot_driver_rows is not None:
            return self.snapshot_driver_rows
        from .spark.server import cores_are_local

        local = cores_are_local(self.spark_master, self.spark_remote, self.store_path)
        return sys.maxsize if local else SPARK_TABLE_ROWS

    @field_validator("tables", mode="before")
    @classmethod
    def _parse_tables(cls, value: Any) -> Any:
        return parse_tables(value) if isinstance(value, str) else value

    @field_validator("owners", mode="before")
    @classmethod
    def _parse_owners(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = tuple(part.strip() for part in value.split(",") if part.strip())
        for owner in value:
            name = owner.removeprefix("team:")
            if not name or (name == owner and "@" not in owner):
                raise ValueError(
                    f"owner {owner!r} is neither an email address nor team:name "
                    "(for example team:data-platform,alice@example.com)"
                )
        return value

    @field_validator("spark_conf", mode="before")
    @classmethod
    def _parse_spark_conf(cls, value: Any) -> Any:
        return parse_spark_conf(value) if isinstance(value, str) else value

    @field_validator("store_retention", "follow_retry", mode="before")
    @classmethod
    def _parse_retention(cls, value: Any) -> Any:
        return parse_duration(value) if isinstance(value, str) else value

    @field_validator("partitions_kept", mode="before")
    @classmethod
    def _all_is_none(cls, value: Any) -> Any:
        return None if isinstance(value, str) and value.strip().lower() == "all" else value

    @field_validator("memory_limit", "decoding_work_mem", mode="before")
    @classmethod
    def _parse_memory(cls, value: Any) -> Any:
        return parse_bytes(value) if isinstance(value, str) else value

    @field_validator("spark_master", "spark_remote", mode="before")
    @classmethod
    def _empty_is_none(cls, value: Any) -> Any:
        return value or None

    @field_validator("store", mode="before")
    @classmethod
    def _local_store(cls, value: Any) -> Any:
        return local_store_path(value) if isinstance(value, str) else value

    def spark_target(self) -> dict[str, str | None]:
        """Where Spark runs, as :func:`~.spark.session.get_spark`'s ``master`` and ``remote``:
        the configured ones, else the warm server ``pgcdc spark start`` recorded in the store
        if it runs (:func:`~.spark.server.spark_target`), else local Spark."""
        from .spark.server import spark_target

        return spark_target(self.spark_master, self.spark_remote, self.store_path)

    def spark_session(self) -> Any:
        """A SparkSession where :meth:`spark_target` says: what the engine takes as its lazy
        Spark provider outside Dagster (a run takes its ``spark`` resource's)."""
        from .spark.session import get_spark

        target = self.spark_target()
        return get_spark(master=target["master"], remote=target["remote"], conf=self.spark_conf)

    @property
    def spark_range_changes(self) -> int | None:
        """From how many changes a range goes to Spark's workers (``None``: never).
        ``PGCDC_SPARK_MIN_CHANGES`` when set; else :data:`DEFAULT_SPARK_MIN_CHANGES` on a Spark
        cluster (a master other than ``local``, or Spark Connect), and never on a local Spark:
        there a JVM shares this machine's cores with the servers, and the partitioned path of
        this process is faster in the same bounded memory (``benchmarks/big_transaction.py``)."""
        if self.spark_min_changes is not None:
            return self.spark_min_changes
        master = self.spark_master or ""
        if self.spark_remote or (master and not master.startswith("local")):
            return DEFAULT_SPARK_MIN_CHANGES
        return None

    @property
    def partition_changes(self) -> int:
        """Changes per key-hash partition of a big range's apply, from :attr:`memory_limit`:
        what is left past the process's own (:data:`PROCESS_BASE_BYTES`), shared by the two
        partitions in flight (one compacted, one COPYed) at :data:`COMPACTING_BYTES_PER_CHANGE`
        each, and never below :data:`MIN_PARTITION_CHANGES`."""
        spare = max(0, self.memory_limit - PROCESS_BASE_BYTES)
        return max(MIN_PARTITION_CHANGES, spare // (2 * COMPACTING_BYTES_PER_CHANGE))

    @property
    def origin(self) -> str:
        """The target's replication origin for this slot."""
        return origin_name(self.slot)

    @property
    def store_location(self) -> StoreLocation:
        return parse_location(self.store)

    @property
    def snapshot_export(self) -> Path | None:
        """Where the snapshot's Parquet goes (``PGCDC_SNAPSHOT_PARQUET``): beside a store on a
        disk only (:class:`SettingsError` for an object store's); ``None`` when not asked."""
        if not self.snapshot_parquet:
            return None
        if not self.store_location.is_local:
            raise SettingsError(
                "PGCDC_SNAPSHOT_PARQUET writes the snapshot's Parquet beside a store on a disk "
                f"only, and PGCDC_STORE is {self.store_location.url}: unset one of the two"
            )
        return self.store_path

    @property
    def store_path(self) -> Path:
        """The store's local folder: the store itself on a disk, its work folder (scratch,
        the warm Spark server's record) for an object store."""
        return self.store_location.work_folder

    def require_servers(self) -> ReplicationSettings:
        """These settings, or :class:`SettingsError` when a connection string is missing."""
        missing = [
            f"{PREFIX}{name.upper()}"
            for name in ("source_dsn", "target_dsn")
            if not getattr(self, name)
        ]
        if missing:
            raise SettingsError(
                f"{' and '.join(missing)} not set: export the libpq connection string(s) of the "
                "source and target PostgreSQL (or run 'pgcdc demo' for local throwaway clusters)"
            )
        return self

    @classmethod
    def from_env(
        cls, env: Mapping[str, str] | None = None, *, require_servers: bool = True
    ) -> ReplicationSettings:
        """Settings from ``PGCDC_*`` variables (``os.environ`` by default); an empty variable
        counts as unset. ``require_servers=False`` for the Dagster definitions, which load
        without the connection strings (their resources read them at run time)."""
        env = os.environ if env is None else env
        values = {
            name: env[f"{PREFIX}{name.upper()}"]
            for name in cls.model_fields
            if env.get(f"{PREFIX}{name.upper()}", "").strip()
        }
        try:
            settings = cls.model_validate(values)
        except ValidationError as exc:
            raise SettingsError(_one_line(exc)) from None
        return settings.require_servers() if require_servers else settings


_BYTE_UNITS = {"": 1, "k": 1024, "m": MiB, "g": 1024 * MiB, "t": 1024 * 1024 * MiB}


def parse_bytes(text: str) -> int:
    """``1GB``, ``512MB``, ``1073741824``: a size in bytes (units as PostgreSQL's, powers of
    1024, case-insensitive, the ``B`` optional)."""
    match = re.fullmatch(r"\s*(\d+)\s*([kmgt]?)b?\s*", text.lower())
    if not match:
        raise ValueError(f"{text!r} is not a size: write bytes, or a number with kB, MB or GB")
    return int(match.group(1)) * _BYTE_UNITS[match.group(2)]


def work_mem_setting(size: int) -> str:
    """``logical_decoding_work_mem`` as the server takes it, from bytes (``decoding_work_mem``),
    never below the server's minimum (64 kB)."""
    return f"{max(64, size // 1024)}kB"


def parse_tables(text: str | None) -> tuple[TableName, ...] | None:
    """``PGCDC_TABLES``: a comma list of ``schema.table`` (quoted parts may hold commas)."""
    if not text or not text.strip():
        return None
    parts: list[str] = []
    current: list[str] = []
    quoted = False
    for ch in text:
        if ch == '"':
            quoted = not quoted
        if ch == "," and not quoted:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    parts.append("".join(current))
    try:
        return tuple(sorted({TableName.parse(p) for p in parts if p.strip()}))
    except ValueError as exc:
        raise SettingsError(f"{PREFIX}TABLES: {exc}") from None


def parse_spark_conf(text: str) -> dict[str, str]:
    """``PGCDC_SPARK_CONF``: ``key=value`` pairs separated by ``;`` (a value may hold ``=``,
    ``,`` and spaces: ``spark.archives`` lists, Java options). Every key is a ``spark.*``
    setting, so a typo is named rather than passed on and ignored."""
    conf: dict[str, str] = {}
    for part in text.split(";"):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or not key.startswith("spark."):
            raise ValueError(  # the key alone: a value may be a secret
                f"{key!r} is not a Spark setting: write spark.<name>=<value>, pairs separated "
                "by ';'"
            )
        conf[key] = value.strip()
    return conf


def parse_duration(text: str) -> float | None:
    """``forever`` (``None``), or a number of seconds with an optional unit: ``90``, ``90s``,
    ``30m``, ``12h``, ``7d``; :class:`ValueError` saying what is accepted otherwise."""
    value = text.strip().lower()
    if value == "forever":
        return None
    number, unit = (value[:-1], value[-1]) if value[-1:] in DURATION_UNITS else (value, "s")
    try:
        seconds = float(number) * DURATION_UNITS[unit]
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:  # also refuses nan
        raise ValueError(
            f"{text!r} is not a duration: use 90s, 30m, 12h, 7d, plain seconds, or forever"
        )
    return seconds


_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def local_store_path(value: str) -> str:
    """``PGCDC_STORE`` as the setting keeps it: a ``file://`` URL's path, a path as it is, an
    object store's URL as it is once :func:`~.store.location.parse_location` took it; a
    :class:`ValueError` naming the fix for any other URL, which a local path resolution would
    otherwise turn into a folder ``gs:/bucket`` on this machine."""
    location = parse_location(value)
    return str(location.path) if location.path is not None and _URL.match(value) else value


def _one_line(exc: ValidationError) -> str:
    """Every problem of ``exc``, named by the variable, on one line (without the value of
    a variable that may hold a secret)."""
    problems = []
    for error in exc.errors():
        field = str(error["loc"][0]) if error["loc"] else "?"
        value = error.get("input")
        secret = field in SECRET_FIELDS or (isinstance(value, str) and "@" in value)
        shown = "" if secret else f"={value!r}"
        message = str(error["msg"])
        if message.startswith("Value error, "):  # our own words, as written
            message = message.removeprefix("Value error, ")
        else:
            message = message.lower()
        problems.append(f"{PREFIX}{field.upper()}{shown}: {message}")
    return "; ".join(problems)
