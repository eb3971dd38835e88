"""The vectorised batch decoder agrees with the scalar reference decoder, message by message."""

import random
import struct

import numpy as np
import pyarrow as pa
import pytest

from pgcdc_dagster.engine.decode.pgoutput import (
    Begin,
    Commit,
    Delete,
    Insert,
    PgOutputError,
    Update,
    decode,
)
from pgcdc_dagster.engine.decode.pgoutput_batch import (
    MessageBatch,
    decode_begin_commit,
    decode_changes,
    gather_values,
    one_byte_strings,
    text_lists,
    without_stream_xids,
)


def random_tuple(rng: random.Random, ncols: int) -> bytes:
    out = struct.pack("!H", ncols)
    for _ in range(ncols):
        kind = rng.choice("ttttnu")
        if kind == "t":
            raw = "".join(
                rng.choice("ab é漢\t\n\\'\"0") for _ in range(rng.randrange(0, 12))
            ).encode()
            out += b"t" + struct.pack("!I", len(raw)) + raw
        else:
            out += kind.encode()
    return out


def random_messages(seed: int, n: int = 400) -> list[bytes]:
    rng = random.Random(seed)
    messages = []
    for _ in range(n):
        kind = rng.choice("BCIUUDD")
        ncols = rng.randrange(1, 7)
        relid = struct.pack("!I", rng.randrange(1, 2**32))
        if kind == "B":
            messages.append(
                b"B"
                + struct.pack(
                    "!QqI", rng.randrange(2**40), rng.randrange(2**40), rng.randrange(2**32)
                )
            )
        elif kind == "C":
            messages.append(
                b"C"
                + struct.pack(
                    "!BQQq", 0, rng.randrange(2**40), rng.randrange(2**40), rng.randrange(2**40)
                )
            )
        elif kind == "I":
            messages.append(b"I" + relid + b"N" + random_tuple(rng, ncols))
        elif kind == "U":
            old = rng.choice(["", "K", "O"])
            body = (old.encode() + random_tuple(rng, ncols)) if old else b""
            messages.append(b"U" + relid + body + b"N" + random_tuple(rng, ncols))
        else:
            messages.append(b"D" + relid + rng.choice([b"K", b"O"]) + random_tuple(rng, ncols))
    return messages


@pytest.mark.parametrize("seed", range(5))
def test_batch_decoder_matches_scalar_decoder(seed):
    messages = random_messages(seed)
    batch = MessageBatch.from_messages(messages)
    changes = decode_changes(batch)
    new_rows = text_lists(
        batch,
        changes.new.starts,
        changes.new.lengths,
        changes.new.kinds,
        changes.new.ncols,
        row_valid=changes.has_new,
    ).to_pylist()
    key_rows = text_lists(
        batch,
        changes.key_source.starts,
        changes.key_source.lengths,
        changes.key_source.kinds,
        changes.key_source.ncols,
    ).to_pylist()
    ctl = decode_begin_commit(batch)
    ctl_at = {p: i for i, p in enumerate(ctl.index.tolist())}
    change_at = {p: i for i, p in enumerate(changes.index.tolist())}
    for position, data in enumerate(messages):
        msg = decode(data)
        if isinstance(msg, Begin):
            i = ctl_at[position]
            assert (ctl.final_or_commit_lsn[i], ctl.ts_us[i], ctl.xid[i]) == (
                msg.final_lsn,
                msg.commit_ts_us,
                msg.xid,
            )
        elif isinstance(msg, Commit):
            i = ctl_at[position]
            assert (ctl.final_or_commit_lsn[i], ctl.end_lsn[i], ctl.ts_us[i]) == (
                msg.commit_lsn,
                msg.end_lsn,
                msg.commit_ts_us,
            )
        else:
            i = change_at[position]
            assert changes.relid[i] == msg.relid
            text = lambda t: [None if v is None else v.decode() for v in t.values]  # noqa: E731
            if isinstance(msg, Insert):
                assert new_rows[i] == text(msg.new) and key_rows[i] == text(msg.new)
            elif isinstance(msg, Update):
                assert new_rows[i] == text(msg.new)
                assert key_rows[i] == text(msg.old or msg.new)
                assert bool(changes.has_old[i]) == (msg.old is not None)
            elif isinstance(msg, Delete):
                assert new_rows[i] is None and key_rows[i] == text(msg.old)
            unchanged_new = set((changes.new.kinds[i] == ord("u")).nonzero()[0].tolist())
            expected = set(msg.new.unchanged_toast) if not isinstance(msg, Delete) else set()
            assert unchanged_new == expected


