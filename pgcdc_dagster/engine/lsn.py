"""The one LSN type of the project.

An LSN is a 64-bit byte position in the WAL; ``X/Y`` (two hex halves) is only its text form and
``{start:016X}-{end:016X}`` is the form of an LSN-range partition key. Arithmetic and comparison
always happen on the integer, never on text: ``0/10`` sorts after ``0/9`` as a number but not as
a string. Partition keys use 16 fixed upper-case hex digits per side precisely so that their
string order is their LSN order.
"""

from __future__ import annotations

import re
from typing import Any

from .errors import PgcdcError

_LSN_TEXT = re.compile(r"^([0-9A-Fa-f]{1,8})/([0-9A-Fa-f]{1,8})$")
_RANGE_KEY = re.compile(r"^([0-9A-F]{16})-([0-9A-F]{16})$")
_MAX = (1 << 64) - 1


class LsnError(PgcdcError, ValueError):
    """A text that is not an LSN or an LSN-range key."""


class Lsn(int):
    """A WAL position. An ``int`` subclass so it sorts, hashes and subtracts as the number it is.

    ``Lsn(a) - Lsn(b)`` is the distance in bytes (a plain ``int``); ``str(lsn)`` is ``X/Y``.
    """

    __slots__ = ()

    def __new__(cls, value: int | str | Lsn) -> Lsn:
        if isinstance(value, str):
            return cls.parse(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise LsnError(f"an LSN is an integer or 'X/Y' text, not {type(value).__name__}")
        if not 0 <= value <= _MAX:
            raise LsnError(f"LSN {value} is outside 0..2^64-1")
        return super().__new__(cls, value)

    @classmethod
    def parse(cls, text: str) -> Lsn:
        match = _LSN_TEXT.match(text.strip())
        if match is None:
            raise LsnError(
                f"{text!r} is not an LSN: expected two hex numbers of up to 8 digits as 'X/Y', "
                "for example '0/16B3748'"
            )
        high, low = (int(part, 16) for part in match.groups())
        return super().__new__(cls, (high << 32) | low)

    def __str__(self) -> str:
        return f"{int(self) >> 32:X}/{int(self) & 0xFFFFFFFF:X}"

    def __repr__(self) -> str:
        return f"Lsn('{self}')"

    def __sub__(self, other: Any) -> int:  # type: ignore[override]
        """Bytes between two positions (may be negative)."""
        return int(self) - int(other)

    def __add__(self, other: Any) -> Lsn:  # type: ignore[override]
        return Lsn(int(self) + int(other))

    @property
    def hex16(self) -> str:
        return f"{int(self):016X}"


def lsn_or_none(value: str | int | None) -> Lsn | None:
    """Convert a server value (``pg_lsn`` text, or NULL) to an :class:`Lsn`."""
    return None if value is None else Lsn(value)


class LsnRange:
    """The half-open-by-commit range ``(start, end]`` of one dynamic partition.

    A range holds exactly the transactions whose COMMIT ``end_lsn`` is greater than ``start``
    and at most ``end``. Because a COMMIT's ``end_lsn`` equals the next transaction's first
    LSN (the "collision"), a transaction that begins exactly at ``start`` belongs to this range
    and one that ends exactly at ``start`` belongs to the previous one; contiguous ranges
    (each start equal to the previous end) therefore hold every transaction exactly once.
    """

    __slots__ = ("end", "start")

    def __init__(self, start: Lsn | int | str, end: Lsn | int | str) -> None:
        self.start = Lsn(start)
        self.end = Lsn(end)
        if self.end < self.start:
            raise LsnError(f"range end {self.end} lies before its start {self.start}")

    @classmethod
    def from_key(cls, key: str) -> LsnRange:
        match = _RANGE_KEY.match(key)
        if match is None:
            raise LsnError(
                f"{key!r} is not an LSN-range key: expected 16 upper-case hex digits, '-', "
                "16 more, for example '0000000001000000-0000000001800000'"
            )
        return cls(int(match.group(1), 16), int(match.group(2), 16))

    @property
    def key(self) -> str:
        """The range's name in the store (its folder): fixed width, so names sort in LSN
        order."""
        return f"{self.start.hex16}-{self.end.hex16}"

    @property
    def partition_key(self) -> str:
        """The range's name as people read it (its Dagster partition): the ``X/Y`` form that
        PostgreSQL, ``pgcdc status`` and every metadata field show, so a search for an LSN
        finds it. Registered in chain order, so Dagster lists them in LSN order."""
        return f"{self.start}-{self.end}"

    @classmethod
    def from_partition_key(cls, key: str) -> LsnRange:
        """A range from its :attr:`partition_key`, or from its :attr:`key` (how partitions
        were named before: such partitions stay readable)."""
        start, sep, end = key.partition("-")
        if sep and "/" in start:
            try:
                return cls(Lsn.parse(start), Lsn.parse(end))
            except LsnError:
                pass
        else:
            return cls.from_key(key)
        raise LsnError(
            f"{key!r} is not an LSN-range partition key: expected two LSNs joined by '-', "
            "for example '0/1000000-0/1800000'"
        )

    def holds_commit(self, end_lsn: int) -> bool:
        """Whether a transaction whose COMMIT ends at ``end_lsn`` belongs to this range."""
        return self.start < end_lsn <= self.end

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LsnRange) and (self.start, self.end) == (other.start, other.end)

    def __hash__(self) -> int:
        return hash((self.start, self.end))

    def __repr__(self) -> str:
        return f"LsnRange({self.start}, {self.end})"
