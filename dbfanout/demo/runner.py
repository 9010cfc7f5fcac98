"""The demo's story, start to finish: services up, write, poison, fix, replay, drain, verify.

Timeline for ``--duration D``:

* 0: the writer starts; the host polls every second and the handler replicates;
* D/4: one poison row is written. The handler fails its batch; on the 2nd delivery the worker
  splits it into single events; the good ones go through, the poison one fails
  ``MaxDeliveryCount`` (3) times and lands in the dead-letter queue;
* D/2 (or as soon as the DLQ holds it): the fix is "deployed" (a marker file the handler checks)
  and the operator replays the DLQ with ``dbfanout dlq replay``;
* D: the writer stops; the demo waits (bounded) until the checkpoint reaches the last change,
  the queue and the DLQ are empty and the target matches the source, then compares them.

Everything started is stopped on the way out, Ctrl-C included (one ``ExitStack``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dbfanout.demo.appdir import (
    MAX_DELIVERY_COUNT,
    SOURCE_DDL,
    TOPIC_SUBSCRIPTIONS,
    DemoApp,
    config_text,
    sqlite_engine,
)
from dbfanout.demo.compare import Comparison, compare, read_source, read_target
from dbfanout.demo.mysql_source import DEFAULT_MYSQL_URL, MysqlDemoSource
from dbfanout.demo.operator import ReplayRun, SnapshotRun
from dbfanout.demo.pg_source import DEFAULT_PG_URL, PgDemoSource
from dbfanout.demo.probe import Probe, Snapshot
from dbfanout.demo.services import (
    ChildProcess,
    ServiceError,
    start_azurite,
    start_servicebus,
    start_servicebus_for,
    wait_for,
)
from dbfanout.demo.writer import SourceWriter
from dbfanout.ops.status import snapshot_line

__all__ = ["DemoOptions", "run_demo"]

QUEUE = "orders-changes"
POLLER = "orders"
LOCK_DURATION = "PT10S"
REFRESH = 0.5  # seconds between live-view refreshes (and condition checks)
SNAPSHOT_AT = 0.6  # --source pg-logical: the operator re-snapshots the table at this share of --duration
SNAPSHOT_CHUNK = 50  # rows per chunk of that snapshot (small: the view shows it chunk by chunk)
HOST_START_TIMEOUT = 90.0
FIRST_CHECKPOINT_TIMEOUT = 60.0  # --source mysql-binlog: the poller's first tick takes its place in the binlog


@dataclass(frozen=True, slots=True)
class DemoOptions:
    duration: float = 60.0
    rate: float = 50.0
    keep: bool = False
    seed: int | None = None
    source: str = "keyset"  # or "outbox": hard deletes through an outbox table; "pg-logical": a slot;
    # "mysql-binlog": the binlog
    pg_url: str | None = None  # --source pg-logical: the PostgreSQL to use
    mysql_url: str | None = None  # --source mysql-binlog: the MariaDB/MySQL to use
    topic: bool = False  # a topic with two subscriptions (replica: poisoned and replayed; audit)

    @property
    def dlq_entity(self) -> str:
        """What the operator replays: the queue, or the poisoned subscription of the topic."""
        return f"{QUEUE}/{TOPIC_SUBSCRIPTIONS[0]}" if self.topic else QUEUE

    @property
    def drain_timeout(self) -> float:
        # Generous on 2 cores: the backlog at the end, plus time for a late DLQ and replay.
        return 60.0 + self.duration * self.rate / 100.0


@dataclass
class _Story:
    """What has happened so far (the live view's log, the summary's facts)."""

    started: float = field(default_factory=time.monotonic)
    phase: str = "writing"
    log: list[str] = field(default_factory=list)
    dlq_peak: int = 0
    poison_announced: bool = False
    fixed: bool = False
    duration: float = 60.0  # --duration (the story's clock)
    replay: ReplayRun | None = None
    snapshot: SnapshotRun | None = None  # --source pg-logical: the operator's `dbfanout snapshot`
    snapshot_over: bool = False  # it finished (or failed) and the story said so
    drain_started: float | None = None
    drain_seconds: float = 0.0
    problems: list[str] = field(default_factory=list)

    def say(self, line: str) -> None:
        self.log.append(line)

    def elapsed(self) -> float:
        return time.monotonic() - self.started


def _child_env(app: DemoApp) -> dict[str, str]:
    """The demo's environment minus the app's settings: local.settings.json decides, as with func."""
    env = {k: v for k, v in os.environ.items() if k not in app.settings}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _start_host(app: DemoApp, env: dict[str, str]) -> ChildProcess:
    args = [sys.executable, "-m", "dbfanout.cli", "run", "--app-root", str(app.root), "--grace", "10",
            "--log-level", "WARNING"]  # fmt: skip
    host = ChildProcess(args, cwd=app.root, env=env, log=app.host_log)

    def ready() -> bool:
        text = app.host_log.read_text(errors="replace") if app.host_log.exists() else ""
        return "dbfanout host running" in text or not host.alive()

    try:
        wait_for(ready, HOST_START_TIMEOUT, "the local Functions host to start")
    except BaseException:
        host.stop()
        raise
    if not host.alive():
        tail = "\n".join(app.host_log.read_text(errors="replace").splitlines()[-15:])
        raise ServiceError(f"the local Functions host exited at start-up:\n{tail}")
    return host


def _ignore_signals() -> None:
    # Shutting down: a second Ctrl-C must not cut the clean-up short and orphan a child.
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(ValueError):  # not the main thread (tests): nothing to do
            signal.signal(sig, signal.SIG_IGN)


def run_demo(options: DemoOptions, show: Callable[[Snapshot], None]) -> dict[str, Any]:
    """Run the whole demo; returns the summary (``summary["ok"]`` only on an exact match)."""
    workdir = Path(tempfile.mkdtemp(prefix="dbfanout-demo-"))
    with contextlib.ExitStack() as stack:
        if not options.keep:
            stack.callback(shutil.rmtree, workdir, ignore_errors=True)
        app_name = "demo" + uuid.uuid4().hex[:6]
        # The database first: a server that cannot serve the demo is refused before anything starts.
        pg = _pg_source(options, stack)
        binlog = _mysql_source(options, stack)
        if options.topic:
            # The emulator declares the topic, its subscriptions and their rules from the app's own config.
            topic_config = config_text(app_name, QUEUE, topic=True)
            emulator = start_servicebus_for(topic_config, lock_duration=LOCK_DURATION)
        else:
            emulator = start_servicebus(QUEUE, max_delivery_count=MAX_DELIVERY_COUNT, lock_duration=LOCK_DURATION)
        stack.callback(emulator.stop)
        azurite = start_azurite(workdir)
        stack.callback(azurite.stop)
        app = DemoApp.create(
            workdir / "app", queue=QUEUE, storage=azurite.connection_string, servicebus=emulator.connection_string,
            outbox=options.source == "outbox", topic=options.topic, pg_logical=pg, mysql_binlog=binlog,
            app_name=app_name,
        )  # fmt: skip
        env = _child_env(app)
        host = _start_host(app, env)
        stack.callback(host.stop)
        target = sqlite_engine(app.target_db)
        stack.callback(target.dispose)
        probe = Probe(
            storage=azurite.connection_string, app_name=app.app_name, poller=POLLER, queue=QUEUE,
            emulator=emulator, target=target, subscriptions=TOPIC_SUBSCRIPTIONS if options.topic else (),
            binlog=binlog is not None,
        )  # fmt: skip
        log_source = pg or binlog
        writer = SourceWriter(
            log_source.engine() if log_source else app.source_db, options.rate, seed=options.seed,
            outbox=options.source == "outbox", hard_deletes=log_source is not None,
        )  # fmt: skip
        stack.callback(_stop_quietly, writer)
        story = _Story(duration=options.duration)
        if options.keep:
            story.say(f"app folder (kept): {workdir}")
        stack.callback(_stop_replay, story)
        stack.callback(_ignore_signals)  # registered last: runs first on the way out
        if binlog is not None:
            _await_binlog_start(probe, writer, host, app)
            story.say(f"the poller took its place in the binlog (replica server_id {binlog.server_id}): "
                      "every change after it is delivered")  # fmt: skip
        writer.start()
        how = {"outbox": "through the outbox (hard deletes)", "pg-logical": f"to {pg.table if pg else ''} on "
               "PostgreSQL (hard deletes, read from a replication slot)", "mysql-binlog": f"to "
               f"{binlog.table if binlog else ''} on MariaDB/MySQL (hard deletes, read from the binlog)"}.get(
            options.source, "to orders")  # fmt: skip
        story.say(f"writing ~{options.rate:g} changes/s {how}; the host polls every second")
        if options.topic:
            story.say(f"one topic, {QUEUE}, two subscriptions: replica (replicates; has the poison bug) "
                      "and audit (records each event it is given)")  # fmt: skip
        _loop(options, story, writer, probe, host, show, app, env)
        last = probe.snapshot(writer, started=story.started, phase="done", log=tuple(story.log))
        show(last)
        check = compare(read_source(writer.engine), read_target(target))
        summary = _summary(options, story, writer, last, check, app if options.keep else None)
    return summary


def _pg_source(options: DemoOptions, stack: contextlib.ExitStack) -> PgDemoSource | None:
    """``--source pg-logical``: the table, publication and slot, dropped on every way out (after
    the host stopped: callbacks run last-in first-out, and the host is started after this)."""
    if options.source != "pg-logical":
        return None
    pg = PgDemoSource(options.pg_url or DEFAULT_PG_URL, SOURCE_DDL)
    stack.callback(pg.drop)
    pg.create()
    return pg


def _mysql_source(options: DemoOptions, stack: contextlib.ExitStack) -> MysqlDemoSource | None:
    """``--source mysql-binlog``: the checked server's demo database, dropped on every way out."""
    if options.source != "mysql-binlog":
        return None
    source = MysqlDemoSource(options.mysql_url or DEFAULT_MYSQL_URL, SOURCE_DDL)
    stack.callback(source.drop)
    source.create()
    return source


