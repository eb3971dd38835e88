"""The compare: is the target equal to the source, and mending where it is not.

A table is compared chunk by chunk (:mod:`.chunks`) between a source and a target snapshot at
one consistent point taken while the replication goes on (:mod:`.consistent_pair`), by
:mod:`.verify`; the chunks that differ are replaced with the source's rows at that point
(:mod:`.repair`); a lost slot is recovered the same way at a new slot's point
(:mod:`.recover`).

Invariant kept here: every compare and every repair happens at one consistent point, with the
target standing still (under the range lock) wherever rows are replaced, so a repair never
races an apply.
"""
