"""bench_capacity.py's ``--writer pgbench``: PostgreSQL's own load generator offers the rate.

Python writer threads share this process's GIL and cost most of a core at 15,000 rows/s on two
cores: the writer starves the system it measures. pgbench (C, asynchronous libpq, one thread for
many clients) offers the same commits for a fraction of that. Its script inserts the step's
commits into the benchmark's table with the columns the threads writer writes (id = version from
a sequence, ``v``, ``committed_at`` the write time as epoch seconds, one value per commit), so the
handler's commit -> handler latency is the same measure. Its backends run as ``bench_writer``
(``PGAPPNAME``), the writer's backends for DbCost; its process's CPU joins the writer column.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa
from bench_latency import _cpu_seconds, _with_app_name

from tests.host.app_support import wait_for
from tests.support.private_postgres import PostgresBinariesMissing, find_bindir

WRITER_APP = "bench_writer"  # DbCost counts these backends as the writer's
COUNT_APP = "bench_count"  # this module's own queries: counted as neither the poller nor the writer


def find_pgbench() -> str | None:
    """pgbench from the PostgreSQL binaries the tests use (their bindir), else the PATH's."""
    try:
        candidate = find_bindir() / "pgbench"
    except PostgresBinariesMissing:
        candidate = None
    if candidate is not None and candidate.is_file():
        return str(candidate)
    return shutil.which("pgbench")


def pgbench_script(table: str, sequence: str, rows: int) -> str:
    """One pgbench transaction: ``rows`` rows in one INSERT (autocommit: one commit), ids from
    ``sequence``, version = id, ``committed_at`` read once per statement (an uncorrelated scalar
    subquery is an InitPlan: every row of the commit gets the same time, as the threads writer's)."""
    if rows < 1:
        raise ValueError("rows per commit: at least 1")
    return (
        f"INSERT INTO {table} (id, version, v, committed_at)\n"
        f"SELECT n, n, 'x', (SELECT extract(epoch FROM clock_timestamp())::float8)\n"
        f"FROM (SELECT nextval('{sequence}') AS n FROM generate_series(1, {rows})) AS ids;\n"
    )


def pgbench_argv(
    pgbench: str, script: Path, url: sa.URL, tps: float, clients: int, jobs: int, seconds: int
) -> list[str]:
    """The command line: the script at ``tps`` transactions a second (-R: the total over the
    clients), no vacuum, no initialisation, prepared statements (psycopg prepares a statement it
    runs often too), for ``seconds`` (the benchmark ends it earlier)."""
    argv = [pgbench, "-n", "-M", "prepared", "-f", str(script), "-R", f"{tps:g}"]
    argv += ["-c", str(clients), "-j", str(min(jobs, clients)), "-T", str(seconds)]
    argv += ["-h", url.host or "127.0.0.1", "-p", str(url.port or 5432), "-U", url.username or "postgres"]
    return [*argv, url.database or "postgres"]


@dataclass
class PgbenchWriter:
    """pgbench writing one table of a deployment; one run per step, ended by ``stop``."""

    pgbench: str
    url: str  # the deployment's database (SQLAlchemy URL)
    table: str
    folder: Path  # scripts and pgbench's output
    proc: subprocess.Popen[bytes] | None = None
    first: int = 1  # the first id of the running step
    _started: object = None  # the server's clock when the step's pgbench started

    def __post_init__(self) -> None:
        self.sequence = f"{self.table}_bench_ids"
        self._engine = sa.create_engine(_with_app_name(self.url, COUNT_APP))
        with self._engine.begin() as conn:
            conn.exec_driver_sql(f"CREATE SEQUENCE {self.sequence}")

    def start(self, first: int, rate: float, rows: int, clients: int, jobs: int, seconds: float) -> None:
        """Offer ``rate`` rows a second in commits of ``rows``, ids from ``first`` on."""
        self.first = first
        with self._engine.begin() as conn:
            restart = sa.text("SELECT setval(:s, :v, false), clock_timestamp()")
            self._started = conn.execute(restart, {"s": self.sequence, "v": first}).one()[1]
        script = self.folder / f"insert-{rows}.sql"
        script.write_text(pgbench_script(self.table, self.sequence, rows))
        url = sa.engine.make_url(self.url)
        argv = pgbench_argv(self.pgbench, script, url, rate / rows, clients, jobs, int(seconds) + 60)
        env = {**os.environ, "PGAPPNAME": WRITER_APP}
        if url.password:
            env["PGPASSWORD"] = url.password
        with (self.folder / "pgbench.log").open("ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)

    def failed(self) -> str | None:
        """pgbench's output when it exited by itself (it runs until ``stop``)."""
        if self.proc is None or self.proc.poll() is None:
            return None
        return f"pgbench exited ({self.proc.returncode}): " + (self.folder / "pgbench.log").read_text()[-2000:]

    def issued(self) -> int:
        """Rows whose ids were taken so far in this step: written, or in a commit under way."""
        with self._engine.connect() as conn:
            last, called = conn.exec_driver_sql(f"SELECT last_value, is_called FROM {self.sequence}").one()
        return int(last) - self.first + 1 if called else 0

    def cpu(self) -> float:
        """pgbench's CPU seconds so far (``/proc/<pid>/stat``; 0 once it ended)."""
        return _cpu_seconds(self.proc.pid) if self.proc is not None else 0.0

    def stop(self) -> tuple[int, int]:
        """End pgbench (a commit under way is rolled back with its connection) and return
        (rows committed in the step, the next free id)."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGKILL)  # nothing to clean up: the server ends its sessions
            self.proc.wait(30)
            self.proc = None
            # A backend inside its INSERT still commits it after the client went: count once they left.
            wait_for(lambda: self._sessions() == 0, 30, "pgbench's sessions to end", 0.05)
        with self._engine.connect() as conn:
            count = conn.execute(sa.text(f"SELECT count(*) FROM {self.table} WHERE id >= :f"), {"f": self.first})
            written = int(count.scalar_one())
        return written, self.first + self.issued()

    def _sessions(self) -> int:
        with self._engine.connect() as conn:
            query = sa.text(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND application_name = :app AND backend_start >= :t"
            )
            return int(conn.execute(query, {"app": WRITER_APP, "t": self._started}).scalar_one())

    def close(self) -> None:
        """Stop pgbench if it still runs, and release the connections."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self._engine.dispose()
