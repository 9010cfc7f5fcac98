"""AMQP links: attach or refuse, CBS, transfers in, deliveries out, settlement echoes.

Each link remembers its role in proton's per-object attribute record (``link.sb_role``), which
survives proton re-wrapping the same C object in a new Python wrapper.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Any

import cproton  # type: ignore[import-untyped]
from proton import Condition, Delivery, Disposition, Event, Link, Message, Terminus, symbol, ulong

from sbemulator.broker import Broker, EntityPath
from sbemulator.codec import CodecError
from sbemulator.errors import BrokerError, InvalidOperationError
from sbemulator.faults import Faults
from sbemulator.management import handle_request
from sbemulator.messages import parse_transfer, render
from sbemulator.queue import Queue

log = logging.getLogger("sbemulator.links")

SESSION_FILTER = symbol("com.microsoft:session-filter")
LOCKED_UNTIL_UTC = symbol("com.microsoft:locked-until-utc")
TIMEOUT = symbol("com.microsoft:timeout")
MAX_BATCH_SIZE = symbol("com.microsoft:max-message-batch-size")
TRACKING_ID = symbol("com.microsoft:tracking-id")
DEAD_LETTER = "com.microsoft:dead-letter"
INCOMING_CREDIT = 1000
DEFAULT_SESSION_WAIT = 60.0
TICK_INTERVAL = 0.05
_DOTNET_EPOCH_TICKS = 621355968000000000

# The receive/settle hot path talks to proton's C API directly: every Python wrapper proton
# builds (Event, Delivery, Link, Disposition, their attribute records) costs microseconds, and the
# SDK waits for each settlement echo, so that cost is on the critical path of every message.
_lib, _ffi = cproton.lib, cproton.ffi
_ACCEPTED = int(Disposition.ACCEPTED)
_record_get_py = cproton.pn_record_get_py
_UUID = uuid.UUID


@dataclass(eq=False)
class Producer:
    """A client sender: transfers go to ``path``."""

    path: EntityPath


@dataclass(eq=False)
class RequestLink:
    """A client's request link to ``$cbs`` or ``<entity>/$management``."""

    path: EntityPath | None  # None for $cbs


@dataclass(eq=False)
class Consumer:
    """A client receiver of ``queue``; ``session_id`` is the session it has locked."""

    link: Link
    queue: Queue
    delete: bool
    session_id: str | None = None
    session_key: str | None = None
    seen_version: int = -1
    deadline: float = 0.0  # next-available session attach still waiting until then


def dotnet_ticks(unix_seconds: float) -> int:
    """A .NET DateTime in ticks, as com.microsoft:locked-until-utc carries it."""
    return round(unix_seconds * 1000) * 10000 + _DOTNET_EPOCH_TICKS


def _role(obj: Any) -> Any:
    return getattr(obj, "sb_role", None)


def _condition(exc: BrokerError) -> Condition:
    # pyamqp indexes `info` unconditionally: always send a non-null map.
    return Condition(exc.condition, str(exc), {TRACKING_ID: str(uuid.uuid4())})


