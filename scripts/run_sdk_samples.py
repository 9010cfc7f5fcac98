"""Run the official azure-servicebus samples, unchanged, against the local emulator.

    .venv/bin/python scripts/run_sdk_samples.py [--jobs 2] [--timeout 90] [-k receive] [--keep]

The samples come from the azure-servicebus source distribution on the package registry, fetched at
run time (``pip download --no-binary :all: --no-deps azure-servicebus==<installed version>``); no
copy is kept in this repository. The emulator runs as ``python -m sbemulator servicebus`` on free
ports with a Config.json holding one queue, one session queue and one topic/subscription per
sample (samples leave messages behind; separate entities keep them from seeing each other's).

A sample runs unchanged except for what ``UseDevelopmentEmulator=true`` implies for a connection
string: every sample that builds its client from ``SERVICEBUS_FULLY_QUALIFIED_NAMESPACE`` and
``DefaultAzureCredential`` gets a credential the emulator accepts and plain TCP instead of TLS
(this script re-runs itself as a thin wrapper that patches those two things, then runs the sample
file with ``runpy``). Samples that need the management (ATOM) API, Entra ID, an HTTP proxy or a
custom endpoint are skipped and listed; the two that receive until interrupted pass when they are
still running, without a traceback, after 15 s; ``--quick`` also skips the two that sleep for
minutes (auto_lock_renew). Prints one line per sample and ``N passed, N failed,
N skipped``; exits 1 when a sample failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

SKIPPED = {
    "mgmt_queue": "needs the management (ATOM) API",
    "mgmt_rule": "needs the management (ATOM) API",
    "mgmt_subscription": "needs the management (ATOM) API",
    "mgmt_topic": "needs the management (ATOM) API",
    "topic_subscription_with_rule_operations": "needs the management (ATOM) API",
    "client_identity_authentication": "needs Entra ID (EnvironmentCredential)",
    "proxy": "needs an HTTP proxy",
    "connection_to_custom_endpoint_address": "needs a custom endpoint / proxy host",
}
PIP_DOWNLOAD = [sys.executable, "-m", "pip", "download", "-q", "--no-binary", ":all:", "--no-deps"]
# These receive with `for msg in receiver:` and no max_wait_time: they run until interrupted, on
# the real service too. They pass when still running, without a traceback, after this many seconds.
RUN_UNTIL_INTERRUPTED = {"receive_iterator_queue": 15.0, "failure_and_recovery": 15.0}
# These sleep 200 s (sync) and 480 s (async) on purpose, locks renewed while "processing": they
# need a longer timeout; --quick skips them (tests/emulator/test_fidelity.py covers the renewer).
SLOW = {"auto_lock_renew": 660.0}
SAS_POLICY, SAS_KEY = "RootManageSharedAccessKey", "SAS_KEY_VALUE"


@dataclass(frozen=True)
class Sample:
    """One sample file and the entity names it gets."""

    path: Path
    index: int
    skipped_because: str | None = None

    @property
    def name(self) -> str:
        return f"{self.path.parent.name}/{self.path.stem}"

    @property
    def skip_reason(self) -> str | None:
        return self.skipped_because or SKIPPED.get(self.path.stem.removesuffix("_async"))


def fetch_samples(workdir: Path) -> Path:
    """Download and unpack the sdist of the installed azure-servicebus; returns its samples/ folder."""
    wanted = version("azure-servicebus")
    subprocess.run(
        [*PIP_DOWNLOAD, f"azure-servicebus=={wanted}", "-d", str(workdir)],
        check=True,
    )
    (archive,) = workdir.glob("azure*servicebus-*.tar.gz")
    with tarfile.open(archive) as tar:
        tar.extractall(workdir, filter="data")
    (samples,) = workdir.glob("azure*servicebus-*/samples")
    return samples


def write_config(path: Path, samples: list[Sample]) -> None:
    """A Config.json with a queue, a session queue and a topic/subscription per sample."""
    queues: list[dict[str, Any]] = []
    topics: list[dict[str, Any]] = []
    for s in samples:
        queues.append({"Name": f"q{s.index}", "Properties": {"LockDuration": "PT30S"}})
        queues.append({"Name": f"sq{s.index}", "Properties": {"LockDuration": "PT30S", "RequiresSession": True}})
        topics.append(
            {"Name": f"t{s.index}", "Subscriptions": [{"Name": f"s{s.index}", "Properties": {"LockDuration": "PT30S"}}]}
        )
    doc = {"UserConfig": {"Namespaces": [{"Name": "sbemulatorns", "Queues": queues, "Topics": topics}]}}
    path.write_text(json.dumps(doc, indent=1), encoding="utf-8")


def start_emulator(config: Path, log: Path) -> tuple[subprocess.Popen[bytes], int]:
    """``python -m sbemulator servicebus`` on free ports; returns the process and its AMQP port."""
    out = log.open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "sbemulator", "servicebus", "--config", str(config), "--port", "0", "--http-port", "0"],
        stdout=out,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        m = re.search(rb"AMQP port: (\d+)", log.read_bytes())
        if m:
            return proc, int(m.group(1))
        if proc.poll() is not None:
            break
        time.sleep(0.1)  # polling a child's output file: no condition to wait on
    proc.kill()
    raise SystemExit(f"the emulator did not start; its output:\n{log.read_text(errors='replace')}")


def run_sample(sample: Sample, port: int, timeout: float, logdir: Path) -> tuple[str, float, str]:
    """Run one sample in a child process; returns (PASS|FAIL|TIMEOUT, seconds, last output line)."""
    i = sample.index
    env = dict(
        os.environ,
        SERVICEBUS_CONNECTION_STR=(
            f"Endpoint=sb://127.0.0.1:{port};SharedAccessKeyName={SAS_POLICY};"
            f"SharedAccessKey={SAS_KEY};UseDevelopmentEmulator=true"
        ),
        SERVICEBUS_FULLY_QUALIFIED_NAMESPACE=f"127.0.0.1:{port}",
        SERVICEBUS_QUEUE_NAME=f"q{i}",
        SERVICEBUS_SESSION_QUEUE_NAME=f"sq{i}",
        SERVICEBUS_TOPIC_NAME=f"t{i}",
        SERVICEBUS_SUBSCRIPTION_NAME=f"s{i}",
        SERVICEBUS_SESSION_ID="session-1",
        SERVICEBUS_SAS_POLICY=SAS_POLICY,
        SERVICEBUS_SAS_KEY=SAS_KEY,
        PYTHONUNBUFFERED="1",
    )
    log = logdir / f"{sample.name.replace('/', '__')}.log"
    stem = sample.path.stem.removesuffix("_async")
    endless = RUN_UNTIL_INTERRUPTED.get(stem)
    started = time.monotonic()
    with log.open("wb") as out:
        try:
            proc = subprocess.run(
                [sys.executable, __file__, "--run-one", str(sample.path)],
                cwd=sample.path.parent,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=endless or max(timeout, SLOW.get(stem, 0.0)),
            )
            status = "PASS" if proc.returncode == 0 else "FAIL"
        except subprocess.TimeoutExpired:
            status = "TIMEOUT" if endless is None or "Traceback" in log.read_text(errors="replace") else "PASS"
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    return status, time.monotonic() - started, (lines[-1][:160] if lines else "")


def run_one(path: str) -> None:
    """The wrapper: emulator credential and plain TCP for credential-built clients, then the sample."""
    import runpy

    import azure.identity
    import azure.identity.aio
    from azure.core.credentials import AccessToken
    from azure.servicebus import ServiceBusClient
    from azure.servicebus.aio import ServiceBusClient as AsyncServiceBusClient

    class EmulatorCredential:
        """Stands in for DefaultAzureCredential: the emulator accepts any token."""

        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

        def get_token(self, *scopes: str, **kwargs: object) -> AccessToken:
            return AccessToken("emulator-token", int(time.time()) + 3600)

        def close(self) -> None:
            pass

        def __enter__(self) -> EmulatorCredential:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

    class AsyncEmulatorCredential(EmulatorCredential):
        async def get_token(self, *scopes: str, **kwargs: object) -> AccessToken:  # type: ignore[override]
            return AccessToken("emulator-token", int(time.time()) + 3600)

        async def close(self) -> None:  # type: ignore[override]
            pass

        async def __aenter__(self) -> AsyncEmulatorCredential:
            return self

        async def __aexit__(self, *exc: object) -> None:
            pass

    azure.identity.DefaultAzureCredential = EmulatorCredential  # type: ignore[misc,assignment]
    azure.identity.aio.DefaultAzureCredential = AsyncEmulatorCredential  # type: ignore[misc,assignment]
    for cls in (ServiceBusClient, AsyncServiceBusClient):
        original = cls.__init__

        def patched(self: Any, *args: Any, __original: Any = original, **kwargs: Any) -> None:
            kwargs.setdefault("use_tls", False)  # what UseDevelopmentEmulator=true does
            __original(self, *args, **kwargs)

        cls.__init__ = patched  # type: ignore[method-assign]
    sys.argv = [path]
    runpy.run_path(path, run_name="__main__")


def discover(samples_dir: Path, pattern: str | None) -> list[Sample]:
    """Every sample file, sync then async, optionally filtered by a substring."""
    files = sorted(samples_dir.glob("sync_samples/*.py")) + sorted(samples_dir.glob("async_samples/*.py"))
    chosen = [f for f in files if not pattern or pattern in f"{f.parent.name}/{f.stem}"]
    return [Sample(f, i) for i, f in enumerate(chosen)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-one", help=argparse.SUPPRESS)
    parser.add_argument("--jobs", type=int, default=2, help="samples run in parallel (default 2)")
    parser.add_argument("--timeout", type=float, default=90.0, help="seconds per sample (default 90)")
    parser.add_argument("-k", dest="pattern", help="only samples whose name contains this")
    parser.add_argument("--keep", action="store_true", help="keep the temp folder (logs per sample)")
    parser.add_argument("--quick", action="store_true", help="skip the samples that sleep for minutes")
    args = parser.parse_args()
    if args.run_one:
        run_one(args.run_one)
        return 0
    workdir = Path(tempfile.mkdtemp(prefix="sbsamples-"))
    samples = discover(fetch_samples(workdir), args.pattern)
    if args.quick:
        samples = [
            Sample(s.path, s.index, "sleeps for minutes (--quick)") if s.path.stem.removesuffix("_async") in SLOW else s
            for s in samples
        ]
    runnable = [s for s in samples if s.skip_reason is None]
    config, logdir = workdir / "Config.json", workdir / "logs"
    logdir.mkdir()
    write_config(config, runnable)
    emulator, port = start_emulator(config, workdir / "emulator.log")
    results: dict[str, tuple[str, float, str]] = {}
    try:
        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            futures = {s.name: pool.submit(run_sample, s, port, args.timeout, logdir) for s in runnable}
            for name, fut in futures.items():
                results[name] = status, took, last = fut.result()
                detail = "" if status == "PASS" else f"  | {last}"
                print(f"{status:7} {took:5.1f}s  {name}{detail}", flush=True)
    finally:
        emulator.terminate()
        emulator.wait(timeout=15)
    for s in samples:
        if s.skip_reason:
            print(f"SKIP            {s.name}  | {s.skip_reason}")
    passed = sum(1 for r in results.values() if r[0] == "PASS")
    failed = len(results) - passed
    skipped = len(samples) - len(runnable)
    print(f"logs: {workdir}" if args.keep or failed else "", end="\n" if args.keep or failed else "")
    if not args.keep and not failed:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
