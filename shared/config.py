"""Loading and validating ``dbfanout.toml``.

The key names are a public contract (DESIGN §3.3): never rename one, only add. Secrets are not
written in the file: ``${NAME}`` references are expanded from app settings / the environment.
Every problem raises :class:`~shared.errors.ConfigError` naming the key and the fix.
"""

from __future__ import annotations

import re
import tomllib
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from shared.errors import ConfigError
from shared.lease_margins import default_state_timeout, margin_problem
from shared.settings import Settings, load_settings

__all__ = [
    "AppConfig",
    "Config",
    "PollerConfig",
    "SubscriptionConfig",
    "config_path",
    "load_config",
    "missing_setting_error",
    "parse_config",
]

CONFIG_SETTING = "DBFANOUT_CONFIG"
DEFAULT_CONFIG_NAME = "dbfanout.toml"
#: A process keeps its poller's lease between ticks (poller/lease/keeper.py) and renews it when half is
#: left: one write per 15 s at 30 s, and a crashed owner's poller resumes within ~35 s.
DEFAULT_LEASE_TTL_SECONDS = 30
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,62}$")
_QUEUE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,259}$")
_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_HANDLER = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
# Service Bus subscription names: 1-50 letters, digits, '.', '-', '_', starting and ending alphanumeric.
_SUBSCRIPTION = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,48}[A-Za-z0-9])?$")

Transport = Literal["servicebus", "storage-queue"]
NullCursorPolicy = Literal["skip", "fail"]
OversizePolicy = Literal["error", "claim-check"]
SourceKind = Literal["keyset", "outbox", "pg_logical", "mysql_binlog"]
Wake = Literal["poll", "notify", "wal"]
OnLostPosition = Literal["fail", "resnapshot"]
#: Kinds whose source reads a log that can lose the changes after a checkpoint (``on_lost_position``).
LOG_POSITION_KINDS = ("pg_logical",)
#: Keys that only mean something to a keyset (table/query) poller.
_KEYSET_ONLY = ("query", "cursor", "pk", "soft_delete_column", "xid_column", "filter", "null_cursor", "cursor_timezone")
_SLOT_NAME = re.compile(r"^[a-z0-9_]{1,63}$")
_PG_LOGICAL_ONLY = ("tables", "slot", "publication", "snapshot", "snapshot_chunk_size", "signal_table")
#: Keys that only mean something to a mysql_binlog poller.
_MYSQL_BINLOG_ONLY = ("server_id",)
_SIGNAL_TABLE = re.compile(r"^([a-z_][a-z0-9_]{0,62}\.)?[a-z_][a-z0-9_]{0,62}$")


@dataclass(frozen=True, slots=True)
class AppConfig:
    name: str
    state_container: str = "db-state"
    state_connection: str = "DBFANOUT_STATE"
    servicebus_connection: str = "DBFANOUT_SERVICEBUS"
    # storage-queue transport: the setting (or prefix) of its storage account; default: state_connection
    queue_connection: str | None = None

    @property
    def storage_queue_connection(self) -> str:
        return self.queue_connection or self.state_connection


@dataclass(frozen=True, slots=True)
class SubscriptionConfig:
    """One subscription of a topic poller: its own handler, filter, retries and dead-letter queue."""

    name: str
    handler: str
    # A Service Bus SQL filter over the message's properties (e.g. ``[dbfanout-event-count] > 1``);
    # None: every message of the poller. shared.topology.subscription_rule adds the replay target.
    filter: str | None = None
    max_delivery_count: int | None = None
    cardinality: Literal["one", "many"] = "one"


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
    cardinality: Literal["one", "many"] = "one"
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
    snapshot: Literal["never", "initial"] = "never"
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


