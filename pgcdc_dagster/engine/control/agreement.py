"""Do the tables the replication copied and those the publication sends agree? A table no longer
sent, one sent without having been added, an add left unfinished, a row filter or column list
changed since a table was copied: each named with its fix (the ``replicated_tables`` check,
``pgcdc status``, ``pgcdc verify``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..connect import connect
from ..identifiers import TableName
from ..settings import ReplicationSettings
from ..store.output_store import (
    Chain,
    StoreError,
)
from .range_lock import (
    tables_changing,
    who_holds,
)

if TYPE_CHECKING:
    pass


from .positions import replicated_tables
from .sessions import source_session, store_of


def adding_not_done(chain: Chain | None) -> str | None:
    """While tables are being added, one line saying why the target is not a whole copy of the
    source (the applies hold their changes back) and what to run; ``None`` otherwise. Ending
    the replication on it (a cutover, a finish) would leave the target without them."""
    if chain is None or not chain.adding:
        return None
    names = " ".join(str(t) for t in chain.adding)
    if set(chain.adding) <= set(chain.resyncing):
        return (
            f"resyncing {names} is not done, so their changes are held back and the target is "
            f"not a whole copy: let pgcdc resync {names} (or the next catch-up) finish first"
        )
    return (
        f"adding {names} is not done, so their changes are held back and the target is not a "
        f"whole copy: let pgcdc add-table {names} finish (run it again if it was killed) first"
    )


def refuse_while_adding(settings: ReplicationSettings) -> None:
    """Raise :class:`~..store.output_store.StoreError` while tables are being added
    (:func:`adding_not_done`; a cutover also compares only the tables its code location listed)."""
    if (refusal := adding_not_done(store_of(settings).chain())) is not None:
        raise StoreError(refusal)


def no_longer_published(
    settings: ReplicationSettings, published: Sequence[TableName] | None = None
) -> list[TableName]:
    """The tables the chain replicates (:attr:`~..store.output_store.Chain.tables`) that the
    publication no longer sends (``published``, when the caller has read it) and the target still
    holds: their copy there is no longer kept in sync. A table dropped and created again on the
    source is one (a publication lists tables by identity, so the new one is not in it), as
    is one dropped from the publication."""
    from ..catalog import table_columns

    chain = store_of(settings).chain()
    if chain is None or not chain.tables:
        return []
    sent = set(replicated_tables(settings) if published is None else published)
    gone = [t for t in chain.tables if t not in sent]
    if not gone:
        return []
    with connect(settings.target_dsn, role="target", autocommit=True) as conn:
        on_target = set(table_columns(conn, gone))
    return [t for t in gone if t in on_target]


@dataclass(frozen=True)
class TablesAgreement:
    """Where the tables the chain replicates and those the publication sends part ways (each
    empty when they agree): what a user must act on, or the target silently drifts."""

    no_longer_published: tuple[TableName, ...] = ()
    """Replicated, still on the target, no longer sent (:func:`no_longer_published`): their
    copy is no longer kept in sync, and nothing fails (as with native replication)."""
    not_added: tuple[TableName, ...] = ()
    """Sent, not replicated (added to the publication by hand, never copied): every apply
    of a range that changes one fails until ``pgcdc add-table`` copies it."""
    adding: tuple[TableName, ...] = ()
    """Tables being added (:attr:`~..store.output_store.Chain.adding`): the applies hold their
    changes back until their add is done."""
    adding_by: str = ""
    """Who is adding them (the holder of :func:`~.range_lock.tables_lock`); empty: nobody, an
    add ended before finishing and must run again."""
    reshaped: tuple[Reshaped, ...] = ()
    """Replicated tables the publication sends more or other rows of than when they were
    copied: nothing copies what the change let in (as with native replication)."""

    @property
    def agree(self) -> bool:
        """Nothing to act on: an add under way is not a problem, one left unfinished is."""
        unfinished = self.adding and not self.adding_by
        return not (self.no_longer_published or self.not_added or unfinished or self.reshaped)

    def reshaped_lines(self) -> list[str]:
        """One line a table the publication sends otherwise than at its copy, with the fix."""
        return [r.line() for r in self.reshaped]

    def adding_line(self) -> str | None:
        """One line on the tables being added, with the fix when an add did not finish."""
        if not self.adding:
            return None
        names = " ".join(str(t) for t in self.adding)
        if self.adding_by:
            return (
                f"adding {names} ({self.adding_by}): their changes are held back until its "
                "copy is done; the other tables' are applied"
            )
        return (
            f"adding {names} did not finish, so their changes are held back (the other "
            f"tables' are applied): run pgcdc add-table {names} again"
        )


@dataclass(frozen=True)
class Reshaped:
    """A replicated table whose row filter changed since its copy (:attr:`~.store.Chain.
    row_filters`), or whose column list now sends columns it left out then
    (:attr:`~..store.output_store.Chain.unpublished`). The stream follows the publication from the
    change on; a column list that leaves out more stops the apply
    (:mod:`..apply.transaction`), this does not."""

    table: TableName
    filter_then: str | None
    filter_now: str | None
    columns_now_sent: tuple[str, ...] = ()

    def line(self) -> str:
        what = []
        if self.filter_now != self.filter_then:
            what.append(
                f"the publication's row filter is {_filter_text(self.filter_now)}, it was "
                f"{_filter_text(self.filter_then)} when the table was copied, so the target "
                "lacks the rows only the new one passes and keeps those only the old one did"
            )
        if self.columns_now_sent:
            names = ", ".join(self.columns_now_sent)
            what.append(
                f"the publication now sends column(s) {names}, left out when the table was "
                "copied, so they are empty in the rows copied then"
            )
        return (
            f"{self.table}: {'; and '.join(what)} (as with native replication): pgcdc resync "
            f"{self.table} copies it again as now published"
        )


def _filter_text(row_filter: str | None) -> str:
    return "none" if row_filter is None else f"WHERE {row_filter}"


def tables_agreement(
    settings: ReplicationSettings, *, timeout_s: int | None = None
) -> TablesAgreement:
    """How the chain's tables and the publication's agree (one source session, within
    ``timeout_s`` when given, and one of the target when a replicated table is no longer sent
    or one is being added). Nothing to say before a base snapshot completes, nor of a chain
    that predates its record of tables."""
    from ..published_columns import published_shapes
    from ..source.publication import publication_tables

    chain = store_of(settings).chain()
    if chain is None or not chain.complete or not chain.tables:
        return TablesAgreement()
    with source_session(settings, timeout_s, autocommit=True) as conn:
        published = publication_tables(conn, settings.publication)
        sent = set(published)
        compared = [t for t in chain.row_filters if t in sent and t not in chain.adding]
        shapes = published_shapes(conn, settings.publication, compared, whole=True)
    reshaped = []
    for table in compared:
        shape, then = shapes.get(table), chain.row_filters[table]
        now = shape.row_filter if shape else then  # gone since read: no_longer_published
        sent_now = [c for c in chain.unpublished.get(table, ()) if shape and c in shape.columns]
        if now != then or sent_now:
            reshaped.append(Reshaped(table, then, now, tuple(sent_now)))
    wanted = set(settings.tables) if settings.tables else None
    replicated = {*chain.tables, *chain.adding}
    adders = tables_changing(settings.target_dsn, settings.slot) if chain.adding else []
    adding_by = who_holds(adders) if adders else ""
    return TablesAgreement(
        adding_by=adding_by,
        no_longer_published=tuple(no_longer_published(settings, published)),
        not_added=tuple(
            t for t in published if t not in replicated and (wanted is None or t in wanted)
        ),
        adding=chain.adding,
        reshaped=tuple(reshaped),
    )


def added_beyond(settings: ReplicationSettings, listed: Sequence[TableName]) -> list[TableName]:
    """The tables the chain replicates (:attr:`~..store.output_store.Chain.tables`) and the
    publication sends that ``listed`` lacks: tables ``pgcdc add-table`` added after ``listed`` was
    read (a code location lists its tables once, when it loads; a follow that made way for an add
    goes on with the added ones). A table the publication no longer sends is not one: nothing keeps
    it in sync. Reads the source only when the chain holds a table ``listed`` lacks."""
    chain = store_of(settings).chain()
    if chain is None:
        return []
    known = set(listed)
    extra = [t for t in chain.tables if t not in known]
    if not extra:
        return []
    sent = set(replicated_tables(settings))
    return [t for t in extra if t in sent]
