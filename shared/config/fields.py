"""Reading one TOML table: typed values checked against their range, defaults from the dataclass.

Every reader raises :class:`~shared.errors.ConfigError` naming the key; a key the table does not
know is named with the closest known one ("did you mean").
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from collections.abc import Mapping
from typing import Any

from shared.errors import ConfigError
from shared.settings import Settings

__all__ = ["NAME", "Reader", "defaults_of", "expand_refs", "missing_setting_error", "reject_unknown"]

NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,62}$")
REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def defaults_of(cls: type) -> dict[str, Any]:
    """The defaults a config dataclass declares: the one place each default is written."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def reject_unknown(raw: Mapping[str, Any], prefix: str, known: set[str]) -> None:
    """A key the table does not know: named, with the closest known keys if any is close."""
    unknown = sorted(set(raw) - known)
    if not unknown:
        return
    close = difflib.get_close_matches(unknown[0], sorted(known), n=3)
    hint = f"did you mean {' or '.join(close)}?" if close else 'README.md, "Configure a poller", lists the keys'
    raise ConfigError(f"{prefix}.{unknown[0]}", "unknown key", hint=hint)


class Reader:
    """Typed values of one table (``prefix`` names it in errors); absent keys take ``defaults``."""

    def __init__(self, raw: Mapping[str, Any], prefix: str, defaults: Mapping[str, Any]) -> None:
        self.raw = raw
        self.prefix = prefix
        self._defaults = defaults

    def error(self, key: str, problem: str, hint: str | None = None) -> ConfigError:
        return ConfigError(f"{self.prefix}.{key}", problem, hint=hint)

    def get(self, key: str) -> Any:
        return self.raw.get(key, self._defaults.get(key))

    def text(self, key: str) -> Any:
        value = self.get(key)
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise self.error(key, f"must be a non-empty string (got {value!r})")
        return value

    def required(self, key: str, example: str) -> Any:
        value = self.text(key)
        if value is None:
            raise self.error(key, "is required", hint=example)
        return value

    def integer(self, key: str, lo: int, hi: int) -> Any:
        """An integer in ``lo..hi``; 0 stands for "unset" where the default is None."""
        value = self.get(key)
        if value is None and key not in self.raw:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise self.error(key, f"must be an integer from {lo} to {hi} (got {value!r})")
        return value if value or self._defaults.get(key) is not None else None

    def number(self, key: str, lo: float) -> Any:
        value = self.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or value < lo:
            raise self.error(key, f"must be a number >= {lo} (got {value!r})")
        return float(value)

    def choice(self, key: str, choices: Any, default: Any = None) -> Any:
        """One of a ``Literal`` type's values (``default``: when the dataclass's does not apply)."""
        allowed = typing.get_args(choices)
        value = self.raw.get(key, self.get(key) if default is None else default)
        if value not in allowed:
            raise self.error(key, f"must be one of {', '.join(allowed)} (got {value!r})")
        return value

    def flag(self, key: str) -> bool:
        return bool(self.get(key))


def expand_refs(value: str, settings: Settings, key: str) -> str:
    """Replace ``${NAME}`` with the app setting NAME; a missing setting is an error."""

    def sub(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in settings:
            raise missing_setting_error(key, name)
        return settings[name]

    return REF.sub(sub, value)


def missing_setting_error(key: str, name: str) -> ConfigError:
    """The error for a ``${NAME}`` reference whose app setting is not set."""
    return ConfigError(
        key,
        f"references ${{{name}}} but the app setting {name} is not set",
        hint=f"set {name} in the environment, local.settings.json Values, or the Function App settings",
    )
