"""The checks ``dbfanout validate`` reports, and the ones shared by queue, topic and slot validation.

Kept apart from :mod:`dbfanout.ops.validation` so the per-kind check modules (``slot_checks``,
``topic_checks``) and the orchestration that calls them import this one, not each other.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import asdict, dataclass
from typing import Any, Literal

from dbfanout.ops.bus import QueueProbe
from shared.config import PollerConfig

__all__ = [
    "Check",
    "Status",
    "duplicate_detection_check",
    "duration_seconds",
    "max_delivery_check",
    "needed_window_seconds",
    "schedule_interval_seconds",
    "session_check",
]

Status = Literal["ok", "warn", "fail", "skip"]


@dataclass(frozen=True, slots=True)
class Check:
    poller: str
    name: str
    status: Status
    detail: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def duration_seconds(value: Any) -> float:
    """A management-API duration in seconds (the SDK types it ``timedelta | str``; reads give timedeltas)."""
    return value.total_seconds() if isinstance(value, dt.timedelta) else 0.0


def schedule_interval_seconds(schedule: str) -> float | None:
    """Seconds between two firings of a six-field NCRONTAB (None for ``%SETTING%``)."""
    if schedule.startswith("%"):
        return None
    from croniter import croniter

    fields = schedule.split()
    it = croniter(" ".join(fields[1:] + fields[:1]), dt.datetime(2026, 1, 1), second_at_beginning=False)
    first, second = it.get_next(dt.datetime), it.get_next(dt.datetime)
    return float((second - first).total_seconds())


def needed_window_seconds(cfg: PollerConfig) -> float:
    """Duplicate-detection window that covers a re-send after a lost commit: TTL + interval + tick
    (a lingering tick lasts up to ``linger_seconds`` more)."""
    tick = cfg.time_budget_seconds + cfg.linger_seconds
    return cfg.lease_ttl_seconds + (schedule_interval_seconds(cfg.schedule) or 0) + tick


def duplicate_detection_check(cfg: PollerConfig, enabled: bool, window: float) -> Check:
    """The queue's (or topic's) duplicate detection: on, with a window that covers a re-send."""
    p, need, entity = cfg.name, needed_window_seconds(cfg), "topic" if cfg.is_topic else "queue"
    if not enabled:
        return Check(
            p,
            "duplicate detection",
            "fail",
            "off: a re-send after a lost commit is delivered twice "
            f"(recreate the {entity} with it on; it cannot be changed later)",
        )
    if window < need:
        return Check(
            p,
            "duplicate detection",
            "fail",
            f"window {window:.0f}s < {need:.0f}s (lease TTL + schedule interval + tick time)",
        )
    return Check(p, "duplicate detection", "ok", f"on, window {window:.0f}s >= {need:.0f}s")


def session_check(cfg: PollerConfig, probe: QueueProbe, subscription: str | None = None) -> Check:
    """``sessions`` in the config against what the queue (or subscription) requires (its workers'
    receivers must match)."""
    what, entity = ("subscription", f"{cfg.queue}/{subscription}") if subscription else ("queue", cfg.queue)
    name = f"sessions [{subscription}]" if subscription else "sessions"
    if probe.requires_session is None:
        return Check(cfg.name, name, "skip", f"could not tell whether the {what} requires sessions")
    if probe.requires_session and not cfg.sessions:
        return Check(
            cfg.name,
            name,
            "fail",
            f"{entity} requires sessions but sessions = false: the worker's receiver is refused; "
            f"set sessions = true, or use a {what} without sessions",
        )
    if cfg.sessions and not probe.requires_session:
        return Check(
            cfg.name,
            name,
            "fail",
            f"sessions = true but {entity} does not require sessions: events are not ordered per key; "
            f"recreate the {what} with RequiresSession (it cannot be changed later), or set sessions = false",
        )
    state = "on" if cfg.sessions else "off"
    return Check(cfg.name, name, "ok", f"{state}, as the {what} requires")


def max_delivery_check(cfg: PollerConfig, mdc: int, subscription: str | None = None) -> Check:
    """The queue's (or subscription's) MaxDeliveryCount against the poller: above
    split_after_deliveries, and known to it."""
    name = f"max delivery count [{subscription}]" if subscription else "max delivery count"
    key = (
        f"pollers.{cfg.name}.subscriptions.{subscription}.max_delivery_count" if subscription else "max_delivery_count"
    )
    expected = cfg.deliveries_for(subscription)
    if mdc <= cfg.split_after_deliveries:
        return Check(
            cfg.name,
            name,
            "fail",
            f"{mdc} (split_after_deliveries = {cfg.split_after_deliveries} must "
            "be lower, so a failing batch is split before it is dead-lettered)",
        )
    if mdc != expected:
        # the worker cannot read it on Azure (no Manage right): it relies on the config's value
        return Check(
            cfg.name,
            name,
            "warn",
            f"{mdc}, but the poller assumes {expected}: set {key} = {mdc}, or crashes "
            "may dead-letter a failing batch whole before the worker splits it",
        )
    return Check(cfg.name, name, "ok", f"{mdc} (split_after_deliveries = {cfg.split_after_deliveries})")
