"""A dead-lettered message carrying a claim-check reference is replayed and arrives whole."""

from __future__ import annotations

from typing import Any

import pytest
from azure.servicebus import ServiceBusClient, ServiceBusSubQueue

from poller.sinks.servicebus import ServiceBusSink
from shared.claimcheck import is_claim, open_claim_check
from shared.codec import decode_batch
from shared.models import HandlerContext, RowChange
from shared.servicebus import QueueSender
from tests.cli.conftest import consume_like_host
from worker.runtime import Worker
from worker.split import Splitter

pytestmark = pytest.mark.integration

BIG = "y" * 1_000_000


def test_replay_resolves_the_claim_of_a_dead_lettered_oversize_row(workspace: Any, bus: ServiceBusClient) -> None:
    # Given a claim-check poller whose 1 MB row a broken handler drove into the DLQ (split, then dead-lettered)
    with workspace.config_path.open("a") as toml:
        toml.write('oversize_policy = "claim-check"\n')
    config = workspace.config
    claims = open_claim_check(config)
    workspace.source.upsert([1])
    workspace.source.upsert([2], value=BIG)
    sink = ServiceBusSink(config.poller("orders"), QueueSender(bus, workspace.queue), claim_check=claims.offload)
    assert workspace.tick(sink=sink).rows == 2
    handled: dict[int, str] = {}
    broken = True

    def handler(events: list[RowChange], context: HandlerContext) -> None:
        if broken:
            raise RuntimeError("handler bug")
        handled.update({e.pk["id"]: (e.after or {})["v"] for e in events})

    senders: dict[str, QueueSender] = {}
    splitter = Splitter(config, lambda q, ms: senders.setdefault(q, QueueSender(bus, q)).send_all(ms))
    worker = Worker(config, splitter=splitter, handlers={"orders": handler}, resolve_claims=claims.resolve)

    def stats() -> dict[str, int]:
        counts: dict[str, int] = workspace.emulator.queue_stats(workspace.queue)
        return counts

    consume_like_host(bus, workspace.queue, worker, lambda: stats()["dead_lettered"] == 2 and stats()["messages"] == 0)
    with bus.get_queue_receiver(workspace.queue, sub_queue=ServiceBusSubQueue.DEAD_LETTER) as dlq:
        dead = [decode_batch(b"".join(m.body)) for m in dlq.peek_messages(max_message_count=10)]
    assert sorted(is_claim(b.events[0]) for b in dead) == [False, True]  # the DLQ holds the reference
    # When the handler is fixed and the operator replays the DLQ
    broken = False
    result = workspace.run("dlq", "replay", workspace.queue, "--all", "--yes")
    assert result.exit_code == 0, result.output + result.stderr
    # Then the replayed reference is resolved: the handler gets the 1 MB row whole
    consume_like_host(bus, workspace.queue, worker, lambda: len(handled) == 2)
    assert handled == {1: "x", 2: BIG}
    assert stats()["messages"] == 0 and stats()["dead_lettered"] == 0
    for sender in senders.values():
        sender.close()
