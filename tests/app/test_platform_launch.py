"""function_app.py loads under the platform's Python worker in every launch mode (issues 13, 15).

Each case runs ``platform_judge.py`` in a subprocess with the ``sys.path`` a launch mode gives the
real worker (a folder holding a plain ``worker`` module ahead of the app; the app joining later;
the warm ``-m`` start), then indexes the app with the real ``azure-functions-runtime`` indexer and
registry, whose binding checks are the 4.x worker's (a PEP 585 ``list[...]`` annotation fails with
"invalid non-type annotation"). Both ``azure-functions`` majors are tried.

``azure-functions-runtime`` and ``azure-functions`` 2.x declare ``Requires-Python >=3.13``: on 3.13
(where the platform loads apps through its proxy worker and this runtime) they install as the
platform installs them, and pip gives the app's environment ``azure-functions`` 2.x; on 3.11 and
3.12 they go into a cache folder with ``--ignore-requires-python`` (both are pure Python). Without a
reachable package registry the tests skip and say so.

``test_the_platform_runtime_ticks_the_app`` runs a timer tick and a Service Bus delivery through the
runtime's own binding conversion (``platform_judge.py --invoke``) against Azurite and the emulator.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

REPO = Path(__file__).resolve().parents[2]
NATIVE_RUNTIME = sys.version_info >= (3, 13)  # the runtime's own Requires-Python
# The azure-functions major pip picks for this interpreter (2.x requires Python 3.13).
SDK_MAJOR = "2." if NATIVE_RUNTIME else "1."
PY = f"{sys.version_info.major}.{sys.version_info.minor}"
JUDGE = Path(__file__).with_name("platform_judge.py")
# Pinned with ranges, like dependencies: the indexer and its one runtime dependency.
RUNTIME_PACKAGES = ("azure-functions-runtime>=1.3,<2", "azurefunctions-extensions-base>=1.1,<2")
SDK2_PACKAGES = ("azure-functions>=2.3,<3", "werkzeug>=3.1,<4")

CONFIG = """
[app]
name = "platform"
servicebus_connection = "SB_CONN"
queue_connection = "QUEUE_CONN"

[pollers.orders]
source_url = "${ORDERS_DB_URL}"
table = "orders"
cursor = "updated_at"
pk = ["id"]
queue = "orders-changes"

[pollers.batches]
source_url = "${ORDERS_DB_URL}"
table = "orders"
cursor = "updated_at"
pk = ["id"]
queue = "batch-changes"
cardinality = "many"

[pollers.ordered]
source_url = "${ORDERS_DB_URL}"
table = "orders"
cursor = "updated_at"
pk = ["id"]
queue = "ordered-changes"
sessions = true

[pollers.ordered_batches]
source_url = "${ORDERS_DB_URL}"
table = "orders"
cursor = "updated_at"
pk = ["id"]
queue = "ordered-batch-changes"
sessions = true
cardinality = "many"

[pollers.light]
source_url = "${ORDERS_DB_URL}"
table = "orders"
cursor = "updated_at"
pk = ["id"]
queue = "light-changes"
transport = "storage-queue"

[pollers.unset]
source_url = "${DBFANOUT_TEST_UNSET_DB_URL}"   # never set: this poller alone must fail, at its ticks
table = "orders"
cursor = "updated_at"
pk = ["id"]
queue = "unset-changes"

[pollers.fanout]
source_url = "${ORDERS_DB_URL}"
table = "orders"
cursor = "updated_at"
pk = ["id"]
topic = "order-events"

[pollers.fanout.subscriptions.search]
handler = "handlers.example:handle"

[pollers.fanout.subscriptions.audit]
handler = "handlers.example:handle"
cardinality = "many"

[pollers.keyed]
source_url = "${ORDERS_DB_URL}"
table = "orders"
cursor = "updated_at"
pk = ["id"]
topic = "keyed-events"
sessions = true

