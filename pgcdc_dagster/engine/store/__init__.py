"""The decoded output store: one Parquet folder per LSN range with its manifest, the chain of
ranges from the base snapshot on (:mod:`.output_store`; on an object store,
:mod:`.object_store`), and retention (:mod:`.retention`).

Invariant kept here: a range exists only whole (written, synced, then renamed into place; on an
object store, its manifest created last), and its manifest is the one record of what it holds;
a range is removed only once applied.
"""

from __future__ import annotations

from pathlib import Path

from ..store_location import StoreLocation, parse_location
from .object_store import ObjectOutputStore
from .output_store import OutputStore


def open_store(where: StoreLocation | str | Path) -> OutputStore:
    """The output store at ``where`` (a location, ``PGCDC_STORE``'s value, or a local
    folder): on a disk, or on an object store."""
    location = where if isinstance(where, StoreLocation) else parse_location(str(where))
    if location.path is not None:
        return OutputStore(location.path)
    return ObjectOutputStore(location)
