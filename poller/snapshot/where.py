"""A snapshot request's ``where``: a small grammar, parsed, never pasted into SQL.

Why: anyone who can write the signal table can request a snapshot, and the poller runs its chunk
selects with its own role (one with replication rights). So a condition is not SQL to run but a
sentence of a small language — the table's own column names, comparisons (``= <> != < <= > >=``),
``AND`` / ``OR`` / ``NOT``, ``IN (literal, ...)``, ``BETWEEN``, ``IS [NOT] NULL``, and literals
(numbers, strings — a date is written as a string, ``'2024-01-01'`` — ``TRUE`` / ``FALSE``) — which
is turned into a SQLAlchemy expression: identifiers quoted by the dialect, every value a bound
parameter. Anything else — a subquery, a function call, a cast, a second statement, a comment, a
parameter marker, an unknown or qualified column — is refused with the reason, before anything runs.

The parsing is sqlglot's (pure Python; in the ``postgres`` and ``mysql-binlog`` extras, imported
only when a condition is checked): its syntax tree is walked and only the node types above are
accepted, so what sqlglot understands beyond them is refused rather than passed on.

The source's dialect (``where_sql``'s ``dialect``; PostgreSQL by default) decides how the condition
is read and written: PostgreSQL reads ``"Name"`` as a quoted identifier, folds an unquoted one to
lower case and renders ``"name"``; MySQL/MariaDB read `` `Name` `` as an identifier (and a
double-quoted text as a string, as the server does by default), match a column name whatever its
case (as the server does) and render `` `name` ``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql, postgresql

__all__ = ["MYSQL_DIALECTS", "PARAM_PREFIX", "WhereRefused", "condition", "where_sql"]

#: The bound parameters of a condition are named PARAM_PREFIX + n (none of the chunk select's own).
PARAM_PREFIX = "dbfanout_w"
_MAX_LENGTH = 4000  # a condition is a line typed by an operator, not a document
# The parser and the expression builder recurse per level: a few dozen nested parentheses or NOTs
# exhaust Python's stack (RecursionError), so nesting is bounded on the text before parsing.
_MAX_NESTING = 24
_MAX_TERMS = 200  # AND/OR/NOT/comparison terms: SQLAlchemy compiles a chain recursively too
_NAMED: sa.Dialect = postgresql.dialect(paramstyle="named")  # type: ignore[no-untyped-call]  # quoting as PostgreSQL, ``:name`` binds for sa.text
_MYSQL_NAMED: sa.Dialect = mysql.dialect(paramstyle="named")  # backticks, ``:name`` binds
#: SQLAlchemy dialect names (``engine.dialect.name``) read and written as MySQL (MariaDB's is "mysql" too).
MYSQL_DIALECTS = frozenset({"mysql", "mariadb"})


class WhereRefused(ValueError):
    """A condition outside the grammar (the message says what and why)."""


@dataclass(frozen=True)
class _Parts:
    columns: Collection[str]
    params: dict[str, Any]
    mysql: bool = False  # column names match whatever their case (MySQL's rule), else PostgreSQL's


def condition(text: str, columns: Collection[str]) -> sa.ColumnElement[bool]:
    """``text`` as a SQLAlchemy boolean expression over ``columns`` (a table's column names).

    Raises :class:`WhereRefused` when it is not a sentence of the grammar (see the module docstring).
    """
    expression, _ = _convert(text, columns)
    return expression


def where_sql(text: str, columns: Collection[str], dialect: str = "postgresql") -> tuple[str, dict[str, Any]]:
    """``text`` as a fragment for ``sa.text`` (identifiers quoted by ``dialect``'s rules — a
    SQLAlchemy dialect name, PostgreSQL's by default, see the module docstring — values as
    ``:dbfanout_wN`` binds) and its parameters. Raises :class:`WhereRefused`."""
    mysql_rules = dialect in MYSQL_DIALECTS
    expression, params = _convert(text, columns, mysql_rules)
    try:
        sql = str(expression.compile(dialect=_MYSQL_NAMED if mysql_rules else _NAMED))
    except RecursionError as exc:
        raise WhereRefused("the condition is nested too deeply") from exc
    # sa.text reads ``:word`` as a bind: escape every colon but our own binds' (a quoted column
    # name may hold one). The names are ours: no value or identifier of the input is a bind name.
    sql = re.sub(r":(?!" + PARAM_PREFIX + r"\d+\b)", r"\\:", sql)
    return sql, params


def _convert(
    text: str, columns: Collection[str], mysql_rules: bool = False
) -> tuple[sa.ColumnElement[bool], dict[str, Any]]:
    if not isinstance(text, str) or not text.strip():
        raise WhereRefused("the condition is empty")
    if len(text) > _MAX_LENGTH:
        raise WhereRefused(f"the condition is longer than {_MAX_LENGTH} characters")
    _check_nesting(text)
    try:
        return _parse(text, columns, mysql_rules)
    except RecursionError as exc:  # a bound above missed a shape: refuse it, never stall the poller
        raise WhereRefused("the condition is nested too deeply") from exc


def _check_nesting(text: str) -> None:
    """Refuse a condition nested more than :data:`_MAX_NESTING` deep (open parentheses plus the NOTs
    applied one to another), or of more than :data:`_MAX_TERMS` terms, counted outside quoted
    strings and identifiers, in linear time."""
    nots: list[int] = [0]  # per open parenthesis, the NOTs in a row before it (and now, last)
    deepest = terms = 0
    quote = ""
    for word in _TOKENS.finditer(text):
        token = word.group(0)
        if quote:
            quote = "" if token == quote else quote
        elif token in ("'", '"', "`"):
            quote = token
        elif token == "(":
            nots.append(0)
        elif token == ")":
            nots = nots[:-1] or [0]
            nots[-1] = 0
        elif token.upper() == "NOT":
            nots[-1] += 1
        elif not token.startswith("\\"):
            nots[-1] = 0
            terms += 1
        deepest = max(deepest, len(nots) - 1 + sum(nots))
    if deepest > _MAX_NESTING:
        raise WhereRefused(f"the condition nests more than {_MAX_NESTING} levels of parentheses and NOTs")
    if terms > _MAX_TERMS:
        raise WhereRefused(f"the condition has more than {_MAX_TERMS} terms (comparisons, AND, OR)")


_TOKENS = re.compile(r"'|\"|`|\\.|\(|\)|\b(?:NOT|AND|OR|IS|IN|BETWEEN)\b|[=<>!]+", re.I)


def _parse(text: str, columns: Collection[str], mysql_rules: bool) -> tuple[sa.ColumnElement[bool], dict[str, Any]]:
    try:
        import sqlglot
        from sqlglot.errors import SqlglotError
    except ImportError as exc:  # never run a condition that could not be checked
        raise WhereRefused(
            "checking a condition needs sqlglot, which is not installed: add sqlglot>=26,<31 beside the driver "
            "(requirements-drivers.txt for the app; pip install 'dbfanout[postgres]' or 'dbfanout[mysql-binlog]' "
            "for the CLI)"
        ) from exc
    try:
        statements = [s for s in sqlglot.parse(text, read="mysql" if mysql_rules else "postgres") if s is not None]
    except SqlglotError as exc:
        raise WhereRefused(f"the condition does not parse: {str(exc).splitlines()[0]}") from exc
    if len(statements) != 1:
        raise WhereRefused("the condition must be one expression (no ';', no second statement)")
    parts = _Parts(columns, {}, mysql_rules)
    return _boolean(statements[0], parts), parts.params


def _refuse(node: Any, why: str) -> WhereRefused:
    sql = node.sql(dialect="postgres") if hasattr(node, "sql") else repr(node)
    return WhereRefused(f"{why}: {sql[:120]}")


def _check_comments(node: Any) -> None:
    if getattr(node, "comments", None):
        raise _refuse(node, "comments are not allowed in a condition")


def _boolean(node: Any, parts: _Parts) -> sa.ColumnElement[bool]:
    """A node that is a condition: AND, OR, NOT, a comparison, IN, BETWEEN, IS [NOT] NULL."""
    from sqlglot import exp

    _check_comments(node)
    if isinstance(node, exp.Paren):
        return _boolean(node.this, parts)
    if isinstance(node, exp.And):
        return sa.and_(_boolean(node.this, parts), _boolean(node.expression, parts))
    if isinstance(node, exp.Or):
        return sa.or_(_boolean(node.this, parts), _boolean(node.expression, parts))
    if isinstance(node, exp.Not):
        return sa.not_(_boolean(node.this, parts))
    if isinstance(node, exp.Boolean):
        return sa.true() if node.this else sa.false()
    return _predicate(node, parts)


def _predicate(node: Any, parts: _Parts) -> sa.ColumnElement[bool]:
    """A comparison, IN, BETWEEN or IS [NOT] NULL."""
    from sqlglot import exp

    comparisons: dict[type, Callable[[Any, Any], sa.ColumnElement[bool]]] = {
        exp.EQ: lambda a, b: a == b,
        exp.NEQ: lambda a, b: a != b,
        exp.LT: lambda a, b: a < b,
        exp.LTE: lambda a, b: a <= b,
        exp.GT: lambda a, b: a > b,
        exp.GTE: lambda a, b: a >= b,
    }
    compare = comparisons.get(type(node))
    if compare is not None:
        return compare(_operand(node.this, parts), _operand(node.expression, parts))
    if isinstance(node, exp.In):
        if node.args.get("query") is not None or node.args.get("unnest") is not None or node.args.get("field"):
            raise _refuse(node, "IN takes a list of literals only")
        values = [_value(v, parts) for v in node.expressions]
        if not values:
            raise _refuse(node, "IN needs at least one value")
        return _column(node.this, parts).in_(values)
    if isinstance(node, exp.Between):
        subject = _operand(node.this, parts)
        low, high = _operand(node.args["low"], parts), _operand(node.args["high"], parts)
        between: sa.ColumnElement[bool] = subject.between(low, high)
        if node.args.get("symmetric"):  # BETWEEN SYMMETRIC: either order of the bounds (PostgreSQL)
            return sa.or_(between, subject.between(high, low))
        return between
    if isinstance(node, exp.Is):
        if not isinstance(node.expression, exp.Null):
            raise _refuse(node, "IS takes NULL or NOT NULL only")
        _check_comments(node.expression)
        column = _column(node.this, parts)
        return column.is_not(None) if node.args.get("negate") else column.is_(None)
    raise _refuse(node, f"{_name(node)} is not allowed in a condition (columns, comparisons, AND/OR/NOT, IN, "
                        "BETWEEN, IS [NOT] NULL and literals only)")  # fmt: skip


def _operand(node: Any, parts: _Parts) -> Any:
    """A column or a literal (a bound parameter)."""
    from sqlglot import exp

    _check_comments(node)
    if isinstance(node, exp.Paren):
        return _operand(node.this, parts)
    if isinstance(node, exp.Column):
        return _column(node, parts)
    return _value(node, parts)


def _column(node: Any, parts: _Parts) -> sa.ColumnClause[Any]:
    from sqlglot import exp

    _check_comments(node)
    if isinstance(node, exp.Paren):
        return _column(node.this, parts)
    if not isinstance(node, exp.Column) or not isinstance(node.this, exp.Identifier):
        raise _refuse(node, f"expected a column of the table, found {_name(node)}")
    if node.args.get("table") or node.args.get("db") or node.args.get("catalog"):
        raise _refuse(node, "a column is named by itself, not qualified")
    identifier = node.this
    _check_comments(identifier)
    # PostgreSQL folds an unquoted name to lower case; a quoted one is exact. MySQL's column names
    # match whatever their case, quoted or not: the table's own spelling is used.
    name = identifier.this if identifier.quoted else str(identifier.this).lower()
    if parts.mysql:
        name = next((c for c in parts.columns if c.lower() == str(identifier.this).lower()), name)
    if name not in parts.columns:
        known = ", ".join(sorted(parts.columns))
        raise _refuse(node, f"unknown column {name!r} (the table's columns: {known})")
    if parts.mysql:  # always quoted: a name that is a keyword of a newer server than SQLAlchemy knows
        return sa.column(sa.sql.quoted_name(name, True))
    return sa.column(name)


def _value(node: Any, parts: _Parts) -> sa.BindParameter[Any]:
    """A literal as a bound parameter: a number, a string, TRUE/FALSE; a negative number."""
    from sqlglot import exp

    _check_comments(node)
    value: Any
    if isinstance(node, exp.Paren):
        return _value(node.this, parts)
    if isinstance(node, exp.Neg) and isinstance(node.this, exp.Literal) and not node.this.is_string:
        _check_comments(node.this)
        value = -_number(node.this)
    elif isinstance(node, exp.Literal):
        value = str(node.this) if node.is_string else _number(node)
    elif isinstance(node, exp.Boolean):
        value = bool(node.this)
    else:
        raise _refuse(node, f"expected a literal (a number, a string, TRUE or FALSE), found {_name(node)}")
    key = f"{PARAM_PREFIX}{len(parts.params)}"
    parts.params[key] = value
    # Untyped: no cast is rendered, so PostgreSQL types the value against its column (a date
    # column compares with '2024-01-01'; psycopg sends a string as text of unknown type).
    return sa.bindparam(key, value, type_=sa.types.NullType(), unique=False)


def _number(node: Any) -> int | Decimal:
    text = str(node.this)
    try:
        return int(text) if re.fullmatch(r"\d+", text) else Decimal(text)
    except InvalidOperation as exc:
        raise _refuse(node, "not a number") from exc


def _name(node: Any) -> str:
    from sqlglot import exp

    if isinstance(node, exp.Func):
        return f"a function call ({type(node).__name__})"
    if isinstance(node, exp.Subquery | exp.Select | exp.Query):
        return "a subquery"
    if isinstance(node, exp.Cast):
        return "a cast"
    return type(node).__name__