def _await_binlog_start(probe: Probe, writer: SourceWriter, host: ChildProcess, app: DemoApp) -> None:
    """A binlog poller starts at the binlog's end as of its first tick (it has no slot holding
    the log for it): the writer starts once that place is checkpointed, so no change precedes it."""

    def placed() -> bool:
        probe.checkpoint(writer)
        return probe.checkpointed or not host.alive()

    wait_for(placed, FIRST_CHECKPOINT_TIMEOUT, "the binlog poller's first checkpoint", interval=REFRESH)
    if not host.alive():
        tail = "\n".join(app.host_log.read_text(errors="replace").splitlines()[-15:])
        raise ServiceError(f"the local Functions host exited before its first checkpoint:\n{tail}")


def _loop(
    options: DemoOptions,
    story: _Story,
    writer: SourceWriter,
    probe: Probe,
    host: ChildProcess,
    show: Callable[[Snapshot], None],
    app: DemoApp,
    env: dict[str, str],
) -> None:
    """Refresh the view and move the story on, until drained (or out of time)."""
    last_compare = 0.0
    while True:
        snap = probe.snapshot(writer, started=story.started, phase=story.phase, log=tuple(story.log))
        show(snap)
        _advance(options, story, writer, snap, app, env)
        if not host.alive():
            story.problems.append(f"the host process exited unexpectedly (see {app.host_log})")
            return
        if story.drain_started is not None:
            story.drain_seconds = time.monotonic() - story.drain_started
            if _drained(story, writer, snap) and time.monotonic() - last_compare >= 1.0:
                last_compare = time.monotonic()
                if compare(read_source(writer.engine), read_target(probe.target)).ok:
                    story.say(f"drained in {story.drain_seconds:.1f} s: target matches source")
                    return
            if story.drain_seconds > options.drain_timeout:
                story.problems.append(f"the pipeline did not drain within {options.drain_timeout:.0f} s")
                return
        time.sleep(REFRESH)  # pacing of the view; every wait above is on a condition


