"""Child process for the crash test: receive one message in peek-lock, report, then hang."""

import sys
import time

from azure.servicebus import ServiceBusClient

conn_str, queue = sys.argv[1], sys.argv[2]
client = ServiceBusClient.from_connection_string(conn_str, retry_total=0)
receiver = client.get_queue_receiver(queue, max_wait_time=5)
(message,) = receiver.receive_messages(1, max_wait_time=10)
print(f"locked {message.sequence_number}", flush=True)
time.sleep(600)  # the parent kills us with SIGKILL while the lock is held
