"""A TCP proxy in front of a server that can lose a write's response after the write landed.

``FaultProxy(port).drop_next_response_to(b"PUT ")`` arms it: the next request on any connection
that starts with that method reaches the server in full, the proxy waits for the server's answer
and then closes the client's connection without passing the answer on — the client sees a
dropped connection for a write that was carried out (an ambiguous write, seed 002 §11).
``stall_next_request_to(b"PUT ", seconds)`` holds the next such request in the proxy for that
long before passing it on (a slow network or a busy front end): a client that gives up first
closes its connection, and the request never reaches the server.
``requests`` counts the HTTP requests that went through (benchmarks count storage calls with it).

``go_down()`` makes the server unreachable through the proxy: open connections are reset and new
ones are reset as soon as they connect, until ``come_up()`` (any TCP protocol: AMQP too).
"""

from __future__ import annotations

import select
import socket
import struct
import threading
import time
from contextlib import suppress

__all__ = ["FaultProxy"]

_METHODS = (b"GET ", b"PUT ", b"HEAD ", b"POST ", b"DELETE ", b"PATCH ", b"OPTIONS ")


class FaultProxy:
    """Forwards 127.0.0.1:``port`` (picked by the OS) to 127.0.0.1:``target_port``."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._armed: bytes | None = None
        self.dropped = 0  # answers swallowed so far
        self._stall: tuple[bytes, float] | None = None
        self.stalled = 0  # requests held back so far
        self.abandoned = 0  # held requests whose client gave up (never passed on)
        self.requests = 0  # HTTP requests seen (a request's first bytes start a read)
        self._closed = threading.Event()
        self._down = False
        self._open: set[socket.socket] = set()
        threading.Thread(target=self._accept, name="fault-proxy", daemon=True).start()

    def drop_next_response_to(self, method: bytes) -> None:
        with self._lock:
            self._armed = method

    def stall_next_request_to(self, method: bytes, seconds: float) -> None:
        with self._lock:
            self._stall = (method, seconds)

    def _take_stall(self, data: bytes) -> float | None:
        with self._lock:
            if self._stall is not None and data.startswith(self._stall[0]):
                seconds, self._stall = self._stall[1], None
                self.stalled += 1
                return seconds
            return None

    def _take_arm(self, data: bytes) -> bool:
        with self._lock:
            if self._armed is not None and data.startswith(self._armed):
                self._armed = None
                return True
            return False

    def go_down(self) -> None:
        """Reset every open connection, and every new one, until :meth:`come_up`."""
        with self._lock:
            self._down = True
            sockets, self._open = list(self._open), set()
        for sock in sockets:
            _reset(sock)

    def come_up(self) -> None:
        """Forward again (after :meth:`go_down`)."""
        with self._lock:
            self._down = False

    def close(self) -> None:
        self._closed.set()
        with suppress(OSError):
            self._listener.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                down = self._down
            if down:
                _reset(client)
                continue
            threading.Thread(target=self._pump, args=(client,), daemon=True).start()

    def _pump(self, client: socket.socket) -> None:
        server = socket.create_connection(("127.0.0.1", self.target_port))
        with self._lock:
            self._open.update((client, server))
        doomed = False  # the request in flight is the armed one: swallow its answer
        try:
            while not self._closed.is_set():
                readable, _, _ = select.select([client, server], [], [], 0.5)
                for sock in readable:
                    data = sock.recv(65536)
                    if not data:
                        return
                    if sock is client:
                        if data.startswith(_METHODS):
                            with self._lock:
                                self.requests += 1
                        doomed = doomed or self._take_arm(data)
                        stall = self._take_stall(data) if data.startswith(_METHODS) else None
                        if stall is not None and not self._hold(client, data, stall, server):
                            return
                        if stall is None:
                            server.sendall(data)
                    elif doomed:
                        with self._lock:
                            self.dropped += 1
                        return  # the write landed; its answer never reaches the client
                    else:
                        client.sendall(data)
        except (OSError, ValueError):  # ValueError: go_down() closed a socket under select()
            return
        finally:
            with self._lock:
                self._open.difference_update((client, server))
            for sock in (client, server):
                with suppress(OSError):
                    sock.close()

    def _hold(self, client: socket.socket, data: bytes, seconds: float, server: socket.socket) -> bool:
        """Hold a request for ``seconds`` (buffering the rest of it), then pass it on.

        False when the client gave up meanwhile: the request is dropped, never reaching the server.
        """
        held, until = bytearray(data), time.monotonic() + seconds
        while (left := until - time.monotonic()) > 0:
            readable, _, _ = select.select([client], [], [], left)
            if readable:
                try:
                    more = client.recv(65536)
                except OSError:
                    more = b""  # reset by the client
                if not more:
                    with self._lock:
                        self.abandoned += 1
                    return False
                held += more
        server.sendall(bytes(held))
        return True


def _reset(sock: socket.socket) -> None:
    """Close with an RST (SO_LINGER 0): the peer sees "connection reset", not an orderly close."""
    with suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