def _drained(story: _Story, writer: SourceWriter, snap: Snapshot) -> bool:
    replay_done = story.replay is not None and story.replay.poll()
    if story.snapshot is not None and not story.snapshot_over:
        return False  # the operator's snapshot is still being read
    return bool(replay_done) and snap.enqueued >= writer.version and snap.queue_messages == 0 and snap.dlq == 0


def _advance(
    options: DemoOptions, story: _Story, writer: SourceWriter, snap: Snapshot, app: DemoApp, env: dict[str, str]
) -> None:
    """Take the next step of the story when its moment (and its precondition) has come."""
    t = story.elapsed()
    story.dlq_peak = max(story.dlq_peak, snap.dlq)
    if writer.poison_id is None and t >= options.duration / 4 and story.phase == "writing":
        writer.inject_poison()
        story.phase = "poisoned"
        story.say("injecting a poison row: the handler has a bug for status = 'poison'")
    if story.phase == "poisoned" and writer.poison_id is not None and not story.poison_announced:
        story.poison_announced = True
        story.say(f"poison row id={writer.poison_id} written; its batch fails, is split, its single event retries")
    if story.phase == "poisoned" and snap.dlq > 0 and not story.fixed:
        story.say(f"DLQ: {snap.dlq} message dead-lettered after {MAX_DELIVERY_COUNT} deliveries; "
                  "the other rows kept flowing")  # fmt: skip
        story.phase = "quarantined"
    if story.phase == "quarantined" and t >= options.duration / 2:
        app.fix_file.touch()  # the handler checks this file on every call: the fix is live at once
        story.fixed = True
        story.say(f"fix deployed; operator runs: dbfanout dlq replay {options.dlq_entity} --all --yes")
        story.replay = ReplayRun(app, env, options.dlq_entity)
        story.phase = "replaying"
    if story.phase == "replaying" and story.replay is not None and story.replay.poll():
        if story.replay.exit_code == 0:
            story.say(f"replayed {story.replay.replayed} message(s) from the DLQ of {options.dlq_entity}")
        else:
            story.problems.append(f"dlq replay failed: {story.replay.error}")
            story.say(f"dlq replay failed: {story.replay.error}")
        story.phase = "replayed"
    if options.source == "pg-logical":
        _snapshot_step(story, snap, app, env)
    if story.drain_started is None and t >= options.duration:
        writer.stop()
        story.drain_started = time.monotonic()
        story.say(f"writer stopped after {writer.version:,} changes; waiting for the pipeline to drain")
        story.phase = f"draining ({story.phase})" if story.phase not in ("replayed",) else "draining"


