"""Run one poller's tick and hand its messages to the worker, inside an app's own environment.

Run by ``test_user_installs.py`` with the Python of a virtual environment made from the app's
``requirements.txt`` alone (plus the driver a user uncomments): no dev extra, no CLI extra. It does
what the platform's Python worker does with ``function_app.py``: import it, index its functions, call
the timer function, and call the Service Bus trigger function with each message of the poller's
queue, converted the way ``dbfanout run`` converts them (``dbfanout/host/messages.py``, loaded from
its file: the operator package itself is not installed here). Prints the indexed function names.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--app", required=True, type=Path)
    parser.add_argument("--poller", required=True)
    parser.add_argument("--queue", required=True)
    parser.add_argument("--messages-module", required=True, type=Path)
    args = parser.parse_args()
    os.chdir(args.app)
    sys.path.insert(0, str(args.app))

    from azure.functions.timer import TimerRequest
    from azure.servicebus import ServiceBusClient

    import function_app

    spec = importlib.util.spec_from_file_location("host_messages", args.messages_module)
    assert spec is not None and spec.loader is not None
    messages = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(messages)

    functions = {f.get_function_name(): f.get_user_function() for f in function_app.app.get_functions()}
    functions[f"poll_{args.poller}"](TimerRequest(past_due=False))
    work = functions["work_" + args.queue.replace("-", "_")]
    handled = 0
    with (
        ServiceBusClient.from_connection_string(os.environ["DBFANOUT_SERVICEBUS"]) as client,
        client.get_queue_receiver(args.queue, max_wait_time=5) as receiver,
    ):
        for msg in receiver.receive_messages(max_message_count=20, max_wait_time=5):
            work(messages.to_functions_message(msg))
            receiver.complete_message(msg)
            handled += 1
    function_app.shutdown()
    loaded = sorted(name for name in sys.modules if name.split(".")[0] in OPTIONAL)
    print(json.dumps({"functions": sorted(functions), "messages": handled, "optional_loaded": loaded}))


OPTIONAL = {"psycopg", "psycopg2", "pymysql", "pyodbc", "typer", "rich", "croniter", "proton", "cproton", "dbfanout"}

if __name__ == "__main__":
    main()
