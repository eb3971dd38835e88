"""A stored range's format: its rows (:data:`CHANGE_SCHEMA`, one per change, in commit order)
and its manifest (``_RANGE.json``: watermarks, counts, relations), the store's single source
of truth for what the range holds.

Row values are positional lists of the text the server sent (``new_row``, ``key``); the column
names, types and key flags of each list live in the manifest's ``relations``, indexed by the
row's ``relation_version``. That keeps a range self-describing across DDL (a Relation message
re-sent mid-range becomes a new version) without repeating names in every row.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..lsn import Lsn, LsnRange
from .errors import StoreError

MANIFEST = "_RANGE.json"

FORMAT_VERSION = 1

CHANGE_SCHEMA = pa.schema(
    [
        pa.field("commit_end_lsn", pa.int64(), nullable=False),
        pa.field("commit_lsn", pa.int64(), nullable=False),
        pa.field("lsn", pa.int64(), nullable=False),
        pa.field("xid", pa.int64(), nullable=False),
        pa.field("commit_ts", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("seq", pa.int32(), nullable=False),
        pa.field("action", pa.string(), nullable=False),
        pa.field("schema_name", pa.string(), nullable=False),
        pa.field("table_name", pa.string(), nullable=False),
        pa.field("relation_version", pa.int32(), nullable=False),
        pa.field("key", pa.list_(pa.string())),
        pa.field("new_row", pa.list_(pa.string())),
        pa.field("unchanged_toast", pa.list_(pa.string())),
        pa.field("flags", pa.int8(), nullable=False),
    ]
)
"""One row per change.

``action`` is ``I``/``U``/``D``/``T``. ``key`` holds the replica-identity values that find the
row *before* the change (from the old tuple when one was sent, else from the new row): the key
columns, or every column under REPLICA IDENTITY FULL. ``new_row`` is the row after the change
(NULL for deletes and truncates). ``unchanged_toast`` names the columns whose value was not
sent because it did not change. ``flags`` carries TRUNCATE's CASCADE (1) / RESTART IDENTITY (2).
"""


class EndposOutcome(StrEnum):
    """Where a range's endpos fell relative to the transactions around it."""

    AT_COMMIT_BOUNDARY = "at_commit_boundary"
    BETWEEN_TRANSACTIONS = "between_transactions"
    MID_TRANSACTION = "mid_transaction"
    """A transaction began before endpos and commits after it: deferred, whole, to the next
    range."""
    EMPTY = "empty"
    """No transaction of the range committed: nothing to apply."""


@dataclass
class RangeResult:
    """Watermarks and counts of one received range: the manifest's ``result``."""

    range_key: str
    start_lsn: str
    endpos: str
    endpos_outcome: EndposOutcome
    transform_lsn: str | None
    """End of the last stored COMMIT; ``None`` when the range stored no transaction."""
    safe_point: str
    """Where the slot's confirmed position may be advanced once the range is stored."""
    last_xid: int | None
    last_commit_ts_us: int | None
    transactions: int
    changes: int
    inserts: int = 0
    updates: int = 0
    deletes: int = 0
    truncates: int = 0
    messages: int = 0
    straddlers: list[dict[str, int]] = field(default_factory=list)
    bytes: int = 0
    """Parquet bytes in the store."""
    wire_bytes: int = 0
    seconds: float = 0.0
    already_stored: bool = False
    """Set on the result handed back when the range was found stored (never written)."""