def _snapshot_step(story: _Story, snap: Snapshot, app: DemoApp, env: dict[str, str]) -> None:
    """--source pg-logical: the operator re-reads the live table beside the stream (``dbfanout
    snapshot``); the view follows its progress in the state blob until it is done."""
    if story.snapshot is None:
        if story.elapsed() >= SNAPSHOT_AT * story.duration:
            story.say(f"operator runs: dbfanout snapshot {POLLER} --chunk-size {SNAPSHOT_CHUNK}: every row is read "
                      "again beside the stream, none overwrites a newer change")  # fmt: skip
            story.snapshot = SnapshotRun(app, env, POLLER, SNAPSHOT_CHUNK)
        return
    run = story.snapshot
    if story.snapshot_over or not run.poll():
        return
    progress = snap.snapshot
    if run.error is not None:
        story.snapshot_over = True
        story.problems.append(f"dbfanout snapshot failed: {run.error}")
        story.say(f"dbfanout snapshot failed: {run.error}")
    elif progress is not None and progress["id"] == run.request and progress["status"] != "running":
        story.snapshot_over = True
        story.say(f"{snapshot_line(progress)} in {progress['chunks']} chunks")
        if progress["status"] != "done":
            story.problems.append(f"the snapshot ended {progress['status']}: {progress.get('error')}")


def _summary(
    options: DemoOptions,
    story: _Story,
    writer: SourceWriter,
    last: Snapshot,
    check: Comparison,
    kept: DemoApp | None,
) -> dict[str, Any]:
    replay = story.replay
    replayed = replay.replayed if replay is not None else 0
    problems = list(story.problems)
    if story.dlq_peak == 0:
        problems.append("the poison row never reached the dead-letter queue")
    if replayed == 0:
        problems.append("nothing was replayed from the dead-letter queue")
    if options.topic:
        problems += _audit_problems(last)
    if options.source == "pg-logical" and not story.snapshot_over:
        problems.append("the operator's snapshot did not finish")
    ok = check.ok and not problems and last.dlq == 0
    return {
        "ok": ok,
        "duration_s": options.duration,
        "rate": options.rate,
        "source": options.source,
        "topology": "topic" if options.topic else "queue",
        "written": {**writer.ops, "total": writer.written},
        "pipeline": {**last.to_json()},
        "dlq": {
            "poison_id": writer.poison_id,
            "dead_lettered": story.dlq_peak,
            "replayed": replayed,
            "left": last.dlq,
            "replay_exit_code": replay.exit_code if replay is not None else None,
        },
        "snapshot": last.snapshot,
        "check": check.to_json(),
        "drain_seconds": round(story.drain_seconds, 2),
        "problems": problems,
        "app_dir": str(kept.root.parent) if kept is not None else None,
    }


def _audit_problems(last: Snapshot) -> list[str]:
    """The audit subscription must have been given every event exactly once: none of the replica
    subscription's retries, split singles or replay may reach it."""
    problems = []
    if last.audit_duplicates:
        problems.append(f"the audit subscription was given {last.audit_duplicates} event(s) more than once")
    if last.audit_events != last.distinct:
        problems.append(
            f"the audit subscription saw {last.audit_events} events, the replica subscription {last.distinct}"
        )
    return problems


def _stop_quietly(writer: SourceWriter) -> None:
    with contextlib.suppress(Exception):
        writer.stop()


def _stop_replay(story: _Story) -> None:
    if story.replay is not None:
        story.replay.stop()
    if story.snapshot is not None:
        story.snapshot.stop()
