"""Control: what a catch-up does next, decided from the durable facts only
(:mod:`.next_step`), and the steps carried out (:mod:`.pipeline`: snapshot, receive, apply,
add a table, resync); one catch-up of a slot at a time (:mod:`.range_lock`); work a command
starts before its Dagster run exists (:mod:`.head_start`); ending a replication
(:mod:`.finish`); going on after the source failed over (:mod:`.failover`). Comparing source
and target is :mod:`..compare`'s.

Invariant kept here: Dagster's records are never consulted for what to do next; a re-run after
a crash anywhere converges from the slot, the store and the origin.
"""
