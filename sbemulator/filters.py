"""Subscription rule filters: correlation filters and a subset of Service Bus SQL filters.

A filter sees a message as :class:`MessageView`: its system properties (``sys.Label``,
``sys.MessageId``, ...) and its application properties (``user.name`` or just ``name``).

SQL supported: ``=``, ``<>``/``!=``, ``<``, ``<=``, ``>``, ``>=``, ``[NOT] IN (...)``,
``[NOT] LIKE 'pat%'``, ``IS [NOT] NULL``, ``EXISTS(name)``, ``AND``, ``OR``, ``NOT``,
parentheses; string (``'it''s'``), integer, decimal, ``TRUE``/``FALSE`` and ``NULL`` literals.
Missing properties compare as unknown (three-valued logic, like the service). Not supported (a
:class:`ConfigError` names it): arithmetic, functions other than EXISTS, rule actions.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sbemulator.codec import APP_PROPS, PROPERTIES, decode_value, iter_values, split_sections
from sbemulator.errors import ConfigError

# Index of each system property in the AMQP properties list (a None index: not in that section).
_SYSTEM_FIELDS = {
    "messageid": 0,
    "to": 2,
    "label": 3,
    "subject": 3,
    "replyto": 4,
    "correlationid": 5,
    "contenttype": 6,
    "sessionid": 10,
    "replytosessionid": 12,
}


@dataclass(frozen=True, slots=True)
class MessageView:
    """The properties filters look at, decoded once per message."""

    system: Mapping[str, Any]
    user: Mapping[str, Any]

    @classmethod
    def of(cls, payload: bytes) -> MessageView:
        """Decode the properties and application properties sections of an encoded message."""
        system: dict[str, Any] = {}
        user: dict[str, Any] = {}
        for s in split_sections(payload):
            if s.code == PROPERTIES:
                values = [decode_value(payload, a)[0] for a, _ in iter_values(payload, s.value_start)]
                for name, index in _SYSTEM_FIELDS.items():
                    if index < len(values) and values[index] is not None:
                        v = values[index]
                        system[name] = v.hex() if isinstance(v, bytes) else str(v) if index in (0, 5) else v
            elif s.code == APP_PROPS:
                it = iter_values(payload, s.value_start)
                for k_start, _ in it:
                    v_start, _ = next(it)
                    user[str(decode_value(payload, k_start)[0]).lower()] = decode_value(payload, v_start)[0]
        return cls(system, user)


Predicate = Callable[[MessageView], bool]


@dataclass(frozen=True, slots=True)
class CorrelationFilter:
    """Every given system property and application property must be equal."""

    system: Mapping[str, Any] = field(default_factory=dict)
    user: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, raw: Mapping[str, Any], where: str) -> CorrelationFilter:
        """Parse a Config.json ``CorrelationFilter`` object."""
        system, user = {}, {}
        for key, value in raw.items():
            if key == "Properties":
                if not isinstance(value, Mapping):
                    raise ConfigError(f"{where}.Properties must be an object of property name -> value")
                user = {str(k).lower(): v for k, v in value.items()}
            elif key.lower() in _SYSTEM_FIELDS:
                if value not in (None, ""):
                    system[key.lower() if key.lower() != "subject" else "label"] = value
            else:
                known = ["ContentType", "CorrelationId", "Label", "MessageId", "Properties", "ReplyTo"]
                known += ["ReplyToSessionId", "SessionId", "Subject", "To"]
                raise ConfigError(f"{where}.{key} is not a correlation filter property; known: {known}")
        return cls(system, user)

    def __call__(self, view: MessageView) -> bool:
        for name, want in self.system.items():
            got = view.system.get("label" if name == "subject" else name)
            if not _equal(got, want):
                return False
        return all(_equal(view.user.get(name), want) for name, want in self.user.items())


def _equal(got: Any, want: Any) -> bool:
    if got is None:
        return False
    if isinstance(got, bool) or isinstance(want, bool):
        return str(got).lower() == str(want).lower()
    if isinstance(got, int | float) and isinstance(want, int | float):
        return got == want
    return str(got) == str(want)


# ---- SQL ---------------------------------------------------------------------------------------
_TOKEN = re.compile(
    r"\s*(?:(?P<str>'(?:[^']|'')*')|(?P<num>\d+(?:\.\d+)?)|(?P<op><>|!=|<=|>=|=|<|>|\(|\)|,)"
    r"|(?P<name>\[[^\]]+\]|[A-Za-z_][A-Za-z0-9_.$-]*))"
)
_KEYWORDS = {"AND", "OR", "NOT", "IN", "IS", "NULL", "TRUE", "FALSE", "LIKE", "EXISTS", "ESCAPE"}
Value = Callable[[MessageView], Any]
Cond = Callable[[MessageView], "bool | None"]


@dataclass(frozen=True, slots=True)
class _Tok:
    kind: str  # str, num, op, name, kw, end
    text: str
    value: Any = None


def _tokenize(text: str) -> list[_Tok]:
    out, pos = [], 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        m = _TOKEN.match(text, pos)
        if not m:
            raise ConfigError(f"SQL filter {text!r}: cannot read {text[pos:].strip()[:20]!r}")
        pos = m.end()
        kind = m.lastgroup or ""
        raw = m.group(kind)
        if kind == "str":
            out.append(_Tok("lit", raw, raw[1:-1].replace("''", "'")))
        elif kind == "num":
            out.append(_Tok("lit", raw, float(raw) if "." in raw else int(raw)))
        elif kind == "name" and raw.upper() in _KEYWORDS:
            out.append(_Tok("kw", raw.upper()))
        elif kind == "name":
            out.append(_Tok("name", raw.strip("[]")))
        else:
            out.append(_Tok("op", raw))
    out.append(_Tok("end", ""))
    return out


class _SqlParser:
    """Recursive descent: or -> and -> not -> predicate -> operand."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.toks = _tokenize(text)
        self.i = 0

    def parse(self) -> Cond:
        cond = self._or()
        if self._peek().kind != "end":
            self._fail(f"unexpected {self._peek().text!r}")
        return cond

    def _fail(self, why: str) -> None:
        raise ConfigError(f"SQL filter {self.text!r}: {why} (supported: =, <>, <, >, IN, LIKE, IS NULL, AND, OR, NOT)")

    def _peek(self) -> _Tok:
        return self.toks[self.i]

    def _take(self, kind: str, text: str | None = None) -> bool:
        tok = self._peek()
        if tok.kind == kind and (text is None or tok.text == text):
            self.i += 1
            return True
        return False

    def _expect(self, kind: str, text: str) -> None:
        if not self._take(kind, text):
            self._fail(f"expected {text!r}")

    def _or(self) -> Cond:
        return self._chain("OR", self._and, decisive=True)

    def _and(self) -> Cond:
        return self._chain("AND", self._not, decisive=False)

    def _chain(self, keyword: str, operand: Callable[[], Cond], *, decisive: bool) -> Cond:
        left = operand()
        while self._take("kw", keyword):
            left = _junction(left, operand(), decisive)
        return left

    def _not(self) -> Cond:
        if self._take("kw", "NOT"):
            inner = self._not()
            return lambda v: None if (r := inner(v)) is None else not r
        return self._predicate()

    def _predicate(self) -> Cond:
        if self._take("op", "("):
            inner = self._or()
            self._expect("op", ")")
            return inner
        if self._take("kw", "EXISTS"):
            self._expect("op", "(")
            tok = self._peek()
            if not self._take("name"):
                self._fail("EXISTS needs a property name")
            self._expect("op", ")")
            getter = _property(tok.text)
            return lambda v: getter(v) is not None
        left = self._operand()
        if self._take("kw", "IS"):
            negate = self._take("kw", "NOT")
            self._expect("kw", "NULL")
            return lambda v: (left(v) is None) != negate
        negate = self._take("kw", "NOT")
        if self._take("kw", "IN"):
            return _maybe_not(self._in(left), negate)
        if self._take("kw", "LIKE"):
            return _maybe_not(self._like(left), negate)
        if negate:
            self._fail("NOT must be followed by IN or LIKE here")
        tok = self._peek()
        if tok.kind != "op" or tok.text not in _COMPARE:
            if tok.kind == "lit" or (tok.kind == "kw" and tok.text in ("TRUE", "FALSE")):
                self._fail(f"expected an operator before {tok.text!r}")
            return lambda v: _truth(left(v))
        self.i += 1
        right = self._operand()
        compare = _COMPARE[tok.text]
        return lambda v: _compare(compare, left(v), right(v))

    def _in(self, left: Value) -> Cond:
        self._expect("op", "(")
        items = [self._operand()]
        while self._take("op", ","):
            items.append(self._operand())
        self._expect("op", ")")

        def cond(v: MessageView) -> bool | None:
            got = left(v)
            if got is None:
                return None
            return any(_compare(_COMPARE["="], got, item(v)) for item in items)

        return cond

    def _like(self, left: Value) -> Cond:
        tok = self._peek()
        if not self._take("lit") or not isinstance(tok.value, str):
            self._fail("LIKE needs a string pattern")
        pattern = re.compile(
            "".join(".*" if c == "%" else "." if c == "_" else re.escape(c) for c in tok.value), re.DOTALL
        )
        return lambda v: None if (got := left(v)) is None else bool(pattern.fullmatch(str(got)))

    def _operand(self) -> Value:
        tok = self._peek()
        if self._take("lit"):
            value = tok.value
            return lambda v: value
        if self._take("kw", "TRUE") or self._take("kw", "FALSE"):
            flag = tok.text == "TRUE"
            return lambda v: flag
        if self._take("kw", "NULL"):
            return lambda v: None
        if self._take("name"):
            return _property(tok.text)
        self._fail(f"expected a property or a literal, found {tok.text or 'the end'!r}")
        raise AssertionError  # unreachable: _fail raises


