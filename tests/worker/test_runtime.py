"""The worker runtime: a message in, the handler called, then complete, split or raise — and say why."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace

import pytest
from azure.storage.blob import BlobServiceClient, ContainerClient

from shared.claimcheck import ClaimCheck, is_claim
from shared.codec import decode_batch
from shared.errors import EnvelopeError, HandlerError
from shared.models import Batch, RowChange
from tests.support.azurite import Azurite
from tests.worker.support import QUEUE, Handler, Sent, batch, delivery, event, event_ids, make_config, make_worker
from worker.delivery import DeliveryInfo
from worker.functions import batch_failure
from worker.hooks import Hook
from worker.runtime import Delivery, Worker
from worker.settlement import Settle
from worker.split import Splitter


def test_success_completes_and_the_handler_sees_the_message_ids() -> None:
    handler = Handler()
    outcome = make_worker(handler).process(delivery(batch(3), delivery_count=2, message_id="m-7"))
    assert outcome is Settle.COMPLETE
    ((seen, context),) = handler.calls
    assert seen == ["ev-0", "ev-1", "ev-2"]
    assert (context.message_id, context.delivery_count, context.batch_id) == ("m-7", 2, "batch-1")


def test_a_failing_batch_raises_on_its_first_delivery_with_the_cause_logged_and_chained(
    caplog: pytest.LogCaptureFixture,
) -> None:
    worker = make_worker(Handler(poison={"ev-1"}), sent=Sent())
    with caplog.at_level(logging.WARNING, "dbfanout"), pytest.raises(HandlerError) as raised:
        worker.process(delivery(batch(3), message_id="m-1"))
    assert isinstance(raised.value.__cause__, ValueError)
    assert "m-1" in str(raised.value) and "poison rows ['ev-1']" in str(raised.value)
    (record,) = [r for r in caplog.records if "retried" in r.getMessage()]
    # the traceback and the ids travel with the log line
    assert record.exc_info is not None and record.exc_info[1] is raised.value.__cause__
    assert (record.poller, record.batch_id, record.message_id, record.delivery_count) == (  # type: ignore[attr-defined]
        "orders",
        "batch-1",
        "m-1",
        1,
    )


def test_a_failing_batch_is_split_from_split_after_deliveries_and_the_error_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sent = Sent()
    worker = make_worker(Handler(poison={"ev-1"}), sent=sent)
    with caplog.at_level(logging.WARNING, "dbfanout"):
        assert worker.process(delivery(batch(3), delivery_count=2, message_id="m-1")) is Settle.SPLIT
    ((queue, singles),) = sent.messages
    assert queue == QUEUE and event_ids(singles) == [("ev-0",), ("ev-1",), ("ev-2",)]
    (record,) = [r for r in caplog.records if "split" in r.getMessage()]
    assert record.exc_info is not None and "poison rows" in str(record.exc_info[1])
    assert record.message_id == "m-1"  # type: ignore[attr-defined]


def test_close_to_max_delivery_count_a_failing_batch_is_split_on_its_first_failure() -> None:
    # MaxDeliveryCount 3: two crashes after a failed first delivery would dead-letter the batch whole
    sent = Sent()
    worker = make_worker(Handler(poison={"ev-1"}), sent=sent, max_delivery_count=3)
    assert worker.process(delivery(batch(3), delivery_count=1)) is Settle.SPLIT
    assert len(sent.messages) == 1
    # while with the default (10) the first failure retries the batch whole
    with pytest.raises(HandlerError):
        make_worker(Handler(poison={"ev-1"}), sent=Sent()).process(delivery(batch(3), delivery_count=1))


def test_a_batch_redelivered_close_to_max_delivery_count_is_split_before_its_handler_runs() -> None:
    # Crashes (a row that kills the host) use up deliveries without a failure the worker could see:
    # a batch arriving with fewer than CRASH_MARGIN deliveries left after this one is split unhandled
    sent, handler = Sent(), Handler()
    worker = make_worker(handler, sent=sent, max_delivery_count=3)
    assert worker.process(delivery(batch(3), delivery_count=2, message_id="m-2")) is Settle.SPLIT
    assert handler.calls == []  # the handler never saw the batch that may kill it
    ((queue, singles),) = sent.messages
    assert queue == QUEUE and event_ids(singles) == [("ev-0",), ("ev-1",), ("ev-2",)]
    # its first delivery, a single, or a redelivery with deliveries to spare are handled as usual
    assert worker.process(delivery(batch(3), delivery_count=1)) is Settle.COMPLETE
    assert worker.process(delivery(batch(1), delivery_count=3)) is Settle.COMPLETE
    relaxed = make_worker(handler, sent=Sent())
    assert relaxed.process(delivery(batch(3), delivery_count=7)) is Settle.COMPLETE
    assert len(handler.calls) == 3


def test_a_single_event_is_never_split_it_fails_until_dead_lettered() -> None:
    sent = Sent()
    worker = make_worker(Handler(poison={"ev-0"}), sent=sent, max_delivery_count=3)
    for count in (1, 2, 3):
        with pytest.raises(HandlerError):
            worker.process(delivery(batch(1), delivery_count=count))
    assert sent.messages == []


def test_the_last_failed_delivery_logs_the_dead_lettering_once_with_the_event_ids(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Given a single poison event on a queue that allows 3 deliveries (issue 40)
    worker = make_worker(Handler(poison={"ev-0"}), sent=Sent(), max_delivery_count=3)
    for count in (1, 2, 3):
        caplog.clear()
        # When delivery `count` fails
        with caplog.at_level(logging.WARNING, "dbfanout"), pytest.raises(HandlerError):
            worker.process(delivery(batch(1), delivery_count=count, message_id="m-9"))
        dead = [r for r in caplog.records if "dead-lettered" in r.getMessage() and "retried" not in r.getMessage()]
        retried = [r for r in caplog.records if "retried" in r.getMessage()]
        if count < 3:
            # Then the first two say it will be retried, and nothing says it is dead-lettered
            assert (len(retried), dead) == (1, [])
            continue
        # Then the last one logs the dead-lettering once, at WARNING, with the event ids, and no retry
        assert retried == []
        (record,) = dead
        assert record.levelno == logging.WARNING
        assert record.event_ids == ["ev-0"]  # type: ignore[attr-defined]
        assert (record.message_id, record.delivery_count, record.max_delivery_count) == ("m-9", 3, 3)  # type: ignore[attr-defined]


def test_a_malformed_body_raises_an_envelope_error_and_logs_the_message_id(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, "dbfanout"), pytest.raises(EnvelopeError):
        make_worker(Handler()).process(Delivery(body=b"{not json", message_id="m-bad", delivery_count=1))
    (record,) = caplog.records
    assert record.message_id == "m-bad" and record.exc_info is not None  # type: ignore[attr-defined]


def test_several_failures_of_a_many_invocation_are_all_reported_with_their_ids() -> None:
    errors: list[Exception] = []
    for i in range(2):
        exc = ValueError(f"boom {i}")
        exc.add_note(f"message_id=m-{i} delivery_count=1")
        errors.append(exc)
    group = batch_failure(errors, 5)
    assert isinstance(group, ExceptionGroup) and list(group.exceptions) == errors
    assert "2 of 5 messages failed" in str(group) and "m-0" in str(group) and "m-1" in str(group)
    assert batch_failure(errors[:1], 5) is errors[0]


# ---- claim-check: references resolved before the handler, a missing claim fails the message ------
@pytest.fixture
def container(azurite: Azurite) -> Iterator[ContainerClient]:
    service = BlobServiceClient.from_connection_string(azurite.connection_string)
    client = service.create_container(f"claims-{uuid.uuid4().hex[:10]}")
    yield client
    client.delete_container()


def _with_claim(claims: ClaimCheck, big: int) -> Batch:
    """A batch whose event ``big`` travels as a reference to its stored self."""
    b = batch(3)
    events = list(b.events)
    events[big] = claims.offload(event(big, {"id": big, "blob": "x" * 1_000_000}), 1_000_000)
    return replace(b, events=tuple(events))


@pytest.mark.integration
def test_a_claim_is_resolved_before_the_handler_sees_it(container: ContainerClient) -> None:
    claims = ClaimCheck(container)
    b = _with_claim(claims, 1)
    assert is_claim(b.events[1])
    seen: list[object] = []
    worker = make_worker(lambda events, _ctx: seen.extend(events), resolve_claims=claims.resolve)
    assert worker.process(delivery(b)) is Settle.COMPLETE
    assert [len(str(e.after)) > 1_000_000 for e in seen] == [False, True, False]  # type: ignore[attr-defined]


@pytest.mark.integration
def test_a_resolved_claim_keeps_its_messages_order_epoch__issue_39(container: ContainerClient) -> None:
    # Given a message of epoch 4 whose event 1 travels as a claim (the stored event has no epoch)
    claims = ClaimCheck(container)
    b = replace(_with_claim(claims, 1), epoch=4)
    seen: list[RowChange] = []
    worker = make_worker(lambda events, _ctx: seen.extend(events), resolve_claims=claims.resolve)
    # When it is handled, Then every event the handler gets has the message's epoch, the resolved one too
    assert worker.process(delivery(b)) is Settle.COMPLETE
    assert [e.epoch for e in seen] == [4, 4, 4] and len(str(seen[1].after)) > 1_000_000


@pytest.mark.integration
def test_a_missing_claim_fails_the_message_with_a_clear_error_and_splits_it(container: ContainerClient) -> None:
    claims = ClaimCheck(container)
    b = _with_claim(claims, 2)
    container.delete_blob(claims.blob_name(b.events[2]))
    handler, sent = Handler(), Sent()
    worker = make_worker(handler, sent=sent, resolve_claims=claims.resolve)
    # the first delivery fails with an error naming the blob and the event; the handler is not called
    with pytest.raises(HandlerError) as raised:
        worker.process(delivery(b))
    assert isinstance(raised.value.__cause__, EnvelopeError) and handler.calls == []
    assert "claim-check blob" in str(raised.value) and "ev-2" in str(raised.value) and "missing" in str(raised.value)
    assert "touch the row" in raised.value.__cause__.hint
    # the second splits it: the healthy rows go on alone, the reference stays a reference
    assert worker.process(delivery(b, delivery_count=2)) is Settle.SPLIT
    ((_, singles),) = sent.messages
    assert event_ids(singles) == [("ev-0",), ("ev-1",), ("ev-2",)]
    assert is_claim(decode_batch(singles[2].body).events[0])


def test_a_message_for_an_unknown_poller_fails_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    stranger = replace(batch(2), poller="invoices")
    with caplog.at_level(logging.ERROR, "dbfanout"), pytest.raises(EnvelopeError, match="invoices"):
        make_worker(Handler()).process(delivery(stranger, message_id="m-x"))
    (record,) = caplog.records
    assert record.message_id == "m-x" and record.exc_info is not None  # type: ignore[attr-defined]


def test_a_hook_is_called_around_and_after_each_step_of_a_delivery() -> None:
    # Given a hook that records the points it is called at
    calls: list[str] = []

    class Recording(Hook):
        def delivery(self, info: DeliveryInfo) -> AbstractContextManager[object]:
            calls.append(f"delivery {info.batch.batch_id} {info.queue}")
            return nullcontext()

        def after_handler(self, info: DeliveryInfo, seconds: float, error: Exception | None) -> None:
            calls.append(f"after_handler {type(error).__name__}")

        def before_split(self, info: DeliveryInfo, error: Exception | None) -> None:
            calls.append("before_split")

        def after_split(self, info: DeliveryInfo) -> None:
            calls.append("after_split")

        def after_delivery(self, info: DeliveryInfo, outcome: Settle, error: Exception | None) -> None:
            calls.append(f"after_delivery {outcome.value} last={info.last}")

    config = make_config()
    worker = Worker(
        config, splitter=Splitter(config, Sent()), handlers={"orders": Handler(poison={"ev-1"})}, hooks=[Recording()]
    )
    # When a one-event batch succeeds, then a two-event one fails on its first delivery, then on its second
    worker.process(delivery(batch(1, "b-ok")))
    with pytest.raises(HandlerError):
        worker.process(delivery(batch(2, "b-bad")))
    worker.process(delivery(batch(2, "b-bad"), delivery_count=2))
    # Then the hook saw each step in order: complete; raise (not the last); split
    assert calls == [
        f"delivery b-ok {QUEUE}",
        "after_handler NoneType",
        "after_delivery complete last=False",
        f"delivery b-bad {QUEUE}",
        "after_handler ValueError",
        "after_delivery raise last=False",
        f"delivery b-bad {QUEUE}",
        "after_handler ValueError",
        "before_split",
        "after_split",
        "after_delivery split last=False",
    ]
