"""Throughput of the local Service Bus emulator, driven by the real azure-servicebus SDK.

Run by hand:  python benchmarks/bench_emulator.py [--messages 20000] [--prefetch 200]

Measures (1) send: batches of 100 x 1 KB messages; (2) receive + complete in peek-lock with
prefetch. Reports messages/s and CPU per message of the emulator and of the SDK client.

By default the emulator runs as its own process (``python -m sbemulator servicebus``), as it
does in use; ``--in-process`` runs it on a thread of the benchmark process instead, where server
and SDK compete for one GIL (slower; shows the cost tests pay).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from azure.servicebus import ServiceBusClient, ServiceBusMessage

from sbemulator import EmulatorConfig
from sbemulator.testing import running_emulator

BODY = b"x" * 1024
BATCH = 100


@dataclass(frozen=True)
class Result:
    name: str
    messages: int
    seconds: float
    process_cpu: float
    server_cpu: float

    def line(self) -> str:
        rate = self.messages / self.seconds
        return (
            f"{self.name:<28} {self.messages:>7} msgs {self.seconds:7.2f} s {rate:9.0f} msg/s"
            f"  emulator CPU {self.server_cpu / self.messages * 1e6:6.1f} us/msg"
            f"  client CPU {self.process_cpu / self.messages * 1e6:6.1f} us/msg"
        )


def _proc_cpu(pid: int, task: int | None = None) -> float:
    path = f"/proc/{pid}/task/{task}/stat" if task else f"/proc/{pid}/stat"
    with open(path) as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


_SERVER_PID: int | None = None


def _server_cpu() -> float:
    """CPU seconds of the emulator process, or of its AMQP thread when in-process."""
    if _SERVER_PID is not None:
        return _proc_cpu(_SERVER_PID)
    for t in threading.enumerate():
        if t.name.startswith("sbemulator:") and t.native_id is not None:
            return _proc_cpu(os.getpid(), t.native_id)
    return 0.0


@contextlib.contextmanager
def external_emulator() -> Iterator[str]:
    """The emulator as a child process; yields its connection string."""
    global _SERVER_PID
    config = {
        "UserConfig": {
            "Namespaces": [
                {"Name": "sbemulatorns", "Queues": [{"Name": "bench", "Properties": {"MaxSizeInMegabytes": 512}}]}
            ]
        }
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "Config.json"
        path.write_text(json.dumps(config))
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sbemulator",
                "servicebus",
                "--config",
                str(path),
                "--port",
                "0",
                "--http-port",
                "0",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        try:
            assert proc.stdout is not None
            lines = [proc.stdout.readline() for _ in range(4)]
            _SERVER_PID = proc.pid
            yield lines[3].split("Connection string: ", 1)[1].strip()
        finally:
            _SERVER_PID = None
            proc.terminate()
            proc.wait(timeout=10)


@contextlib.contextmanager
def in_process_emulator() -> Iterator[str]:
    """The emulator on a thread of this process; yields its connection string."""
    config = EmulatorConfig.with_queues("bench", max_size_bytes=512 * 1024 * 1024)
    with running_emulator(config) as emu:
        yield emu.connection_string


def measure(name: str, n: int, fn: Callable[[], None]) -> Result:
    p0, s0, t0 = time.process_time(), _server_cpu(), time.perf_counter()
    fn()
    return Result(name, n, time.perf_counter() - t0, time.process_time() - p0, _server_cpu() - s0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--prefetch", type=int, default=300)
    parser.add_argument("--in-process", action="store_true", help="run the emulator on a thread of this process")
    args = parser.parse_args()
    n = args.messages - args.messages % BATCH
    emulator = in_process_emulator() if args.in_process else external_emulator()
    with emulator as conn_str, ServiceBusClient.from_connection_string(conn_str) as client:
        with client.get_queue_sender("bench") as sender:
            sender.send_messages(ServiceBusMessage(b"warm-up"))

            def send_all() -> None:
                for _ in range(n // BATCH):
                    batch = sender.create_message_batch()
                    for _ in range(BATCH):
                        batch.add_message(ServiceBusMessage(BODY))
                    sender.send_messages(batch)

            sent = measure(f"send batch {BATCH} x 1 KB", n, send_all)
        with client.get_queue_receiver("bench", prefetch_count=args.prefetch, max_wait_time=2) as receiver:
            (warm,) = receiver.receive_messages(1, max_wait_time=5)
            receiver.complete_message(warm)

            def receive_all() -> None:
                done = 0
                while done < n:
                    got = receiver.receive_messages(max_message_count=args.prefetch, max_wait_time=5)
                    if not got:
                        raise SystemExit(f"stalled after {done} messages")
                    for m in got:
                        receiver.complete_message(m)
                    done += len(got)

            received = measure(f"receive+complete prefetch {args.prefetch}", n, receive_all)
    where = "in-process (shared GIL)" if args.in_process else "separate process"
    print(f"emulator benchmark on {os.cpu_count()} cores, {n} messages of 1 KB, emulator {where}")
    print(sent.line())
    print(received.line())


if __name__ == "__main__":
    main()