@dataclass(frozen=True, slots=True)
class Config:
    app: AppConfig
    pollers: Mapping[str, PollerConfig]
    path: Path | None = None
    settings: Mapping[str, str] = field(default_factory=dict, repr=False)

    def poller(self, name: str) -> PollerConfig:
        try:
            return self.pollers[name]
        except KeyError:
            known = ", ".join(sorted(self.pollers)) or "none"
            raise ConfigError(f"pollers.{name}", f"no such poller (configured: {known})") from None

    def queues(self) -> dict[str, list[PollerConfig]]:
        """Pollers grouped by queue name (topic pollers are not listed: see :meth:`topics`)."""
        grouped: dict[str, list[PollerConfig]] = {}
        for p in self.pollers.values():
            if not p.is_topic:
                grouped.setdefault(p.queue, []).append(p)
        return grouped

    def topics(self) -> dict[str, PollerConfig]:
        """Topic name → the one poller that sends to it."""
        return {p.queue: p for p in self.pollers.values() if p.is_topic}


def config_path(settings: Settings, app_root: Path | None = None, explicit: str | Path | None = None) -> Path:
    """Where the config file is: ``--config``, else ``DBFANOUT_CONFIG``, else beside the app."""
    root = app_root if app_root is not None else Path.cwd()
    raw = explicit or settings.get(CONFIG_SETTING) or DEFAULT_CONFIG_NAME
    path = Path(raw)
    return path if path.is_absolute() else root / path


def load_config(
    explicit: str | Path | None = None,
    *,
    app_root: Path | None = None,
    settings: Settings | None = None,
    lenient_settings: bool = False,
) -> Config:
    """Read, expand and validate the config file (``lenient_settings``: see :func:`parse_config`)."""
    resolved = dict(settings) if settings is not None else load_settings(app_root)
    path = config_path(resolved, app_root, explicit)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            CONFIG_SETTING,
            f"config file {path} not found",
            hint=f"create {DEFAULT_CONFIG_NAME} beside function_app.py or point {CONFIG_SETTING} at it",
        ) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(str(path), f"not valid TOML: {exc}") from exc
    return parse_config(data, resolved, path=path, lenient_settings=lenient_settings)


def parse_config(
    data: Mapping[str, Any], settings: Settings, *, path: Path | None = None, lenient_settings: bool = False
) -> Config:
    """Validate a parsed config. A ``${NAME}`` in ``source_url`` whose setting is not set raises,
    unless ``lenient_settings``: then only that poller is marked (``PollerConfig.missing_settings``)
    and fails its own ticks."""
    app_raw = _table(data, "app")
    unknown = set(data) - {"app", "pollers"}
    if unknown:
        raise ConfigError(sorted(unknown)[0], "unknown top-level table (expected [app] and [pollers.NAME])")
    app = AppConfig(
        name=_name(app_raw, "app.name"),
        state_container=_str(app_raw, "app", "state_container", "db-state"),
        state_connection=_str(app_raw, "app", "state_connection", "DBFANOUT_STATE"),
        servicebus_connection=_str(app_raw, "app", "servicebus_connection", "DBFANOUT_SERVICEBUS"),
        queue_connection=_str(app_raw, "app", "queue_connection", None),
    )
    _reject_unknown(app_raw, "app", {f for f in AppConfig.__dataclass_fields__})
    pollers_raw = data.get("pollers")
    if not isinstance(pollers_raw, Mapping) or not pollers_raw:
        raise ConfigError("pollers", "no pollers configured", hint="add a [pollers.NAME] table")
    pollers = {name: _poller(name, raw, settings, lenient_settings) for name, raw in pollers_raw.items()}
    _check_outbox_pruning(pollers)
    _check_topics(pollers)
    return Config(app=app, pollers=pollers, path=path, settings=dict(settings))


def _check_outbox_pruning(pollers: Mapping[str, PollerConfig]) -> None:
    """A poller prunes by its own checkpoint: it must be the outbox's only reader."""
    readers: dict[tuple[str, str | None], list[PollerConfig]] = {}
    for p in pollers.values():
        if p.kind == "outbox":
            readers.setdefault((p.source_url, p.table), []).append(p)
    for group in readers.values():
        pruning = [p for p in group if p.outbox_retention_seconds is not None]
        if pruning and len(group) > 1:
            others = ", ".join(p.name for p in group if p is not pruning[0])
            raise ConfigError(
                f"pollers.{pruning[0].name}.outbox_retention_seconds",
                f"poller(s) {others} read the same outbox: pruning by one checkpoint would delete rows the "
                "others have not read",
                hint="remove outbox_retention_seconds from every poller of this outbox and prune by the "
                "oldest checkpoint yourself (docs/outbox.md)",
            )


