"""The store's folders on disk: which bucket a range lies in, how folders are listed, made
durable and removed. One place for the layout's rules (see :mod:`.output_store`)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from ..lsn import Lsn, LsnRange

CHAIN = "_CHAIN.json"

CHAIN_LOCK = ".chain.lock"

PRUNED_PREFIX = ".pruned-"

RANGE_KEY_LENGTH = 33
"""``<16 hex digits>-<16 hex digits>``: the name of a range's folder."""


def bucket_names(start: Lsn) -> tuple[str, str]:
    """The two folders a range starting at ``start`` is stored under: its 4 GiB of WAL (the
    ``X`` of ``X/Y``) and its 16 MiB within those, in fixed-width upper-case hex, so names sort
    as the LSNs do."""
    digits = start.hex16
    return digits[:8], digits[8:10]


def listed(folder: Path, reverse: bool) -> list[str]:
    """The visible subfolders of ``folder``, sorted (none when it is gone: a bucket a prune
    emptied and removed)."""
    try:
        with os.scandir(folder) as entries:
            names = [e.name for e in entries if not e.name.startswith(".") and e.is_dir()]
    except FileNotFoundError:
        return []
    return sorted(names, reverse=reverse)


def ending_at(walked: Iterator[LsnRange], end: Lsn) -> LsnRange | None:
    """The first range of a walk back that ends at ``end``; ``None`` once one ends before it
    (ranges ending after it, of another chain, are passed)."""
    for rng in walked:
        if rng.end == end:
            return rng
        if rng.end < end:
            return None
    return None


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_folder(path: str) -> int:
    """Delete a range's folder (files only, no subfolders); returns the Parquet bytes it held.
    Plain ``os`` calls: a prune removes thousands of ranges, and the kernel's unlinks and
    rmdir are most of what each costs."""
    removed = 0
    try:
        with os.scandir(path) as entries:
            for entry in entries:
                if entry.name.startswith("part-"):
                    removed += entry.stat().st_size
                os.unlink(entry.path)
        os.rmdir(path)
    except FileNotFoundError:
        pass  # another prune got there first
    return removed
