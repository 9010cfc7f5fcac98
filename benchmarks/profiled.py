"""Run a Python module with cProfile on every thread; write the merged profile at exit (run by hand).

    python benchmarks/profiled.py OUT.prof -m dbfanout.cli run --app-root DIR
    python -m pstats OUT.prof

Each thread gets its own profiler (``threading.setprofile``); at exit (a normal return, or SIGTERM,
which the profiled programs turn into a graceful stop) they are merged into one ``pstats`` file.
cProfile inflates the cost of small calls: read shares, not absolute times.
"""

from __future__ import annotations

import atexit
import cProfile
import pstats
import runpy
import sys
import threading
from typing import Any

_profiles: list[cProfile.Profile] = []
_lock = threading.Lock()


def _start_thread_profile(*_: Any) -> None:
    profile = cProfile.Profile()
    with _lock:
        _profiles.append(profile)
    profile.enable()  # replaces this setprofile hook for the thread


def _dump(path: str) -> None:
    with _lock:
        profiles = list(_profiles)
    for p in profiles:
        p.create_stats()
    stats = pstats.Stats(profiles[0])
    for p in profiles[1:]:
        stats.add(p)
    stats.dump_stats(path)


def main() -> None:
    if len(sys.argv) < 4 or sys.argv[2] != "-m":
        raise SystemExit(__doc__)
    out, module = sys.argv[1], sys.argv[3]
    sys.argv = [module, *sys.argv[4:]]
    threading.setprofile(_start_thread_profile)
    atexit.register(_dump, out)
    _start_thread_profile()
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
