"""The failure metric by tick step: what operators alert on (``dbfanout.failures``, by ``stage``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from shared.errors import BrokerRefusingError
from shared.telemetry import metrics

__all__ = ["stage"]


@contextmanager
def stage(name: str, poller: str) -> Iterator[None]:
    """Count a failure of this step by stage (the metric operators alert on); errors propagate.

    A refusing broker is counted by ``dbfanout.sends_refused`` instead (:mod:`poller.tick.backoff`).
    """
    try:
        yield
    except BrokerRefusingError:
        raise
    except Exception:
        metrics.failures.add(1, {"stage": name, "poller": poller})
        raise
