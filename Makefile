# Every target builds what it needs on a fresh machine: Python's venv through apt when absent
# (and, as root, the OS account the throwaway clusters run as), then a virtualenv with the
# project installed, which brings PostgreSQL and Java from pip where the system has none.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export SPARK_LOCAL_IP ?= 127.0.0.1

.PHONY: test demo lint bench-receive bench-snapshot bench-apply system-deps venv clean

system-deps:
	@bash .ci/system-deps

$(STAMP): pyproject.toml
	@$(MAKE) --no-print-directory system-deps
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

venv: $(STAMP)

# Three workers by default, in a random order (docs/contributing.md); TEST_WORKERS=1 runs the suite
# in this process.
TEST_WORKERS ?= 3
TEST_ARGS = $(if $(filter-out 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadgroup)

test: $(STAMP)
	$(PY) -m pytest -q $(TEST_ARGS) pgcdc_dagster_tests

demo: $(STAMP)
	$(VENV)/bin/pgcdc demo

lint: $(STAMP)
	$(VENV)/bin/ruff check pgcdc_dagster pgcdc_dagster_tests benchmarks docs/hooks
	$(VENV)/bin/ruff format --check pgcdc_dagster pgcdc_dagster_tests benchmarks docs/hooks
	$(VENV)/bin/mypy pgcdc_dagster/engine
	$(VENV)/bin/lint-imports
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet --site-dir .pgcdc/site

bench-receive: $(STAMP)
	$(PY) benchmarks/receive.py

bench-snapshot: $(STAMP)
	$(PY) benchmarks/snapshot.py

bench-apply: $(STAMP)
	$(PY) benchmarks/apply.py

clean:
	rm -rf $(VENV) .pgcdc