[pollers.keyed.subscriptions.ledger]
handler = "handlers.example:handle"
cardinality = "many"
"""

# function -> (binding type, the binding fields the worker's metadata must carry)
EXPECTED: dict[str, tuple[str, dict[str, Any]]] = {
    "poll_orders": ("timerTrigger", {"name": "timer"}),
    "poll_batches": ("timerTrigger", {"name": "timer"}),
    "poll_ordered": ("timerTrigger", {"name": "timer"}),
    "poll_ordered_batches": ("timerTrigger", {"name": "timer"}),
    "poll_light": ("timerTrigger", {"name": "timer"}),
    "poll_unset": ("timerTrigger", {"name": "timer"}),
    "work_orders_changes": ("serviceBusTrigger", {"cardinality": "ONE", "queueName": "orders-changes"}),
    "work_batch_changes": ("serviceBusTrigger", {"cardinality": "MANY", "queueName": "batch-changes"}),
    "work_ordered_changes": (
        "serviceBusTrigger",
        {"cardinality": "ONE", "isSessionsEnabled": True, "queueName": "ordered-changes"},
    ),
    "work_ordered_batch_changes": (
        "serviceBusTrigger",
        {"cardinality": "MANY", "isSessionsEnabled": True, "queueName": "ordered-batch-changes"},
    ),
    "work_light_changes": ("queueTrigger", {"queueName": "light-changes", "connection": "QUEUE_CONN"}),
    "work_unset_changes": ("serviceBusTrigger", {"cardinality": "ONE", "queueName": "unset-changes"}),
    "poll_fanout": ("timerTrigger", {"name": "timer"}),
    "poll_keyed": ("timerTrigger", {"name": "timer"}),
    "work_order_events_search": (
        "serviceBusTrigger",
        {"cardinality": "ONE", "topicName": "order-events", "subscriptionName": "search", "queueName": None},
    ),
    "work_order_events_audit": (
        "serviceBusTrigger",
        {"cardinality": "MANY", "topicName": "order-events", "subscriptionName": "audit", "queueName": None},
    ),
    "work_keyed_events_ledger": (
        "serviceBusTrigger",
        {"cardinality": "MANY", "isSessionsEnabled": True, "topicName": "keyed-events", "subscriptionName": "ledger"},
    ),
}


def _pip_target(packages: tuple[str, ...]) -> Path:
    """Install ``packages`` (no dependencies) into a cache folder shared by test runs, once."""
    key = hashlib.sha256("\n".join((PY, *packages)).encode()).hexdigest()[:16]
    target = Path(tempfile.gettempdir()) / "dbfanout-platform-judge" / key
    if target.is_dir():
        return target
    staging = Path(tempfile.mkdtemp(prefix=f"{key}-", dir=target.parent if target.parent.is_dir() else None))
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps"]
    if not NATIVE_RUNTIME:
        cmd.append("--ignore-requires-python")
    done = subprocess.run([*cmd, "--target", str(staging), *packages], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        pytest.skip(f"cannot install {', '.join(packages)} (package registry unreachable?): {done.stderr[-400:]}")
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        staging.rename(target)  # atomic: a concurrent run either sees all of it or installs its own
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    return target


@pytest.fixture(scope="module")
def runtime_site() -> Path:
    return _pip_target(RUNTIME_PACKAGES)


@pytest.fixture(scope="module")
def sdk2_site() -> Path:
    return _pip_target(SDK2_PACKAGES)


def launch(
    mode: str, app: Path, sites: list[Path], tmp_path: Path, env: dict[str, str], invoke: Path | None = None
) -> dict[str, Any]:
    """Index ``app`` as the platform's worker does when started in ``mode`` (then run the invocations
    of the file ``invoke``); the judge's JSON output."""
    site_args = [arg for site in sites for arg in ("--site", str(site))]
    if invoke is not None:
        site_args += ["--invoke", str(invoke)]
    full_env = {**os.environ, **env}
    full_env.pop("PYTHONPATH", None)
    if mode == "warm":
        judge_dir = tmp_path / "judge"
        judge_dir.mkdir(exist_ok=True)
        shutil.copy(JUDGE, judge_dir / "platform_judge.py")
        full_env["PYTHONPATH"] = str(judge_dir)
        cmd = [sys.executable, "-m", "platform_judge", "--mode", mode, "--app", str(app), *site_args]
    else:
        # The platform's layout: <workers>/python/3.11/LINUX/X64/worker.py is the launcher script.
        launcher_dir = tmp_path / "workers" / "python" / PY / "LINUX" / "X64"
        launcher_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy(JUDGE, launcher_dir / "worker.py")
        cmd = [sys.executable, str(launcher_dir / "worker.py"), "--mode", mode, "--app", str(app), *site_args]
    done = subprocess.run(cmd, cwd=app, env=full_env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{mode} launch failed:\n{done.stderr[-3000:]}"
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _settings(tmp_path: Path) -> dict[str, str]:
    config = tmp_path / "dbfanout.toml"
    config.write_text(CONFIG)
    return {"DBFANOUT_CONFIG": str(config), "ORDERS_DB_URL": "sqlite:///never-opened.db"}


def _assert_expected_bindings(functions: dict[str, Any]) -> None:
    assert set(functions) == set(EXPECTED)
    for name, (binding_type, fields) in EXPECTED.items():
        (binding,) = functions[name]["bindings"]
        assert binding["type"] == binding_type, name
        assert {k: binding.get(k) for k in fields} == fields, name
        if binding_type == "serviceBusTrigger" and not fields.get("isSessionsEnabled"):
            assert not binding.get("isSessionsEnabled"), name


@pytest.mark.parametrize("mode", ["coretools", "placeholder", "warm"])
def test_every_launch_mode_indexes_the_app_with_the_same_bindings(
    mode: str, runtime_site: Path, tmp_path: Path
) -> None:
    # Given the repository as the app folder and a config with every binding shape the app makes
    # (queues and topic subscriptions, one and many, with and without sessions), and one poller
    # whose source_url setting is missing
    env = _settings(tmp_path)
    # When the platform's worker indexes it in this launch mode
    result = launch(mode, REPO, [runtime_site], tmp_path, env)
    # Then every function loads, with the bindings the host needs
    assert result["azure_functions"].startswith(SDK_MAJOR)
    _assert_expected_bindings(result["functions"])
    # ... and identical to what the warm start (the one mode that always worked) produces
    if mode != "warm":
        assert result["functions"] == launch("warm", REPO, [runtime_site], tmp_path, env)["functions"]


@pytest.mark.parametrize("mode", ["coretools", "warm"])
def test_azure_functions_2_indexes_the_app_too(mode: str, runtime_site: Path, sdk2_site: Path, tmp_path: Path) -> None:
    # Given azure-functions 2.x ahead of the environment's (1.x before Python 3.13, which 2.x needs)
    env = _settings(tmp_path)
    # When the worker indexes the app with it
    result = launch(mode, REPO, [sdk2_site, runtime_site], tmp_path, env)
    # Then the app loads with the same bindings as under 1.x
    assert result["azure_functions"].startswith("2.")
    _assert_expected_bindings(result["functions"])


# What the host sends: a timer's TypedData is JSON; a Service Bus message's body is bytes, with its
# system properties as trigger metadata (strings, and JSON for numbers and property maps).
TIMER_INPUT = {"json": json.dumps({"Schedule": {"AdjustForDST": True}, "ScheduleStatus": None, "IsPastDue": False})}


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["coretools", "warm"])
def test_the_platform_runtime_ticks_the_app(
    mode: str, runtime_site: Path, tmp_path: Path, azurite: Any, servicebus: Any
) -> None:
    from azure.servicebus import ServiceBusClient

    from tests.support.deployment import PROBE_HANDLER

    # Given a deployment of the app with a SQLite poller, Azurite and the emulator
    app, queue, env = _probe_deployment(tmp_path, azurite, servicebus, PROBE_HANDLER, "(1, 1, 'one'), (2, 2, 'two')")
    env["PROBE_FILE"] = str(tmp_path / "handled.jsonl")
    # When the runtime invokes the timer function
    timer = tmp_path / "timer.json"
    timer.write_text(json.dumps([{"function": "poll_orders", "input": TIMER_INPUT}]))
    launch(mode, app, [runtime_site], tmp_path, env, invoke=timer)
    # ... and then the queue trigger, with the message the poller sent
    with (
        ServiceBusClient.from_connection_string(servicebus.connection_string) as client,
        client.get_queue_receiver(queue, max_wait_time=5) as receiver,
    ):
        (msg,) = receiver.receive_messages(max_message_count=5, max_wait_time=5)
        work = tmp_path / "work.json"
        work.write_text(json.dumps([_delivery_invocation(f"work_{queue.replace('-', '_')}", msg)]))
        launch(mode, app, [runtime_site], tmp_path, env, invoke=work)
        receiver.complete_message(msg)
    # Then the handler was given both rows, through the runtime's conversions, on this Python
    handled = [json.loads(line) for line in (tmp_path / "handled.jsonl").read_text().splitlines()]
    assert sorted((e["pk"]["id"], e["after"]["v"]) for e in handled) == [(1, "one"), (2, "two")]


