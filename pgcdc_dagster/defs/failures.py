"""Engine errors as Dagster sees them: the one-line problems a user must act on, and the
``Failure`` a step raises for them."""

from dagster import Failure

from ..engine.errors import PgcdcError

ENGINE_ERRORS: tuple[type[Exception], ...] = (PgcdcError,)
"""Problems a user must act on: their message is one line naming the fix."""


def as_failure(exc: Exception) -> Failure:
    return Failure(description=str(exc), metadata={"error": type(exc).__name__})
