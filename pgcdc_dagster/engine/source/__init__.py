"""The source server: its replication slot, the publication that chooses what the slot sends,
the checks before a slot is created, and reading the slot into the store, by peek
(:mod:`.peek`) or by the streaming protocol (:mod:`.stream` over :mod:`.walsender`).

Invariant kept here: the slot's confirmed position advances only to a point before which every
transaction's COMMIT belongs to a range the store holds durably; never inside a COMMIT record,
never backwards, and on an idle or filtered source too.
"""
