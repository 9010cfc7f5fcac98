"""A private PostgreSQL for the tests: the installed binaries, a temporary folder, a free port.

When the server at the test URL cannot do what a test needs (``wal_level = logical`` for the
pg_logical source), the tests start their own instance with ``initdb`` and ``pg_ctl`` instead of
asking the user to restart theirs with other settings. It listens on 127.0.0.1 only, trusts
local connections (user ``postgres``, database ``test``) and is deleted when stopped.

``initdb`` refuses to run as root: as root the instance runs as the ``postgres`` OS user (the
packages create it) and its folder is theirs.

Each instance has a watchdog process: when the process that owns it (the pytest controller)
ends without stopping it (killed), the watchdog stops the server and deletes its folder, so a
killed test run leaves no server behind on a shared machine.

One instance per test session, shared by the xdist workers: ``shared_private_postgres`` starts
it under a file lock in the session's folder and records it there; the controller stops what
is recorded at the end (``stop_recorded``).
"""

from __future__ import annotations

import fcntl
import glob
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from tests.support.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
SERVICE_USER = "postgres"
DATABASE = "test"

# A throwaway instance: no fsync (nothing survives it), small memory on a busy machine.
# synchronous_commit stays on: logical decoding reads only flushed WAL, and the tests read a
# change right after its commit returns.
BASE_SETTINGS = {"fsync": "off", "full_page_writes": "off", "shared_buffers": "32MB"}

# For kind = "pg_logical": the suite's tests each create a slot (two xdist workers at once, crash
# tests leave theirs active until the killed backend ends) and may stream over the replication
# protocol.
LOGICAL_SETTINGS = {"wal_level": "logical", "max_replication_slots": "40", "max_wal_senders": "40"}


class PostgresBinariesMissing(RuntimeError):
    """initdb / pg_ctl are not installed here (or cannot be run): the test skips with this."""


def find_bindir() -> Path:
    """The folder with ``initdb`` and ``pg_ctl``: $DBFANOUT_TEST_PG_BINDIR when set (only it), else
    ``pg_config --bindir``, the newest /usr/lib/postgresql/*/bin, or the PATH's."""
    chosen = os.environ.get("DBFANOUT_TEST_PG_BINDIR")
    if chosen:
        if (Path(chosen) / "initdb").is_file() and (Path(chosen) / "pg_ctl").is_file():
            return Path(chosen)
        raise PostgresBinariesMissing(f"PostgreSQL's initdb and pg_ctl are not in DBFANOUT_TEST_PG_BINDIR={chosen}")
    candidates: list[Path] = []
    pg_config = shutil.which("pg_config")
    if pg_config:
        out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, check=False)
        if out.returncode == 0 and out.stdout.strip():
            candidates.append(Path(out.stdout.strip()))
    by_version = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=_version_key, reverse=True)
    candidates += [Path(p) for p in by_version]
    initdb = shutil.which("initdb")
    if initdb:
        candidates.append(Path(initdb).resolve().parent)
    for folder in candidates:
        if (folder / "initdb").is_file() and (folder / "pg_ctl").is_file():
            return folder
    raise PostgresBinariesMissing(
        "PostgreSQL's initdb and pg_ctl are not installed (looked in pg_config --bindir, "
        "/usr/lib/postgresql/*/bin and the PATH; or set DBFANOUT_TEST_PG_BINDIR)"
    )


def _version_key(path: str) -> tuple[int, ...]:
    version = Path(path).parent.name
    return tuple(int(part) for part in version.split(".") if part.isdigit())


@dataclass(frozen=True)
class _RunAs:
    """Who runs the server: the current user, or the postgres OS user when we are root."""

    uid: int | None = None
    gid: int | None = None

    @classmethod
    def for_current_user(cls) -> _RunAs:
        if os.geteuid() != 0:
            return cls()
        try:
            entry = pwd.getpwnam(SERVICE_USER)
        except KeyError:
            raise PostgresBinariesMissing(
                f"initdb refuses to run as root and there is no {SERVICE_USER!r} OS user to run it as"
            ) from None
        return cls(entry.pw_uid, entry.pw_gid)

    def run(self, argv: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
        extra: dict[str, Any] = {}
        if self.uid is not None:
            extra = {"user": self.uid, "group": self.gid, "extra_groups": []}
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}  # no stray PGDATA, PGPORT
        env["LC_ALL"] = "C"
        return subprocess.run(
            argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False, **extra
        )

    def own(self, path: Path) -> None:
        if self.uid is not None and self.gid is not None:
            os.chown(path, self.uid, self.gid)