@dataclass(frozen=True)
class RangeManifest:
    """What a stored range holds (``_RANGE.json``): its result, and the relation versions and
    type names its positional row values are read with."""

    result: RangeResult
    relations: list[dict[str, Any]]
    """Per ``relation_version``: relid, schema, table, replica_identity and columns (name,
    type_oid, typmod, key), as pgoutput's Relation message sent them."""
    types: dict[str, str]
    """Names of the non-built-in type oids the relations use."""
    bytes: int = 0
    format_version: int = FORMAT_VERSION
    chain_last_commit: str | None = None
    """End of the last COMMIT stored in the chain up to this range's end (the consistent point
    when none is): where the target's origin stands once the range is applied. Set when the
    range is stored, from its own last COMMIT or else from the range before it, so walking
    back over empty ranges (an idle source stores one every ``follow_idle_s``) takes one step.
    ``None`` when unknown: a range before it stored without it, or not in the current chain."""
    used_relations: list[int] | None = None
    """The relation versions the range's rows use (see :meth:`StoredRange.relation_versions`),
    recorded by its writer, so that an apply knows them without reading the rows; ``None`` in a
    range stored without it (read from its rows then)."""

    def to_json(self) -> str:
        result = {k: v for k, v in dataclasses.asdict(self.result).items() if k != "already_stored"}
        return json.dumps(
            {
                "result": result,
                "relations": self.relations,
                "types": self.types,
                "bytes": self.bytes,
                "format_version": self.format_version,
                "chain_last_commit": self.chain_last_commit,
                "used_relations": self.used_relations,
            },
            indent=1,
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> RangeManifest:
        raw = json.loads(text)
        known = {f.name for f in dataclasses.fields(RangeResult)}
        fields = {k: v for k, v in raw.get("result", {}).items() if k in known}
        fields["endpos_outcome"] = EndposOutcome(fields.get("endpos_outcome", "empty"))
        fields["bytes"] = raw.get("bytes", fields.get("bytes", 0))
        return cls(
            result=RangeResult(**fields),
            relations=list(raw.get("relations", [])),
            types=dict(raw.get("types", {})),
            bytes=int(raw.get("bytes", 0)),
            format_version=int(raw.get("format_version", FORMAT_VERSION)),
            chain_last_commit=raw.get("chain_last_commit"),
            used_relations=raw.get("used_relations"),
        )


@dataclass(frozen=True)
class StoredRange:
    range: LsnRange
    path: Path
    manifest: RangeManifest
    store: Any = field(default=None, compare=False, repr=False)
    """The :class:`~.output_store.OutputStore` that read or wrote it."""

    @property
    def store_root(self) -> Path:
        """The root of the store the range lies in (in its bucket, or directly under
        ``changes/`` in the flat layout)."""
        folder = self.path.parent
        if folder.name != "changes":  # a bucket: changes/<hi>/<mid>
            folder = folder.parent.parent
        return folder.parent

    @property
    def transform_lsn(self) -> Lsn | None:
        """End of the range's last COMMIT; ``None`` when it holds no transaction."""
        value = self.manifest.result.transform_lsn
        return None if value is None else Lsn.parse(value)

    @property
    def chain_last_commit(self) -> Lsn | None:
        """See :attr:`RangeManifest.chain_last_commit`."""
        value = self.manifest.chain_last_commit
        return None if value is None else Lsn.parse(value)

    @property
    def last_commit_known(self) -> Lsn | None:
        """The chain's last COMMIT up to this range's end as the range itself knows it: its
        record, else its own last COMMIT; ``None`` when it knows neither (an empty range
        stored without the record)."""
        return self.chain_last_commit or self.transform_lsn

    @property
    def safe_point(self) -> Lsn:
        """Where the slot may be confirmed once this range is stored."""
        return Lsn.parse(self.manifest.result.safe_point)

    @property
    def changes(self) -> int:
        return self.manifest.result.changes

    @property
    def files(self) -> list[Path]:
        return sorted(self.path.glob("part-*.parquet"))

    def sources(self) -> list[Any]:
        """The range's Parquet files, as :class:`pyarrow.parquet.ParquetFile` opens them: local
        paths here, open object-store files for an object store's range."""
        return list(self.files)

    def spark_inputs(self) -> list[str]:
        """The range's Parquet files as Spark's executors read them (paths; an object store's
        range gives URLs, read by :mod:`..compaction.object_reader`)."""
        return [str(f) for f in self.files]

    def home(self) -> Any:
        """The store the range lies in (an :class:`~.output_store.OutputStore`)."""
        if self.store is None:
            raise StoreError(f"range {self.range.key} was made outside a store")
        return self.store

    def read_table(self, columns: Sequence[str] | None = None) -> pa.Table:
        """The range's changes (only ``columns``, when named), typed as :data:`CHANGE_SCHEMA`.

        Read file by file with :class:`pyarrow.parquet.ParquetFile`, not ``pq.read_table``: the
        dataset layer behind the latter imports pandas the first time (a noticeable cost in a
        process that had not, such as a cold command's follower) and adds nothing for files written
        whole with this schema."""
        schema = (
            CHANGE_SCHEMA
            if columns is None
            else pa.schema([CHANGE_SCHEMA.field(name) for name in columns])
        )
        files = self.sources()
        if not files:
            return schema.empty_table()
        tables = []
        for path in files:
            with pq.ParquetFile(path) as parquet:
                table = parquet.read(columns=schema.names)
            tables.append(table if table.schema.equals(schema) else table.cast(schema))
        return pa.concat_tables(tables)

    def iter_batches(self, columns: Sequence[str], batch_rows: int = 65_536) -> Iterator[pa.Table]:
        """The range's changes (only ``columns``) in batches of at most ``batch_rows``, file by
        file: a range of any size read in bounded memory (:mod:`..apply.partitioned_staging`)."""
        schema = pa.schema([CHANGE_SCHEMA.field(name) for name in columns])
        for path in self.sources():
            with pq.ParquetFile(path) as parquet:
                for batch in parquet.iter_batches(batch_size=batch_rows, columns=schema.names):
                    table = pa.Table.from_batches([batch])
                    yield table if table.schema.equals(schema) else table.cast(schema)

    def relation_versions(self) -> set[int]:
        """The relation versions (indexes into the manifest's ``relations``) the range's rows
        use. The manifest may list more: a range cut from a peek starts with every relation
        the peek had seen, and pgoutput sends a partition's own Relation message beside its
        root's when it publishes through the root (under a column list, narrowed like the
        root's), though every change names the root. Its manifest's record when it has one."""
        if self.manifest.used_relations is not None:
            return set(self.manifest.used_relations)
        used: set[int] = set()
        for batch in self.iter_batches(["relation_version"], batch_rows=1_048_576):
            used.update(pc.unique(batch.column("relation_version")).to_pylist())
        return used
