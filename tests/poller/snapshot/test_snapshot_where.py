"""A snapshot request's ``where`` (poller/snapshot/where.py): a small grammar, run with bound values.

Accepted conditions are generated from the grammar, written out as an operator would type them,
parsed, run on PostgreSQL and compared with a reference evaluation in Python (SQL's three-valued
logic: NULL compares unknown); hostile inputs are refused before anything runs.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from poller.snapshot.where import WhereRefused, where_sql
from tests.support.databases import unique_name

pytestmark = pytest.mark.integration

COLUMNS = {"id": "int", "n": "int", "s": "str", "Mixed Case": "int"}
ROWS: list[dict[str, Any]] = [
    {"id": i, "n": None if i % 4 == 0 else i % 7 - 3, "s": None if i % 5 == 0 else "abcde"[i % 5] * (i % 3 + 1),
     "Mixed Case": i % 3 if i % 6 else None}
    for i in range(40)
]  # fmt: skip


@dataclass(frozen=True)
class Sql:
    """A condition as text, and how to evaluate it on a row (True, False or None: unknown)."""

    text: str
    eval: Any


def _name(column: str) -> str:
    return f'"{column}"' if column != column.lower() or " " in column else column


def _cmp(op: str, a: Any, b: Any) -> bool | None:
    if a is None or b is None:
        return None
    result: bool = {"=": a == b, "<>": a != b, "!=": a != b, "<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b}[op]
    return result


def _literal(kind: str) -> st.SearchStrategy[tuple[str, Any]]:
    if kind == "int":
        return st.integers(-5, 45).map(lambda v: (str(v), v))
    return st.text("abcde'", min_size=0, max_size=3).map(lambda v: ("'" + v.replace("'", "''") + "'", v))


@st.composite
def predicates(draw: st.DrawFn) -> Sql:
    column = draw(st.sampled_from(sorted(COLUMNS)))
    kind, name = COLUMNS[column], _name(column)
    form = draw(st.sampled_from(["cmp", "in", "between", "null", "notnull"]))
    if form == "cmp":
        op = draw(st.sampled_from(["=", "<>", "!=", "<", "<=", ">", ">="]))
        text, value = draw(_literal(kind))
        if draw(st.booleans()):
            return Sql(f"{name} {op} {text}", lambda r: _cmp(op, r[column], value))
        flipped = {"<": ">", ">": "<", "<=": ">=", ">=": "<="}.get(op, op)
        return Sql(f"{text} {op} {name}", lambda r: _cmp(flipped, r[column], value))
    if form == "in":
        values = draw(st.lists(_literal(kind), min_size=1, max_size=4))
        texts, vals = [t for t, _ in values], [v for _, v in values]

        def member(r: dict[str, Any]) -> bool | None:
            return None if r[column] is None else r[column] in vals

        return Sql(f"{name} IN ({', '.join(texts)})", member)
    if form == "between":
        (lo_t, lo), (hi_t, hi) = draw(_literal(kind)), draw(_literal(kind))

        def between(r: dict[str, Any]) -> bool | None:
            return _and(_cmp(">=", r[column], lo), _cmp("<=", r[column], hi))

        return Sql(f"{name} BETWEEN {lo_t} AND {hi_t}", between)
    if form == "null":
        return Sql(f"{name} IS NULL", lambda r: r[column] is None)
    return Sql(f"{name} IS NOT NULL", lambda r: r[column] is not None)


def _and(a: bool | None, b: bool | None) -> bool | None:
    if a is False or b is False:
        return False
    return None if a is None or b is None else True


def _or(a: bool | None, b: bool | None) -> bool | None:
    if a is True or b is True:
        return True
    return None if a is None or b is None else False


def _not(a: bool | None) -> bool | None:
    return None if a is None else not a


def _extend(children: st.SearchStrategy[Sql]) -> st.SearchStrategy[Sql]:
    both = st.tuples(children, children)
    return st.one_of(
        both.map(lambda p: Sql(f"({p[0].text}) AND ({p[1].text})", lambda r: _and(p[0].eval(r), p[1].eval(r)))),
        both.map(lambda p: Sql(f"{p[0].text} OR {p[1].text}", lambda r: _or(p[0].eval(r), p[1].eval(r)))),
        children.map(lambda c: Sql(f"NOT ({c.text})", lambda r: _not(c.eval(r)))),
    )


CONDITIONS = st.recursive(predicates(), _extend, max_leaves=6)


@pytest.fixture(scope="module")
def table(pg_url: str) -> Iterator[tuple[sa.Engine, str]]:
    engine, name = sa.create_engine(pg_url), unique_name("wh")
    with engine.begin() as conn:
        conn.execute(sa.text(f'CREATE TABLE {name} (id int PRIMARY KEY, n int, s text, "Mixed Case" int)'))
        conn.execute(sa.text(f'INSERT INTO {name} VALUES (:id, :n, :s, :m)'),
                     [{"id": r["id"], "n": r["n"], "s": r["s"], "m": r["Mixed Case"]} for r in ROWS])  # fmt: skip
    try:
        yield engine, name
    finally:
        with engine.begin() as conn:
            conn.execute(sa.text(f"DROP TABLE IF EXISTS {name}"))
        engine.dispose()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(condition=CONDITIONS)
def test_an_accepted_condition_selects_what_sql_semantics_say(table: tuple[sa.Engine, str], condition: Sql) -> None:
    engine, name = table
    # When the condition an operator typed is parsed into the chunk's fragment and run
    fragment, params = where_sql(condition.text, set(COLUMNS))
    with engine.connect() as conn:
        got = set(conn.execute(sa.text(f"SELECT id FROM {name} WHERE {fragment}"), params).scalars())
    # Then it selects exactly the rows the condition is true for (unknown is not true)
    assert got == {r["id"] for r in ROWS if condition.eval(r) is True}, (condition.text, fragment)
    # And every value travelled as a bound parameter: no literal of the input is in the fragment
    assert "'" not in fragment


HOSTILE = [
    "id = (SELECT 1)",
    "id IN (SELECT id FROM pg_class)",
    "EXISTS (SELECT 1)",
    "lower(s) = 'a'",
    "pg_sleep(1) IS NULL",
    "id = nextval('x')",
    "1=1; DROP TABLE t",
    "id = 1; SELECT pg_terminate_backend(1)",
    "id = 1 -- all of it",
    "id = 1 /* x */",
    "id::text = '1'",
    "CAST(id AS text) = '1'",
    "no_such = 1",
    "t.id = 1",
    "pg_catalog.pg_class.oid = 1",
    "id = $1",
    "id = %(x)s",
    "s LIKE 'a%'",
    "id = ARRAY[1]",
    "id = NULL",
    "id + 1 = 2",
    "s = E'\\x41'",
    "",
    "   ",
    "id = 1 UNION SELECT 1",
    "(SELECT 1) = 1",
    "id = 'a' || 'b'",
    "CASE WHEN id = 1 THEN true END",
]


@pytest.mark.parametrize("text", HOSTILE)
def test_a_hostile_condition_is_refused_with_the_reason(text: str) -> None:
    with pytest.raises(WhereRefused) as refused:
        where_sql(text, set(COLUMNS))
    assert str(refused.value)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=40))
def test_arbitrary_text_is_refused_or_becomes_a_fragment_of_columns_and_binds_only(text: str) -> None:
    try:
        fragment, params = where_sql(text, set(COLUMNS))
    except WhereRefused:
        return
    # What is accepted holds no literal and no name but the table's columns and our binds
    allowed = {"AND", "OR", "NOT", "IN", "BETWEEN", "IS", "NULL", "true", "false", "=", "!=", "<>", "<", "<=", ">",
               ">=", "(", ")", ",", *(f":{key}" for key in params), *COLUMNS, *(f'"{c}"' for c in COLUMNS)}  # fmt: skip
    tokens = re.findall(r'"[^"]*"|:\w+|\w+|[<>=!]+|\S', fragment)
    assert set(tokens) <= allowed, (text, fragment)


# Issue 39: shapes that raised something other than WhereRefused (RecursionError inside the parser),
# which stalled the poller whose fetch reached the request; and BETWEEN SYMMETRIC read as BETWEEN.
DEEP = {
    "47 nested parentheses": "(" * 47 + "id = 1" + ")" * 47,
    "98 NOTs": "NOT " * 98 + "id = 1",
    "NOT and parentheses interleaved": "NOT (" * 40 + "id = 1" + ")" * 40,
    "a chain of 1,000 ORs": " OR ".join(["id = 1"] * 1000)[:4000],
}


@pytest.mark.parametrize("text", DEEP.values(), ids=DEEP.keys())
@pytest.mark.parametrize("dialect", ["postgresql", "mysql"])
def test_deep_nesting_is_refused_with_the_reason_never_a_recursion_error(text: str, dialect: str) -> None:
    with pytest.raises(WhereRefused, match=r"nests more than|more than .* terms"):
        where_sql(text, set(COLUMNS), dialect)


def test_moderate_nesting_still_works() -> None:
    fragment, _ = where_sql("(" * 10 + "NOT " * 10 + "id = 1" + ")" * 10, set(COLUMNS))
    assert "id" in fragment


_TOKEN_SOUP = st.lists(
    st.sampled_from(["(", ")", "NOT", "AND", "OR", "id", "n", "=", "<", "1", "'a'", "'('", "IN", "BETWEEN",
                     "SYMMETRIC", "IS", "NULL", ",", ";", "--", "\\", '"', "`", "TRUE"]),
    max_size=400,
).map(" ".join)  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(text=st.one_of(_TOKEN_SOUP, st.text(max_size=300)), dialect=st.sampled_from(["postgresql", "mysql"]))
def test_any_text_is_a_fragment_or_a_refusal_never_another_error(text: str, dialect: str) -> None:
    # Given any text an operator or a signal-table writer can store as a request's where
    # Then checking it returns a fragment or raises WhereRefused: nothing else escapes
    with contextlib.suppress(WhereRefused):
        where_sql(text, set(COLUMNS), dialect)


def test_between_symmetric_accepts_the_bounds_in_either_order(table: tuple[sa.Engine, str]) -> None:
    engine, name = table
    fragment, params = where_sql("id BETWEEN SYMMETRIC 3 AND 1", set(COLUMNS))
    with engine.connect() as conn:
        got = set(conn.execute(sa.text(f"SELECT id FROM {name} WHERE {fragment}"), params).scalars())
        want = set(conn.execute(sa.text(f"SELECT id FROM {name} WHERE id BETWEEN SYMMETRIC 3 AND 1")).scalars())
    assert got == want and got
