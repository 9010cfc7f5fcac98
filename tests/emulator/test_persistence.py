"""--data-dir: a restart loses no message, delivery count or session state."""

from __future__ import annotations

from pathlib import Path

import pytest
from azure.servicebus import ServiceBusClient, ServiceBusMessage

from sbemulator import EmulatorConfig
from sbemulator.testing import running_emulator

from .helpers import drain

pytestmark = pytest.mark.integration


def test_restart_with_data_dir_keeps_messages_counts_dead_letters_and_runtime_queues(tmp_path: Path):
    config = EmulatorConfig.with_queues("durable", lock_duration="PT5S")
    # Given messages sent, one abandoned once, one dead-lettered, and a queue created at runtime
    with running_emulator(config, data_dir=tmp_path) as emu:
        emu.create_queue("made-later")
        with ServiceBusClient.from_connection_string(emu.connection_string, retry_total=0) as client:
            with client.get_queue_sender("durable") as sender:
                sender.send_messages([ServiceBusMessage(f"m{i}") for i in range(3)])
            with client.get_queue_sender("made-later") as sender:
                sender.send_messages(ServiceBusMessage("late"))
            with client.get_queue_receiver("durable", max_wait_time=1) as receiver:
                first, second = receiver.receive_messages(2, max_wait_time=5)
                receiver.abandon_message(first)
                receiver.dead_letter_message(second, reason="why", error_description="because")
    # When the emulator restarts on the same data dir
    with (
        running_emulator(config, data_dir=tmp_path) as emu,
        ServiceBusClient.from_connection_string(emu.connection_string, retry_total=0) as client,
    ):
        # Then everything is back, with delivery counts and dead-letter reasons
        got = {str(m): m.delivery_count for m in drain(client, "durable", 2)}
        assert got == {"m0": 1, "m2": 0}
        (dead,) = drain(client, "durable", 1, sub_queue="deadletter")
        assert (str(dead), dead.dead_letter_reason) == ("m1", "why")
        assert [str(m) for m in drain(client, "made-later", 1)] == ["late"]
        # And sequence numbers continue after the old ones
        with client.get_queue_sender("durable") as sender:
            sender.send_messages(ServiceBusMessage("new"))
        (new,) = drain(client, "durable", 1)
        assert new.sequence_number is not None and new.sequence_number > 3
