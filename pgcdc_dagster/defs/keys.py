"""The asset keys of the project, in one place: assets, the follow job, checks and the sensor
all name the same assets."""

from __future__ import annotations

import re
import zlib

from dagster import AssetKey

from ..engine.identifiers import TableName

SLOT_KEY = AssetKey("replication_slot")
BASE_SNAPSHOT_KEY = AssetKey("base_snapshot")
DECODED_CHANGES_KEY = AssetKey("decoded_changes")
CUTOVER_KEY = AssetKey("cutover")

_KEY_PART = re.compile(r"[A-Za-z0-9_]+")
_KEY_UNSAFE = re.compile(r"[^A-Za-z0-9_]")


def key_part(name: str) -> str:
    """A SQL name as an asset-key part. Dagster allows ``[A-Za-z0-9_]`` only: other names are
    folded to that set, with a short hash of the real name so two names never collide (the
    real name is in each asset's description)."""
    if name and _KEY_PART.fullmatch(name):
        return name
    return f"{_KEY_UNSAFE.sub('_', name)}_{zlib.crc32(name.encode()):08x}"


def source_key(table: TableName) -> AssetKey:
    return AssetKey(["source", key_part(table.schema), key_part(table.name)])


def target_key(table: TableName) -> AssetKey:
    return AssetKey(["target", key_part(table.schema), key_part(table.name)])
