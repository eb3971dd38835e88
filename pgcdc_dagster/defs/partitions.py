"""LSN-range partitions: keys ``{start:016X}-{end:016X}``, registered in LSN order."""

from dagster import DagsterInstance, DynamicPartitionsDefinition

from ..engine.lsn import LsnRange

LSN_RANGES = "lsn_ranges"
lsn_ranges = DynamicPartitionsDefinition(name=LSN_RANGES)


def registered_ranges(instance: DagsterInstance) -> list[LsnRange]:
    """Every registered range in LSN order (keys sort like LSNs by construction)."""
    return [LsnRange.from_key(k) for k in sorted(instance.get_dynamic_partitions(LSN_RANGES))]
