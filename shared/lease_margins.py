"""The lease's timing rule: one slow storage request must not let a held lease lapse.

A process renews its lease when less than :data:`RENEW_WHEN_LEFT` of ``lease_ttl_seconds`` is
left; its background renewer looks every TTL / :data:`RENEWER_LOOKS_PER_TTL`. A renewal that
times out (``state_timeout_seconds``) is retried at the renewer's next look, so the rule is that
**two heartbeats fit before expiry** even when the first one is sent a renewer interval late:

    renew threshold - renewer interval >= 2 x state_timeout_seconds

With the defaults (TTL 30 s: renew at 15 s left, look every 3 s, storage timeout 6 s) 12 s of the
15 s hold two timed-out requests. Config load refuses a combination that breaks the rule, saying
what to set (:func:`margin_problem`); ``dbfanout validate`` shows the margins of every poller.
"""

from __future__ import annotations

__all__ = [
    "HEARTBEATS_BEFORE_EXPIRY",
    "MAX_STATE_TIMEOUT",
    "RENEWER_LOOKS_PER_TTL",
    "RENEW_WHEN_LEFT",
    "default_state_timeout",
    "describe_margins",
    "margin_problem",
    "renew_interval",
    "renew_threshold",
]

#: A lease is renewed once less than this part of its TTL is left (half-life, as DHCP's T1).
RENEW_WHEN_LEFT = 0.5
#: The background renewer looks this many times per TTL (every TTL / 10: 3 s at 30 s).
RENEWER_LOOKS_PER_TTL = 10
#: Heartbeats that must fit between the renew threshold (less one renewer interval) and expiry.
HEARTBEATS_BEFORE_EXPIRY = 2
#: The state store's request timeout never exceeds this (seconds), however long the TTL.
MAX_STATE_TIMEOUT = 10.0


def renew_threshold(ttl: float) -> float:
    """Seconds left on the lease below which a renewal is due."""
    return ttl * RENEW_WHEN_LEFT


def renew_interval(ttl: float) -> float:
    """Seconds between two looks of the background renewer."""
    return ttl / RENEWER_LOOKS_PER_TTL


def _budget(ttl: float) -> float:
    """The time two heartbeats may take: from the latest first attempt to expiry."""
    return renew_threshold(ttl) - renew_interval(ttl)


def default_state_timeout(ttl: float) -> float:
    """The largest storage request timeout the rule allows for ``ttl``, capped at 10 s."""
    return min(MAX_STATE_TIMEOUT, _budget(ttl) / HEARTBEATS_BEFORE_EXPIRY)


def margin_problem(ttl: float, state_timeout: float) -> str | None:
    """What breaks the rule for this TTL and storage timeout, with what to set; None when it holds."""
    need = state_timeout * HEARTBEATS_BEFORE_EXPIRY
    if _budget(ttl) >= need:
        return None
    min_ttl = need / (RENEW_WHEN_LEFT - 1 / RENEWER_LOOKS_PER_TTL)
    return (
        f"lease_ttl_seconds = {ttl:g} leaves {_budget(ttl):g} s between a late renewal and expiry, less "
        f"than {HEARTBEATS_BEFORE_EXPIRY} heartbeats of state_timeout_seconds = {state_timeout:g} ({need:g} s): "
        "one slow storage request would let the lease lapse; set lease_ttl_seconds >= "
        f"{min_ttl:g}, or state_timeout_seconds <= {default_state_timeout(ttl):g}"
    )


def describe_margins(ttl: float, state_timeout: float) -> str:
    """One line for ``dbfanout validate``: when the lease renews, and how many timeouts fit."""
    fit = int(_budget(ttl) // state_timeout) if state_timeout > 0 else 0
    return (
        f"lease_ttl_seconds {ttl:g}: renewed at {renew_threshold(ttl):g} s left (looked at every "
        f"{renew_interval(ttl):g} s); {fit} storage timeouts of {state_timeout:g} s fit before expiry "
        f"(needs {HEARTBEATS_BEFORE_EXPIRY})"
    )
