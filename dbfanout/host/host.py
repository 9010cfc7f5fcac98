"""The local Functions host: load the app, serve its timers and queue triggers, stop cleanly.

    host = LocalHost(app_root=Path("."))
    host.start()                # settings → os.environ, import function_app, start the triggers
    host.wait(stop_event)       # until Ctrl-C / SIGTERM / --duration
    host.stop()                 # stop receiving, let calls finish, close the app's runtimes

Shutdown order matters for leases: timers stop firing and a running tick ends (it releases its
lease itself); queue receivers stop taking messages and settle what finishes within the grace
period; then the app's long-lived parts (pollers' runtimes, the worker's senders) are closed.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

from dbfanout.host.app_loader import DEFAULT_APP, FunctionSpec, apply_settings, discover, load_app
from dbfanout.host.hostjson import HostJson, load_host_json
from dbfanout.host.servicebus import QueueRunner
from dbfanout.host.sessions import SessionQueueRunner
from dbfanout.host.storagequeue import StorageQueueRunner
from dbfanout.host.timer_pool import TimerPool
from dbfanout.host.timers import TimerRunner
from shared.logs import JsonFormatter, TextFormatter, get_logger, ids, use_console_format

__all__ = ["LocalHost", "LogFormat", "configure_logging", "freeze_heap"]

_QueueTrigger = QueueRunner | SessionQueueRunner | StorageQueueRunner
_Runner = TimerRunner | _QueueTrigger

log = get_logger("host")

LogFormat = Literal["text", "json"]
RUN_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
SHUTDOWN_HOOK = "shutdown"  # an optional module-level function the app may expose
#: When the heap is frozen a second time: by then the first ticks and deliveries opened the drivers,
#: engines and SDK clients, which then live as long as the process.
WARM_SECONDS = 20.0


class LocalHost:
    """Runs a Python v2 Functions app without the Functions host."""

    def __init__(
        self,
        app_root: Path,
        app_spec: str = DEFAULT_APP,
        *,
        extra_settings: Mapping[str, str] | None = None,
        grace_seconds: float = 30.0,
    ) -> None:
        self.app_root = app_root.resolve()
        self.app_spec = app_spec
        self.extra_settings = dict(extra_settings or {})
        self.grace_seconds = grace_seconds
        self.host_json: HostJson = HostJson()
        self.functions: list[FunctionSpec] = []
        self.timers: list[TimerRunner] = []
        self._timer_pool = TimerPool()  # the timers share its threads
        self.queues: list[_QueueTrigger] = []
        self.app: Any = None
        self._stopped = False
        self.clean_stop = True  # False when a call outlived the grace period

    def start(self) -> None:
        """Load settings, host.json and the app; start every supported trigger."""
        settings = apply_settings(self.app_root, self.extra_settings)
        self.host_json = load_host_json(self.app_root)
        self.app = load_app(self.app_spec, self.app_root)
        self.functions = discover(self.app)
        for spec in self.functions:
            if spec.trigger_type == "timerTrigger":
                self.timers.append(TimerRunner(spec, settings, pool=self._timer_pool))
            elif spec.trigger_type == "serviceBusTrigger" and spec.trigger.get("isSessionsEnabled"):
                self.queues.append(SessionQueueRunner(spec, settings, self.host_json.service_bus))
            elif spec.trigger_type == "serviceBusTrigger":
                self.queues.append(QueueRunner(spec, settings, self.host_json.service_bus))
            elif spec.trigger_type == "queueTrigger":
                self.queues.append(StorageQueueRunner(spec, settings, self.host_json.queues))
            else:
                keys = ids(function=spec.name, type=spec.trigger_type)
                log.warning("trigger type not served by the local host; skipped", extra=keys)
        # Parse everything before starting anything: a bad schedule fails the start, not a thread.
        runners: list[_Runner] = [
            *self.queues,
            *self.timers,
        ]
        for runner in runners:
            runner.start()
        log.info(
            "host started",
            extra=ids(
                app_root=str(self.app_root),
                timers=",".join(t.spec.name for t in self.timers),
                queues=",".join(q.spec.name for q in self.queues),
            ),
        )

    def wait(self, stop: threading.Event, duration: float | None = None) -> None:
        """Block until ``stop`` is set or ``duration`` seconds passed.

        The process is the host's from here on (``dbfanout run``): what it built to start, and
        again what it built in its first :data:`WARM_SECONDS`, is frozen out of the cyclic
        collector's full passes (:func:`freeze_heap`).
        """
        freeze_heap()
        warm_at: float | None = time.monotonic() + WARM_SECONDS
        deadline = None if duration is None else time.monotonic() + duration
        while not stop.is_set():
            now = time.monotonic()
            if warm_at is not None and now >= warm_at:
                freeze_heap()
                warm_at = None
            remaining = None if deadline is None else deadline - now
            if remaining is not None and remaining <= 0:
                return
            stop.wait(0.5 if remaining is None else min(0.5, remaining))

    def stop(self) -> None:
        """Graceful shutdown (idempotent): stop triggers, finish calls (bounded), close the app."""
        if self._stopped:
            return
        self._stopped = True
        for timer in self.timers:
            timer.stop()
        for runner in self.queues:
            runner.stop(self.grace_seconds)
        deadline = time.monotonic() + self.grace_seconds + 5.0
        parts: list[_Runner] = [*self.timers, *self.queues]
        for part in parts:
            if not part.join(max(0.1, deadline - time.monotonic())):
                self.clean_stop = False
                log.warning("a trigger did not stop in time", extra=ids(function=part.spec.name))
        if any(q.running for q in self.queues):
            self.clean_stop = False
        self._close_app()
        log.info("host stopped")

    def _close_app(self) -> None:
        """Close what the app keeps open: its ``shutdown()`` hook, else closables its functions hold."""
        module = _app_module(self.app_spec)
        hook = getattr(module, SHUTDOWN_HOOK, None) if module is not None else None
        closables = [hook] if callable(hook) else [c.close for c in _closure_closables(self.functions)]
        for close in closables:
            try:
                close()
            except Exception as exc:  # best effort: one failing close must not keep the others open
                log.warning("closing an app part failed", extra=ids(error=repr(exc)))


def freeze_heap() -> None:
    """Collect, then move every object alive now to the collector's permanent generation (``gc.freeze``).

    CPython runs a full collection after every ten middle ones, and it walks every tracked object
    of the old generation: the modules, the app, the SDKs, the drivers - hundreds of thousands of
    objects that live as long as the host. A busy worker promotes enough short-lived objects to run
    one every ~14,000 events of pg_logical messages, and on a heap of 64,000 objects (a host's is
    larger) those walks cost 2.5-4 CPU µs an event, as much as decoding it (issue 41,
    ``benchmarks/bench_worker_cpu.py``: 0.3 µs frozen). Frozen objects are
    still freed by reference counting; only a cycle among them that becomes garbage is never
    collected, which is why the garbage is collected first.
    """
    gc.collect()
    gc.freeze()


def _app_module(spec: str) -> ModuleType | None:
    import sys

    return sys.modules.get(spec.partition(":")[0])


def _closure_closables(functions: list[FunctionSpec]) -> Iterator[Any]:
    """Objects with ``close()`` captured by the functions (the pollers' Runtimes, the WorkerApp).

    function_app.py keeps them in the closures of the registered functions; without a shutdown
    hook this is how the host reaches them to release connections at exit.
    """
    seen: set[int] = set()
    for spec in functions:
        for cell in getattr(spec.call, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if id(value) in seen or isinstance(value, type | ModuleType) or callable(value):
                continue
            if callable(getattr(value, "close", None)):
                seen.add(id(value))
                yield value


def configure_logging(level: int, log_format: LogFormat = "text") -> None:
    """The dbfanout loggers at ``level`` (the CLI root stays at WARNING), each line rendered with
    its fields: ``text`` (``... batch enqueued poller=orders batch_id=...``) or ``json`` lines."""
    logging.getLogger("dbfanout").setLevel(level)
    # The app's handlers (handlers/, as `dbfanout init` writes them) log at the same level: the
    # Functions host shows a function's own logs at Information too.
    logging.getLogger("handlers").setLevel(level)
    logging.getLogger("azure").setLevel(logging.WARNING)
    use_console_format(JsonFormatter() if log_format == "json" else TextFormatter(RUN_LOG_FORMAT))
