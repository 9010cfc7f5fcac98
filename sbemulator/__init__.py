"""A local Azure Service Bus emulator: an AMQP 1.0 server the unmodified azure-servicebus SDK uses.

from sbemulator import Emulator, EmulatorConfig

with Emulator(EmulatorConfig.with_queues("orders", lock_duration="PT5S")) as emu:
    client = ServiceBusClient.from_connection_string(emu.connection_string)
"""

from sbemulator.config import EmulatorConfig, QueueConfig, QueueProperties, SubscriptionConfig, TopicConfig
from sbemulator.emulator import Emulator
from sbemulator.errors import ConfigError, EmulatorError
from sbemulator.faults import Faults

__all__ = [
    "ConfigError",
    "Emulator",
    "EmulatorConfig",
    "EmulatorError",
    "Faults",
    "QueueConfig",
    "QueueProperties",
    "SubscriptionConfig",
    "TopicConfig",
]
