import pytest
from psycopg import sql

from pgcdc_dagster.engine.identifiers import TableName


@pytest.mark.parametrize(
    "text, expected",
    [
        ("public.orders", TableName("public", "orders")),
        ("orders", TableName("public", "orders")),
        ("Public.Orders", TableName("public", "orders")),
        ('"Odd Schema"."select"', TableName("Odd Schema", "select")),
        ('"a""b".c', TableName('a"b', "c")),
        ('s."x.y"', TableName("s", "x.y")),
    ],
)
def test_parse(text, expected):
    assert TableName.parse(text) == expected


@pytest.mark.parametrize("bad", ["", "a.", ".a", "a.b.c", '"unterminated', '"a"b'])
def test_parse_rejects(bad):
    with pytest.raises(ValueError):
        TableName.parse(bad)


def test_display_quotes_only_when_needed_and_round_trips():
    for table in [
        TableName("public", "orders"),
        TableName("Odd Schema", "select"),
        TableName("s", 'q"t'),
    ]:
        assert TableName.parse(str(table)) == table
    assert str(TableName("public", "orders")) == "public.orders"
    assert str(TableName("Odd Schema", "select")) == '"Odd Schema"."select"'


def test_sql_identifier_is_composed_not_formatted(source_dsn):
    import psycopg

    with psycopg.connect(source_dsn) as conn:
        assert TableName("Odd Schema", 'se"lect').sql.as_string(conn) == '"Odd Schema"."se""lect"'
        assert isinstance(TableName("a", "b").sql, sql.Identifier)