def _check_topics(pollers: Mapping[str, PollerConfig]) -> None:
    """A topic belongs to one poller, and no name is both a queue and a topic."""
    owners: dict[str, str] = {}
    queues = {p.queue for p in pollers.values() if not p.is_topic}
    for p in pollers.values():
        if not p.is_topic:
            continue
        if p.queue in owners:
            raise ConfigError(
                f"pollers.{p.name}.topic",
                f"topic {p.queue} is already the topic of poller {owners[p.queue]}",
                hint="give each poller its own topic (its subscriptions are that poller's handlers)",
            )
        if p.queue in queues:
            raise ConfigError(f"pollers.{p.name}.topic", f"{p.queue} is also a poller's queue: pick another name")
        owners[p.queue] = p.name


# --------------------------------------------------------------------------------------------


def _table(data: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = data.get(key)
    if not isinstance(value, Mapping):
        raise ConfigError(key, f"missing [{key}] table")
    return value


def _reject_unknown(raw: Mapping[str, Any], prefix: str, known: set[str]) -> None:
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"{prefix}.{unknown[0]}", f"unknown key (known keys: {', '.join(sorted(known))})")


def _name(raw: Mapping[str, Any], key: str) -> str:
    value = raw.get(key.rsplit(".", 1)[-1])
    if not isinstance(value, str) or not _NAME.match(value):
        raise ConfigError(key, f"must be a name of letters, digits, '-' or '_' (got {value!r})")
    return value


def _str(raw: Mapping[str, Any], prefix: str, key: str, default: str | None) -> Any:
    value = raw.get(key, default)
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise ConfigError(f"{prefix}.{key}", f"must be a non-empty string (got {value!r})")
    return value


def _int(raw: Mapping[str, Any], prefix: str, key: str, default: int, lo: int, hi: int) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(f"{prefix}.{key}", f"must be an integer from {lo} to {hi} (got {value!r})")
    return value


def _num(raw: Mapping[str, Any], prefix: str, key: str, default: float | None, lo: float) -> float | None:
    value = raw.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value < lo:
        raise ConfigError(f"{prefix}.{key}", f"must be a number >= {lo} (got {value!r})")
    return float(value)


def _state_timeout(raw: Mapping[str, Any], prefix: str, lease_ttl: int) -> float | None:
    """``state_timeout_seconds`` (optional): two heartbeats of it must fit before the lease expires."""
    value = _num(raw, prefix, "state_timeout_seconds", None, 0.5)
    if value is not None and value > 120:
        raise ConfigError(f"{prefix}.state_timeout_seconds", f"must be at most 120 (got {value!r})")
    problem = margin_problem(lease_ttl, value) if value is not None else None  # the default always fits
    if problem:
        raise ConfigError(f"{prefix}.state_timeout_seconds", problem, hint="docs/operations.md, Lease margins")
    return value


def _linger(raw: Mapping[str, Any], prefix: str) -> float:
    """``linger_seconds``: 0 (off) up to 600; a lingering tick keeps its timer invocation running."""
    value = _num(raw, prefix, "linger_seconds", 0.0, 0.0) or 0.0
    if value > 600:
        raise ConfigError(
            f"{prefix}.linger_seconds",
            f"must be at most 600 (got {value!r})",
            hint="a linger ends before the next timer occurrence anyway; keep it below the schedule interval",
        )
    return value


def _wake(raw: Mapping[str, Any], prefix: str, source_url: str) -> Any:
    """``wake``: "poll" (default), "notify" (PostgreSQL tables only) or "wal" (kind = "pg_logical"
    only); the last two only with a linger."""
    wake = _choice(raw, prefix, "wake", "poll", ("poll", "notify", "wal"))
    if wake == "poll":
        return wake
    if not (_num(raw, prefix, "linger_seconds", 0.0, 0.0) or 0.0):
        raise ConfigError(f"{prefix}.wake", "wakes a lingering tick: set linger_seconds too", hint="linger_seconds = 4")
    if wake == "wal":
        if raw.get("kind") != "pg_logical":
            raise ConfigError(
                f"{prefix}.wake",
                '"wal" watches the WAL flush position: it needs kind = "pg_logical"',
                hint='for a keyset or outbox poller on PostgreSQL use wake = "notify" (a trigger) or "poll"',
            )
        return wake
    if source_url and not source_url.split(":", 1)[0].startswith("postgresql"):  # "": a missing setting
        raise ConfigError(f"{prefix}.wake", '"notify" needs a PostgreSQL source (LISTEN/NOTIFY)')
    if raw.get("query") is not None:
        raise ConfigError(f"{prefix}.wake", '"notify" needs table (a trigger goes on it), not query')
    return wake


