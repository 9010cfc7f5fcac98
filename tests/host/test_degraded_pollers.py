"""A poller that cannot run fails its own ticks; the rest of the app keeps working (issue 13).

The real ``function_app.py`` runs under ``dbfanout run`` with three pollers on Storage queues
(Azurite only): one sound, one whose ``source_url`` names an app setting that is not set, one
whose database is unreachable.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from azure.storage.queue import QueueServiceClient

from shared.storagequeue import poison_queue_name
from tests.host.app_support import AppDir, HostProcess, SourceWriter, Target, wait_for
from tests.support.azurite import Azurite
from tests.support.ports import free_port

pytestmark = pytest.mark.integration

BROKEN = """
[pollers.unset]
source_url = "${{DBFANOUT_TEST_UNSET_DB_URL}}"
table = "orders"
cursor = "version"
pk = ["id"]
queue = "{queue}-unset"
schedule = "*/1 * * * * *"
transport = "storage-queue"

[pollers.unreachable]
source_url = "postgresql+psycopg://nobody@127.0.0.1:{port}/none?connect_timeout=2"
table = "orders"
cursor = "version"
pk = ["id"]
queue = "{queue}-unreachable"
schedule = "*/1 * * * * *"
transport = "storage-queue"
"""


def test_a_missing_setting_or_an_unreachable_database_degrades_only_its_poller(
    tmp_path: Path, azurite: Azurite
) -> None:
    # Given an app whose sound poller shares it with a poller missing its setting and one whose
    # database does not answer
    service = QueueServiceClient.from_connection_string(azurite.connection_string)
    queue = f"orders-{uuid.uuid4().hex[:10]}"
    for name in (queue, f"{queue}-unset", f"{queue}-unreachable"):
        service.create_queue(name)
        service.create_queue(poison_queue_name(name))
    app = AppDir.create(
        tmp_path / "app",
        queue=queue,
        storage=azurite.connection_string,
        servicebus="unused: this app has no Service Bus poller",
        transport="storage-queue",
        queues_json={"maxPollingInterval": "00:00:00.500"},
    )
    config = app.root / "dbfanout.toml"
    config.write_text(config.read_text() + BROKEN.format(queue=queue, port=free_port()))
    writer = SourceWriter(app.root / "source.db", 60, pause=0.0)
    target = Target(app.root / "target.db")
    host = HostProcess(app).start()
    try:
        # When rows change while the app runs
        writer.start()
        writer.join(60)
        # Then the sound poller and its queue worker replicate them
        wait_for(lambda: target.rows() == writer.expected(), 90, "the target to match the source")
        # ... while the other two pollers' ticks fail, each with an error that says why
        wait_for(lambda: "DBFANOUT_TEST_UNSET_DB_URL is not set" in host.log_text(), 60, "the unset poller's error")
        wait_for(lambda: "FetchError: poller unreachable" in host.log_text(), 60, "the unreachable poller's error")
        assert host.terminate() == 0, host.log_tail()
    finally:
        host.stop_quietly()
        target.close()
