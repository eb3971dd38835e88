"""The replication engine: plain Python over PostgreSQL, Arrow and Spark, no Dagster.

Progress lives in three durable places, each owned by one module and asked by the rest:
:mod:`.slot` (what the source may discard), :mod:`.store` (what each LSN range holds),
:mod:`.origin` (what the target has applied). :mod:`.next_step` decides what to do next from
those facts alone; :mod:`.pipeline` carries the steps out (receive, apply, snapshot).
"""