POISON_HANDLER = """
def handle(events, context):
    for e in events:
        raise ConnectionError(
            f"cannot write row {e.pk['id']} to Endpoint=sb://target.example/;SharedAccessKeyName=w;SharedAccessKey=TOPSECRET="
        )
"""


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["warm"])
def test_under_the_platform_runtime_a_dead_letter_carries_its_reason(
    mode: str, runtime_site: Path, tmp_path: Path, azurite: Any, servicebus: Any
) -> None:
    from azure.servicebus import ServiceBusClient, ServiceBusSubQueue
    from typer.testing import CliRunner

    from dbfanout.cli import app as cli

    # Given a deployed app whose handler raises a text holding a connection string, on a queue that
    # dead-letters at the second delivery (MaxDeliveryCount 2, the poller's max_delivery_count too)
    app, queue, env = _probe_deployment(
        tmp_path, azurite, servicebus, POISON_HANDLER, "(7, 1, 'poison')", max_delivery_count=2
    )
    config = tmp_path / "dbfanout.toml"
    timer = tmp_path / "timer.json"
    timer.write_text(json.dumps([{"function": "poll_orders", "input": TIMER_INPUT}]))
    launch(mode, app, [runtime_site], tmp_path, env, invoke=timer)
    # When the runtime delivers the message twice, the function raising each time, and the broker
    # then dead-letters it (the host abandons a failed delivery; here the test does)
    errors = []
    with ServiceBusClient.from_connection_string(servicebus.connection_string) as client:
        with client.get_queue_receiver(queue, max_wait_time=5) as receiver:
            for _ in range(2):
                (msg,) = receiver.receive_messages(max_message_count=1, max_wait_time=5)
                work = tmp_path / "work.json"
                work.write_text(
                    json.dumps([_delivery_invocation(f"work_{queue.replace('-', '_')}", msg, expect_error=True)])
                )
                errors += launch(mode, app, [runtime_site], tmp_path, env, invoke=work)["errors"]
                receiver.abandon_message(msg)
        with client.get_queue_receiver(queue, sub_queue=ServiceBusSubQueue.DEAD_LETTER, max_wait_time=5) as dlq:
            assert len(dlq.peek_messages(max_message_count=5)) == 1
    # Then the text the host would log for each failure names the message and is scrubbed
    assert [e["type"] for e in errors] == ["HandlerError", "HandlerError"]
    assert all("SharedAccessKey=***" in e["message"] and "TOPSECRET" not in e["message"] for e in errors)
    # And `dbfanout dlq peek --json` shows the reason beside the dead letter, from the failure record
    # the function wrote, keyed by the body the runtime handed it
    peek = CliRunner().invoke(cli, ["dlq", "peek", queue, "--json", "--config", str(config)], env=env)
    assert peek.exit_code == 0, peek.output
    (line,) = json.loads(peek.stdout)
    failure = line["failure"]
    assert failure["error"].startswith("ConnectionError: cannot write row 7")
    assert "SharedAccessKey=***" in failure["error"] and "TOPSECRET" not in peek.stdout
    assert failure["delivery_count"] == 2 and failure["dead_lettered"] is True