def _choice(raw: Mapping[str, Any], prefix: str, key: str, default: str, choices: tuple[str, ...]) -> Any:
    value = raw.get(key, default)
    if value not in choices:
        raise ConfigError(f"{prefix}.{key}", f"must be one of {', '.join(choices)} (got {value!r})")
    return value


def expand_refs(value: str, settings: Settings, key: str) -> str:
    """Replace ``${NAME}`` with the app setting NAME; a missing setting is an error."""

    def sub(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in settings:
            raise missing_setting_error(key, name)
        return settings[name]

    return _REF.sub(sub, value)


def missing_setting_error(key: str, name: str) -> ConfigError:
    """The error for a ``${NAME}`` reference whose app setting is not set."""
    return ConfigError(
        key,
        f"references ${{{name}}} but the app setting {name} is not set",
        hint=f"set {name} in the environment, local.settings.json Values, or the Function App settings",
    )


def _poller(name: str, raw: Any, settings: Settings, lenient_settings: bool = False) -> PollerConfig:
    prefix = f"pollers.{name}"
    if not _NAME.match(name):
        raise ConfigError(prefix, "poller names must be letters, digits, '-' or '_' (they name blobs)")
    if not isinstance(raw, Mapping):
        raise ConfigError(prefix, "must be a table")
    _reject_unknown(raw, prefix, set(PollerConfig.__dataclass_fields__) - {"name", "missing_settings"})
    kind = _choice(raw, prefix, "kind", "keyset", ("keyset", "outbox", "pg_logical", "mysql_binlog"))
    raw = _kind_defaults(name, raw, prefix, kind)
    table, query = raw.get("table"), raw.get("query")
    if (table is None) == (query is None):
        raise ConfigError(f"{prefix}.table", "set exactly one of table or query")
    pk_raw = raw.get("pk")
    pk = (pk_raw,) if isinstance(pk_raw, str) else tuple(pk_raw) if isinstance(pk_raw, list) else ()
    optional = kind in ("pg_logical", "mysql_binlog") and pk_raw is None  # each table's primary key
    if not optional and (not pk or not all(isinstance(c, str) and c for c in pk)):
        raise ConfigError(f"{prefix}.pk", "must be a column name or a list of column names", hint='pk = ["id"]')
    source_url = _str(raw, prefix, "source_url", None)
    if source_url is None:
        raise ConfigError(f"{prefix}.source_url", "is required", hint='source_url = "${ORDERS_DB_URL}"')
    queue, topic = _entity(raw, prefix)
    cursor = _str(raw, prefix, "cursor", None)
    if cursor is None:
        raise ConfigError(f"{prefix}.cursor", "is required", hint='cursor = "updated_at"')
    handler = _str(raw, prefix, "handler", None)
    if handler is not None and not _HANDLER.match(handler):
        raise ConfigError(f"{prefix}.handler", f"must be module:function (got {handler!r})")
    cardinality = _choice(raw, prefix, "cardinality", "one", ("one", "many"))
    subscriptions = _subscriptions(raw, prefix, topic, handler, cardinality)
    schedule = _str(raw, prefix, "schedule", "*/5 * * * * *")
    if not schedule.startswith("%") and len(schedule.split()) != 6:
        raise ConfigError(
            f"{prefix}.schedule",
            f"must be a six-field NCRONTAB expression (seconds first), got {schedule!r}",
            hint='e.g. "*/5 * * * * *" for every five seconds, or "%SETTING%"',
        )
    max_bytes = _int(raw, prefix, "max_message_bytes", 256 * 1024, 16 * 1024, 100 * 1024 * 1024)
    lease_ttl = _int(raw, prefix, "lease_ttl_seconds", DEFAULT_LEASE_TTL_SECONDS, 10, 3600)
    missing = tuple(dict.fromkeys(n for n in _REF.findall(source_url) if n not in settings)) if lenient_settings else ()
    expanded = "" if missing else expand_refs(source_url, settings, f"{prefix}.source_url")
    return PollerConfig(
        name=name,
        source_url=expanded,
        missing_settings=missing,
        table=_str(raw, prefix, "table", None),
        query=_str(raw, prefix, "query", None),
        cursor=cursor,
        pk=pk,
        queue=queue,
        schedule=schedule,
        batch_size=_int(raw, prefix, "batch_size", 500, 1, 100_000),
        max_batches_per_tick=_int(raw, prefix, "max_batches_per_tick", 20, 1, 10_000),
        lease_ttl_seconds=lease_ttl,
        state_timeout_seconds=_state_timeout(raw, prefix, lease_ttl),
        settle_seconds=_num(raw, prefix, "settle_seconds", 2.0, 0.0) or 0.0,
        soft_delete_column=_str(raw, prefix, "soft_delete_column", None),
        handler=handler,
        filter=_str(raw, prefix, "filter", None),
        cursor_timezone=_str(raw, prefix, "cursor_timezone", None),
        null_cursor=_choice(raw, prefix, "null_cursor", "skip", ("skip", "fail")),
        xid_column=_str(raw, prefix, "xid_column", None),
        tick_budget_seconds=_num(raw, prefix, "tick_budget_seconds", None, 1.0),
        transport=_choice(raw, prefix, "transport", "servicebus", ("servicebus", "storage-queue")),
        max_message_bytes=max_bytes,
        oversize_policy=_choice(raw, prefix, "oversize_policy", "error", ("error", "claim-check")),
        split_after_deliveries=_int(raw, prefix, "split_after_deliveries", 2, 1, 1000),
        max_delivery_count=_int(raw, prefix, "max_delivery_count", 0, 0, 2000) or None,
        cardinality=cardinality,
        use_monitor=bool(raw.get("use_monitor", True)),
        sessions=bool(raw.get("sessions", False)),
        max_uncommitted_batches=_int(raw, prefix, "max_uncommitted_batches", 16, 1, 64),
        linger_seconds=_linger(raw, prefix),
        poll_interval_ms=_int(raw, prefix, "poll_interval_ms", 250, 10, 10_000),
        wake=_wake(raw, prefix, expanded),
        kind=kind,
        outbox_retention_seconds=_num(raw, prefix, "outbox_retention_seconds", None, 0.0),
        tables=tuple(raw.get("tables", ())),
        slot=raw.get("slot"),
        publication=raw.get("publication"),
        snapshot=_choice(raw, prefix, "snapshot", "never", ("never", "initial")),
        snapshot_chunk_size=_int(raw, prefix, "snapshot_chunk_size", 0, 0, 1_000_000),
        signal_table=_signal_table(raw, prefix),
        on_lost_position=_on_lost_position(raw, prefix, kind),
        server_id=_server_id(name, raw, prefix) if kind == "mysql_binlog" else 0,
        topic=topic,
        subscriptions=subscriptions,
        cursor_is_commit_time=bool(raw.get("cursor_is_commit_time", False)),
    )


def _on_lost_position(raw: Mapping[str, Any], prefix: str, kind: str) -> OnLostPosition:
    """``on_lost_position``: only for sources that read a log position (a keyset source has none to lose)."""
    value: OnLostPosition = _choice(raw, prefix, "on_lost_position", "fail", ("fail", "resnapshot"))
    if "on_lost_position" in raw and kind not in LOG_POSITION_KINDS:
        raise ConfigError(
            f"{prefix}.on_lost_position",
            f"applies to kind = {' / '.join(repr(k) for k in LOG_POSITION_KINDS)} only (kind = {kind!r} reads "
            "the table itself: it has no log position to lose)",
        )
    return value


def _server_id(name: str, raw: Mapping[str, Any], prefix: str) -> int:
    """A mysql_binlog poller's replica server id: ``server_id``, else one derived from its name
    (stable across restarts, in 1e9..2e9 where hand-picked server ids rarely are)."""
    if "server_id" in raw:
        return _int(raw, prefix, "server_id", 0, 1, 4_294_967_295)
    return 1_000_000_000 + zlib.crc32(name.encode()) % 1_000_000_000


def _signal_table(raw: Mapping[str, Any], prefix: str) -> str:
    """The snapshot signal table, schema-qualified (it is written into SQL: plain names only)."""
    value = _str(raw, prefix, "signal_table", "public.dbfanout_signal")
    if not _SIGNAL_TABLE.match(value):
        raise ConfigError(
            f"{prefix}.signal_table",
            f"must be [schema.]table in lower-case letters, digits and _ (got {value!r})",
            hint='signal_table = "public.dbfanout_signal"',
        )
    return value if "." in value else f"public.{value}"


def _entity(raw: Mapping[str, Any], prefix: str) -> tuple[str, str | None]:
    """``(name, topic)``: exactly one of ``queue`` and ``topic``; topics are Service Bus only."""
    queue, topic = _str(raw, prefix, "queue", None), _str(raw, prefix, "topic", None)
    if queue is not None and topic is not None:
        raise ConfigError(f"{prefix}.topic", "set exactly one of queue or topic")
    if topic is not None:
        if not _QUEUE.match(topic):
            raise ConfigError(f"{prefix}.topic", f"must be a Service Bus topic name (got {topic!r})")
        if raw.get("transport", "servicebus") != "servicebus":
            raise ConfigError(f"{prefix}.transport", "topics are a Service Bus feature: remove transport or use queue")
        return topic, topic
    if queue is None or not _QUEUE.match(queue):
        raise ConfigError(
            f"{prefix}.queue", f"must be a Service Bus queue name (got {queue!r})", hint="or topic = NAME"
        )
    if "subscriptions" in raw:
        raise ConfigError(
            f"{prefix}.subscriptions", "subscriptions need a topic", hint='topic = "orders" instead of queue'
        )
    return queue, None


def _subscriptions(
    raw: Mapping[str, Any], prefix: str, topic: str | None, handler: str | None, cardinality: str
) -> dict[str, SubscriptionConfig]:
    """A topic poller's ``[pollers.X.subscriptions.NAME]`` tables (each names its own handler)."""
    if topic is None:
        return {}
    if handler is not None:
        raise ConfigError(
            f"{prefix}.handler",
            "a topic poller has no handler of its own: each subscription names its handler",
            hint=f'[{prefix}.subscriptions.NAME] with handler = "module:function"',
        )
    table = raw.get("subscriptions")
    if not isinstance(table, Mapping) or not table:
        raise ConfigError(
            f"{prefix}.subscriptions",
            "a topic poller needs at least one subscription",
            hint=f'[{prefix}.subscriptions.search] with handler = "handlers.search:handle"',
        )
    subs: dict[str, SubscriptionConfig] = {}
    for name, sub_raw in table.items():
        key = f"{prefix}.subscriptions.{name}"
        if not _SUBSCRIPTION.match(name):
            raise ConfigError(
                key, "subscription names are 1-50 letters, digits, '.', '-' or '_', alphanumeric at both ends"
            )
        if not isinstance(sub_raw, Mapping):
            raise ConfigError(key, "must be a table")
        _reject_unknown(sub_raw, key, set(SubscriptionConfig.__dataclass_fields__) - {"name"})
        sub_handler = _str(sub_raw, key, "handler", None)
        if sub_handler is None or not _HANDLER.match(sub_handler):
            raise ConfigError(f"{key}.handler", f"must be module:function (got {sub_handler!r})")
        subs[name] = SubscriptionConfig(
            name=name,
            handler=sub_handler,
            filter=_str(sub_raw, key, "filter", None),
            max_delivery_count=_int(sub_raw, key, "max_delivery_count", 0, 0, 2000) or None,
            cardinality=_choice(sub_raw, key, "cardinality", cardinality, ("one", "many")),
        )
    return subs


def _outbox_defaults(raw: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """An outbox poller names its table only: the order and the event's key come from the outbox."""
    given = [k for k in _KEYSET_ONLY if k in raw]
    if given:
        raise ConfigError(
            f"{prefix}.{given[0]}",
            'does not apply to kind = "outbox" (the outbox table fixes the order and the event key)',
            hint='keep table = "<outbox table>" and remove the keyset keys',
        )
    if raw.get("table") is None:
        raise ConfigError(f"{prefix}.table", 'kind = "outbox" needs the outbox table', hint='table = "dbfanout_outbox"')
    return {**raw, "cursor": "id", "pk": ["id"]}


def _kind_defaults(name: str, raw: Mapping[str, Any], prefix: str, kind: str) -> Mapping[str, Any]:
    """The keys a source kind fixes, after rejecting the keys of another kind."""
    if kind == "outbox":
        raw = _outbox_defaults(raw, prefix)
    elif "outbox_retention_seconds" in raw:
        raise ConfigError(f"{prefix}.outbox_retention_seconds", 'applies to kind = "outbox" only')
    if kind == "mysql_binlog":
        return _mysql_binlog_defaults(raw, prefix)
    if any(k in raw for k in _MYSQL_BINLOG_ONLY):
        raise ConfigError(f"{prefix}.server_id", 'applies to kind = "mysql_binlog" only')
    if kind == "pg_logical":
        raw = _pg_logical_defaults(name, raw, prefix)
    elif any(k in raw for k in _PG_LOGICAL_ONLY):
        given = next(k for k in _PG_LOGICAL_ONLY if k in raw)
        raise ConfigError(f"{prefix}.{given}", f'{", ".join(_PG_LOGICAL_ONLY)} apply to kind = "pg_logical" only')
    return raw


def _log_tables(raw: Mapping[str, Any], prefix: str, kind: str, log: str, example: str) -> list[str]:
    """The tables a log source's poller names (``table`` or ``tables``); keyset keys refused, as ``log``
    (the slot, the binlog) gives every change in commit order."""
    given = [k for k in _KEYSET_ONLY if k in raw and k != "pk"]
    if given:
        raise ConfigError(
            f"{prefix}.{given[0]}",
            f'does not apply to kind = "{kind}" ({log} gives every change in commit order)',
            hint=f'keep tables = ["{example}", ...] (pk is optional: each table\'s primary key)',
        )
    table, tables = raw.get("table"), raw.get("tables")
    if (table is None) == (tables is None):
        raise ConfigError(f"{prefix}.tables", f'kind = "{kind}" needs exactly one of table or tables')
    tables = [table] if tables is None else tables
    if not isinstance(tables, list) or not tables or not all(isinstance(t, str) and t for t in tables):
        raise ConfigError(f"{prefix}.tables", "must be a list of table names", hint=f'tables = ["{example}"]')
    return tables


def _mysql_binlog_defaults(raw: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """A mysql_binlog poller names its tables; the binlog orders the changes (snapshots run beside it)."""
    tables = _log_tables(raw, prefix, "mysql_binlog", "the binlog", "shop.orders")
    # snapshot, snapshot_chunk_size and signal_table apply (the signal table is in the source database)
    wrong = [k for k in ("slot", "publication") if k in raw]
    if wrong:
        raise ConfigError(f"{prefix}.{wrong[0]}", 'applies to kind = "pg_logical" only')
    bad = [t for t in tables if t.count(".") > 1]
    if bad:
        raise ConfigError(f"{prefix}.tables", f"{bad[0]!r}: name a table as database.table (or table)")
    return {**raw, "table": tables[0], "tables": tables, "cursor": "binlog_position", "settle_seconds": 0.0}


def _pg_logical_defaults(name: str, raw: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """A pg_logical poller names its tables (and optionally slot/publication): the slot orders changes."""
    tables = _log_tables(raw, prefix, "pg_logical", "the replication slot", "public.orders")
    default = "dbfanout_" + name.lower().replace("-", "_")
    out = {**raw, "table": tables[0], "tables": tables, "cursor": "commit_lsn", "settle_seconds": 0.0}
    for key in ("slot", "publication"):
        out[key] = value = raw.get(key, default)
        if not isinstance(value, str) or not _SLOT_NAME.match(value):
            raise ConfigError(f"{prefix}.{key}", f"must be lower-case letters, digits and _ (up to 63), got {value!r}")
    return out
