"""The worker's hooks: what only observes a delivery (logs, metrics, traces, failure records).

Like dramatiq's middleware, :class:`worker.runtime.Worker` calls each hook at fixed points of a
delivery and the hooks never decide its settlement: a new concern is a new hook, not an edit of
the runtime. A hook is shared by every thread the worker serves, so it keeps no per-delivery state
of its own; what it needs of the delivery is on :class:`~worker.delivery.DeliveryInfo`.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

from worker.delivery import Delivery, DeliveryInfo
from worker.settlement import Settle

__all__ = ["Hook"]


class Hook:
    """A no-op at every point; subclasses override the points they observe.

    Order of calls for one delivery: :meth:`delivery` wraps it all; then :meth:`after_handler` (if
    the handler ran), :meth:`before_split` / :meth:`after_split` (if it is split), and
    :meth:`after_delivery` with the outcome. A hook must not raise: it would fail the delivery.
    """

    def delivery(self, info: DeliveryInfo) -> AbstractContextManager[object]:
        """A context around the whole delivery (a trace span); it sees the error that fails it."""
        return nullcontext()

    def rejected(self, stage: str, delivery: Delivery, info: DeliveryInfo | None) -> None:
        """The message cannot be handled at all (``stage``: decode, handler-load); it will be dead-lettered."""

    def after_handler(self, info: DeliveryInfo, seconds: float, error: Exception | None) -> None:
        """The handler returned (``error`` None) or raised after ``seconds``."""

    def before_split(self, info: DeliveryInfo, error: Exception | None) -> None:
        """The batch's singles are about to be sent (``error`` None: split before its handler ran)."""

    def after_split(self, info: DeliveryInfo) -> None:
        """The singles were sent; the parent completes."""

    def after_delivery(self, info: DeliveryInfo, outcome: Settle, error: Exception | None) -> None:
        """The outcome is decided; RAISE with ``error``: this delivery fails (``info.last``: for good)."""
