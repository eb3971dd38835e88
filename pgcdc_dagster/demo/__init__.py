"""The embedded default behind ``make demo`` (:mod:`.run`), and the throwaway local PostgreSQL
clusters it, the tests and the benchmarks run on (:mod:`.local_cluster`). Not used by the
product's own code paths."""
