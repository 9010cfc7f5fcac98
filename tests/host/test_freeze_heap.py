"""dbfanout run's host freezes the heap it serves with (issue 41: the collector's full passes)."""

from __future__ import annotations

import gc
import threading
from pathlib import Path

import pytest

from dbfanout.host import host as host_module
from dbfanout.host.host import LocalHost


def test_serving_freezes_what_was_built_to_start_and_collects_garbage_first(tmp_path: Path) -> None:
    # Given a host about to serve, a heap with nothing frozen, and a cycle that is already garbage
    gc.unfreeze()
    stop = threading.Event()
    stop.set()  # serve for no time at all
    try:

        class Cycle:
            pass

        cycle = Cycle()
        cycle.me = cycle  # type: ignore[attr-defined]
        collected = gc.get_stats()[2]["collected"]
        del cycle
        # When it waits
        LocalHost(tmp_path).wait(stop)
        # Then what was alive is frozen, and the garbage was collected first, not frozen with it
        assert gc.get_freeze_count() > 1000
        assert gc.get_stats()[2]["collected"] > collected
    finally:
        gc.unfreeze()  # the rest of the test session collects as before


def test_the_warm_freeze_comes_once_after_warm_seconds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a host whose warm-up is over at once, serving for a moment
    calls: list[int] = []
    monkeypatch.setattr(host_module, "WARM_SECONDS", 0.0)
    monkeypatch.setattr(host_module, "freeze_heap", lambda: calls.append(1))
    # When it waits a moment; Then the heap was frozen at the start and once when warm, not again
    LocalHost(tmp_path).wait(threading.Event(), duration=0.6)
    assert len(calls) == 2
