"""One poller's config: its source, its keyset order or log, its queue or topic, its handler.

:class:`PollerConfig` stays one flat, frozen dataclass because code across the app reads its
attributes (``poller.wake``, ``poller.kind``, ...) and builds it with keywords; the keys of one
source kind are parsed and checked by that kind's section (:mod:`shared.config.sections`). Each
field's default is written here and nowhere else: the parser reads it from the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from shared.config.fields import missing_setting_error
from shared.errors import ConfigError
from shared.lease_margins import default_state_timeout

__all__ = [
    "DEFAULT_LEASE_TTL_SECONDS",
    "Cardinality",
    "NullCursorPolicy",
    "OnLostPosition",
    "OversizePolicy",
    "PollerConfig",
    "Snapshot",
    "SourceKind",
    "SubscriptionConfig",
    "Transport",
    "Wake",
]

#: A process keeps its poller's lease between ticks (poller/lease/keeper.py) and renews it when half is
#: left: one write per 15 s at 30 s, and a crashed owner's poller resumes within ~35 s.
DEFAULT_LEASE_TTL_SECONDS = 30

Transport = Literal["servicebus", "storage-queue"]
NullCursorPolicy = Literal["skip", "fail"]
OversizePolicy = Literal["error", "claim-check"]
SourceKind = Literal["keyset", "outbox", "pg_logical", "mysql_binlog"]
Wake = Literal["poll", "notify", "wal"]
OnLostPosition = Literal["fail", "resnapshot"]
Cardinality = Literal["one", "many"]
Snapshot = Literal["never", "initial"]


@dataclass(frozen=True, slots=True)
class SubscriptionConfig:
    """One subscription of a topic poller: its own handler, filter, retries and dead-letter queue."""

    name: str
    handler: str
    # A Service Bus SQL filter over the message's properties (e.g. ``[dbfanout-event-count] > 1``);
    # None: every message of the poller. shared.topology.subscription_rule adds the replay target.
    filter: str | None = None
    max_delivery_count: int | None = None
    cardinality: Cardinality = "one"


@dataclass(frozen=True, slots=True)
class PollerConfig:
    """One poller: a source, its keyset order, its queue and its handler."""

    name: str
    source_url: str = field(repr=False)  # holds the expanded secret: never print it
    cursor: str
    pk: tuple[str, ...]
    queue: str
    table: str | None = None
    query: str | None = None
    schedule: str = "*/5 * * * * *"
    batch_size: int = 500
    max_batches_per_tick: int = 20
    lease_ttl_seconds: int = DEFAULT_LEASE_TTL_SECONDS
    # The state blob's request timeout; None: the largest the lease margins allow (shared.lease_margins).
    state_timeout_seconds: float | None = None
    settle_seconds: float = 2.0
    soft_delete_column: str | None = None
    handler: str | None = None
    # Extensions (not in the original brief; defaults keep the brief's behaviour).
    filter: str | None = None
    cursor_timezone: str | None = None
    null_cursor: NullCursorPolicy = "skip"
    xid_column: str | None = None
    tick_budget_seconds: float | None = None
    transport: Transport = "servicebus"
    max_message_bytes: int = 256 * 1024
    oversize_policy: OversizePolicy = "error"
    split_after_deliveries: int = 2
    # The queue's MaxDeliveryCount (storage queues: host.json maxDequeueCount); None: the default of
    # the transport (10, 5). A failing batch close to it is split at once, so crashes that used up
    # its deliveries cannot dead-letter its healthy rows.
    max_delivery_count: int | None = None
    cardinality: Cardinality = "one"
    use_monitor: bool = True
    sessions: bool = False
    # Batches sent ahead of the last landed checkpoint write (group commit); 1 = commit each batch
    # before the next is fetched, the brief's strict order. Duplicates after a crash: at most this many.
    max_uncommitted_batches: int = 16
    # Linger (opt-in): after catching up, a tick keeps polling the source every poll_interval_ms
    # (backing off to 4x while idle) for up to linger_seconds, ending before the next timer
    # occurrence; changes reach the queue without waiting for the next timer. 0: off.
    linger_seconds: float = 0.0
    poll_interval_ms: int = 250
    # "notify" (PostgreSQL, with linger): a lingering tick waits on LISTEN instead of polling; a
    # statement-level trigger on the poller's tables (validate --fix) calls pg_notify on commit.
    # "wal" (pg_logical, with linger): it watches the WAL flush position every poll_interval_ms.
    wake: Wake = "poll"
    # Where changes come from: "keyset" (a table or query read in cursor order, the default) or
    # "outbox" (an outbox table the application writes, see shared.outbox; cursor and pk are its own).
    kind: SourceKind = "keyset"
    # outbox: delete rows this long after a landed checkpoint covered them (None: never prune).
    outbox_retention_seconds: float | None = None
    # pg_logical: the tables read from the slot (``table`` is the first), the slot, the publication.
    tables: tuple[str, ...] = ()
    slot: str | None = None
    publication: str | None = None
    # pg_logical and mysql_binlog snapshots (poller.snapshot.chunks): "initial" delivers every existing row once
    # on the first start (no checkpoint yet) while changes keep flowing; "never" (the default) streams
    # changes only.
    snapshot: Snapshot = "never"
    # Rows a snapshot chunk reads (0: four pages, at most 20,000 rows; see poller.snapshot.chunks), and the
    # table its watermarks and requests are written to (pg_logical: it must be in the publication,
    # `dbfanout validate --fix` adds it; mysql_binlog: in the source database, "public." meaning the
    # source URL's database).
    snapshot_chunk_size: int = 0
    signal_table: str = "public.dbfanout_signal"
    # When the log no longer holds the changes after the checkpoint (a replication slot PostgreSQL
    # invalidated or dropped): "fail" (the default) stops with an error naming the fix; "resnapshot"
    # replaces the slot and snapshots every table, unattended (see poller.sources.pg_logical.slot).
    on_lost_position: OnLostPosition = "fail"
    # mysql_binlog: the server id the poller's replica connection announces (unique among the
    # server's replicas: a second connection with the same id makes the server drop the first).
    # Default: derived from the poller's name (validate checks it against the server's own).
    server_id: int = 0
    # Topic fan-out: ``topic = "orders"`` instead of ``queue``; ``queue`` then holds the same name
    # (the entity the poller sends to) and ``subscriptions`` each name a handler.
    topic: str | None = None
    subscriptions: Mapping[str, SubscriptionConfig] = field(default_factory=dict)
    # Telemetry: the (temporal) cursor column is the row's commit time, so commit -> handler latency
    # is measured from it (else from the poller's read time; pg_logical and outbox know their own).
    cursor_is_commit_time: bool = False

    # Not a config key: app settings ``source_url`` names that were not set when the config was
    # loaded leniently (as function_app.py does, so one poller's missing setting cannot unindex the
    # app). ``source_url`` is then empty and every tick of this poller fails with require_settings().
    missing_settings: tuple[str, ...] = ()

    def require_settings(self) -> None:
        """Raise the :class:`ConfigError` naming a setting ``source_url`` needs but that is not set."""
        if self.missing_settings:
            raise missing_setting_error(f"pollers.{self.name}.source_url", self.missing_settings[0])

    @property
    def deliveries(self) -> int:
        """How many deliveries the queue allows before it quarantines a message."""
        if self.max_delivery_count:
            return self.max_delivery_count
        return 5 if self.transport == "storage-queue" else 10

    @property
    def is_topic(self) -> bool:
        """Whether this poller sends to a topic (one subscription per handler) rather than a queue."""
        return self.topic is not None

    def subscription(self, name: str) -> SubscriptionConfig:
        """The subscription ``name`` of this topic poller (a :class:`ConfigError` if there is none)."""
        try:
            return self.subscriptions[name]
        except KeyError:
            known = ", ".join(sorted(self.subscriptions)) or "none"
            raise ConfigError(
                f"pollers.{self.name}.subscriptions.{name}", f"no such subscription (configured: {known})"
            ) from None

    def deliveries_for(self, subscription: str | None) -> int:
        """The MaxDeliveryCount of the subscription (topic pollers) or of the queue."""
        if subscription is not None:
            sub = self.subscription(subscription)
            if sub.max_delivery_count:
                return sub.max_delivery_count
        return self.deliveries

    @property
    def state_timeout(self) -> float:
        """The state store's request timeout (seconds): set, or derived from the lease TTL."""
        return self.state_timeout_seconds or default_state_timeout(self.lease_ttl_seconds)

    @property
    def time_budget_seconds(self) -> float:
        """How long one tick may fetch and send: two thirds of the lease unless set."""
        return self.tick_budget_seconds if self.tick_budget_seconds else self.lease_ttl_seconds * 2 / 3
