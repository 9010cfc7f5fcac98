"""The in-process emulator: broker + AMQP server thread + health endpoint."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from sbemulator.amqp_server import AmqpServer
from sbemulator.broker import Broker
from sbemulator.config import EmulatorConfig, QueueProperties, TopicConfig
from sbemulator.faults import Faults
from sbemulator.health import HealthServer
from sbemulator.links import LinkHandler
from sbemulator.persistence import SqliteJournal

log = logging.getLogger("sbemulator")
SAS_KEY_NAME = "RootManageSharedAccessKey"
SAS_KEY_VALUE = "SAS_KEY_VALUE"


class Emulator:
    """A local Service Bus namespace speaking AMQP 1.0 to the unmodified azure-servicebus SDK.

    ``port=0`` / ``http_port=0`` pick free ports (read them from :attr:`port` and
    :attr:`http_port` after :meth:`start`). With ``data_dir`` every message, its delivery count
    and session state are kept in ``data_dir/sbemulator.sqlite3`` and restored on start.
    """

    def __init__(
        self,
        config: EmulatorConfig | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        http_port: int | None = 0,
        data_dir: str | Path | None = None,
    ) -> None:
        self.config = config or EmulatorConfig()
        self.host = host
        self._requested_port = port
        self._requested_http_port = http_port
        self._journal = SqliteJournal(Path(data_dir)) if data_dir is not None else None
        self.broker = Broker(self.config, journal=self._journal)
        if self._journal is not None:
            self._journal.restore(self.broker)
        self.faults = Faults()
        self._lock = threading.RLock()
        self._server: AmqpServer | None = None
        self._health: HealthServer | None = None
        self._thread: threading.Thread | None = None

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> Emulator:
        """Bind the ports and start serving; returns once connections are accepted."""
        if self._thread is not None:
            return self
        handler = LinkHandler(self.broker, self.faults)
        self._server = AmqpServer(handler, self._lock, self.host, self._requested_port)
        self._thread = threading.Thread(target=self._run, name=f"sbemulator:{self.port}", daemon=True)
        self._thread.start()
        if self._requested_http_port is not None:
            self._health = HealthServer(self.host, self._requested_http_port, self._status)
            self._health.start()
        log.info("Service Bus emulator listening on %s:%d", self.host, self.port)
        return self

    def _run(self) -> None:
        assert self._server is not None
        try:
            self._server.serve_forever()
        except Exception:
            log.exception("the emulator loop stopped unexpectedly")
        finally:
            if self._journal is not None:
                with self._lock:
                    self._journal.flush()

    def stop(self) -> None:
        """Close every connection, stop the threads, flush persistence. Idempotent."""
        if self._health is not None:
            self._health.stop()
            self._health = None
        if self._server is not None and self._thread is not None:
            self._server.stop()
            self._thread.join(timeout=10)
        self._thread = None
        if self._journal is not None:
            self._journal.close()

    def __enter__(self) -> Emulator:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # ---- addresses -----------------------------------------------------------------------
    @property
    def port(self) -> int:
        """The AMQP port (valid after start)."""
        if self._server is None:
            raise RuntimeError("the emulator is not started; call start() first")
        return self._server.port

    @property
    def http_port(self) -> int:
        """The port of ``GET /health`` (valid after start)."""
        if self._health is None:
            raise RuntimeError("the health endpoint is not running (started with http_port=None?)")
        return self._health.port

    @property
    def connection_string(self) -> str:
        """What to give ``ServiceBusClient.from_connection_string``."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return (
            f"Endpoint=sb://{host}:{self.port};SharedAccessKeyName={SAS_KEY_NAME};"
            f"SharedAccessKey={SAS_KEY_VALUE};UseDevelopmentEmulator=true"
        )

    # ---- runtime administration ----------------------------------------------------------
    def create_queue(self, name: str, properties: QueueProperties | None = None, **props: Any) -> None:
        """Add a queue while running (no-op if it exists); keywords as :meth:`QueueProperties.of`."""
        merged = (properties or QueueProperties()).with_changes(**props) if props else properties
        with self._lock:
            self.broker.create_queue(name, merged)
            if self._journal is not None:
                self._journal.put_queue(name, self.broker.queue(name).props)

    def create_topic(self, config: TopicConfig | Mapping[str, Any]) -> None:
        """Add a topic with its subscriptions while running (no-op if it exists).

        ``config`` is a :class:`TopicConfig` or a Config.json topic object, e.g.
        ``{"Name": "orders", "Subscriptions": [{"Name": "audit"}, {"Name": "eu", "Rules": [...]}]}``.
        """
        topic = config if isinstance(config, TopicConfig) else TopicConfig.from_json(config, where="topic")
        with self._lock:
            self.broker.create_topic(topic)
            if self._journal is not None and topic.raw:
                self._journal.put_topic(topic.name, topic.raw)

    def queue_stats(self, name: str) -> dict[str, int]:
        """Counts for assertions: active, deferred, scheduled, locked and dead-lettered messages.

        ``name`` is a queue or a subscription (``topic/Subscriptions/name``).
        """
        with self._lock:
            q, dlq = self.broker.queue(name), self.broker.queue(f"{name}/$DeadLetterQueue")
            states = [m.state.name.lower() for m in q.messages.values()]
            return {
                "messages": len(q.messages),
                "active": states.count("active"),
                "deferred": states.count("deferred"),
                "scheduled": states.count("scheduled"),
                "locked": sum(1 for m in q.messages.values() if m.lock_token is not None),
                "dead_lettered": len(dlq.messages),
                "bytes": q.bytes,
            }

    def _status(self) -> dict[str, Any]:
        with self._lock:
            queues = sum(1 for _ in self.broker.queues()) // 2
            topics = sum(1 for _ in self.broker.topics())
        return {"status": "healthy", "amqpPort": self.port, "queues": queues, "topics": topics}
