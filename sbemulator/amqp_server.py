"""A single-threaded selector loop driving proton's protocol engine over plain TCP sockets.

We own the sockets (rather than proton's reactor) so that: the port can be 0 and known before
``start`` returns; one misbehaving connection (garbage bytes, a handler bug) is closed alone;
and shutdown is immediate.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import cproton  # type: ignore[import-untyped]
from proton import Collector, Condition, Connection, Event, Transport, symbol

from sbemulator.frames import DeliveryIdSequencer
from sbemulator.links import LinkHandler

log = logging.getLogger("sbemulator.server")
MAX_TIMEOUT = 0.5
RECV_CHUNK = 256 * 1024
SEND_CHUNK = 256 * 1024  # output is peeked and sent in pieces of at most this size
TRANSPORT_TICK_INTERVAL = 0.1
MAX_EVENTS_PER_PASS = 10_000
# Only these events need the handler; skipping the rest before proton wraps them in Python
# objects (TRANSPORT fires on every frame) saves much of the per-message cost.
_HANDLED = frozenset(
    e.number
    for e in (
        Event.CONNECTION_REMOTE_OPEN,
        Event.SESSION_REMOTE_OPEN,
        Event.LINK_REMOTE_OPEN,
        Event.LINK_FLOW,
        Event.LINK_REMOTE_CLOSE,
        Event.SESSION_REMOTE_CLOSE,
        Event.CONNECTION_REMOTE_CLOSE,
    )
)
# DELIVERY, the per-message event, goes to the handler without any Python wrapper.
_DELIVERY = Event.DELIVERY.number
_lib, _ffi = cproton.lib, cproton.ffi
_EVENT_TYPES: dict[int, Any] = type(Event.DELIVERY).TYPES  # number -> EventType, for log messages


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    peer: str
    transport: Transport
    connection: Connection
    collector: Collector = field(default_factory=Collector)
    sequencer: DeliveryIdSequencer = field(default_factory=DeliveryIdSequencer)
    write_wanted: bool = False


class AmqpServer:
    """Accepts AMQP connections on ``host:port`` (0 = a free port) and runs them on one thread."""

    def __init__(self, handler: LinkHandler, lock: threading.RLock, host: str = "127.0.0.1", port: int = 0) -> None:
        self._handler = handler
        self._lock = lock
        self._listener = socket.create_server((host, port), backlog=128)
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._conns: dict[socket.socket, _Conn] = {}
        self._stopping = False
        self._next_transport_tick = 0.0
        # Reused I/O buffers (the loop is single-threaded): no allocation per read or write.
        self._recv_buf = bytearray(RECV_CHUNK)
        self._recv_ptr = _ffi.from_buffer(self._recv_buf)
        self._recv_view = memoryview(self._recv_buf)
        self._send_buf = bytearray(SEND_CHUNK)
        self._send_ptr = _ffi.from_buffer(self._send_buf)
        self._send_view = memoryview(self._send_buf)

    def wake(self) -> None:
        """Make the loop run its timers/dispatch now (thread-safe)."""
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def stop(self) -> None:
        """Ask the loop to exit (thread-safe); ``serve_forever`` closes everything."""
        self._stopping = True
        self.wake()

    def serve_forever(self) -> None:
        """Run until :meth:`stop`."""
        timeout = 0.0
        try:
            while not self._stopping:
                ready = self._selector.select(timeout)
                with self._lock:
                    for key, mask in ready:
                        self._on_ready(key.fileobj, mask)  # type: ignore[arg-type]
                    timeout = self._run_idle()
                    for conn in list(self._conns.values()):
                        self._flush(conn)
        finally:
            self._shutdown()

    def _run_idle(self) -> float:
        try:
            timeout = self._handler.on_idle()
        except Exception:
            log.exception("timer/dispatch failed; the server keeps running")
            timeout = MAX_TIMEOUT
        now = time.monotonic()
        if now < self._next_transport_tick:  # idle-timeout keepalives need only coarse ticks
            return min(timeout, MAX_TIMEOUT, self._next_transport_tick - now)
        self._next_transport_tick = now + TRANSPORT_TICK_INTERVAL
        for conn in list(self._conns.values()):
            try:
                deadline = conn.transport.tick(now)
            except Exception:
                self._close(conn, "transport tick failed")
                continue
            if deadline:
                timeout = min(timeout, max(0.0, deadline - now))
            self._process(conn)
        return min(timeout, MAX_TIMEOUT)

    def _on_ready(self, sock: socket.socket, mask: int) -> None:
        if sock is self._listener:
            self._accept()
        elif sock is self._wake_r:
            try:
                while self._wake_r.recv(4096):
                    pass
            except BlockingIOError:
                pass
        elif (conn := self._conns.get(sock)) is not None:
            if mask & selectors.EVENT_READ:
                self._read(conn)
            if mask & selectors.EVENT_WRITE and sock in self._conns:
                self._flush(conn)

    def _accept(self) -> None:
        try:
            sock, addr = self._listener.accept()
        except OSError:
            return
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        transport = Transport(Transport.SERVER)
        sasl = transport.sasl()
        sasl.allow_insecure_mechs = True
        sasl.allowed_mechs("ANONYMOUS")
        connection = Connection()
        conn = _Conn(sock, f"{addr[0]}:{addr[1]}", transport, connection)
        connection.collect(conn.collector)
        transport.bind(connection)
        self._conns[sock] = conn
        self._selector.register(sock, selectors.EVENT_READ, None)
        log.debug("accepted %s", conn.peer)

    def _read(self, conn: _Conn) -> None:
        t = conn.transport._impl
        try:
            capacity = _lib.pn_transport_capacity(t)
            if capacity < 0:
                self._close(conn, "transport closed its input")
                return
            # Received straight into one reused buffer, as much as the socket has, and handed to
            # proton from there in as many pushes as it takes: proton's input buffer grows (up to
            # the max frame size) only once it is full, so reading no more than its spare capacity
            # took a large transfer in reads of a few bytes to a few hundred (~230 per 230 KB message).
            n = conn.sock.recv_into(self._recv_buf, RECV_CHUNK)
            if n:
                fixed = conn.sequencer.feed(self._recv_view[:n])
                ptr, size = (self._recv_ptr, n) if fixed is None else (_ffi.from_buffer(fixed), len(fixed))
                done = 0
                while done < size:
                    pushed = _lib.pn_transport_push(t, ptr + done, size - done)
                    if pushed <= 0:  # an error code, or no room even after growing: a frame over the limit
                        raise OSError(f"proton took {pushed} of {size - done} bytes")
                    done += pushed
            else:
                conn.transport.close_tail()
        except BlockingIOError:
            return
        except Exception as exc:  # a reset socket, or bytes proton refuses
            self._close(conn, f"read failed: {exc!r}")
            return
        self._process(conn)
        # Answer now (a settlement echo the client is waiting for) rather than after the timers
        # and dispatch of this pass; the flush after them finds this connection already drained.
        self._flush(conn)

    def _process(self, conn: _Conn) -> None:
        """Dispatch the connection's pending proton events; a handler error closes only it."""
        collector = conn.collector
        impl = collector._impl
        budget = MAX_EVENTS_PER_PASS  # one chatty connection must not starve the loop (and the others)
        handler, lib = self._handler, _lib
        while budget and (raw := lib.pn_collector_peek(impl)):  # a NULL cdata pointer is falsy
            budget -= 1
            etype = lib.pn_event_type(raw)
            try:
                if etype == _DELIVERY:
                    handler.on_delivery(lib.pn_event_delivery(raw))
                elif etype in _HANDLED:
                    handler.on_event(Event.wrap(raw))  # type: ignore[no-untyped-call]
            except Exception:
                name = _EVENT_TYPES.get(etype, etype)
                log.exception("handler failed on %s for %s; closing that connection", name, conn.peer)
                try:
                    conn.connection.condition = Condition(
                        "amqp:internal-error", "emulator handler error", {symbol("reason"): "handler"}
                    )
                    conn.connection.close()
                except Exception:
                    self._close(conn, "handler error")
                    return
            lib.pn_collector_pop(impl)
        if conn.transport.closed:
            self._flush(conn)
            self._close(conn, _end_reason(conn))

    def _flush(self, conn: _Conn) -> None:
        if conn.sock not in self._conns:
            return
        t, lib = conn.transport._impl, _lib
        try:
            pending = lib.pn_transport_pending(t)
            while pending > 0:
                size = lib.pn_transport_peek(t, self._send_ptr, min(pending, SEND_CHUNK))
                if size < -1:
                    raise OSError(f"proton output error ({size})")
                if size <= 0:  # nothing to hand out despite pending > 0: never spin on it
                    break
                sent = conn.sock.send(self._send_view[:size])
                if sent <= 0:
                    break
                lib.pn_transport_pop(t, sent)
                pending = lib.pn_transport_pending(t)
            if pending < -1:  # PN_EOS (-1) means finished; anything lower is an error
                raise OSError(f"proton output error ({pending})")
            if pending < 0 and lib.pn_transport_capacity(t) < 0:
                self._close(conn, _end_reason(conn))
                return
        except BlockingIOError:
            pending = 1
        except Exception as exc:
            self._close(conn, f"write failed: {exc!r}")
            return
        want = pending > 0
        if want != conn.write_wanted:
            conn.write_wanted = want
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if want else 0)
            self._selector.modify(conn.sock, events, None)

    def _close(self, conn: _Conn, why: str) -> None:
        if self._conns.pop(conn.sock, None) is None:
            return
        error = _local_error(conn)
        if error:  # we closed it for a protocol error: say which, at a level seen without -v
            log.warning("closing %s: %s (%s)", conn.peer, error, why)
        else:
            log.debug("closing %s: %s", conn.peer, why)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn.sock)
        conn.sock.close()
        self._forget_links(conn)
        with contextlib.suppress(Exception):
            conn.transport.unbind()
        conn.collector.release()

    def _forget_links(self, conn: _Conn) -> None:
        link = conn.connection.link_head(0)
        while link is not None:
            try:
                self._handler.link_gone(link)
            except Exception:
                log.exception("cleanup of a link failed")
            link = link.next(0)
        conn.connection.sb_replies = None

    def _shutdown(self) -> None:
        with self._lock:
            for conn in list(self._conns.values()):
                try:
                    conn.connection.close()
                    self._process(conn)
                    self._flush(conn)
                except Exception:
                    pass
                self._close(conn, "emulator stopping")
        self._selector.close()
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()


def _describe(condition: Condition | None) -> str:
    if condition is None:
        return ""
    return f"{condition.name} {condition.description!r}" if condition.description else str(condition.name)


def _local_error(conn: _Conn) -> str:
    """The error proton raised on this connection itself (a protocol violation), if any."""
    condition = conn.transport.condition
    description = condition.description or "" if condition is not None else ""
    if "connection aborted" in description:
        return ""  # the client went away without closing: not a protocol error
    if description.startswith("no such channel"):
        return ""  # the SDK, closing from several threads, detaches a link after ending its session
    return _describe(condition)


def _end_reason(conn: _Conn) -> str:
    """Why a connection's transport ended: the peer's close condition, or a clean close."""
    remote = _describe(conn.connection.remote_condition)
    return f"closed by the client: {remote}" if remote else "closed by the client"
