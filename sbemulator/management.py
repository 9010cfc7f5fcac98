"""The ``<entity>/$management`` request/response operations (protocol section 5)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from typing import Any

from proton import UNDESCRIBED, Array, Data, Message, symbol, timestamp

from sbemulator.broker import Broker, EntityPath
from sbemulator.entities import IncomingMessage
from sbemulator.errors import BrokerError, InvalidOperationError
from sbemulator.messages import parse_message, render
from sbemulator.queue import Queue
from sbemulator.topic import Topic

Body = dict[str, Any]
_UNDESCRIBED: Any = UNDESCRIBED
Op = Callable[[Queue, Mapping[str, Any], float], "Body | None"]
_NO_CONTENT = None  # an op returning None answers 204


def handle_request(broker: Broker, entity: EntityPath, request: Message) -> Message:
    """Run one management request and build its reply (never raises)."""
    props: dict[Any, Any] = dict(request.properties or {})
    op_name = str(props.get("operation", ""))
    reply = Message(correlation_id=request.id, address=request.reply_to)
    try:
        target = broker.entity(entity)
        body_in = _normalise(request.body)
        body: Body | None
        if isinstance(target, Topic):
            topic_op = _TOPIC_OPS.get(op_name)
            if topic_op is None:
                raise InvalidOperationError(
                    f"management operation {op_name!r} does not apply to topic '{target.name}';"
                    " address one of its subscriptions"
                )
            body = topic_op(broker, target, body_in, broker.clock())
        else:
            op = _OPS.get(op_name)
            if op is None:
                raise InvalidOperationError(f"management operation {op_name!r} is not supported by the emulator")
            body = op(target, body_in, broker.clock())
        status, description = (200, "OK") if body is not None else (204, "No Content")
        reply.properties = {"statusCode": status, "statusDescription": description}  # type: ignore[assignment]
        reply.body = body if body is not None else {}
    except BrokerError as exc:
        reply.properties = {  # type: ignore[assignment]
            "statusCode": exc.status_code,
            "statusDescription": str(exc),
            "errorCondition": symbol(exc.condition),
        }
        reply.body = {}
    return reply


def _normalise(body: object) -> dict[str, Any]:
    if not isinstance(body, Mapping):
        return {}
    out = {}
    for key, value in body.items():
        name = bytes(key).decode() if isinstance(key, bytes | memoryview) else str(key)
        out[name] = bytes(value) if isinstance(value, memoryview) else value
    return out


def _tokens(body: Mapping[str, Any]) -> list[uuid.UUID]:
    return [t if isinstance(t, uuid.UUID) else uuid.UUID(bytes=bytes(t)) for t in body.get("lock-tokens") or []]


def _renew_lock(q: Queue, body: Mapping[str, Any], now: float) -> Body:
    expirations = [timestamp(round(q.renew(t, now) * 1000)) for t in _tokens(body)]
    return {"expirations": Array(_UNDESCRIBED, Data.TIMESTAMP, *expirations)}


def _peek(q: Queue, body: Mapping[str, Any], now: float) -> Body | None:
    start = int(body.get("from-sequence-number") or 0)
    count = int(body.get("message-count") or 1)
    found = q.peek(start, count, body.get("session-id"))
    if not found:
        return _NO_CONTENT
    return {"messages": [{"message": render(m, None)} for m in found]}


def _receive_by_sequence(q: Queue, body: Mapping[str, Any], now: float) -> Body:
    delete = body.get("receiver-settle-mode") == 0  # ReceiverSettleMode.First = receive-and-delete
    deliveries = q.lock_deferred([int(s) for s in body.get("sequence-numbers") or []], now, delete=delete)
    out = []
    for d in deliveries:
        entry: dict[str, Any] = {"message": render(d.message, None if delete else d.locked_until)}
        if d.lock_token is not None:
            entry["lock-token"] = d.lock_token
        out.append(entry)
    return {"messages": out}


def _update_disposition(q: Queue, body: Mapping[str, Any], now: float) -> Body:
    status = str(body.get("disposition-status", ""))
    for token in _tokens(body):
        if status == "completed":
            q.complete(token, now)
        elif status == "abandoned":
            q.abandon(token, now)
        elif status == "defered":
            q.defer(token, now)
        elif status == "suspended":
            q.dead_letter(token, body.get("deadletter-reason"), body.get("deadletter-description"), now)
        else:
            raise InvalidOperationError(f"unknown disposition-status {status!r}")
    return {}


def _schedule(q: Queue, body: Mapping[str, Any], now: float) -> Body:
    return _schedule_on(q, body, lambda incoming: q.enqueue(incoming, now))


def _schedule_on(
    entity: Queue | Topic, body: Mapping[str, Any], enqueue: Callable[[IncomingMessage], int | None]
) -> Body:
    seqs = []
    for entry in body.get("messages") or []:
        payload = bytes(entry.get("message") or b"")
        incoming = parse_message(payload)
        entity.check_size(len(payload))
        seq = enqueue(incoming)
        seqs.append(seq if seq is not None else 0)
    return {"sequence-numbers": Array(_UNDESCRIBED, Data.LONG, *seqs)}


def _cancel(q: Queue, body: Mapping[str, Any], now: float) -> Body:
    q.cancel_scheduled(int(s) for s in body.get("sequence-numbers") or [])
    return {}


def _schedule_on_topic(broker: Broker, topic: Topic, body: Mapping[str, Any], now: float) -> Body:
    return _schedule_on(topic, body, lambda incoming: broker.enqueue(topic, incoming, now))


def _cancel_on_topic(broker: Broker, topic: Topic, body: Mapping[str, Any], now: float) -> Body:
    for seq in body.get("sequence-numbers") or []:
        topic.cancel_scheduled(int(seq))
    return {}


def _get_state(q: Queue, body: Mapping[str, Any], now: float) -> Body:
    sid = str(body["session-id"])
    q.sessions.check(sid, None, now)
    return {"session-state": q.sessions.record(sid).state}


def _set_state(q: Queue, body: Mapping[str, Any], now: float) -> Body:
    sid = str(body["session-id"])
    q.sessions.check(sid, None, now)
    state = body.get("session-state")
    q.sessions.set_state(sid, bytes(state) if state is not None else None, now)
    return {}


def _renew_session(q: Queue, body: Mapping[str, Any], now: float) -> Body:
    until = q.sessions.renew(str(body["session-id"]), None, now)
    return {"expiration": timestamp(round(until * 1000))}


def _list_sessions(q: Queue, body: Mapping[str, Any], now: float) -> Body | None:
    since_ms = int(body.get("last-updated-time") or 0)
    # DateTime.MaxValue asks for "all sessions with messages" (default listing mode).
    since = 0.0 if since_ms >= 253402300799000 else since_ms / 1000.0
    ids = q.sessions.active_ids(since)
    skip, top = int(body.get("skip") or 0), int(body.get("top") or 100)
    page = ids[skip : skip + top]
    if not page:
        return _NO_CONTENT
    return {"skip": skip + len(page), "sessions-ids": Array(_UNDESCRIBED, Data.STRING, *page)}


_TOPIC_OPS: dict[str, Callable[[Broker, Topic, Mapping[str, Any], float], Body]] = {
    "com.microsoft:schedule-message": _schedule_on_topic,
    "com.microsoft:cancel-scheduled-message": _cancel_on_topic,
}
_OPS: dict[str, Op] = {
    "com.microsoft:renew-lock": _renew_lock,
    "com.microsoft:peek-message": _peek,
    "com.microsoft:receive-by-sequence-number": _receive_by_sequence,
    "com.microsoft:update-disposition": _update_disposition,
    "com.microsoft:schedule-message": _schedule,
    "com.microsoft:cancel-scheduled-message": _cancel,
    "com.microsoft:get-session-state": _get_state,
    "com.microsoft:set-session-state": _set_state,
    "com.microsoft:renew-session-lock": _renew_session,
    "com.microsoft:get-message-sessions": _list_sessions,
}
