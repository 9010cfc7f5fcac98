"""``dbfanout validate``: everything a poller needs, checked before it runs.

The handler is imported the way the worker imports it (:func:`worker.handlers.load_handler`,
from the app root), so a missing module or function shows here, not at the first message.

Each check is a :class:`Check` with a status: ``ok``, ``warn`` (works, but read the advice),
``fail`` (will break, lose or stall data: exit 1) or ``skip`` (cannot be checked from here, e.g.
queue properties against the emulator, which has no management API).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from azure.servicebus import ServiceBusClient

from dbfanout.ops.binlog_checks import binlog_checks
from dbfanout.ops.bus import is_emulator, probe_queue
from dbfanout.ops.checks import (
    Check,
    Status,
    duplicate_detection_check,
    duration_seconds,
    max_delivery_check,
    needed_window_seconds,
    schedule_interval_seconds,
    session_check,
)
from dbfanout.ops.context import open_store
from dbfanout.ops.slot_checks import slot_checks
from dbfanout.ops.snapshot_checks import initial_too_late, ordering_check, signal_grant_checks
from dbfanout.ops.topic_checks import topic_checks
from poller.sources.factory import open_source
from poller.sources.mysql_binlog.source import MysqlBinlogSource
from poller.sources.outbox import OutboxSource
from poller.sources.pg_logical.source import PgLogicalSource
from poller.tick.events import to_batch
from shared.config import Config, PollerConfig
from shared.errors import ConfigError, DbFanoutError, OversizeRowError
from shared.lease_margins import describe_margins, margin_problem
from shared.messages import pack_batch
from worker.handlers import load_handler

__all__ = [
    "Check",
    "duplicate_detection_check",
    "handler_check",
    "max_delivery_check",
    "schedule_interval_seconds",
    "validate_poller",
]

SAMPLE_ROWS = 200


def _msg(exc: Exception) -> str:
    return str(exc) if isinstance(exc, DbFanoutError) else f"{type(exc).__name__}: {exc}"


def _source_checks(cfg: PollerConfig, fix: bool = False, others: tuple[PollerConfig, ...] = ()) -> Iterator[Check]:
    p = cfg.name
    try:
        cfg.require_settings()  # the errors the deployed poller's ticks would fail with:
        source = open_source(cfg)  # a missing setting, a driver that is not installed
    except ConfigError as exc:
        yield Check(p, "source", "fail", _msg(exc))
        return
    yield from _outbox_fix(source, p, fix)
    yield from _notify_checks(cfg, fix)
    if isinstance(source, PgLogicalSource | MysqlBinlogSource):
        yield from _log_checks(source, cfg, fix, others)
        return
    try:
        info = source.describe()
        page = source.fetch(None, SAMPLE_ROWS)
    except Exception as exc:
        yield Check(p, "source", "fail", _msg(exc))
        return
    yield Check(
        p,
        "source",
        "ok",
        f"{info['dialect']} {info['mode']} {info['source']!s:.60}: columns present, "
        f"cursor kind {info['cursor_kind'] or 'unknown (no rows yet)'}",
    )
    if info["index_warning"]:
        yield Check(p, "index", "fail", info["index_warning"])
    elif info["mode"] == "table":
        yield Check(p, "index", "ok", f"an index leads with ({', '.join([cfg.cursor, *cfg.pk])})")
    elif info["mode"] == "outbox":
        yield from _outbox_checks(cfg, info)
    if info["cursor_kind"] == "float":
        yield Check(p, "cursor type", "warn", "a float cursor loses precision; prefer an integer or timestamp")
    stamps = [v for r in page.rows if isinstance(v := r.values.get(cfg.cursor), dt.datetime)]
    if len(stamps) >= 10 and all(s.microsecond == 0 for s in stamps):
        yield Check(
            p,
            "cursor precision",
            "warn",
            "sampled cursor values have whole seconds only: many rows share a "
            "value (the pk tiebreaker keeps order; use microsecond timestamps to narrow late-commit gaps)",
        )
    if page.skipped_null_cursors:
        status: Status = "fail" if cfg.null_cursor == "fail" else "warn"
        yield Check(
            p,
            "null cursors",
            status,
            f"{page.skipped_null_cursors} row(s) have a NULL {cfg.cursor} and are never delivered",
        )
    yield Check(p, "settle window", "warn" if "none:" in str(info["settle"]) else "ok", str(info["settle"]))
    if page.rows:
        try:
            pack_batch(to_batch(cfg, source.fingerprint, page.rows), cfg.max_message_bytes)
            yield Check(p, "message size", "ok", f"{len(page.rows)} sampled rows fit in {cfg.max_message_bytes} bytes")
        except OversizeRowError as exc:
            status = "fail" if cfg.oversize_policy == "error" else "warn"
            yield Check(p, "message size", status, f"{exc} (oversize_policy = {cfg.oversize_policy!r})")


def _log_checks(
    source: PgLogicalSource | MysqlBinlogSource, cfg: PollerConfig, fix: bool, others: tuple[PollerConfig, ...]
) -> Iterator[Check]:
    """A change-log source's own checks: the slot's (pg_logical) or the binlog's (mysql_binlog)."""
    if isinstance(source, PgLogicalSource):
        yield from slot_checks(cfg, fix=fix)
        yield from signal_grant_checks(cfg)
        yield from ordering_check(cfg)
        return
    source.close()
    yield from binlog_checks(cfg, others=others, fix=fix)
    yield from ordering_check(cfg)


