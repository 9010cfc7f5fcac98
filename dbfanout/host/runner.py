"""What every queue-trigger runner shares: a pump thread, a pool of function calls, a graceful stop."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, TypeVar

from dbfanout.host.app_loader import FunctionSpec

__all__ = ["TriggerRunner", "joined"]

Invocation = TypeVar("Invocation")


def joined(thread: threading.Thread | None, timeout: float) -> bool:
    """Wait up to ``timeout`` for ``thread``; True when it ended (or never started)."""
    if thread is not None:
        thread.join(timeout)
        return not thread.is_alive()
    return True


class TriggerRunner(Generic[Invocation]):
    """Runs ``_run`` (the pump) on its own thread; calls go to a pool of ``max_concurrent_calls``."""

    def __init__(self, spec: FunctionSpec, queue_name: str, max_concurrent_calls: int) -> None:
        self.spec = spec
        self.queue = queue_name
        self._stop = threading.Event()
        self._done: queue.Queue[Invocation] = queue.Queue()  # calls hand their outcome back to the pump
        self._inflight: set[Invocation] = set()
        self._pool = ThreadPoolExecutor(max_concurrent_calls, thread_name_prefix=f"fn:{spec.name}")
        self._thread: threading.Thread | None = None
        self._grace = 30.0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"queue:{self.spec.name}", daemon=True)
        self._thread.start()

    def stop(self, grace: float = 30.0) -> None:
        """Stop taking messages; in-flight calls get ``grace`` seconds to finish and be settled."""
        self._grace = grace
        self._stop.set()

    @property
    def running(self) -> int:
        """Calls not settled yet (after a stop: those that outlived the grace period)."""
        return len(self._inflight)

    def join(self, timeout: float) -> bool:
        """Wait for the pump thread; True when it ended within ``timeout``."""
        return joined(self._thread, timeout)

    def _run(self) -> None:
        raise NotImplementedError
