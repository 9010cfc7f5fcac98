"""What idle pollers cost: N pollers in one app under ``dbfanout run``, none finding a row (run by hand).

    python benchmarks/bench_idle.py [--pollers 100] [--seconds 30] [--warmup 10] [--baseline DIR] [--profile DIR]

Each poller reads its own empty PostgreSQL table every second (``*/1 * * * * *``); all send to one
queue. The host runs as users run it (``python -m dbfanout.cli run``, log level WARNING) against
Azurite (behind a counting proxy: every storage request the host makes goes through it) and the
project's Service Bus emulator (in this process). After ``--warmup`` seconds (every poller has
ticked and holds its lease), over ``--seconds``:

* host CPU in cores (user + system time of the host process / wall time), and its RSS at the end;
* database connections the host holds (``pg_stat_activity`` rows with the app's application_name);
* storage requests per tick: requests through the proxy / (pollers x seconds) — the schedule fires
  once a second, so that is the number of ticks.

``--baseline DIR`` runs the same on another checkout first (``git archive COMMIT | tar -x -C DIR``;
its packages via ``PYTHONPATH``, its own defaults such as ``lease_ttl_seconds``), one table for both.
Targets (issue 23): storage requests per idle tick <= 0.1; 100 idle pollers <= 0.10 cores.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import sqlalchemy as sa  # noqa: E402

from sbemulator.testing import running_emulator, unique_queue  # noqa: E402
from tests.host.app_support import AppDir, drop_pg_schema, pg_schema_url, wait_for  # noqa: E402
from tests.support.azurite import start_azurite  # noqa: E402
from tests.support.databases import PG_URL, unique_name  # noqa: E402
from tests.support.faultproxy import FaultProxy  # noqa: E402

POLLER = """
[pollers.p{i}]
source_url = "${{ORDERS_DB_URL}}"
table = "t{i}"
cursor = "version"
pk = ["id"]
queue = "{queue}"
schedule = "*/1 * * * * *"
settle_seconds = 0
handler = "handlers.example:handle"
"""


@dataclass
class Result:
    label: str
    pollers: int
    seconds: float
    cores: float
    rss_mb: float
    connections: int
    requests: int

    @property
    def per_tick(self) -> float:
        return self.requests / (self.pollers * self.seconds)


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _connections(app_name: str) -> int:
    engine = sa.create_engine(PG_URL)
    try:
        with engine.connect() as conn:
            query = sa.text("SELECT count(*) FROM pg_stat_activity WHERE application_name = :a")
            return int(conn.execute(query, {"a": app_name}).scalar() or 0)
    finally:
        engine.dispose()


def run_once(label: str, code: Path, args: argparse.Namespace, tmp: Path) -> Result:
    azurite = start_azurite()
    proxy = FaultProxy(azurite.blob_port)
    schema = unique_name("idle")
    app_name = f"bench_idle_{uuid.uuid4().hex[:8]}"
    url = pg_schema_url(PG_URL, schema) + f"&application_name={app_name}"
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        for i in range(args.pollers):
            conn.exec_driver_sql(f"CREATE TABLE t{i} (id INTEGER PRIMARY KEY, version INTEGER NOT NULL, v TEXT)")
            conn.exec_driver_sql(f"CREATE INDEX ix_t{i} ON t{i} (version, id)")
    engine.dispose()
    host: subprocess.Popen[bytes] | None = None
    try:
        with running_emulator() as emulator:
            queue = unique_queue(emulator, "idle", requires_duplicate_detection=True)
            storage = azurite.connection_string.replace(f":{azurite.blob_port}/", f":{proxy.port}/")
            app = AppDir.create(
                tmp / label, queue=queue, storage=storage, servicebus=emulator.connection_string, source_url=url
            )
            for name in ("function_app.py", "host.json"):  # the contestant's own app files
                shutil.copy(code / name, app.root / name)
            pollers = "".join(POLLER.format(i=i, queue=queue) for i in range(args.pollers))
            (app.root / "dbfanout.toml").write_text(f'[app]\nname = "{app.app_name}"\n{pollers}')
            env = {k: v for k, v in os.environ.items() if k not in app.settings}
            env.update(PYTHONPATH=str(code), PYTHONUNBUFFERED="1")
            python = [sys.executable]
            if args.profile is not None:  # a CPU-weighted sampler on every thread, written at exit
                args.profile.mkdir(parents=True, exist_ok=True)
                python += [str(Path(__file__).with_name("profiled.py")), str(args.profile / label)]
            cmd = [*python, "-m", "dbfanout.cli", "run", "--app-root", str(app.root)]
            cmd += ["--log-level", args.log_level]
            with (app.root / "host.log").open("wb") as log:
                host = subprocess.Popen(cmd, cwd=app.root, env=env, stdout=log, stderr=subprocess.STDOUT)
            wait_for(lambda: proxy.requests >= 2 * args.pollers, 120, "every poller's first tick")
            time.sleep(args.warmup)  # every poller settles into its idle ticks
            cpu0, requests0, t0 = _cpu_seconds(host.pid), proxy.requests, time.monotonic()
            time.sleep(args.seconds)  # the measurement window
            wall = time.monotonic() - t0
            result = Result(
                label,
                args.pollers,
                wall,
                (_cpu_seconds(host.pid) - cpu0) / wall,
                _rss_mb(host.pid),
                _connections(app_name),
                proxy.requests - requests0,
            )
            if host.poll() is not None:
                raise RuntimeError(f"the host exited early (see {app.root / 'host.log'})")
            return result
    finally:
        if host is not None and host.poll() is None:
            host.terminate()
            try:
                host.wait(60)
            except subprocess.TimeoutExpired:
                host.kill()
        proxy.close()
        azurite.stop()
        drop_pg_schema(PG_URL, schema)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--pollers", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=30.0, help="the measurement window")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds after every poller's first tick")
    parser.add_argument("--baseline", type=Path, help="another checkout, measured first with the same harness")
    parser.add_argument("--keep", action="store_true", help="keep the app folders (host.log)")
    parser.add_argument("--log-level", default="WARNING", help="the host's (INFO logs every tick)")
    parser.add_argument("--profile", type=Path, help="write DIR/<code>.txt: a CPU profile of the host")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-idle-"))
    try:
        contestants = [("baseline", args.baseline.resolve())] if args.baseline else []
        contestants.append(("this", ROOT))
        results = [run_once(label, code, args, tmp) for label, code in contestants]
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"{args.pollers} idle pollers, 1 s schedule, {args.seconds:.0f} s window after {args.warmup:.0f} s warm-up")
    print("| code | host CPU (cores) | host RSS | DB connections | storage requests | per tick |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r.label} | {r.cores:.3f} | {r.rss_mb:.0f} MB | {r.connections} | {r.requests} | {r.per_tick:.3f} |")


if __name__ == "__main__":
    main()
