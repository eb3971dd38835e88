"""The one SQL-identifier helper: table names that are always quoted, never formatted in; and
the names the engine gives what it creates on a server."""

from __future__ import annotations

from dataclasses import dataclass

from psycopg import sql


@dataclass(frozen=True, order=True)
class TableName:
    """A schema-qualified table name, kept as its two raw parts.

    ``str()`` gives the display form with each part quoted only when PostgreSQL would need it
    (``public.orders``, ``"Odd Schema"."select"``), which is also what users type in
    ``PGCDC_TABLES``; :attr:`sql` gives the composable identifier for queries.
    """

    schema: str
    name: str

    @property
    def sql(self) -> sql.Identifier:
        return sql.Identifier(self.schema, self.name)

    def __str__(self) -> str:
        return f"{quote_if_needed(self.schema)}.{quote_if_needed(self.name)}"

    @classmethod
    def parse(cls, text: str) -> TableName:
        """Parse ``schema.table`` (either part may be double-quoted; unquoted parts fold to
        lower case, as in SQL). A bare ``table`` means ``public.table``."""
        parts = _split_qualified(text.strip())
        if len(parts) == 1:
            return cls("public", parts[0])
        if len(parts) == 2:
            return cls(parts[0], parts[1])
        raise ValueError(f"{text!r} is not a table name: expected schema.table")


_PLAIN = set("abcdefghijklmnopqrstuvwxyz0123456789_")


def quote_if_needed(ident: str) -> str:
    """Quote an identifier the way ``quote_ident`` does, keywords aside (always-safe superset:
    anything not plain lower-case is quoted)."""
    if ident and ident[0] not in "0123456789" and set(ident) <= _PLAIN and ident not in _RESERVED:
        return ident
    return '"' + ident.replace('"', '""') + '"'


def _split_qualified(text: str) -> list[str]:
    parts: list[str] = []
    i, n = 0, len(text)
    while i < n:
        if text[i] == '"':
            j, buf = i + 1, []
            while True:
                if j >= n:
                    raise ValueError(f"{text!r} has an unterminated quoted identifier")
                if text[j] == '"':
                    if j + 1 < n and text[j + 1] == '"':
                        buf.append('"')
                        j += 2
                        continue
                    break
                buf.append(text[j])
                j += 1
            parts.append("".join(buf))
            i = j + 1
        else:
            j = text.find(".", i)
            j = n if j < 0 else j
            word = text[i:j].strip()
            if not word:
                raise ValueError(f"{text!r} has an empty name part")
            parts.append(word.lower())
            i = j
        if i < n:
            if text[i] != ".":
                raise ValueError(f"{text!r}: expected '.' after a quoted identifier")
            i += 1
    if text.endswith("."):
        raise ValueError(f"{text!r} has an empty name part")
    return parts


# Reserved words that must be quoted as identifiers (PostgreSQL's "reserved" category).
_RESERVED = frozenset(
    """all analyse analyze and any array as asc asymmetric both case cast check collate column
    constraint create current_catalog current_date current_role current_time current_timestamp
    current_user default deferrable desc distinct do else end except false fetch for foreign
    from grant group having in initially intersect into lateral leading limit localtime
    localtimestamp not null offset on only or order placing primary references returning
    select session_user some symmetric system_user table then to trailing true union unique
    user using variadic when where window with""".split()
)


def origin_name(slot_name: str) -> str:
    """The target's replication origin for ``slot_name``."""
    return f"pgcdc_{slot_name}"
