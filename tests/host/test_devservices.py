"""``dbfanout run`` starts Azurite and the Service Bus emulator only for settings that point at no
running service (issue 40: one command to run locally)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from azure.servicebus import ServiceBusClient, ServiceBusMessage
from azure.servicebus.exceptions import ServiceBusError

from dbfanout.host.devservices import local_settings_needing_services, start_dev_services
from sbemulator import Emulator
from shared.config import Config, parse_config

pytestmark = pytest.mark.integration

CONFIG = {
    "app": {"name": "devsvc"},
    "pollers": {
        "orders": {
            "source_url": "sqlite:///x.db",
            "table": "orders",
            "cursor": "version",
            "pk": ["id"],
            "queue": "orders-changes",
            "handler": "handlers.x:handle",
        },
        "fanout": {
            "source_url": "sqlite:///x.db",
            "table": "orders",
            "cursor": "version",
            "pk": ["id"],
            "topic": "orders-fanout",
            "subscriptions": {"audit": {"handler": "handlers.x:handle"}},
        },
    },
}
REAL_NAMESPACE = "Endpoint=sb://shop.servicebus.windows.net/;SharedAccessKeyName=k;SharedAccessKey=v"


def config() -> Config:
    return parse_config(CONFIG, {}, lenient_settings=True)


@pytest.fixture
def not_amqp() -> Iterator[int]:
    """A port that accepts connections and answers like another protocol (as a RabbitMQ on 5672 does)."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.recv(8)
                conn.sendall(b"AMQP\x00\x00\x09\x01")

    threading.Thread(target=serve, daemon=True).start()
    yield port
    server.close()


def test_unset_settings_need_both_services() -> None:
    # Given no settings at all; Then every storage setting and the Service Bus setting need a service
    storage, bus = local_settings_needing_services(config(), {})
    assert storage == ["AzureWebJobsStorage", "DBFANOUT_STATE"]
    assert bus == ["DBFANOUT_SERVICEBUS"]


def test_real_services_and_identity_settings_are_used_as_they_are() -> None:
    settings = {
        "AzureWebJobsStorage": "DefaultEndpointsProtocol=https;AccountName=shop;AccountKey=x",
        "DBFANOUT_STATE__blobServiceUri": "https://shop.blob.core.windows.net",
        "DBFANOUT_SERVICEBUS": REAL_NAMESPACE,
    }
    assert local_settings_needing_services(config(), settings) == ([], [])


def test_an_emulator_string_whose_port_speaks_another_protocol_gets_an_emulator(not_amqp: int) -> None:
    # Given the sample's emulator string, on a port where something else listens
    value = f"Endpoint=sb://localhost:{not_amqp};SharedAccessKeyName=k;SharedAccessKey=v;UseDevelopmentEmulator=true"
    # Then it counts as no emulator running
    assert local_settings_needing_services(config(), {"DBFANOUT_SERVICEBUS": value})[1] == ["DBFANOUT_SERVICEBUS"]


def test_a_running_emulator_is_used(servicebus: Any) -> None:
    settings = {"DBFANOUT_SERVICEBUS": servicebus.connection_string}
    assert local_settings_needing_services(config(), settings)[1] == []


def test_the_started_emulator_has_the_apps_queues_topics_and_subscriptions(tmp_path: Path) -> None:
    # Given an app whose Service Bus setting is unset
    services = start_dev_services(tmp_path, config(), {"AzureWebJobsStorage": "x", "DBFANOUT_STATE": "x"})
    try:
        # Then an emulator was started for it, with the queue and the topic's subscription declared
        connection = services.settings["DBFANOUT_SERVICEBUS"]
        assert set(services.settings) == {"DBFANOUT_SERVICEBUS"}
        with ServiceBusClient.from_connection_string(connection) as client:
            with client.get_queue_sender("orders-changes") as sender:
                sender.send_messages(ServiceBusMessage("q"))
            with client.get_topic_sender("orders-fanout") as sender:
                sender.send_messages(ServiceBusMessage("t"))
            with client.get_subscription_receiver("orders-fanout", "audit", max_wait_time=5) as receiver:
                assert [str(m) for m in receiver.receive_messages(max_wait_time=5)] == ["t"]
    finally:
        services.close()


def test_a_missing_entity_names_app_config(servicebus: Emulator) -> None:
    # Given an emulator without the app's queues (started without --app-config)
    client = ServiceBusClient.from_connection_string(servicebus.connection_string)
    with client, pytest.raises(ServiceBusError) as caught, client.get_queue_sender("no-such-queue") as sender:
        sender.send_messages(ServiceBusMessage("x"))
    # Then the error says how to declare them
    assert "--app-config" in str(caught.value)


def _app_folder(root: Path, storage: str, servicebus: str) -> Path:
    from dbfanout.demo.appdir import app_settings, write_app_folder

    write_app_folder(root, app_settings(root, storage=storage, servicebus=servicebus))
    (root / "dbfanout.toml").write_text(
        '[app]\nname = "devsvc"\n\n[pollers.orders]\nsource_url = "${ORDERS_DB_URL}"\ntable = "orders"\n'
        'cursor = "version"\npk = ["id"]\nqueue = "orders-changes"\nschedule = "0 0 0 1 1 *"\n'
        'handler = "handlers.example:handle"\n'
    )
    return root


def _run(root: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DBFANOUT_", "AzureWebJobs"))}
    result = subprocess.run(
        [sys.executable, "-m", "dbfanout.cli", "run", "--duration", "1", "--grace", "1", *args],
        cwd=root, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return result.stdout + result.stderr


def test_run_starts_only_the_missing_service_and_no_emulators_starts_none(
    tmp_path: Path, azurite: Any, not_amqp: int
) -> None:
    # Given an app whose storage is a running Azurite and whose Service Bus string names a port
    # where no emulator answers
    bus = f"Endpoint=sb://127.0.0.1:{not_amqp};SharedAccessKeyName=k;SharedAccessKey=v;UseDevelopmentEmulator=true"
    root = _app_folder(tmp_path, azurite.connection_string, bus)
    # When dbfanout run starts; Then it starts the emulator for DBFANOUT_SERVICEBUS alone
    output = _run(root)
    assert "started Service Bus emulator" in output and "for DBFANOUT_SERVICEBUS: orders-changes" in output
    assert "started Azurite" not in output and "dbfanout host running" in output
    # When it starts with --no-emulators; Then nothing is started: the settings are used as they are
    output = _run(root, "--no-emulators")
    assert "dbfanout run: started" not in output and "dbfanout host running" in output


def test_an_emulator_started_without_app_config_says_how_to_declare_the_queues() -> None:
    # Given the emulator started by hand, without --app-config
    proc = subprocess.Popen(
        [sys.executable, "-m", "dbfanout.cli", "emulator", "servicebus", "--port", "0", "--http-port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(3)]  # AMQP port, health, queues: printed at start
    finally:
        proc.terminate()
        proc.wait(30)
    # Then its queue line names --app-config
    queues = next(line for line in lines if line.startswith("Queues:"))
    assert "--app-config dbfanout.toml" in queues
