"""The replication engine: plain Python over PostgreSQL, Arrow and Spark, no Dagster.

Its folders are the stages a change passes through, each depending only on those below it
(``make lint`` checks it, see ``docs/architecture.md``)::

    follow      a long-lived catch-up: receive and apply range after range
    control     what to do next, and doing it: plan, catch up, add a table, finish, verify
    snapshot    the base copy at the slot's exported snapshot, and tables added later
    target      the apply: compaction's net rows staged and merged, the origin, DDL
    source      the slot, the publication, and reading the slot (peek or stream)
    compaction  the net effect of a range per table
    decode      pgoutput bytes into whole transactions of Arrow rows
    store       the decoded ranges on disk, their manifests, the chain, retention
    spark       the SparkSession and its executors

Progress lives in three durable places, each owned by one module and asked by the rest:
:mod:`.source.slot` (what the source may discard), :mod:`.store.output_store` (what each LSN
range holds), :mod:`.apply.origin` (what the target has applied).
:mod:`.control.next_step` decides what to do next from those facts alone;
:mod:`.control.pipeline` carries the steps out.
"""
