"""Spark, the scale-out data plane: the one SparkSession (:mod:`.session`), a warm local Spark
Connect server (:mod:`.server`), and the executors made ready for the engine's tasks, checked
before any work is given to them (:mod:`.executors`, :mod:`.probe`).

Invariant kept here: Spark's tasks talk to PostgreSQL directly; control (LSNs, slots, origins,
transactions) stays with the driver.
"""
