"""The timer side of ``function_app.py``: one timer function per poller (``poll_<poller>``)."""

from __future__ import annotations

import datetime as dt
import logging
import re
import time
from collections.abc import Callable

import azure.functions as func

from poller.runtime import Runtimes
from poller.tick.summary import TickSummary
from shared.config import Config
from shared.errors import PositionLostError, SchemaChangeError
from shared.logs import get_logger, ids
from shared.scrub import scrubbed_errors
from shared.telemetry import metrics

__all__ = ["next_occurrence", "poller_blueprint", "timer_function_name"]

log = get_logger("poller.functions")

#: Tick outcomes of an instance that held the lease and finished (a tick another instance holds
#: the lease for says nothing about this poller's health; the holder reports its own).
_RAN = frozenset({"caught_up", "max_batches", "time_budget"})


def timer_function_name(poller: str) -> str:
    return "poll_" + re.sub(r"\W", "_", poller)


class _NoHttpAuthLevelNotice(logging.Filter):
    """Drops the one line azure-functions logs at every indexing of an app without an HTTP trigger,
    ``Auth level is not applied to non http function app`` (root logger, from its
    ``FunctionRegister.get_functions``; azure-functions-python-worker#1615). The library offers no
    way to declare an app timer- and queue-only, which ours is by design. Every other record passes.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            record.name == "root"
            and str(record.msg).startswith("Auth level is not applied to non http function app")
            and record.pathname.replace("\\", "/").endswith("azure/functions/decorators/function_app.py")
        )


def _quiet_no_http_notice() -> None:
    root = logging.getLogger()
    if not any(isinstance(f, _NoHttpAuthLevelNotice) for f in root.filters):
        root.addFilter(_NoHttpAuthLevelNotice())


def poller_blueprint(config: Config, runtimes: Runtimes | None = None) -> func.Blueprint:
    """Register the timers. Opens no connection: runtimes are built on the first tick."""
    _quiet_no_http_notice()  # before the app that registers this blueprint is indexed
    bp = func.Blueprint()
    shared_runtimes = runtimes or Runtimes(config)
    for poller in config.pollers.values():
        tick = _timer(shared_runtimes, poller.name)
        bp.function_name(timer_function_name(poller.name))(
            bp.timer_trigger(arg_name="timer", schedule=poller.schedule, use_monitor=poller.use_monitor)(tick)
        )
    return bp


def next_occurrence(timer: func.TimerRequest) -> dt.datetime | None:
    """The timer's next firing from its schedule status (``use_monitor``), or None when unknown."""
    status = getattr(timer, "schedule_status", None)
    value = status.get("Next") if isinstance(status, dict) else None
    if not isinstance(value, str):
        return None
    try:
        when = dt.datetime.fromisoformat(value)
    except ValueError:
        return None
    return when if when.tzinfo is not None else when.replace(tzinfo=dt.UTC)


class _LastingCondition:
    """A tick error that stays until an operator acts (:class:`PositionLostError`: the source's log
    lost the changes after the checkpoint; :class:`SchemaChangeError`: a migration changed the cursor
    or a key column).

    Logged once per state at ERROR, without a traceback, and once more when it ends; the timer
    returns instead of raising (the host would log a traceback at every firing). No success is
    recorded meanwhile, so the stall alert fires; ``dbfanout status`` shows the same text.
    """

    def __init__(self, poller: str) -> None:
        self.poller = poller
        self._text: str | None = None

    def failed(self, error: PositionLostError | SchemaChangeError) -> None:
        text = str(error)
        if text != self._text:
            log.error("%s", text, extra=ids(poller=self.poller, error=type(error).__name__))
            self._text = text
        else:
            log.debug("still: %s", text, extra=ids(poller=self.poller))

    def ran(self) -> None:
        if self._text is not None:
            log.info("the source is readable again; delivering", extra=ids(poller=self.poller))
            self._text = None


def _timer(runtimes: Runtimes, poller: str) -> Callable[[func.TimerRequest], None]:
    lasting = _LastingCondition(poller)
    summary = TickSummary(poller)  # idle ticks log at DEBUG; one INFO summary every few minutes

    def tick(timer: func.TimerRequest) -> None:
        # A timer function must return None: the Python worker rejects other values.
        with scrubbed_errors():  # the host logs what leaves a function verbatim
            try:
                result = runtimes.get(poller).tick(next_occurrence(timer))
            except (PositionLostError, SchemaChangeError) as exc:
                lasting.failed(exc)
                return
        lasting.ran()
        if result.stop_reason in _RAN:  # this instance ran the tick to its end: the poller is alive
            metrics.last_success_timestamp.record(time.time(), {"poller": poller})
        summary.tick_done(result.stop_reason, result.rows, result.batches)

    tick.__name__ = timer_function_name(poller)
    return tick
