"""Run a Python module under a profiler; write the report at exit (run by hand).

    python benchmarks/profiled.py OUT -m dbfanout.cli run --app-root DIR

``OUT.txt``: a CPU-weighted sampling profile of every thread. Every 1 ms a sampler thread reads
each thread's CPU clock (``pthread_getcpuclockid``) and charges the CPU time it used since the
last sample to the stack it is in now, so a thread waiting for the GIL, a socket or a lock is
charged nothing, and the overhead is small (no per-call hook). The switch interval is cut to
0.2 ms so the sampler gets the GIL at nearly any point; a thread's CPU since the last sample is
still charged to where it is now, so read areas and threads, not single lines. The report lists CPU per thread,
per area (our packages, the SDKs, the standard library), and the top functions by self and by
inclusive time. With ``DBFANOUT_PROFILE=cprofile`` it writes ``OUT.prof`` instead (cProfile on
every thread, ``time.thread_time``; it inflates the cost of small calls: read shares only).

The report is written at exit: a normal return, or SIGTERM, which the profiled programs (``dbfanout
run``, ``python -m sbemulator``) turn into a graceful stop.
"""

from __future__ import annotations

import atexit
import collections
import cProfile
import os
import pstats
import runpy
import sys
import threading
import time
from types import FrameType
from typing import Any

_profiles: list[cProfile.Profile] = []
_lock = threading.Lock()


def _start_thread_profile(*_: Any) -> None:
    profile = cProfile.Profile(time.thread_time)  # CPU time: a thread waiting for the GIL is not charged
    with _lock:
        _profiles.append(profile)
    profile.enable()  # replaces this setprofile hook for the thread


def _dump_cprofile(path: str) -> None:
    with _lock:
        profiles = list(_profiles)
    for p in profiles:
        p.create_stats()
    stats = pstats.Stats(profiles[0])
    for p in profiles[1:]:
        stats.add(p)
    stats.dump_stats(path)


_AREAS = (
    ("sbemulator/", "sbemulator"),
    ("/shared/codec", "shared.codec (decode/encode)"),
    ("/shared/", "shared (other)"),
    ("/poller/", "poller"),
    ("/worker/", "worker"),
    ("/dbfanout/host/", "dbfanout.host"),
    ("/dbfanout/", "dbfanout (other)"),
    ("azure/servicebus/_pyamqp", "azure-servicebus: pyamqp"),
    ("azure/servicebus", "azure-servicebus: client"),
    ("azure/storage", "azure-storage"),
    ("azure/core", "azure-core"),
    ("azure/functions", "azure-functions"),
    ("sqlalchemy", "sqlalchemy"),
    ("proton", "proton"),
    ("bench_handler", "handler"),
)


def _area(filename: str) -> str:
    for needle, name in _AREAS:
        if needle in filename:
            return name
    if "site-packages" in filename:
        return "other packages"
    return "stdlib and other"


def _name(frame: FrameType) -> str:
    code = frame.f_code
    return f"{code.co_filename.rpartition('site-packages/')[2]}:{code.co_firstlineno}({code.co_name})"


def _top(cpu: dict[str, float], n: int | None = None) -> list[tuple[str, float]]:
    return sorted(cpu.items(), key=lambda kv: -kv[1])[:n]


class Sampler:
    def __init__(self, interval: float = 0.001) -> None:
        self.interval = interval
        self.self_cpu: dict[str, float] = collections.defaultdict(float)
        self.incl_cpu: dict[str, float] = collections.defaultdict(float)
        self.area_cpu: dict[str, float] = collections.defaultdict(float)
        self.thread_cpu: dict[str, float] = collections.defaultdict(float)
        self._last: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="profiler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.interval):
            frames = sys._current_frames()
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in frames.items():
                if ident == me:
                    continue
                try:
                    cpu = time.clock_gettime(time.pthread_getcpuclockid(ident))
                except (OSError, ValueError):
                    continue
                used = cpu - self._last.get(ident, cpu)
                self._last[ident] = cpu
                if used <= 0:
                    continue
                self.thread_cpu[names.get(ident, str(ident)).split("_")[0]] += used
                self.self_cpu[_name(frame)] += used
                self.area_cpu[_area(frame.f_code.co_filename)] += used
                seen: set[str] = set()
                f: FrameType | None = frame
                while f is not None:
                    name = _name(f)
                    if name not in seen:
                        seen.add(name)
                        self.incl_cpu[name] += used
                    f = f.f_back

    def report(self, path: str) -> None:
        self._stop.set()
        total = sum(self.thread_cpu.values()) or 1.0
        lines = [f"CPU sampled: {total:.2f} s (process CPU {sum(os.times()[:2]):.2f} s)", "", "by thread:"]
        lines += [f"  {v:8.2f} s {v / total:6.1%}  {k}" for k, v in _top(self.thread_cpu)]
        lines += ["", "by area (the frame running, self time):"]
        lines += [f"  {v:8.2f} s {v / total:6.1%}  {k}" for k, v in _top(self.area_cpu)]
        lines += ["", "top functions, self:"]
        lines += [f"  {v:8.2f} s {v / total:6.1%}  {k}" for k, v in _top(self.self_cpu, 45)]
        lines += ["", "top functions, inclusive:"]
        lines += [f"  {v:8.2f} s {v / total:6.1%}  {k}" for k, v in _top(self.incl_cpu, 90)]
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")


def main() -> None:
    if len(sys.argv) < 4 or sys.argv[2] != "-m":
        raise SystemExit(__doc__)
    out, module = sys.argv[1], sys.argv[3]
    sys.argv = [module, *sys.argv[4:]]
    if os.environ.get("DBFANOUT_PROFILE") == "cprofile":
        threading.setprofile(_start_thread_profile)
        atexit.register(_dump_cprofile, out + ".prof")
        _start_thread_profile()
    else:
        # A thread holding the GIL drops it at the next switch interval: shortened, the sampler gets
        # in at (nearly) any bytecode, not only where a thread blocks (which would collect the
        # CPU of the code before each blocking call onto the call itself).
        sys.setswitchinterval(0.0002)
        sampler = Sampler()
        atexit.register(sampler.report, out + ".txt")
        sampler.start()
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
