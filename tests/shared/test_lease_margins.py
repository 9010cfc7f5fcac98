"""Lease margins (shared/lease_margins.py): two heartbeats of the storage timeout fit before expiry.

The renewer may send its first heartbeat one look late (TTL/10 after the renew threshold, half
the TTL); a heartbeat that times out is retried at its next look. So half the TTL, less one look,
must hold two storage timeouts, for the defaults of every TTL and for what config load accepts.
"""

from __future__ import annotations

import tomllib

import pytest

from shared.config import parse_config
from shared.errors import ConfigError
from shared.lease_margins import default_state_timeout, margin_problem, renew_interval, renew_threshold
from tests.shared.test_config import SAMPLE

SETTINGS = {"ORDERS_DB_URL": "sqlite://"}


def _orders(**changes: object) -> dict[str, object]:
    data = tomllib.loads(SAMPLE)
    data["pollers"]["orders"].update(changes)
    return data


def test_the_default_timing_fits_two_timed_out_heartbeats_between_the_renew_threshold_and_expiry() -> None:
    # Given the default TTL (30 s) as config load gives it
    data = _orders()
    del data["pollers"]["orders"]["lease_ttl_seconds"]  # type: ignore[index]
    orders = parse_config(data, SETTINGS).poller("orders")
    ttl = orders.lease_ttl_seconds
    # Then the renewal starts at 15 s left, the renewer looks every 3 s, the storage timeout is 6 s
    assert (ttl, renew_threshold(ttl), renew_interval(ttl), orders.state_timeout) == (30, 15, 3, 6)
    # And a heartbeat sent one look late that times out leaves room for a second one before expiry
    assert renew_threshold(ttl) - renew_interval(ttl) >= 2 * orders.state_timeout


@pytest.mark.parametrize("ttl", [10, 11, 15, 29, 30, 45, 60, 120, 600, 3600])
def test_every_ttl_config_load_accepts_has_a_default_storage_timeout_that_fits(ttl: int) -> None:
    orders = parse_config(_orders(lease_ttl_seconds=ttl), SETTINGS).poller("orders")
    assert margin_problem(ttl, orders.state_timeout) is None
    assert orders.state_timeout == min(10.0, ttl / 5)


def test_config_load_refuses_a_storage_timeout_two_heartbeats_do_not_fit_and_says_what_to_set() -> None:
    # When the storage timeout is the old 10 s at a 30 s TTL (renewal a third before expiry: 10 s)
    with pytest.raises(ConfigError) as info:
        parse_config(_orders(lease_ttl_seconds=30, state_timeout_seconds=10), SETTINGS)
    # Then the error names the key, the margin it lacks and both ways out
    assert info.value.key == "pollers.orders.state_timeout_seconds"
    assert "12 s between a late renewal and expiry" in info.value.problem
    assert "set lease_ttl_seconds >= 50, or state_timeout_seconds <= 6" in info.value.problem


def test_config_load_accepts_a_storage_timeout_that_fits_and_the_poller_uses_it() -> None:
    orders = parse_config(_orders(lease_ttl_seconds=60, state_timeout_seconds=12), SETTINGS).poller("orders")
    assert orders.state_timeout_seconds == 12 and orders.state_timeout == 12
    with pytest.raises(ConfigError, match="state_timeout_seconds"):
        parse_config(_orders(state_timeout_seconds=0.1), SETTINGS)
    assert default_state_timeout(10) == 2.0
