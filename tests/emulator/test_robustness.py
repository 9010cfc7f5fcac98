"""The server survives crashing clients, garbage and handler bugs; health endpoint answers."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from azure.servicebus import ServiceBusClient, ServiceBusMessage
from azure.servicebus.exceptions import ServiceBusError

from sbemulator import Emulator
from sbemulator.links import LinkHandler
from sbemulator.testing import wait_until

from .helpers import drain, send

pytestmark = pytest.mark.integration
CHILD = Path(__file__).with_name("_killed_receiver.py")
DBFANOUT = [sys.executable, "-c", "from dbfanout.cli import main; main()"]


def test_killed_receiver_process_loses_its_lock_and_the_message_is_redelivered(
    client: ServiceBusClient, make_queue, emulator: Emulator
):
    # Given a receiver process holding a 2 s lock on the only message
    queue = make_queue(lock_duration="PT2S")
    send(client, queue, "survivor")
    child = subprocess.Popen(
        [sys.executable, str(CHILD), emulator.connection_string, queue],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().startswith("locked 1")
        wait_until(lambda: emulator.queue_stats(queue)["locked"] == 1, timeout=5)
        # When the process is killed with SIGKILL mid-lock
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
        killed_at = time.monotonic()
    finally:
        if child.poll() is None:
            child.kill()
    # Then after the lock expires the message is redelivered with delivery count 1
    (m,) = drain(client, queue, 1, timeout=10)
    assert str(m) == "survivor"
    assert m.delivery_count == 1
    assert time.monotonic() - killed_at < 6


def test_garbage_bytes_close_that_connection_and_the_server_keeps_serving(
    client: ServiceBusClient, queue: str, emulator: Emulator
):
    # Given a raw socket that sends garbage instead of an AMQP header
    with socket.create_connection(("127.0.0.1", emulator.port), timeout=5) as raw:
        raw.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + os.urandom(512))
        # When the server reads it; Then it closes that connection (EOF after its own header)
        raw.settimeout(5)
        received = b""
        while chunk := raw.recv(4096):
            received += chunk
    assert received.startswith(b"AMQP") or received == b""
    # And the server still serves SDK clients
    send(client, queue, "still here")
    assert [str(m) for m in drain(client, queue, 1)] == ["still here"]


def test_handler_exception_closes_one_connection_and_the_reactor_keeps_running(
    emulator: Emulator, queue: str, monkeypatch: pytest.MonkeyPatch
):
    # Given a bug that makes handling the next transfer raise
    original = LinkHandler._produce
    calls = {"n": 0}

    def broken(self: LinkHandler, role, data):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated handler bug")
        return original(self, role, data)

    monkeypatch.setattr(LinkHandler, "_produce", broken)
    # When a client sends; Then that client gets an error
    with (
        ServiceBusClient.from_connection_string(emulator.connection_string, retry_total=0) as c1,
        pytest.raises(ServiceBusError),
        c1.get_queue_sender(queue) as sender,
    ):
        sender.send_messages(ServiceBusMessage("boom"))
    # And a new client is served normally
    with ServiceBusClient.from_connection_string(emulator.connection_string, retry_total=0) as c2:
        send(c2, queue, "fine")
        assert [str(m) for m in drain(c2, queue, 1)] == ["fine"]


def test_health_endpoint_reports_healthy(emulator: Emulator):
    # Given a running emulator; When GET /health; Then 200 and status healthy
    with urllib.request.urlopen(f"http://127.0.0.1:{emulator.http_port}/health", timeout=5) as resp:
        assert resp.status == 200
        body = json.loads(resp.read())
    assert body["status"] == "healthy"
    assert body["amqpPort"] == emulator.port


def test_cli_prints_connection_string_and_stops_on_sigterm(tmp_path: Path):
    # Given the official sample Config.json with a comment
    config = tmp_path / "Config.json"
    config.write_text(
        '{"UserConfig": {"Namespaces": [{"Name": "sbemulatorns", "Queues": [{"Name": "queue.1",'
        ' "Properties": {"LockDuration": "PT1M", "MaxDeliveryCount": 3}}]}],'
        ' "Logging": {"Type": "File"} // file logging is accepted and ignored\n}}'
    )
    # When the CLI starts with free ports
    proc = subprocess.Popen(
        [sys.executable, "-m", "sbemulator", "servicebus", "--config", str(config), "--port", "0", "--http-port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(4)]
        # Then it prints the port and an emulator connection string naming that port
        port = int(lines[0].split(":")[1])
        assert f"Endpoint=sb://127.0.0.1:{port};" in lines[3]
        assert "UseDevelopmentEmulator=true" in lines[3]
        assert "queue.1" in lines[2]
        # And SIGTERM stops it cleanly
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_storm_of_killed_busy_clients_never_stalls_the_server(make_queue, emulator: Emulator):
    # Given clients that send, receive, complete and abandon flat out, each SIGKILLed mid-flight
    import random
    import threading

    queue = make_queue(lock_duration="PT5S")
    rng = random.Random(7)
    for _ in range(6):
        child = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("_busy_client.py")), emulator.connection_string, queue],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        try:
            assert child.stdout is not None and child.stdout.readline().startswith("ready")
            threading.Event().wait(rng.uniform(0.1, 1.0))  # let it get busy: a random moment to die
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=10)
        finally:
            if child.poll() is None:
                child.kill()
        # Then a brand-new client is served promptly (a stalled loop would hang it in the handshake)
        served = threading.Event()

        def probe(served: threading.Event = served) -> None:
            with ServiceBusClient.from_connection_string(emulator.connection_string, retry_total=0) as fresh:
                with fresh.get_queue_sender(queue) as sender:
                    sender.send_messages(ServiceBusMessage(b"probe"))
                with fresh.get_queue_receiver(queue) as receiver:
                    receiver.peek_messages(max_message_count=1)
            served.set()

        threading.Thread(target=probe, daemon=True).start()
        assert served.wait(timeout=30), "the emulator stopped serving new connections after a client was killed"


def test_dbfanout_emulator_verbose_logs_connections_and_protocol_errors_with_their_reason():
    # Given `dbfanout emulator servicebus -v` (dbfanout configures logging before the emulator does)
    proc = subprocess.Popen(
        [*DBFANOUT, "emulator", "servicebus", "-v", "--port", "0", "--http-port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        port = int(proc.stdout.readline().split(":")[1])
        # When a client opens a connection and breaks the protocol (a frame on a channel it never began)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
            raw.sendall(b"AMQP\x03\x01\x00\x00")  # SASL header
            raw.sendall(bytes.fromhex("0000001902010000005341d00000000900000001a309414e4f4e594d4f5553"))  # init
            raw.sendall(b"AMQP\x00\x01\x00\x00" + bytes.fromhex("0000000f02000005005317c0020140"))  # end on ch 5
            raw.settimeout(5)
            while raw.recv(4096):
                pass
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    # Then -v logged the connection, and the close names the protocol error, not "transport finished"
    assert "accepted 127.0.0.1:" in err
    closing = [line for line in err.splitlines() if "closing 127.0.0.1:" in line]
    assert closing and "amqp:" in closing[0], err
