"""Helpers the tests share: SQL on a test database, processes, stores written by hand,
replication in this process, Spark and standby clusters. Fixtures stay in conftest.py."""
