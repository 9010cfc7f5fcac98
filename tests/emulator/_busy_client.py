"""Child process for the kill-storm test: send, receive, complete and abandon as fast as it can."""

import sys

from azure.servicebus import ServiceBusClient, ServiceBusMessage

conn_str, queue = sys.argv[1], sys.argv[2]
with ServiceBusClient.from_connection_string(conn_str, retry_total=0) as client:
    sender = client.get_queue_sender(queue)
    receiver = client.get_queue_receiver(queue, prefetch_count=50)
    print("ready", flush=True)
    n = 0
    while True:
        sender.send_messages([ServiceBusMessage(b"x" * 2048) for _ in range(20)])
        for m in receiver.receive_messages(max_message_count=20, max_wait_time=1):
            n += 1
            if n % 3:
                receiver.complete_message(m)
            else:
                receiver.abandon_message(m)
