"""What every step opens: the output store, the range lock, a source session bounded in time,
the session that reads the slot, and how the applies follow the source's DDL; and what Spark a
step may use. Below every other step module of :mod:`.pipeline`, which each imports."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeAlias, Union

from ..apply.ddl import SourceDdl
from ..connect import connect
from ..settings import ReplicationSettings, work_mem_setting
from ..store import open_store
from ..store.output_store import (
    OutputStore,
)
from .range_lock import (
    RangeLock,
    command_holder,
)
from .range_lock import range_lock as hold_range_lock

if TYPE_CHECKING:
    import psycopg
    from pyspark.sql import SparkSession


SparkProvider: TypeAlias = Union["SparkSession", Callable[[], "SparkSession"], None]
"""A SparkSession, a callable returning one (started lazily), or ``None`` (in-process only).
(``Union``: the alias is evaluated when the module loads, before pyspark is imported.)"""


def store_of(settings: ReplicationSettings) -> OutputStore:
    return open_store(settings.store_location)


@contextlib.contextmanager
def range_lock(settings: ReplicationSettings, holder: str | None = None) -> Iterator[RangeLock]:
    """One catch-up per slot at a time, whoever starts it (see :mod:`.range_lock`)."""
    holder = holder or command_holder()
    with hold_range_lock(settings.target_dsn, settings.slot, holder) as lock:
        yield lock


def source_session(
    settings: ReplicationSettings, timeout_s: int | None, **kwargs: Any
) -> psycopg.Connection[Any]:
    """A session on the source whose connect and every statement end within ``timeout_s``
    seconds (``None``: unbounded): the slot sensor's tick must not hang on a source that
    stopped answering."""
    if timeout_s is None:
        return connect(settings.source_dsn, role="source", **kwargs)
    conn = connect(settings.source_dsn, role="source", connect_timeout=timeout_s, **kwargs)
    conn.execute(f"SET statement_timeout = '{int(timeout_s)}s'")
    return conn


def decoding_session(settings: ReplicationSettings) -> psycopg.Connection[Any]:
    """A source session to read the slot with: its ``logical_decoding_work_mem`` is
    ``settings.decoding_work_mem`` (see there), set after connecting (a startup option an older
    server does not know would refuse the connection)."""
    conn = connect(settings.source_dsn, role="source")
    if settings.decoding_work_mem:
        conn.execute(
            "SELECT set_config('logical_decoding_work_mem', %s, false)",
            (work_mem_setting(settings.decoding_work_mem),),
        )
        conn.commit()
    return conn


def source_ddl(settings: ReplicationSettings) -> SourceDdl:
    """How the applies follow the source's DDL (:mod:`..apply.ddl`), from ``settings``."""
    return SourceDdl(
        settings.source_dsn,
        keep_dropped=settings.dropped_columns == "keep",
        auto_add=settings.ddl == "auto" and settings.auto_add,
    )
