"""The output store's errors: one base for every problem with the store, and the one a full
file system raises."""

from __future__ import annotations

import errno

from ..errors import PgcdcError


class StoreError(PgcdcError):
    """The output store is missing, unreadable or inconsistent."""


class StoreFullError(StoreError):
    """The store's file system has no room for the range being written; nothing of it was
    stored (its temporary folder goes with the writer), so freeing space and running the
    command again stores it whole."""


OUT_OF_SPACE = (errno.ENOSPC, errno.EDQUOT)
