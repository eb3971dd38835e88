"""The compaction kernel from Arrow tables built here: a range's changes netted per key, moves
followed, unsent TOAST values found, whatever order the changes come in (no database: the
in-process and Spark paths on real ranges are compared in ``apply/test_apply.py``)."""

from __future__ import annotations

import pyarrow as pa

from pgcdc_dagster.engine.compaction import (
    TableRelation,
    compact_arrow,
    compact_table,
    relations_of,
)
from pgcdc_dagster.engine.identifiers import TableName
from pgcdc_dagster.engine.store.output_store import CHANGE_SCHEMA


def _changes(rows: list[tuple]) -> pa.Table:
    """CHANGE_SCHEMA rows of ``public.t`` (id key, v, big), one transaction per change."""
    columns: dict[str, list] = {f.name: [] for f in CHANGE_SCHEMA}
    for i, (action, key, new_row, unchanged) in enumerate(rows):
        values = {
            "commit_end_lsn": 100 + i, "commit_lsn": 99 + i, "lsn": 98 + i, "xid": i,
            "commit_ts": 0, "seq": 0, "action": action, "schema_name": "public",
            "table_name": "t", "relation_version": 0, "key": key, "new_row": new_row,
            "unchanged_toast": unchanged, "flags": 2 if action == "T" else 0,
        }  # fmt: skip
        for name, value in values.items():
            columns[name].append(value)
    return pa.table(columns, schema=CHANGE_SCHEMA)


def _relation_t(replica_identity: str = "d") -> TableRelation:
    """``public.t`` as :func:`_changes` writes it: id (the key unless identity FULL), v, big."""
    full = replica_identity == "f"
    (relation,) = relations_of(
        [
            {
                "relid": 1, "schema": "public", "table": "t",
                "replica_identity": replica_identity,
                "columns": [
                    {"name": "id", "type_oid": 23, "typmod": -1, "key": True},
                    {"name": "v", "type_oid": 25, "typmod": -1, "key": full},
                    {"name": "big", "type_oid": 25, "typmod": -1, "key": full},
                ],
            }
        ]
    ).values()  # fmt: skip
    return relation


def test_kernel_follows_moves_back_to_the_key_holding_unsent_values():
    relation = _relation_t()
    rows = [
        ("I", ["9"], ["9", "gone", "x"], None),
        ("T", None, None, None),  # everything above is discarded
        ("U", ["2"], ["3", "a", None], ["big"]),  # move 2 -> 3: big is at 2 on the target
        ("U", ["3"], ["4", "b", None], ["big"]),  # and on to 4: still at 2
        ("I", ["5"], ["5", "c", "B5"], None),
        ("U", ["5"], ["6", "d", None], ["big"]),  # big sent earlier in the range
        ("U", ["7"], ["7", "e", None], ["big"]),  # big stays as the target has it
    ]
    net = compact_table(_changes(rows), relation)
    assert (net.changes, net.truncates, net.truncate, net.truncate_flags) == (7, 1, True, 2)
    summary = [(r["op"], r["k0"], r["c1"], r["c2"], r["u2"], r["f0"]) for r in net.sorted_rows()]
    assert summary == [
        ("D", "2", None, None, False, None),
        ("D", "3", None, None, False, None),
        ("D", "5", None, None, False, None),
        ("U", "4", "b", None, True, "2"),
        ("U", "6", "d", "B5", False, None),
        ("U", "7", "e", None, True, None),
    ]


def test_kernel_gives_the_same_net_rows_whatever_order_the_changes_come_in():
    """A range is stored in commit order and the kernel then skips its sort; rows in any other
    order (Spark's partitions) must still be sorted first, for both kinds of table."""
    rows = [
        ("I", ["1", "a", "x"], ["1", "a", "x"], None),  # an insert's key: its own values
        ("I", ["2", "b", "y"], ["2", "b", "y"], None),
        ("U", ["1", "a", None], ["1", "c", None], ["big"]),  # old rows in full: under FULL
        ("D", ["2", "b", "y"], None, None),  # all are sent, by default the key leads
        ("I", ["2", "d", "z"], ["2", "d", "z"], None),
        ("U", ["2", "d", "z"], ["3", "e", "w"], None),
    ]
    changes = _changes(rows)
    shuffled = changes.take(pa.array([4, 0, 5, 2, 1, 3]))
    for relation in (_relation_t("d"), _relation_t("f")):
        in_order = compact_table(changes, relation)
        assert compact_table(shuffled, relation).sorted_rows() == in_order.sorted_rows()
        assert compact_table(changes.slice(0, 1), relation).net.num_rows == 1
    full = compact_table(shuffled, _relation_t("f"))
    assert [r["op"] for r in full.sorted_rows()] == ["I", "I", "U", "D", "I", "U"]


def test_a_range_applied_in_part_is_compacted_from_the_origin_on():
    """Transactions whose COMMIT ends at or before the origin are left out; when none does,
    every change is kept (without the filter's copy)."""
    changes = _changes([("I", None, [str(i), "v", None], None) for i in range(6)])
    relation = _relation_t("f")
    table = TableName("public", "t")
    whole = compact_arrow(changes, {table: relation}, after_lsn=99)[table]
    assert [r["c0"] for r in whole.sorted_rows()] == ["0", "1", "2", "3", "4", "5"]
    rest = compact_arrow(changes, {table: relation}, after_lsn=102)[table]  # ends 100..105
    assert [r["c0"] for r in rest.sorted_rows()] == ["3", "4", "5"]
    assert compact_arrow(changes, {table: relation}, after_lsn=105) == {}
