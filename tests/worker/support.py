"""What worker tests share: a one-poller config, batches and their bodies, recording handlers."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from shared.codec import encode_batch
from shared.config import AppConfig, Config, PollerConfig
from shared.messages import OutgoingMessage
from shared.models import Batch, HandlerContext, RowChange
from worker.runtime import Delivery, Worker
from worker.split import Splitter

POLLER = "orders"
QUEUE = "orders-changes"


def make_poller(**changes: object) -> PollerConfig:
    base = PollerConfig(name=POLLER, source_url="sqlite://", cursor="version", pk=("id",), queue=QUEUE, table="orders")
    return replace(base, **changes)  # type: ignore[arg-type]


def make_config(**changes: object) -> Config:
    return Config(AppConfig("app"), {POLLER: make_poller(**changes)})


def event(i: int, after: dict[str, object] | None = None) -> RowChange:
    return RowChange(f"ev-{i}", "upsert", {"id": i}, i, after if after is not None else {"id": i}, POLLER)


def batch(n: int, batch_id: str = "batch-1") -> Batch:
    return Batch(POLLER, batch_id, "sha256:f", tuple(event(i) for i in range(n)))


def delivery(b: Batch, *, delivery_count: int = 1, message_id: str = "msg-1") -> Delivery:
    return Delivery(body=encode_batch(b), message_id=message_id, delivery_count=delivery_count)


@dataclass
class Handler:
    """Records every call; raises for the event ids in ``poison``."""

    poison: set[str] = field(default_factory=set)
    calls: list[tuple[list[str], HandlerContext]] = field(default_factory=list)

    def __call__(self, events: list[RowChange], context: HandlerContext) -> None:
        self.calls.append(([e.event_id for e in events], context))
        bad = sorted(e.event_id for e in events if e.event_id in self.poison)
        if bad:
            raise ValueError(f"poison rows {bad}")


@dataclass
class Sent:
    """A split's destination: what the splitter sent, by queue."""

    messages: list[tuple[str, list[OutgoingMessage]]] = field(default_factory=list)

    def __call__(self, queue: str, messages: list[OutgoingMessage]) -> None:
        self.messages.append((queue, messages))


def make_worker(
    handler: Callable[[list[RowChange], HandlerContext], object],
    *,
    sent: Sent | None = None,
    resolve_claims: Callable[[RowChange], RowChange] | None = None,
    **poller_changes: object,
) -> Worker:
    config = make_config(**poller_changes)
    splitter = Splitter(config, sent) if sent is not None else None
    return Worker(config, splitter=splitter, handlers={POLLER: handler}, resolve_claims=resolve_claims)


def event_ids(messages: Sequence[OutgoingMessage]) -> list[tuple[str, ...]]:
    return [m.event_ids for m in messages]
