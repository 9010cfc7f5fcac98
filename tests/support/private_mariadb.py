"""A private MariaDB with the row-based binlog on, for ``kind = "mysql_binlog"`` tests.

The shared test server (127.0.0.1:3306) runs with the binlog off and must not be reconfigured, so
the binlog tests start their own ``mariadbd`` from the installed binaries: a fresh data directory
(``mariadb-install-db``) in a temporary directory, a free port on 127.0.0.1, the binlog settings a
``mysql_binlog`` poller needs (ROW format, FULL row image, FULL row metadata), removed at the end.

One instance per test process: under pytest-xdist each worker that runs a binlog test starts its
own (a few seconds and about 100 MB each), which keeps the workers independent.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa

from tests.support.ports import free_port, wait_until

__all__ = ["BINLOG_SETTINGS", "PrivateMariaDB", "binaries_missing", "binlog_reason", "start_private_mariadb"]

#: The server options a mysql_binlog poller needs (what `dbfanout validate` checks).
BINLOG_SETTINGS = (
    "--log-bin=binlog",
    "--binlog-format=ROW",
    "--binlog-row-image=FULL",
    "--binlog-row-metadata=FULL",
    "--server-id=1",
    "--binlog-expire-logs-seconds=86400",
)


def _binary(name: str, *more: str) -> str | None:
    for candidate in (name, *more):
        found = shutil.which(candidate) or next(
            (str(p) for d in ("/usr/sbin", "/usr/local/sbin") if (p := Path(d) / candidate).exists()), None
        )
        if found:
            return found
    return None


def binaries_missing() -> str | None:
    """Why a private MariaDB cannot start here (None: it can)."""
    if _binary("mariadbd", "mysqld") is None or _binary("mariadb-install-db", "mysql_install_db") is None:
        return "mariadbd / mariadb-install-db are not installed (apt-get install mariadb-server)"
    return None


def binlog_reason(url: str) -> str | None:
    """None when the server at ``url`` writes a row-based binlog with full images and metadata, else why not."""
    try:
        engine = sa.create_engine(url, connect_args={"connect_timeout": 3})
        try:
            with engine.connect() as conn:
                rows: dict[str, str] = dict(
                    conn.execute(
                        sa.text(
                            "SHOW GLOBAL VARIABLES WHERE Variable_name IN"
                            " ('log_bin', 'binlog_format', 'binlog_row_image', 'binlog_row_metadata')"
                        )
                    ).all()
                )
        finally:
            engine.dispose()
    except Exception as exc:  # any driver error means: not this server
        return f"not reachable ({type(exc).__name__})"
    wanted = {"log_bin": "ON", "binlog_format": "ROW", "binlog_row_image": "FULL", "binlog_row_metadata": "FULL"}
    wrong = [f"{k} = {rows.get(k)}" for k, v in wanted.items() if str(rows.get(k, "")).upper() != v]
    return ", ".join(wrong) or None


@dataclass
class PrivateMariaDB:
    """A running private server: its URL (root, no password, database ``test``) and how to stop it."""

    url: str
    port: int
    directory: Path
    process: subprocess.Popen[bytes]

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and remove its directory."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        shutil.rmtree(self.directory, ignore_errors=True)


def _die_with_parent() -> None:
    """Linux: the server gets SIGTERM when the test process dies (a timeout, a kill), not left running."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: stop() still stops it
        pass


def start_private_mariadb(timeout: float = 120.0, extra: Sequence[str] = ()) -> PrivateMariaDB:
    """Initialise a data directory and start ``mariadbd`` on a free port with the binlog on
    (``extra``: more server options, e.g. ``--log-bin-compress=ON``)."""
    server, install = _binary("mariadbd", "mysqld"), _binary("mariadb-install-db", "mysql_install_db")
    assert server is not None and install is not None, binaries_missing()
    directory = Path(tempfile.mkdtemp(prefix="dbfanout-mariadb-"))
    data = directory / "data"
    as_root = ["--user=root"] if os.geteuid() == 0 else []
    subprocess.run(
        [install, "--no-defaults", "--auth-root-authentication-method=normal", f"--datadir={data}",
         "--skip-test-db", *as_root],
        check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=timeout,
    )  # fmt: skip
    port = free_port()
    log = open(directory / "mariadbd.log", "wb")  # noqa: SIM115 - the server writes it until stopped
    process = subprocess.Popen(
        [server, "--no-defaults", f"--datadir={data}", f"--socket={directory / 'mariadbd.sock'}",
         f"--pid-file={directory / 'mariadbd.pid'}", f"--port={port}", "--bind-address=127.0.0.1",
         "--skip-name-resolve", "--performance-schema=OFF", "--innodb-buffer-pool-size=64M",
         "--innodb-log-file-size=48M", "--max-connections=200", *BINLOG_SETTINGS, *extra, *as_root],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent,
    )  # fmt: skip
    log.close()
    instance = PrivateMariaDB(f"mysql+pymysql://root@127.0.0.1:{port}/test", port, directory, process)
    try:
        admin = sa.create_engine(f"mysql+pymysql://root@127.0.0.1:{port}/", connect_args={"connect_timeout": 2})

        def ready() -> bool:
            if process.poll() is not None:
                tail = (directory / "mariadbd.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"mariadbd exited with {process.returncode}:\n{tail}")
            try:
                with admin.connect() as conn:
                    conn.execute(sa.text("CREATE DATABASE IF NOT EXISTS test"))
                return True
            except sa.exc.OperationalError:
                return False

        wait_until(ready, timeout, "the private MariaDB to accept connections", interval=0.2)
        admin.dispose()
    except BaseException:
        instance.stop()
        raise
    return instance
