"""Timer schedules as the Functions host reads them: six-field NCRONTAB, seconds first.

``{second} {minute} {hour} {day} {month} {day-of-week}``, evaluated in UTC (the host's default
without ``WEBSITE_TIME_ZONE``). A schedule written ``%NAME%`` is read from the app setting NAME.
The host also accepts a TimeSpan (``hh:mm:ss``) on dedicated plans; it is accepted here as a
fixed interval.
"""

from __future__ import annotations

import datetime as dt
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

from croniter import CroniterError, croniter

from shared.errors import ConfigError

__all__ = ["Schedule", "parse_schedule", "resolve_setting"]

_SETTING = re.compile(r"^%([^%]+)%$")
_TIMESPAN = re.compile(r"^(?:(\d+)\.)?(\d{1,2}):(\d{2}):(\d{2})$")


def resolve_setting(value: str, settings: Mapping[str, str], key: str) -> str:
    """``%NAME%`` → the app setting NAME (like binding expressions in function.json)."""
    match = _SETTING.match(value.strip())
    if match is None:
        return value
    name = match.group(1)
    resolved = settings.get(name)
    if not resolved:
        raise ConfigError(key, f"refers to %{name}% but the app setting {name} is not set")
    return resolved


@dataclass(frozen=True, slots=True)
class Schedule:
    """A parsed schedule: an NCRONTAB expression or a fixed interval."""

    expression: str
    interval: dt.timedelta | None = None
    # One parsed expression, moved to each start time: parsing it again for every occurrence cost
    # about 0.3 ms, a quarter of an idle poller's tick under `dbfanout run` (BENCHMARKS.md, issue 23).
    _iter: list[croniter] = field(default_factory=list, init=False, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    def next_after(self, when: dt.datetime) -> dt.datetime:
        """The first occurrence strictly after ``when`` (UTC, timezone-aware)."""
        if when.tzinfo is None:
            raise ValueError("next_after needs a timezone-aware datetime")
        when = when.astimezone(dt.UTC)
        if self.interval is not None:
            return when + self.interval
        with self._lock:
            if not self._iter:
                self._iter.append(croniter(self.expression, when, ret_type=dt.datetime, second_at_beginning=True))
            it = self._iter[0]
            it.set_current(when, force=True)
            nxt: dt.datetime = it.get_next()
        return nxt.astimezone(dt.UTC)

    def previous_before(self, when: dt.datetime) -> dt.datetime:
        """The last occurrence at or before ``when``."""
        when = when.astimezone(dt.UTC)
        if self.interval is not None:
            return when
        probe = when + dt.timedelta(microseconds=1)  # croniter's get_prev is strict
        prev: dt.datetime = croniter(self.expression, probe, ret_type=dt.datetime, second_at_beginning=True).get_prev()
        return prev.astimezone(dt.UTC)


def parse_schedule(raw: str, settings: Mapping[str, str], key: str = "schedule") -> Schedule:
    """Parse a binding's schedule; a bad one raises ConfigError naming ``key`` and the fix."""
    expression = resolve_setting(raw, settings, key).strip()
    span = _TIMESPAN.match(expression)
    if span is not None:
        days, hours, minutes, seconds = (int(g or 0) for g in span.groups())
        interval = dt.timedelta(days=days, hours=hours, minutes=minutes, seconds=seconds)
        if interval <= dt.timedelta(0):
            raise ConfigError(key, f"the interval {expression!r} must be positive")
        return Schedule(expression, interval)
    fields = expression.split()
    hint = 'six fields, seconds first: "*/5 * * * * *" (every 5 s), "0 */2 * * * *" (every 2 min)'
    if len(fields) != 6:
        raise ConfigError(key, f"{expression!r} is not a six-field NCRONTAB expression", hint=hint)
    try:
        croniter(expression, dt.datetime.now(dt.UTC), second_at_beginning=True).get_next()
    except (CroniterError, ValueError, KeyError) as exc:
        # croniter's own message shows the fields reordered (seconds last): name ours instead.
        raise ConfigError(
            key, f"{expression!r} is not a valid NCRONTAB expression (a field is out of range or unknown)", hint=hint
        ) from exc
    return Schedule(expression)