@dataclass
class PrivatePostgres:
    """A running private instance; ``url`` is a postgresql+psycopg URL to its ``test`` database."""

    url: str
    port: int
    root: Path
    bindir: Path
    server_pid: int

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    def stop(self) -> None:
        """Stop the server (fast: open connections are ended) and delete its folder. Idempotent."""
        _stop(self.bindir, self.root)

    def record(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "port": self.port,
            "root": str(self.root),
            "bindir": str(self.bindir),
            "server_pid": self.server_pid,
        }

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> PrivatePostgres:
        return cls(
            url=str(record["url"]),
            port=int(record["port"]),
            root=Path(record["root"]),
            bindir=Path(record["bindir"]),
            server_pid=int(record["server_pid"]),
        )

    def alive(self) -> bool:
        return (self.data_dir / "postmaster.pid").is_file() and _pid_alive(self.server_pid)

    def __enter__(self) -> PrivatePostgres:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def start_private_postgres(settings: dict[str, str], *, owner_pid: int | None = None) -> PrivatePostgres:
    """Start a private PostgreSQL with these server settings (``{"wal_level": "logical"}``) and a
    database ``test``; stop it with ``.stop()`` or use it as a context manager.

    ``owner_pid`` (default: this process) is the process whose end stops the instance if nobody
    called ``stop()``. Raises ``PostgresBinariesMissing`` when the binaries are absent, and
    ``RuntimeError`` with the server's log when it does not start.
    """
    bindir = find_bindir()
    run_as = _RunAs.for_current_user()
    # Run as postgres, the folder must be reachable by them: /tmp, not a root-only $TMPDIR.
    parent = "/tmp" if run_as.uid is not None and os.path.isdir("/tmp") else None
    root = Path(tempfile.mkdtemp(prefix="dbfanout-pg-", dir=parent))
    try:
        run_as.own(root)
        init = run_as.run(
            [str(bindir / "initdb"), "-D", str(root / "data"), "-U", "postgres", "-A", "trust", "-E", "UTF8",
             "--no-locale", "--no-sync"],
            cwd=root, timeout=180,
        )  # fmt: skip
        if init.returncode != 0:
            raise RuntimeError(f"initdb failed ({init.returncode}): {init.stderr.strip()[-2000:]}")
        instance = _start_on_a_free_port(bindir, root, run_as, {**BASE_SETTINGS, **settings})
        _create_database(instance.port)
    except BaseException:
        _stop(bindir, root)
        raise
    _spawn_watchdog(owner_pid if owner_pid is not None else os.getpid(), bindir, root)
    return instance


def _start_on_a_free_port(bindir: Path, root: Path, run_as: _RunAs, settings: dict[str, str]) -> PrivatePostgres:
    """pg_ctl start; another process may take the free port first, so a refused start retries."""
    conf = root / "data" / "postgresql.conf"
    base = conf.read_text(encoding="utf-8")
    failure = ""
    for _ in range(3):
        port = free_port()
        lines = {"listen_addresses": "127.0.0.1", "port": str(port), "unix_socket_directories": str(root), **settings}
        conf.write_text(base + "\n# dbfanout tests\n" + "".join(f"{k} = {_quote(v)}\n" for k, v in lines.items()))
        started = run_as.run(
            [str(bindir / "pg_ctl"), "-D", str(root / "data"), "-l", str(root / "server.log"), "-w", "-t", "120",
             "start"],
            cwd=root, timeout=180,
        )  # fmt: skip
        if started.returncode == 0:
            pid = int((root / "data" / "postmaster.pid").read_text().split()[0])
            url = f"postgresql+psycopg://postgres@127.0.0.1:{port}/{DATABASE}"
            return PrivatePostgres(url=url, port=port, root=root, bindir=bindir, server_pid=pid)
        log = root / "server.log"
        failure = (log.read_text(errors="replace") if log.is_file() else "") + started.stderr
    raise RuntimeError(f"the private PostgreSQL did not start: {failure.strip()[-2000:]}")


def _quote(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _create_database(port: int) -> None:
    import psycopg

    with psycopg.connect(host="127.0.0.1", port=port, user="postgres", dbname="postgres", autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {DATABASE}")  # a constant name, not input


def _stop(bindir: Path, root: Path) -> None:
    data = root / "data"
    if (data / "postmaster.pid").is_file():
        run_as = _RunAs.for_current_user()
        run_as.run([str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "-t", "60", "stop"], root, 90)
        if (data / "postmaster.pid").is_file():  # did not stop in time: end it
            run_as.run([str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"], root, 30)
    shutil.rmtree(root, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _spawn_watchdog(owner_pid: int, bindir: Path, root: Path) -> None:
    subprocess.Popen(
        [sys.executable, "-m", "tests.support.private_postgres", "watch", str(owner_pid), str(bindir), str(root)],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # a Ctrl-C to the test run's process group does not end it first
    )


def _watch(owner_pid: int, bindir: Path, root: Path) -> None:
    """Until the folder is gone (stopped normally): when the owner ends, stop and delete."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while root.exists():
        if not _pid_alive(owner_pid):
            _stop(bindir, root)
            return
        time.sleep(1)  # a watchdog's poll, not a test's wait


# ----------------------------------------------------------------------------------------------
# One instance per test session, shared by the xdist workers


@contextmanager
def _locked(session_dir: Path) -> Iterator[Path]:
    session_dir.mkdir(parents=True, exist_ok=True)
    with open(session_dir / "private-postgres.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield session_dir / "private-postgres.json"
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _read(state: Path) -> dict[str, dict[str, Any]]:
    return json.loads(state.read_text(encoding="utf-8")) if state.is_file() else {}


def shared_private_postgres(session_dir: Path, key: str, settings: dict[str, str], owner_pid: int) -> str:
    """The URL of this session's private instance named ``key``, started by the first caller.

    Workers of one session pass the same ``session_dir``; the instance lives until
    ``stop_recorded(session_dir)`` (the controller, at the end) or the owner's end (the watchdog).
    """
    with _locked(session_dir) as state:
        records = _read(state)
        if key in records:
            known = PrivatePostgres.from_record(records[key])
            if known.alive():
                return known.url
            known.stop()  # whatever is left of it
        instance = start_private_postgres(settings, owner_pid=owner_pid)
        records[key] = instance.record()
        state.write_text(json.dumps(records), encoding="utf-8")
        return instance.url


def stop_recorded(session_dir: Path) -> None:
    """Stop every instance the session recorded and delete the session's folder."""
    if not session_dir.is_dir():
        return
    with _locked(session_dir) as state:
        for record in _read(state).values():
            PrivatePostgres.from_record(record).stop()
    shutil.rmtree(session_dir, ignore_errors=True)


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "watch":
    _watch(int(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]))
