"""A private PostgreSQL server for one test module: server settings of its own, nobody else's.

Tests that need a server-wide setting (``max_slot_wal_keep_size``, ``wal_level``) must never change
the shared servers (5432/5433: other tests and engineers use them). This starts one with
``initdb``/``pg_ctl`` from ``/usr/lib/postgresql/*/bin`` in a temporary directory on a free port,
as the ``postgres`` OS user when run as root (initdb refuses root), with database ``test``; the
test is skipped, saying why, when the binaries are absent.

    with start_private_postgres({"wal_level": "logical"}) as pg:
        engine = sa.create_engine(pg.url)
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest

from tests.support.ports import free_port

__all__ = ["PrivatePostgres", "postgres_bin_dir", "start_private_postgres"]

_START_TIMEOUT = 60


def postgres_bin_dir() -> Path | None:
    """The newest ``/usr/lib/postgresql/<version>/bin`` holding initdb and pg_ctl (None: none)."""
    candidates = [Path(d) for d in glob.glob("/usr/lib/postgresql/*/bin")]
    usable = [d for d in candidates if (d / "initdb").is_file() and (d / "pg_ctl").is_file()]
    usable.sort(key=lambda d: int(d.parent.name) if d.parent.name.isdigit() else 0)
    return usable[-1] if usable else None


class PrivatePostgres:
    """A running private server: ``url`` (``postgresql+psycopg://postgres@127.0.0.1:<port>/test``)."""

    def __init__(self, bin_dir: Path, data_dir: Path, port: int, run_as: dict[str, Any]) -> None:
        self.bin_dir, self.data_dir, self.port = bin_dir, data_dir, port
        self._run_as = run_as
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{port}/test"
        self._stopped = False

    def stop(self) -> None:
        """Stop the server (immediately: it holds nothing to keep) and remove its directory."""
        if self._stopped:
            return
        self._stopped = True
        subprocess.run(
            [str(self.bin_dir / "pg_ctl"), "stop", "-D", str(self.data_dir), "-m", "immediate", "-w"],
            capture_output=True,
            check=False,
            timeout=_START_TIMEOUT,
            **self._run_as,
        )
        shutil.rmtree(self.data_dir.parent, ignore_errors=True)

    def __enter__(self) -> PrivatePostgres:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def start_private_postgres(settings: dict[str, str]) -> PrivatePostgres:
    """Start a private server with ``settings`` in its postgresql.conf; skips when it cannot run here."""
    bin_dir = postgres_bin_dir()
    if bin_dir is None:
        pytest.skip("no PostgreSQL server binaries (initdb, pg_ctl) under /usr/lib/postgresql/*/bin")
    root = tempfile.mkdtemp(prefix="dbfanout-pg-")
    run_as: dict[str, Any] = {"cwd": root}
    if os.geteuid() == 0:  # initdb refuses to run as root
        try:
            user = pwd.getpwnam("postgres")
        except KeyError:
            shutil.rmtree(root, ignore_errors=True)
            pytest.skip("running as root and there is no postgres OS user to run initdb as")
        os.chown(root, user.pw_uid, user.pw_gid)
        run_as.update(user=user.pw_uid, group=user.pw_gid)
    data = Path(root) / "data"
    port = free_port()
    try:
        _run([str(bin_dir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"],
             run_as)  # fmt: skip
        conf = {
            "listen_addresses": "127.0.0.1",
            "port": str(port),
            "unix_socket_directories": root,
            "fsync": "off",
            "max_connections": "40",
            "shared_buffers": "16MB",
            **settings,
        }
        with (data / "postgresql.conf").open("a", encoding="utf-8") as f:
            for key, value in conf.items():
                f.write(f"{key} = '{value}'\n")
        _run([str(bin_dir / "pg_ctl"), "start", "-D", str(data), "-l", str(Path(root) / "server.log"), "-w",
              "-t", str(_START_TIMEOUT)], run_as)  # fmt: skip
        _create_database(port)
    except BaseException:
        subprocess.run([str(bin_dir / "pg_ctl"), "stop", "-D", str(data), "-m", "immediate"],
                       capture_output=True, check=False, **run_as)  # fmt: skip
        shutil.rmtree(root, ignore_errors=True)
        raise
    return PrivatePostgres(bin_dir, data, port, run_as)


def _create_database(port: int) -> None:
    import psycopg  # the dev environment's driver (the tests' PostgreSQL URLs use it)

    with psycopg.connect(host="127.0.0.1", port=port, user="postgres", dbname="postgres", autocommit=True) as conn:
        conn.execute("CREATE DATABASE test")


def _run(argv: list[str], run_as: dict[str, Any]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=_START_TIMEOUT, check=False, **run_as)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:2])} failed ({done.returncode}): {done.stderr.strip() or done.stdout}")