@pytest.mark.parametrize(
    "message, match",
    [
        (b"I\x00\x00\x00\x07N\x00\x01x", "unknown tuple column kind"),
        (b"I\x00\x00\x00\x07N\x00\x01t\x00\x00\x00\x05ab", "does not end with the message"),
        (b"I\x00\x00\x00\x07X\x00\x00", "new tuple marker"),
        (b"D\x00\x00\x00\x07N\x00\x00", "old tuple marker"),
        (b"B\x00", "Begin/Commit message length"),
        (b"I\x00\x00\x00\x07N\x00\x01t\x00\x00\x00\x01\xff", "not valid UTF-8"),
    ],
)
def test_batch_decoder_rejects_malformed_messages(message, match):
    batch = MessageBatch.from_messages([message])
    with pytest.raises(PgOutputError, match=match):
        changes = decode_changes(batch)
        decode_begin_commit(batch)
        text_lists(
            batch, changes.new.starts, changes.new.lengths, changes.new.kinds, changes.new.ncols
        )


@pytest.mark.parametrize("shuffled", [False, True])
def test_gathered_values_are_the_slices_in_order_whatever_their_layout(shuffled: bool) -> None:
    """The one-copy gather (values in buffer order, empty values placed anywhere) and its
    byte-gather fallback (values out of buffer order) both give each value's bytes, in order."""
    rng = np.random.default_rng(7)
    for _ in range(500):
        n = int(rng.integers(1, 40))
        lengths = rng.integers(0, 6, n) * (rng.random(n) < 0.7)
        gaps = rng.integers(0, 6, n)
        starts = np.cumsum(gaps) + np.concatenate(([0], np.cumsum(lengths)[:-1]))
        starts = np.where(lengths == 0, rng.integers(0, 3, n), starts)  # as decoders leave them
        if shuffled:
            order = rng.permutation(n)
            starts, lengths = starts[order], lengths[order]
        buf = rng.integers(0, 256, int(starts.max() + lengths.max() + 16)).astype(np.uint8)
        offsets, data = gather_values(buf, starts.astype(np.int64), lengths.astype(np.int64))
        expected = b"".join(bytes(buf[s : s + n]) for s, n in zip(starts, lengths, strict=True))
        assert data.to_pybytes()[: int(offsets[-1])] == expected
        assert np.diff(offsets).tolist() == lengths.tolist()


def test_one_byte_strings_are_the_kinds_as_text_empty_included():
    codes = np.frombuffer(b"IUDUI", np.uint8)
    assert one_byte_strings(codes).to_pylist() == ["I", "U", "D", "U", "I"]
    assert one_byte_strings(codes[1:4]).to_pylist() == ["U", "D", "U"]  # a view, not a copy
    empty = one_byte_strings(np.zeros(0, np.uint8))
    assert empty.type == pa.string() and len(empty) == 0
    empty.validate(full=True)


@pytest.mark.parametrize("seed", range(3))
def test_stream_block_messages_lose_their_xid_and_read_as_protocol_1(seed):
    """Inside a stream block each change (and Relation, Type, Truncate, Message) carries its
    (sub)transaction's xid after the kind byte; Origin does not. Without it, every message is
    byte for byte the protocol 1 message, and the xids come out in order."""
    rng = random.Random(seed)
    plain = [m for m in random_messages(seed) if m[:1] in (b"I", b"U", b"D")]
    plain.insert(3, b"O" + struct.pack("!Q", 7) + b"origin\x00")
    plain.insert(5, b"R" + struct.pack("!I", 9) + b"public\x00t\x00d" + struct.pack("!H", 0))
    xids = [-1 if m[:1] == b"O" else rng.randrange(2**32) for m in plain]
    streamed = [
        m if x < 0 else m[:1] + struct.pack("!I", x) + m[1:]
        for m, x in zip(plain, xids, strict=True)
    ]
    batch, got = without_stream_xids(MessageBatch.from_messages(streamed))
    assert got.tolist() == xids
    assert [
        batch.buf[s:e].tobytes() for s, e in zip(batch.starts, batch.ends, strict=True)
    ] == plain
    assert batch.kinds.tobytes() == b"".join(m[:1] for m in plain)
