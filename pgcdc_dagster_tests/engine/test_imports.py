"""The engine knows nothing of Dagster: importing every engine module loads no Dagster module.

The modules are imported one after the other in a fresh interpreter that checks, after each,
whether any ``dagster`` module has appeared: the first one that brings it in is named.
"""

import pkgutil
import subprocess
import sys

import pgcdc_dagster.engine as engine

MODULES = sorted(
    info.name for info in pkgutil.walk_packages(engine.__path__, prefix=f"{engine.__name__}.")
)

PROBE = """
import importlib, sys
for module in sys.argv[1:]:
    importlib.import_module(module)
    leaked = sorted(m for m in sys.modules if m.split(".")[0].startswith("dagster"))
    if leaked:
        print(module, "imports", ", ".join(leaked[:3]))
        break
"""


def test_no_engine_module_imports_dagster():
    assert "pgcdc_dagster.engine.apply.transaction" in MODULES
    assert "pgcdc_dagster.engine.snapshot.copy" in MODULES
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *MODULES], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""