def _notify_checks(cfg: PollerConfig, fix: bool) -> Iterator[Check]:
    """``wake = "notify"``: its triggers exist (``--fix`` creates them); else the linger never wakes."""
    if cfg.wake != "notify":
        return
    from dbfanout.ops.notify import create_notify_triggers, missing_notify_triggers

    try:
        if fix:
            created = create_notify_triggers(cfg)
            if created:
                yield Check(cfg.name, "fix", "ok", f"created {', '.join(created)}")
        missing = missing_notify_triggers(cfg)
    except Exception as exc:
        yield Check(cfg.name, "notify trigger", "fail", _msg(exc))
        return
    if missing:
        detail = f"no notify trigger on {', '.join(missing)}: a lingering tick is never woken (run validate --fix)"
        yield Check(cfg.name, "notify trigger", "fail", detail)
    else:
        yield Check(cfg.name, "notify trigger", "ok", "every table notifies the poller's channel on commit")


def _outbox_fix(source: object, poller: str, fix: bool) -> Iterator[Check]:
    """``--fix`` for an outbox poller: create its table or index when missing (then checked as usual)."""
    if not fix or not isinstance(source, OutboxSource):
        return
    try:
        created = source.create_missing()
    except Exception as exc:
        yield Check(poller, "fix", "fail", _msg(exc))
        return
    if created:
        yield Check(poller, "fix", "ok", f"created {', '.join(created)}")


def _outbox_checks(cfg: PollerConfig, info: dict[str, Any]) -> Iterator[Check]:
    p = cfg.name
    yield Check(p, "index", "ok", f"the outbox is read in ({info['cursor']}) order through an index")
    if cfg.outbox_retention_seconds is None:
        yield Check(p, "outbox retention", "warn", "outbox_retention_seconds unset: delivered rows are never pruned")
    else:
        yield Check(
            p, "outbox retention", "ok",
            f"delivered rows older than {cfg.outbox_retention_seconds:g} s are pruned after each tick",
        )  # fmt: skip


def _state_checks(config: Config, cfg: PollerConfig) -> Iterator[Check]:
    try:
        snap = open_store(config, cfg.name).load()
    except Exception as exc:
        yield Check(cfg.name, "state", "fail", _msg(exc))
        return
    if snap is None:
        yield Check(cfg.name, "state", "ok", "no state blob yet: the first tick starts from the beginning")
    elif (fingerprint := _fingerprint(cfg)) is None:
        yield Check(cfg.name, "state", "ok", "state blob readable (the source cannot be opened: see above)")
    elif snap.doc.source_fingerprint != fingerprint:
        yield Check(
            cfg.name,
            "fingerprint",
            "fail",
            "the checkpoint belongs to another source definition; see "
            f"`dbfanout checkpoint reset {cfg.name} --accept-fingerprint` in docs/operations.md",
        )
    else:
        yield Check(cfg.name, "state", "ok", "state blob readable, fingerprint matches")
    if snap is not None and (late := initial_too_late(cfg, snap.doc.checkpoint.position)):
        yield Check(cfg.name, "initial snapshot", "warn", late)


def lease_margins_check(cfg: PollerConfig) -> Check:
    """How the lease renews and how many storage timeouts fit before it expires (the config load
    already refused a combination where fewer than two fit)."""
    problem = margin_problem(cfg.lease_ttl_seconds, cfg.state_timeout)
    detail = problem or describe_margins(cfg.lease_ttl_seconds, cfg.state_timeout)
    return Check(cfg.name, "lease margins", "fail" if problem else "ok", detail)


def _fingerprint(cfg: PollerConfig) -> str | None:
    try:
        return open_source(cfg).fingerprint
    except ConfigError:  # reported by the source check
        return None


