"""pgoutput decoding from byte strings: every message kind, every tuple column kind."""

import struct

import pytest

from pgcdc_dagster.engine.decode.pgoutput import (
    PG_EPOCH_OFFSET_US,
    Begin,
    Commit,
    Delete,
    Insert,
    Message,
    Origin,
    PgOutputError,
    Relation,
    StreamAbort,
    StreamCommit,
    StreamStart,
    StreamStop,
    Truncate,
    Type,
    Update,
    decode,
    decode_stream_control,
)


def tuple_data(*cols):
    out = struct.pack("!H", len(cols))
    for col in cols:
        if col is None:
            out += b"n"
        elif col == "u":
            out += b"u"
        elif isinstance(col, tuple):  # ("b", raw)
            out += b"b" + struct.pack("!I", len(col[1])) + col[1]
        else:
            raw = col.encode()
            out += b"t" + struct.pack("!I", len(raw)) + raw
    return out


def test_begin_and_commit_carry_lsns_and_unix_microseconds():
    begin = decode(b"B" + struct.pack("!QqI", 0x1_0000_00A0, 1_000_000, 771))
    assert begin == Begin(
        final_lsn=0x1_0000_00A0, commit_ts_us=1_000_000 + PG_EPOCH_OFFSET_US, xid=771
    )
    commit = decode(b"C" + struct.pack("!BQQq", 0, 0x1_0000_00A0, 0x1_0000_00D0, 5))
    assert commit == Commit(0, 0x1_0000_00A0, 0x1_0000_00D0, 5 + PG_EPOCH_OFFSET_US)


def test_relation_with_empty_namespace_means_pg_catalog_and_key_flags():
    body = struct.pack("!I", 16385) + b"\x00" + b"Odd Table\x00" + b"f" + struct.pack("!H", 2)
    body += b"\x01" + b"id\x00" + struct.pack("!Ii", 23, -1)
    body += b"\x00" + b"select\x00" + struct.pack("!Ii", 25, -1)
    rel = decode(b"R" + body)
    assert isinstance(rel, Relation)
    assert (rel.namespace, rel.name, rel.replica_identity) == ("pg_catalog", "Odd Table", "f")
    assert [c.name for c in rel.columns] == ["id", "select"]
    assert rel.key_indexes == (0,)
    assert rel.columns[1].type_oid == 25


def test_type_message_for_user_defined_types():
    assert decode(b"Y" + struct.pack("!I", 90001) + b"public\x00mood\x00") == Type(
        90001, "public", "mood"
    )


def test_insert_with_null_unicode_and_binary_columns():
    msg = decode(
        b"I" + struct.pack("!I", 7) + b"N" + tuple_data("1", None, "héllo ✓", ("b", b"\x00\x01"))
    )
    assert isinstance(msg, Insert)
    assert msg.new.values == [b"1", None, "héllo ✓".encode(), b"\x00\x01"]
    assert msg.new.binary
    assert msg.new.unchanged_toast == ()


def test_update_with_unchanged_toast_and_no_old_tuple():
    msg = decode(b"U" + struct.pack("!I", 7) + b"N" + tuple_data("1", "u", "x"))
    assert isinstance(msg, Update)
    assert msg.old is None and msg.old_kind is None
    assert msg.new.values == [b"1", None, b"x"]
    assert msg.new.unchanged_toast == (1,)


@pytest.mark.parametrize("kind", ["K", "O"])
def test_update_with_old_key_or_full_old_row(kind):
    old = tuple_data("1", None) if kind == "K" else tuple_data("1", "u")
    msg = decode(b"U" + struct.pack("!I", 7) + kind.encode() + old + b"N" + tuple_data("2", "b"))
    assert msg.old_kind == kind
    assert msg.old.values == [b"1", None]
    assert msg.new.values == [b"2", b"b"]
    if kind == "O":
        assert msg.old.unchanged_toast == (1,)


def test_delete_with_key_tuple():
    msg = decode(b"D" + struct.pack("!I", 7) + b"K" + tuple_data("42", None))
    assert msg == Delete(7, "K", msg.old)
    assert msg.old.values == [b"42", None]


def test_truncate_flags_and_relations():
    msg = decode(b"T" + struct.pack("!IB", 2, 3) + struct.pack("!II", 10, 11))
    assert msg == Truncate(3, (10, 11))
    assert msg.cascade and msg.restart_identity


def test_origin_and_logical_message():
    assert decode(b"O" + struct.pack("!Q", 99) + b"pg_16400\x00") == Origin(99, "pg_16400")
    msg = decode(b"M" + struct.pack("!BQ", 1, 1234) + b"pfx\x00" + struct.pack("!I", 3) + b"abc")
    assert msg == Message(True, 1234, "pfx", b"abc")


@pytest.mark.parametrize(
    "data, match",
    [
        (b"", "empty"),
        (b"Z", "unknown pgoutput message type"),
        (b"S\x00\x00\x00\x01\x00", "streamed or two-phase"),
        (
            b"I" + struct.pack("!I", 7) + b"N" + struct.pack("!H", 1) + b"x",
            "unknown tuple column kind",
        ),
        (
            b"I" + struct.pack("!I", 7) + b"N" + struct.pack("!H", 2) + b"n",
            "truncated or malformed",
        ),
        (b"I" + struct.pack("!I", 7) + b"X", "new tuple marker"),
        (b"D" + struct.pack("!I", 7) + b"N", "old tuple marker"),
        (b"B\x00\x01", "truncated or malformed"),
    ],
)
def test_malformed_messages_raise_clear_errors(data, match):
    with pytest.raises(PgOutputError, match=match):
        decode(data)


def test_stream_control_messages():
    """Protocol 2's Stream Start, Stop, Commit and Abort (version 4's longer Abort too)."""
    assert decode_stream_control(b"S" + struct.pack("!IB", 77, 1)) == StreamStart(77, True)
    assert decode_stream_control(b"E") == StreamStop()
    commit = b"c" + struct.pack("!IBQQq", 77, 0, 0x10, 0x28, 5)
    assert decode_stream_control(commit) == StreamCommit(77, 0, 0x10, 0x28, 5 + PG_EPOCH_OFFSET_US)
    assert decode_stream_control(b"A" + struct.pack("!II", 77, 78)) == StreamAbort(77, 78)
    longer = b"A" + struct.pack("!IIQq", 77, 77, 0x30, 9)
    assert decode_stream_control(longer) == StreamAbort(77, 77)
    with pytest.raises(PgOutputError, match="truncated 'c'"):
        decode_stream_control(commit[:-1])
