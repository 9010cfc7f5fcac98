"""Loading and validating ``dbfanout.toml``: the keys every poller has, then its kind's section.

The key names are a public contract (DESIGN §3.3): never rename one, only add. Secrets are not
written in the file: ``${NAME}`` references are expanded from app settings / the environment.
Every problem raises :class:`~shared.errors.ConfigError` naming the key and the fix.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shared.config.app import AppConfig, Config
from shared.config.fields import NAME, REF, Reader, defaults_of, expand_refs, reject_unknown
from shared.config.poller import (
    Cardinality,
    NullCursorPolicy,
    OversizePolicy,
    PollerConfig,
    SourceKind,
    SubscriptionConfig,
    Transport,
    Wake,
)
from shared.config.sections import SECTIONS
from shared.errors import ConfigError
from shared.lease_margins import margin_problem
from shared.settings import Settings, load_settings

__all__ = ["CONFIG_SETTING", "DEFAULT_CONFIG_NAME", "config_path", "load_config", "parse_config"]

CONFIG_SETTING = "DBFANOUT_CONFIG"
DEFAULT_CONFIG_NAME = "dbfanout.toml"
_QUEUE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,259}$")
_HANDLER = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
# Service Bus subscription names: 1-50 letters, digits, '.', '-', '_', starting and ending alphanumeric.
_SUBSCRIPTION = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,48}[A-Za-z0-9])?$")
_POLLER_DEFAULTS = defaults_of(PollerConfig)
_POLLER_KEYS = set(PollerConfig.__dataclass_fields__) - {"name", "missing_settings"}  # the TOML keys


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
    app_raw = data.get("app")
    if not isinstance(app_raw, Mapping):
        raise ConfigError("app", "missing [app] table")
    unknown = set(data) - {"app", "pollers"}
    if unknown:
        raise ConfigError(sorted(unknown)[0], "unknown top-level table (expected [app] and [pollers.NAME])")
    app = _app(app_raw)
    pollers_raw = data.get("pollers")
    if not isinstance(pollers_raw, Mapping) or not pollers_raw:
        raise ConfigError("pollers", "no pollers configured", hint="add a [pollers.NAME] table")
    pollers = {name: _poller(name, raw, settings, lenient_settings) for name, raw in pollers_raw.items()}
    _check_outbox_pruning(pollers)
    _check_topics(pollers)
    config = Config(app=app, pollers=pollers, path=path, settings=dict(settings))
    for queue in config.queues():
        config.queue_transport(queue)  # pollers sharing a queue agree on its transport
    return config


def _app(raw: Mapping[str, Any]) -> AppConfig:
    value = raw.get("name")
    if not isinstance(value, str) or not NAME.match(value):
        raise ConfigError("app.name", f"must be a name of letters, digits, '-' or '_' (got {value!r})")
    r = Reader(raw, "app", defaults_of(AppConfig))
    keys = set(AppConfig.__dataclass_fields__)
    app = AppConfig(name=value, **{k: r.text(k) for k in keys - {"name"}})
    reject_unknown(raw, "app", keys)
    return app


def _poller(name: str, raw: Any, settings: Settings, lenient_settings: bool = False) -> PollerConfig:
    prefix = f"pollers.{name}"
    if not NAME.match(name):
        raise ConfigError(prefix, "poller names must be letters, digits, '-' or '_' (they name blobs)")
    if not isinstance(raw, Mapping):
        raise ConfigError(prefix, "must be a table")
    reject_unknown(raw, prefix, _POLLER_KEYS)
    kind: SourceKind = Reader(raw, prefix, _POLLER_DEFAULTS).choice("kind", SourceKind)
    section = SECTIONS[kind]
    r = Reader(section.normalize(name, raw, prefix), prefix, _POLLER_DEFAULTS)
    source = _source(r, kind, settings, lenient_settings)
    return PollerConfig(
        name=name,
        kind=kind,
        **source,
        **_delivery(r),
        **_timing(r, kind, source["source_url"]),
        **section.values(name, r),
    )


def _source(r: Reader, kind: str, settings: Settings, lenient_settings: bool) -> dict[str, Any]:
    """Where rows come from: table or query, the key, the cursor, the (expanded) source URL."""
    table, query = r.raw.get("table"), r.raw.get("query")
    if (table is None) == (query is None):
        raise r.error("table", "set exactly one of table or query")
    pk_raw = r.raw.get("pk")
    pk = (pk_raw,) if isinstance(pk_raw, str) else tuple(pk_raw) if isinstance(pk_raw, list) else ()
    optional = kind in ("pg_logical", "mysql_binlog") and pk_raw is None  # each table's primary key
    if not optional and (not pk or not all(isinstance(c, str) and c for c in pk)):
        raise r.error("pk", "must be a column name or a list of column names", hint='pk = ["id"]')
    source_url = r.required("source_url", 'source_url = "${ORDERS_DB_URL}"')
    key = f"{r.prefix}.source_url"
    missing = tuple(dict.fromkeys(n for n in REF.findall(source_url) if n not in settings)) if lenient_settings else ()
    return {
        "source_url": "" if missing else expand_refs(source_url, settings, key),
        "missing_settings": missing,
        "pk": pk,
        "cursor": r.required("cursor", 'cursor = "updated_at"'),
        "table": r.text("table"),
        "query": r.text("query"),
        "soft_delete_column": r.text("soft_delete_column"),
        "filter": r.text("filter"),
        "cursor_timezone": r.text("cursor_timezone"),
        "null_cursor": r.choice("null_cursor", NullCursorPolicy),
        "xid_column": r.text("xid_column"),
        "cursor_is_commit_time": r.flag("cursor_is_commit_time"),
    }


def _delivery(r: Reader) -> dict[str, Any]:
    """Where batches go and what handles them: queue or topic, handler, transport, message limits."""
    queue, topic = _entity(r)
    handler = r.text("handler")
    if handler is not None and not _HANDLER.match(handler):
        raise r.error("handler", f"must be module:function (got {handler!r})")
    cardinality: Cardinality = r.choice("cardinality", Cardinality)
    return {
        "queue": queue,
        "topic": topic,
        "handler": handler,
        "cardinality": cardinality,
        "subscriptions": _subscriptions(r, topic, handler, cardinality),
        "transport": r.choice("transport", Transport),
        "max_message_bytes": r.integer("max_message_bytes", 16 * 1024, 100 * 1024 * 1024),
        "oversize_policy": r.choice("oversize_policy", OversizePolicy),
        "split_after_deliveries": r.integer("split_after_deliveries", 1, 1000),
        "max_delivery_count": r.integer("max_delivery_count", 0, 2000),
        "use_monitor": r.flag("use_monitor"),
        "sessions": r.flag("sessions"),
    }


def _timing(r: Reader, kind: str, source_url: str) -> dict[str, Any]:
    """When and how much a tick reads: schedule, batches, lease, linger and wake."""
    schedule = r.text("schedule")
    if not schedule.startswith("%") and len(schedule.split()) != 6:
        raise r.error(
            "schedule",
            f"must be a six-field NCRONTAB expression (seconds first), got {schedule!r}",
            hint='e.g. "*/5 * * * * *" for every five seconds, or "%SETTING%"',
        )
    lease_ttl = r.integer("lease_ttl_seconds", 10, 3600)
    return {
        "schedule": schedule,
        "batch_size": r.integer("batch_size", 1, 100_000),
        "max_batches_per_tick": r.integer("max_batches_per_tick", 1, 10_000),
        "lease_ttl_seconds": lease_ttl,
        "state_timeout_seconds": _state_timeout(r, lease_ttl),
        "settle_seconds": r.number("settle_seconds", 0.0) or 0.0,
        "tick_budget_seconds": r.number("tick_budget_seconds", 1.0),
        "max_uncommitted_batches": r.integer("max_uncommitted_batches", 1, 64),
        "linger_seconds": _linger(r),
        "poll_interval_ms": r.integer("poll_interval_ms", 10, 10_000),
        "wake": _wake(r, kind, source_url),
    }


def _state_timeout(r: Reader, lease_ttl: int) -> float | None:
    """``state_timeout_seconds`` (optional): two heartbeats of it must fit before the lease expires."""
    value: float | None = r.number("state_timeout_seconds", 0.5)
    if value is not None and value > 120:
        raise r.error("state_timeout_seconds", f"must be at most 120 (got {value!r})")
    problem = margin_problem(lease_ttl, value) if value is not None else None  # the default always fits
    if problem:
        raise r.error("state_timeout_seconds", problem, hint="docs/operations.md, Lease margins")
    return value


def _linger(r: Reader) -> float:
    """``linger_seconds``: 0 (off) up to 600; a lingering tick keeps its timer invocation running."""
    value: float = r.number("linger_seconds", 0.0) or 0.0
    if value > 600:
        raise r.error(
            "linger_seconds",
            f"must be at most 600 (got {value!r})",
            hint="a linger ends before the next timer occurrence anyway; keep it below the schedule interval",
        )
    return value


def _wake(r: Reader, kind: str, source_url: str) -> Wake:
    """``wake``: "poll" (default), "notify" (PostgreSQL tables only) or "wal" (kind = "pg_logical"
    only); the last two only with a linger."""
    wake: Wake = r.choice("wake", Wake)
    if wake == "poll":
        return wake
    if not (r.number("linger_seconds", 0.0) or 0.0):
        raise r.error("wake", "wakes a lingering tick: set linger_seconds too", hint="linger_seconds = 4")
    if wake == "wal":
        if kind != "pg_logical":
            raise r.error(
                "wake",
                '"wal" watches the WAL flush position: it needs kind = "pg_logical"',
                hint='for a keyset or outbox poller on PostgreSQL use wake = "notify" (a trigger) or "poll"',
            )
        return wake
    if source_url and not source_url.split(":", 1)[0].startswith("postgresql"):  # "": a missing setting
        raise r.error("wake", '"notify" needs a PostgreSQL source (LISTEN/NOTIFY)')
    if r.raw.get("query") is not None:
        raise r.error("wake", '"notify" needs table (a trigger goes on it), not query')
    return wake


def _entity(r: Reader) -> tuple[str, str | None]:
    """``(name, topic)``: exactly one of ``queue`` and ``topic``; topics are Service Bus only."""
    queue, topic = r.text("queue"), r.text("topic")
    if queue is not None and topic is not None:
        raise r.error("topic", "set exactly one of queue or topic")
    if topic is not None:
        if not _QUEUE.match(topic):
            raise r.error("topic", f"must be a Service Bus topic name (got {topic!r})")
        if r.raw.get("transport", "servicebus") != "servicebus":
            raise r.error("transport", "topics are a Service Bus feature: remove transport or use queue")
        return topic, topic
    if queue is None or not _QUEUE.match(queue):
        raise r.error("queue", f"must be a Service Bus queue name (got {queue!r})", hint="or topic = NAME")
    if "subscriptions" in r.raw:
        raise r.error("subscriptions", "subscriptions need a topic", hint='topic = "orders" instead of queue')
    return queue, None


def _subscriptions(
    r: Reader, topic: str | None, handler: str | None, cardinality: Cardinality
) -> dict[str, SubscriptionConfig]:
    """A topic poller's ``[pollers.X.subscriptions.NAME]`` tables (each names its own handler)."""
    if topic is None:
        return {}
    if handler is not None:
        raise r.error(
            "handler",
            "a topic poller has no handler of its own: each subscription names its handler",
            hint=f'[{r.prefix}.subscriptions.NAME] with handler = "module:function"',
        )
    table = r.raw.get("subscriptions")
    if not isinstance(table, Mapping) or not table:
        raise r.error(
            "subscriptions",
            "a topic poller needs at least one subscription",
            hint=f'[{r.prefix}.subscriptions.search] with handler = "handlers.search:handle"',
        )
    return {
        name: _subscription(f"{r.prefix}.subscriptions.{name}", name, raw, cardinality) for name, raw in table.items()
    }


def _subscription(key: str, name: str, raw: Any, cardinality: Cardinality) -> SubscriptionConfig:
    if not _SUBSCRIPTION.match(name):
        raise ConfigError(
            key, "subscription names are 1-50 letters, digits, '.', '-' or '_', alphanumeric at both ends"
        )
    if not isinstance(raw, Mapping):
        raise ConfigError(key, "must be a table")
    reject_unknown(raw, key, set(SubscriptionConfig.__dataclass_fields__) - {"name"})
    r = Reader(raw, key, defaults_of(SubscriptionConfig))
    handler = r.text("handler")
    if handler is None or not _HANDLER.match(handler):
        raise r.error("handler", f"must be module:function (got {handler!r})")
    return SubscriptionConfig(
        name=name,
        handler=handler,
        filter=r.text("filter"),
        max_delivery_count=r.integer("max_delivery_count", 0, 2000),
        cardinality=r.choice("cardinality", Cardinality, default=cardinality),
    )


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
