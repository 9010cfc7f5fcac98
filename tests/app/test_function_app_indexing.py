"""function_app.py registers one timer per poller and one queue trigger per queue (issue 5)."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from shared.errors import ConfigError

CONFIG = """
[app]
name = "shop"
servicebus_connection = "SB_CONN"

[pollers.orders]
source_url = "${ORDERS_DB_URL}"
table = "orders"
cursor = "updated_at"
pk = ["id"]
queue = "orders-changes"
schedule = "*/5 * * * * *"
handler = "handlers.orders:handle"

[pollers.customers]
source_url = "${ORDERS_DB_URL}"
query = "SELECT * FROM customers"
cursor = "version"
pk = ["tenant", "id"]
queue = "customers-changes"
schedule = "%CUSTOMERS_SCHEDULE%"
cardinality = "many"
use_monitor = false

[pollers.customers_backfill]
source_url = "${ORDERS_DB_URL}"
table = "customers"
cursor = "version"
pk = ["tenant", "id"]
queue = "customers-changes"
"""


def _import_app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str) -> ModuleType:
    (tmp_path / "app.toml").write_text(text)
    monkeypatch.setenv("DBFANOUT_CONFIG", str(tmp_path / "app.toml"))
    monkeypatch.setenv("ORDERS_DB_URL", "postgresql://user:s3cret@db/shop")
    sys.modules.pop("function_app", None)
    return importlib.import_module("function_app")


def test_each_poller_gets_a_timer_and_each_queue_one_trigger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = _import_app(tmp_path, monkeypatch, CONFIG)
    functions = {f.get_function_name(): json.loads(f.get_function_json()) for f in module.app.get_functions()}
    assert set(functions) == {
        "poll_orders",
        "poll_customers",
        "poll_customers_backfill",
        "work_orders_changes",
        "work_customers_changes",
    }
    (timer,) = functions["poll_customers"]["bindings"]
    assert timer["type"] == "timerTrigger" and timer["schedule"] == "%CUSTOMERS_SCHEDULE%"
    assert timer["useMonitor"] is False and timer["name"] == "timer"
    (orders_queue,) = functions["work_orders_changes"]["bindings"]
    assert orders_queue["type"] == "serviceBusTrigger" and orders_queue["queueName"] == "orders-changes"
    assert orders_queue["connection"] == "SB_CONN" and orders_queue["cardinality"] == "ONE"
    (customers_queue,) = functions["work_customers_changes"]["bindings"]
    assert customers_queue["cardinality"] == "MANY"
    assert "s3cret" not in json.dumps(functions)


def test_timer_functions_return_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import inspect

    module = _import_app(tmp_path, monkeypatch, CONFIG)
    for f in module.app.get_functions():
        if f.get_function_name().startswith("poll_"):
            assert inspect.signature(f.get_user_function()).return_annotation in (None, "None")


def test_bad_config_fails_at_indexing_naming_the_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError) as info:
        _import_app(tmp_path, monkeypatch, CONFIG.replace('schedule = "*/5 * * * * *"', 'schedule = "*/5 * * * *"'))
    assert info.value.key == "pollers.orders.schedule"


def test_a_storage_queue_poller_gets_a_queue_trigger_on_the_storage_connection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = CONFIG.replace('queue = "orders-changes"', 'queue = "orders-changes"\ntransport = "storage-queue"')
    module = _import_app(tmp_path, monkeypatch, text)
    functions = {f.get_function_name(): json.loads(f.get_function_json()) for f in module.app.get_functions()}
    (binding,) = functions["work_orders_changes"]["bindings"]
    assert binding["type"] == "queueTrigger" and binding["queueName"] == "orders-changes"
    assert binding["connection"] == "DBFANOUT_STATE"


def test_pollers_sharing_a_queue_must_share_its_transport(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = CONFIG.replace("use_monitor = false", 'use_monitor = false\ntransport = "storage-queue"')
    with pytest.raises(ConfigError, match="share queue customers-changes"):
        _import_app(tmp_path, monkeypatch, text)


TOPIC_POLLER = """
[pollers.stock]
source_url = "${ORDERS_DB_URL}"
table = "stock"
cursor = "version"
pk = ["sku"]
topic = "stock.changes"
sessions = true