def _property(name: str) -> Value:
    lower = name.lower()
    if lower.startswith("sys."):
        key = lower[4:]
        if key not in _SYSTEM_FIELDS:
            raise ConfigError(
                f"SQL filter: {name} is not a system property; known: sys.{', sys.'.join(_SYSTEM_FIELDS)}"
            )
        key = "label" if key == "subject" else key
        return lambda v: v.system.get(key)
    key = lower[5:] if lower.startswith("user.") else lower
    return lambda v: v.user.get(key)


_COMPARE: dict[str, Callable[[Any, Any], bool]] = {
    "=": lambda a, b: a == b,
    "<>": lambda a, b: a != b,
    "!=": lambda a, b: a != b,
    "<": lambda a, b: a < b,
    "<=": lambda a, b: a <= b,
    ">": lambda a, b: a > b,
    ">=": lambda a, b: a >= b,
}


def _compare(op: Callable[[Any, Any], bool], a: Any, b: Any) -> bool | None:
    if a is None or b is None:
        return None
    numeric = (int, float)
    if isinstance(a, numeric) and isinstance(b, numeric) and not isinstance(a, bool) and not isinstance(b, bool):
        return op(a, b)
    if type(a) is not type(b):
        a, b = str(a), str(b)
    try:
        return op(a, b)
    except TypeError:
        return None


