"""The target server: a stored range applied exactly once (:mod:`.transaction`): its net rows staged
(:mod:`.staging`; by partitions in bounded memory, :mod:`.partitioned_staging`; by Spark's
workers, :mod:`.spark_staging` and :mod:`.shared_staging`) and merged; the source's DDL
followed (:mod:`.ddl`); sequences copied (:mod:`.sequences`).

Invariant kept here: a range (or a batch of ranges) is applied in one transaction that also
records its progress in the replication origin (:mod:`.origin`), so a crash leaves all of it
or none.
"""