[pollers.stock.subscriptions.search]
handler = "handlers.search:handle"
cardinality = "many"

[pollers.stock.subscriptions.cache-purge]
handler = "handlers.cache:handle"
"""


def test_a_topic_poller_gets_one_subscription_trigger_per_subscription(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a topic poller with two subscriptions (names with non-word characters) beside queue pollers
    module = _import_app(tmp_path, monkeypatch, CONFIG + TOPIC_POLLER)
    functions = {f.get_function_name(): json.loads(f.get_function_json()) for f in module.app.get_functions()}
    # Then its timer sends to the topic and each subscription has its own trigger, the queues unchanged
    assert {"poll_stock", "work_stock_changes_search", "work_stock_changes_cache_purge"} <= set(functions)
    assert {"work_orders_changes", "work_customers_changes"} <= set(functions)
    (search,) = functions["work_stock_changes_search"]["bindings"]
    assert search["type"] == "serviceBusTrigger" and "queueName" not in search
    assert (search["topicName"], search["subscriptionName"]) == ("stock.changes", "search")
    assert search["connection"] == "SB_CONN" and search["cardinality"] == "MANY"
    assert search["isSessionsEnabled"] is True  # a session topic: every subscription requires sessions
    (purge,) = functions["work_stock_changes_cache_purge"]["bindings"]
    assert (purge["topicName"], purge["subscriptionName"]) == ("stock.changes", "cache-purge")
    assert purge["cardinality"] == "ONE"


def test_a_subscription_function_name_taken_by_a_queue_fails_naming_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a queue whose function name is the one of a topic subscription (work_stock_changes_search)
    clash = CONFIG.replace('queue = "orders-changes"', 'queue = "stock_changes_search"') + TOPIC_POLLER
    with pytest.raises(ConfigError) as info:
        _import_app(tmp_path, monkeypatch, clash)
    assert info.value.key == "pollers.stock.subscriptions.search"
    assert "work_stock_changes_search" in str(info.value)


INDEX_LIKE_RUN = """
import logging, sys
from pathlib import Path
logging.basicConfig(level=logging.WARNING)
from dbfanout.host.app_loader import discover, load_app
specs = discover(load_app("function_app:app", Path(sys.argv[1])))
logging.warning("another warning: still shown")
print(len(specs), "functions")
"""


def test_indexing_the_app_prints_no_auth_level_warning_and_hides_no_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import subprocess

    # Given the app with timers and queue triggers only (no HTTP function), indexed as `dbfanout run` does
    (tmp_path / "app.toml").write_text(CONFIG)
    env = {"DBFANOUT_CONFIG": str(tmp_path / "app.toml"), "ORDERS_DB_URL": "sqlite://", "PATH": ""}
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", INDEX_LIKE_RUN, str(root)], capture_output=True, text=True, env=env, timeout=120
    )
    # Then it indexes every function, and azure-functions' "Auth level is not applied" line is gone
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "5 functions"
    assert "Auth level" not in done.stderr, done.stderr
    # While any other warning on the same (root) logger is still printed
    assert "WARNING:root:another warning: still shown" in done.stderr


@pytest.mark.parametrize(("before", "after"), [(700, 20_000), (50_000, 50_000)])
def test_importing_the_app_raises_the_young_gc_threshold_and_keeps_a_higher_one(
    tmp_path: Path, before: int, after: int
) -> None:
    import subprocess

    # Given a process whose young-generation threshold is `before` (700: CPython's default)
    (tmp_path / "app.toml").write_text(CONFIG)
    env = {"DBFANOUT_CONFIG": str(tmp_path / "app.toml"), "ORDERS_DB_URL": "sqlite://", "PATH": ""}
    root = Path(__file__).resolve().parents[2]
    script = (
        f"import gc, sys; sys.path.insert(0, {str(root)!r}); gc.set_threshold({before}, 11, 12)\n"
        "import function_app\nprint(*gc.get_threshold())"
    )
    # When it imports the app
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    # Then the young generation is collected every `after` allocations, the older thresholds untouched
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(after), "11", "12"]