def _probe_deployment(
    tmp_path: Path, azurite: Any, servicebus: Any, handler: str, rows: str, *, max_delivery_count: int | None = None
) -> tuple[Path, str, dict[str, str]]:
    """A deployment copy of the app whose one poller reads a SQLite table holding ``rows`` (SQL
    values) into a fresh queue, its handler ``handler``; the app folder, the queue, the settings."""
    from sbemulator.testing import unique_queue
    from tests.support.deployment import deployment_copy, probe_app_config

    app = deployment_copy(tmp_path / "app")
    (app / "handlers" / "probe.py").write_text(handler)
    limits = {} if max_delivery_count is None else {"max_delivery_count": max_delivery_count}
    queue = unique_queue(servicebus, "plat", requires_duplicate_detection=True, **limits)
    config = probe_app_config("orders", queue) + "".join(f"{k} = {v}\n" for k, v in limits.items())
    (tmp_path / "dbfanout.toml").write_text(config)
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'source.db'}")
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE orders (id INTEGER PRIMARY KEY, version INTEGER NOT NULL, v TEXT)")
        conn.exec_driver_sql(f"INSERT INTO orders VALUES {rows}")
    engine.dispose()
    env = {
        "DBFANOUT_CONFIG": str(tmp_path / "dbfanout.toml"),
        "DBFANOUT_STATE": azurite.connection_string,
        "DBFANOUT_SERVICEBUS": servicebus.connection_string,
        "ORDERS_DB_URL": f"sqlite:///{tmp_path / 'source.db'}",
    }
    return app, queue, env


def _delivery_invocation(function: str, msg: Any, *, expect_error: bool = False) -> dict[str, Any]:
    """What the host sends to invoke ``function`` with the received Service Bus message ``msg``."""
    properties = json.dumps({_plain(k): _plain(v) for k, v in (msg.application_properties or {}).items()})
    assert msg.delivery_count is not None and msg.enqueued_time_utc is not None
    return {
        "function": function,
        "input": {"bytes": base64.b64encode(b"".join(msg.body)).decode()},
        "metadata": {
            "MessageId": {"string": str(msg.message_id)},
            "DeliveryCount": {"json": json.dumps(msg.delivery_count + 1)},  # the host counts from 1
            "EnqueuedTimeUtc": {"string": msg.enqueued_time_utc.isoformat()},
            "ContentType": {"string": str(msg.content_type)},
            "ApplicationProperties": {"json": properties},
            "UserProperties": {"json": properties},  # the SDK tells cardinality one by this field
        },
        "expect_error": expect_error,
    }


def _plain(value: Any) -> Any:
    return value.decode() if isinstance(value, bytes) else value
