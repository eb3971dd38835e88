import pytest

from pgcdc_dagster.engine.lsn import Lsn, LsnError, LsnRange


def test_parse_and_format_round_trip():
    for text in ["0/0", "0/16B3748", "1/0", "FFFFFFFF/FFFFFFFF", "A/BC"]:
        assert str(Lsn(text)) == text
    assert int(Lsn("1/10")) == (1 << 32) + 16
    assert Lsn("0/ab") == Lsn("0/AB")


def test_compares_and_subtracts_as_numbers():
    assert Lsn("0/10") > Lsn("0/9")
    assert Lsn("1/0") - Lsn("0/FFFFFFFF") == 1
    assert Lsn("0/100") + 16 == Lsn("0/110")
    assert sorted([Lsn("1/0"), Lsn("0/FF"), Lsn("0/100")]) == [
        Lsn("0/FF"),
        Lsn("0/100"),
        Lsn("1/0"),
    ]


@pytest.mark.parametrize(
    "bad", ["", "0", "0/", "/1", "0/1/2", "G/1", "123456789/0", "0x1/2", " / "]
)
def test_rejects_malformed_text(bad):
    with pytest.raises(LsnError, match="not an LSN"):
        Lsn(bad)


def test_rejects_out_of_range_integers():
    with pytest.raises(LsnError):
        Lsn(-1)
    with pytest.raises(LsnError):
        Lsn(1 << 64)


def test_range_key_sorts_like_lsns():
    ranges = [LsnRange("0/9", "0/10"), LsnRange("0/10", "1/0"), LsnRange("1/0", "A/0")]
    keys = [r.key for r in ranges]
    assert keys == sorted(keys)
    assert keys[0] == "0000000000000009-0000000000000010"
    assert all(LsnRange.from_key(k) == r for k, r in zip(keys, ranges, strict=True))


def test_partition_key_is_the_lsn_text_and_reads_the_store_form_too():
    rng = LsnRange("0/2469D70", "1/2473D50")
    assert rng.partition_key == "0/2469D70-1/2473D50"
    assert LsnRange.from_partition_key(rng.partition_key) == rng
    assert LsnRange.from_partition_key(rng.key) == rng  # partitions named the earlier way
    with pytest.raises(LsnError, match="not an LSN-range partition key"):
        LsnRange.from_partition_key("0/2469D70-nowhere")


@pytest.mark.parametrize("bad", ["0-1", "000000000000000a-0000000000000010", "x" * 33])
def test_range_key_rejects_malformed(bad):
    with pytest.raises(LsnError, match="not an LSN-range key"):
        LsnRange.from_key(bad)


def test_range_holds_commits_by_end_lsn_with_the_collision():
    r = LsnRange("0/100", "0/200")
    assert not r.holds_commit(0x100)  # ended exactly at start: previous range
    assert r.holds_commit(0x101)
    assert r.holds_commit(0x200)  # ends exactly at endpos: this range
    assert not r.holds_commit(0x201)


def test_range_end_before_start_is_rejected():
    with pytest.raises(LsnError, match="before its start"):
        LsnRange("0/200", "0/100")
