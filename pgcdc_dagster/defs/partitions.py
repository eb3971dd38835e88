"""LSN-range partitions: keys ``X/Y-X/Y`` (:attr:`~..engine.lsn.LsnRange.partition_key`),
registered in LSN order."""

from dagster import DagsterInstance, DynamicPartitionsDefinition

from ..engine.lsn import LsnRange

LSN_RANGES = "lsn_ranges"
lsn_ranges = DynamicPartitionsDefinition(name=LSN_RANGES)


def registered_ranges(instance: DagsterInstance) -> list[LsnRange]:
    """Every registered range in LSN order."""
    ranges = map(LsnRange.from_partition_key, instance.get_dynamic_partitions(LSN_RANGES))
    return sorted(ranges, key=lambda r: (r.start, r.end))