class LinkHandler:
    """Dispatches proton events of all connections. Called with the emulator lock held."""

    def __init__(self, broker: Broker, faults: Faults) -> None:
        self.broker = broker
        self.faults = faults
        self.consumers: set[Consumer] = set()
        self.waiting: list[Consumer] = []
        self._next_tick = 0.0

    # ---- events ----------------------------------------------------------------------------
    def on_event(self, event: Event) -> None:
        """Handle one proton event."""
        etype: Any = event.type
        link: Any = event.link
        if etype == Event.CONNECTION_REMOTE_OPEN:
            event.connection.open()  # type: ignore[union-attr]
        elif etype == Event.SESSION_REMOTE_OPEN:
            event.session.open()  # type: ignore[union-attr]
        elif etype == Event.LINK_REMOTE_OPEN:
            self._attach(link)
        elif etype == Event.LINK_FLOW:
            role = _role(link)
            if isinstance(role, Consumer):
                self._pump(role)
        elif etype == Event.DELIVERY:
            if link.is_receiver:
                self._incoming(link, event.delivery)  # type: ignore[arg-type]
            else:
                self._settle(link, event.delivery)  # type: ignore[arg-type]
        elif etype == Event.LINK_REMOTE_CLOSE:
            self.link_gone(link)
            link.close()
        elif etype == Event.SESSION_REMOTE_CLOSE:
            event.session.close()  # type: ignore[union-attr]
        elif etype == Event.CONNECTION_REMOTE_CLOSE:
            event.connection.close()  # type: ignore[union-attr]

    def on_delivery(self, dlv: Any) -> None:
        """Handle a DELIVERY event given proton's raw ``pn_delivery_t`` (no Python wrappers).

        The common case, a client completing a message, is served entirely through the C API;
        everything else is handed to the wrapper-based code.
        """
        link = _lib.pn_delivery_link(dlv)
        if not _lib.pn_link_is_sender(link):
            self._incoming(Link.wrap(link), Delivery.wrap(dlv))  # type: ignore[no-untyped-call]
        elif not self._complete_fast(link, dlv):
            self._settle(Link.wrap(link), Delivery.wrap(dlv))  # type: ignore[no-untyped-call]

    def _complete_fast(self, link: Any, dlv: Any) -> bool:
        """Settle an `accepted` disposition on a peek-lock receiver; False when it is not one."""
        if _lib.pn_delivery_remote_state(dlv) != _ACCEPTED:
            return False
        attrs = _record_get_py(_lib.pn_link_attachments(link))
        consumer = attrs.get("sb_role") if attrs else None
        if not isinstance(consumer, Consumer) or consumer.delete:
            return False
        token = _tag_token(dlv)
        if token is None:
            return False
        queue, now = consumer.queue, self.broker.clock()
        try:
            if consumer.session_id is not None:
                queue.sessions.check(consumer.session_id, consumer, now)
            queue.complete(token, now)
        except BrokerError as exc:
            wrapped: Any = Delivery.wrap(dlv)  # type: ignore[no-untyped-call]
            wrapped.local.condition = _condition(exc)
            wrapped.update(Delivery.REJECTED)
            wrapped.settle()
            return True
        _lib.pn_delivery_update(dlv, _ACCEPTED)
        _lib.pn_delivery_settle(dlv)
        return True

    def link_gone(self, link: Link) -> None:
        """Forget a link (detached, or its connection vanished). Message locks stay until expiry."""
        role = _role(link)
        if isinstance(role, Consumer):
            self.consumers.discard(role)
            if role in self.waiting:
                self.waiting.remove(role)
            if role.session_id is not None:
                role.queue.sessions.release(role.session_id, role, self.broker.clock())
        if role is not None:
            link.sb_role = None  # breaks the link <-> role reference cycle

    def on_idle(self) -> float:
        """Timers and dispatch after each batch of I/O; returns seconds until the next deadline.

        Runs after every pass of the server loop (once per settled message under load), so the
        common case, nothing due and no new messages, touches as little as possible.
        """
        now = self.broker.clock()
        if now >= self._next_tick:
            # New locks/schedules may add earlier deadlines: re-check at least every TICK_INTERVAL.
            self.broker.tick()
            self._next_tick = min(self.broker.next_deadline(), now + TICK_INTERVAL)
            self._close_lost_sessions()  # only broker.tick loses session locks
        self.broker.journal.flush_if_due()
        if self.waiting:
            self._serve_waiting(now)
        for consumer in list(self.consumers):
            if consumer.queue.version != consumer.seen_version and _lib.pn_link_credit(consumer.link._impl) > 0:
                self._pump(consumer)
        if not self.waiting:
            return max(0.0, self._next_tick - now)
        return max(0.0, min(self._next_tick, *(c.deadline for c in self.waiting)) - now)

    # ---- attach ----------------------------------------------------------------------------
    def _attach(self, link: Link) -> None:
        terminus = link.remote_target if link.is_receiver else link.remote_source
        address = terminus.address or ""
        try:
            if address.lower().endswith("$cbs"):
                self._open_request_link(link, None)
            elif address.lower().endswith("/$management"):
                path = EntityPath.parse(address)
                self.broker.entity(path)
                self._open_request_link(link, path)
            elif link.is_receiver:
                self._attach_producer(link, EntityPath.parse(address))
            else:
                self._attach_consumer(link, EntityPath.parse(address))
        except BrokerError as exc:
            self._refuse(link, exc)

    def _open(self, link: Link) -> None:
        link.source.copy(link.remote_source)
        link.target.copy(link.remote_target)
        link.snd_settle_mode = link.remote_snd_settle_mode
        link.rcv_settle_mode = link.remote_rcv_settle_mode
        link.open()

    def _refuse(self, link: Link, exc: BrokerError) -> None:
        # An attach with a null source/target followed by a closing detach is how the service
        # refuses a link; the SDK maps the detach condition to its exception types.
        log.info("refusing link %s: %s", link.name, exc.condition)
        link.sb_role = None
        link.source.type = Terminus.UNSPECIFIED  # encoded as null
        link.target.type = Terminus.UNSPECIFIED
        link.condition = _condition(exc)
        link.open()
        link.close()

    def _open_request_link(self, link: Link, path: EntityPath | None) -> None:
        self._open(link)
        if link.is_receiver:
            link.sb_role = RequestLink(path)
            link.flow(INCOMING_CREDIT)
        else:
            replies = getattr(link.connection, "sb_replies", None)
            if replies is None:
                replies = link.connection.sb_replies = {}
            replies[(link.remote_source.address or "").lower()] = link

    def _attach_producer(self, link: Link, path: EntityPath) -> None:
        entity = self.broker.sendable(path)
        link.max_message_size = entity.props.max_message_size
        link.properties = {MAX_BATCH_SIZE: ulong(entity.props.max_message_size)}
        self._open(link)
        link.sb_role = Producer(path)
        link.flow(INCOMING_CREDIT)

    def _attach_consumer(self, link: Link, path: EntityPath) -> None:
        queue = self.broker.queue(path)
        delete = link.remote_snd_settle_mode == Link.SND_SETTLED
        consumer = Consumer(link, queue, delete)
        if not queue.props.requires_session or queue.is_dead_letter:
            self._open(link)
            link.sb_role = consumer
            self.consumers.add(consumer)
            return
        filters = _filters(link)
        if SESSION_FILTER not in filters:
            raise InvalidOperationError(
                f"It is not possible for an entity that requires sessions to create a non-sessionful message"
                f" receiver ('{queue.name}' requires sessions): open a session receiver (session_id=...)."
            )
        now = self.broker.clock()
        session_id = filters.get(SESSION_FILTER)
        record = queue.sessions.lock(str(session_id) if session_id is not None else None, consumer, now)
        link.sb_role = consumer
        if record is None:
            props = link.remote_properties or {}
            wait = float(props.get(TIMEOUT, DEFAULT_SESSION_WAIT * 1000)) / 1000.0
            consumer.deadline = now + wait
            self.waiting.append(consumer)
            return
        self._accept_session(consumer, record.session_id, record.locked_until)

    def _accept_session(self, consumer: Consumer, session_id: str, locked_until: float) -> None:
        link = consumer.link
        consumer.session_id = consumer.session_key = session_id
        link.properties = {LOCKED_UNTIL_UTC: dotnet_ticks(locked_until)}
        self._open(link)
        # Echo the identical source address, with the filter naming the session we locked.
        link.source.filter.clear()
        link.source.filter.put_object({SESSION_FILTER: session_id})
        self.consumers.add(consumer)

    def _serve_waiting(self, now: float) -> None:
        for consumer in list(self.waiting):
            record = consumer.queue.sessions.lock(None, consumer, now)
            if record is not None:
                self.waiting.remove(consumer)
                self._accept_session(consumer, record.session_id, record.locked_until)
            elif consumer.deadline <= now:
                self.waiting.remove(consumer)
                exc = BrokerError("no session became available within the timeout")
                exc.condition = "com.microsoft:timeout"
                self._refuse(consumer.link, exc)

    def _close_lost_sessions(self) -> None:
        for queue in self.broker.queues():
            while queue.sessions.lost:
                _, owner = queue.sessions.lost.pop()
                if isinstance(owner, Consumer) and owner in self.consumers:
                    self.consumers.discard(owner)
                    owner.session_id = None
                    owner.link.condition = Condition(
                        "com.microsoft:session-lock-lost", "The session lock has expired.", {TRACKING_ID: ""}
                    )
                    owner.link.close()
                    owner.link.sb_role = None

    # ---- transfers in ----------------------------------------------------------------------
    def _incoming(self, link: Link, dlv: Delivery) -> None:
        if dlv.partial or not dlv.readable:
            return
        data = bytes(link.recv(dlv.pending))
        link.advance()
        role = _role(link)
        try:
            if isinstance(role, Producer):
                self._produce(role, data)
            elif isinstance(role, RequestLink):
                self._request(link, role, data)
            else:
                raise InvalidOperationError("this link is closed")
            dlv.update(Delivery.ACCEPTED)
        except BrokerError as exc:
            dlv.local.condition = _condition(exc)
            dlv.update(Delivery.REJECTED)
        except CodecError as exc:
            dlv.local.condition = Condition("amqp:decode-error", str(exc), {TRACKING_ID: "decode"})
            dlv.update(Delivery.REJECTED)
        dlv.settle()
        if link.credit < INCOMING_CREDIT // 2:
            link.flow(INCOMING_CREDIT - link.credit)

    def _produce(self, role: Producer, data: bytes) -> None:
        entity = role.path.queue
        try:
            fault = self.faults.take_send_fault(entity)
            if fault is not None:
                raise fault
            self.broker.send(role.path, parse_transfer(data), len(data))
        except BrokerError:
            self.faults.count_send(entity, accepted=False)
            raise
        self.faults.count_send(entity, accepted=True)

    def _request(self, link: Link, role: RequestLink, data: bytes) -> None:
        request = Message()
        request.decode(data)
        if role.path is None:  # CBS put-token: every token is accepted
            reply = Message(
                correlation_id=request.id,
                properties={"status-code": 202, "status-description": "Accepted"},
            )
            reply_to = "$cbs"
        else:
            reply = handle_request(self.broker, role.path, request)
            reply_to = request.reply_to or ""
        replies = getattr(link.connection, "sb_replies", None) or {}
        sender = replies.get(reply_to.lower())
        if sender is None:
            log.warning("no reply link for %s; dropping the response", reply_to)
            return
        dlv = sender.delivery(uuid.uuid4().bytes)
        sender.send(reply.encode())
        sender.advance()
        dlv.settle()

    # ---- deliveries out --------------------------------------------------------------------
    def _pump(self, consumer: Consumer) -> None:
        link, queue = consumer.link._impl, consumer.queue
        lib, delete = _lib, consumer.delete
        now = self.broker.clock()
        while lib.pn_link_credit(link) > 0:
            d = queue.lock_next(consumer.session_key, now, delete=delete)
            if d is None:
                consumer.seen_version = queue.version
                break
            token = d.lock_token
            # The SDK reads the lock token as uuid.UUID(bytes_le=delivery_tag); settlement reads
            # the token back from the tag.
            dlv = cproton.pn_delivery(link, (token or uuid.uuid4()).bytes_le)
            data = render(d.message, d.locked_until if token else None)
            sent = lib.pn_link_send(link, _ffi.from_buffer(data), len(data))
            if sent < 0:
                raise RuntimeError(f"proton refused a transfer ({sent})")
            lib.pn_link_advance(link)
            if token is None:
                lib.pn_delivery_settle(dlv)
        if lib.pn_link_get_drain(link) and lib.pn_link_credit(link) > 0:
            lib.pn_link_drained(link)

    def _settle(self, link: Link, dlv: Delivery) -> None:
        consumer = _role(link)
        state = dlv.remote_state
        if not state and not dlv.settled:  # `settled` is the remote peer's settlement
            return
        if not isinstance(consumer, Consumer) or consumer.delete or not state:
            dlv.settle()
            return
        try:
            self._apply_outcome(consumer, dlv, state)
            if state == Disposition.MODIFIED:
                dlv.local.failed = dlv.remote.failed
                dlv.local.undeliverable = dlv.remote.undeliverable
            # A dead-letter is echoed as `rejected` without an error (an error would mean failure).
            dlv.update(state)
        except BrokerError as exc:
            dlv.local.condition = _condition(exc)
            dlv.update(Delivery.REJECTED)
        dlv.settle()

    def _apply_outcome(self, consumer: Consumer, dlv: Delivery, state: int) -> None:
        queue, now = consumer.queue, self.broker.clock()
        token = _tag_token(dlv._impl)
        if token is None:
            raise InvalidOperationError("unknown delivery")
        if consumer.session_id is not None:
            queue.sessions.check(consumer.session_id, consumer, now)
        if state == Disposition.ACCEPTED:
            queue.complete(token, now)
        elif state == Disposition.RELEASED:
            queue.release(token, now)
        elif state == Disposition.MODIFIED:
            remote = dlv.remote
            if remote.failed and remote.undeliverable:
                queue.defer(token, now)
            elif remote.failed:
                queue.abandon(token, now)
            else:
                queue.release(token, now)
        elif state == Disposition.REJECTED:
            info = _info(dlv.remote.condition)
            queue.dead_letter(token, info.get("DeadLetterReason"), info.get("DeadLetterErrorDescription"), now)


def _tag_token(dlv: Any) -> uuid.UUID | None:
    """The lock token a delivery tag carries (proton's Delivery.tag would decode it as UTF-8)."""
    tag = _lib.pn_delivery_tag(dlv)
    if tag.size != 16:
        return None
    return _UUID(bytes_le=_ffi.unpack(tag.start, 16))


def _filters(link: Link) -> dict[Any, Any]:
    data = link.remote_source.filter
    data.rewind()
    if not data.next():
        return {}
    value: Any = data.get_object()
    return dict(value) if isinstance(value, dict) else {}


def _info(condition: Condition | None) -> dict[str, str | None]:
    if condition is None or not condition.info:
        return {}
    out: dict[str, str | None] = {}
    info: Any = condition.info
    for key, value in dict(info).items():
        out[str(key)] = None if value is None else str(value)
    return out
