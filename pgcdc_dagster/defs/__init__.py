"""The Dagster layer: assets, jobs, the slot sensor, checks, resources and metadata that turn
the engine (:mod:`pgcdc_dagster.engine`) into software-defined assets. Assembled by
:mod:`pgcdc_dagster.definitions`; nothing here decides anything about LSNs."""