def _queue_property_checks(config: Config, cfg: PollerConfig) -> Iterator[Check]:
    p, need = cfg.name, needed_window_seconds(cfg)
    if is_emulator(config):
        yield Check(
            p,
            "queue properties",
            "skip",
            "not checkable against the emulator (no management API); on Azure "
            f"duplicate detection must be on with a window >= {need:.0f}s",
        )
        return
    try:
        from azure.servicebus.management import ServiceBusAdministrationClient

        conn = config.settings.get(config.app.servicebus_connection) or ""
        with ServiceBusAdministrationClient.from_connection_string(conn) as admin:
            q = admin.get_queue(cfg.queue)
    except Exception as exc:
        yield Check(p, "queue properties", "skip", f"could not read them ({_msg(exc)[:160]}); needs the Manage right")
        return
    yield duplicate_detection_check(
        cfg, bool(q.requires_duplicate_detection), duration_seconds(q.duplicate_detection_history_time_window)
    )
    mdc = q.max_delivery_count or 0
    yield max_delivery_check(cfg, mdc)
    lock = duration_seconds(q.lock_duration)
    yield Check(
        p,
        "lock duration",
        "ok" if lock >= 30 else "warn",
        f"{lock:.0f}s: handlers must finish well within it "
        "(the Functions host renews locks up to maxAutoLockRenewalDuration)",
    )
    size = (q.max_message_size_in_kilobytes or 256) * 1024
    if cfg.max_message_bytes > size:
        yield Check(p, "message size", "fail", f"max_message_bytes {cfg.max_message_bytes} > the queue's {size}")


def handler_check(cfg: PollerConfig, app_root: Path | None, subscription: str | None = None) -> Check:
    """Import the handler exactly as the worker will (``module:function`` from the app root).

    ``subscription``: the handler of that subscription of a topic poller.
    """
    if subscription is not None:
        spec: str | None = cfg.subscription(subscription).handler
        key, name = f"pollers.{cfg.name}.subscriptions.{subscription}.handler", f"handler [{subscription}]"
    else:
        spec, key, name = cfg.handler, f"pollers.{cfg.name}.handler", "handler"
    if spec is None:
        return Check(
            cfg.name,
            "handler",
            "warn",
            f"{key} is not set: this app's worker fails (and finally dead-letters) every message of this "
            "poller; fine only when another app consumes its queue",
        )
    try:
        load_handler(spec, key=key, app_root=app_root)
    except ConfigError as exc:
        return Check(cfg.name, name, "fail", f"{exc.key}: {exc.problem}")
    except Exception as exc:  # the module imports, but raises while it does (the worker would too)
        return Check(cfg.name, name, "fail", f"importing {spec!r} raised {type(exc).__name__}: {exc}")
    return Check(cfg.name, name, "ok", f"{spec} imports and is callable")


def validate_poller(
    config: Config,
    name: str,
    client: ServiceBusClient | None,
    *,
    fix: bool = False,
    app_root: Path | None = None,
) -> list[Check]:
    """Every check of one poller (handler, database, state, queue; a topic poller: its topology).

    ``fix``: create a missing slot/publication; ``app_root``: where handlers import from.
    """
    cfg = config.poller(name)
    if cfg.is_topic:
        handlers = [handler_check(cfg, app_root, sub) for sub in sorted(cfg.subscriptions)]
        others = tuple(config.pollers.values())
        checks = [*handlers, *_source_checks(cfg, fix, others), *_state_checks(config, cfg), lease_margins_check(cfg)]
        if client is None:
            checks.append(Check(name, "topic", "skip", "no Service Bus connection"))
            return checks
        return [*checks, *topic_checks(config, cfg, client)]
    others = tuple(config.pollers.values())
    checks = [handler_check(cfg, app_root), *_source_checks(cfg, fix, others), *_state_checks(config, cfg)]
    checks.append(lease_margins_check(cfg))
    if cfg.transport != "servicebus" or client is None:
        checks.append(Check(name, "queue", "skip", "not a Service Bus poller, or no Service Bus connection"))
        return checks
    probe = probe_queue(client, cfg.queue)
    if probe.exists:
        kind = " (session-enabled)" if probe.requires_session else ""
        checks.append(Check(name, "queue", "ok", f"{cfg.queue} exists{kind}"))
        checks.append(session_check(cfg, probe))
        checks.extend(_queue_property_checks(config, cfg))
    else:
        missing = probe.exists is False
        detail = f"{cfg.queue} does not exist" if missing else f"{cfg.queue}: cannot check ({probe.error})"
        checks.append(Check(name, "queue", "fail", detail))
    return checks