def _truth(value: Any) -> bool | None:
    return None if value is None else bool(value)


def _junction(left: Cond, right: Cond, decisive: bool) -> Cond:
    """AND (``decisive=False``) or OR (``True``) in three-valued logic."""

    def cond(v: MessageView) -> bool | None:
        a = left(v)
        if a is decisive:
            return decisive
        b = right(v)
        if b is decisive:
            return decisive
        return None if a is None or b is None else not decisive

    return cond


def _maybe_not(cond: Cond, negate: bool) -> Cond:
    if not negate:
        return cond
    return lambda v: None if (r := cond(v)) is None else not r


@dataclass(frozen=True, slots=True)
class SqlFilter:
    """A compiled SQL filter expression."""

    expression: str
    _cond: Cond = field(repr=False, compare=False, default=lambda v: True)

    @classmethod
    def compile(cls, expression: str) -> SqlFilter:
        """Parse ``expression``; ConfigError names what is not understood."""
        return cls(expression, _SqlParser(expression).parse())

    def __call__(self, view: MessageView) -> bool:
        return self._cond(view) is True


@dataclass(frozen=True, slots=True)
class Rule:
    """A named subscription rule."""

    name: str
    matches: Predicate

    @classmethod
    def from_json(cls, raw: Mapping[str, Any], where: str) -> Rule:
        """Parse one entry of a subscription's ``Rules`` in Config.json."""
        name = raw.get("Name")
        if not name:
            raise ConfigError(f"{where}.Name is missing")
        props = raw.get("Properties") or {}
        unknown = set(raw) - {"Name", "Properties"}
        unknown |= set(props) - {"FilterType", "CorrelationFilter", "SqlFilter", "Action"}
        if unknown:
            raise ConfigError(f"{where}: unknown keys {sorted(unknown)}")
        action = props.get("Action")
        if action and (action.get("SqlExpression") if isinstance(action, Mapping) else action):
            raise ConfigError(f"{where}.Properties.Action: rule actions are not supported by this emulator")
        kind = str(props.get("FilterType") or ("Sql" if "SqlFilter" in props else "Correlation")).lower()
        if kind in ("correlation", "correlationfilter"):
            return cls(
                name, CorrelationFilter.from_json(props.get("CorrelationFilter") or {}, f"{where}.CorrelationFilter")
            )
        if kind in ("sql", "sqlfilter"):
            sql = props.get("SqlFilter") or {}
            expression = sql.get("SqlExpression") if isinstance(sql, Mapping) else None
            if not expression:
                raise ConfigError(f"{where}.Properties.SqlFilter.SqlExpression is missing")
            return cls(name, SqlFilter.compile(str(expression)))
        raise ConfigError(f"{where}.Properties.FilterType {props.get('FilterType')!r}: use 'Correlation' or 'Sql'")
