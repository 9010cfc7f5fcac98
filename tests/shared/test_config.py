"""dbfanout.toml: the DESIGN §3.3 keys load; every mistake names its key."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.config import load_config, parse_config
from shared.errors import ConfigError

SAMPLE = """
[app]
name = "shop"
state_container = "db-state"
state_connection = "DBFANOUT_STATE"
servicebus_connection = "DBFANOUT_SERVICEBUS"

[pollers.orders]
source_url = "${ORDERS_DB_URL}"
table = "orders"
cursor = "updated_at"
pk = ["id"]
queue = "orders-changes"
schedule = "*/5 * * * * *"
batch_size = 500
max_batches_per_tick = 20
lease_ttl_seconds = 120
settle_seconds = 2
soft_delete_column = "deleted_at"
handler = "handlers.orders:handle"
"""


def test_design_sample_loads_with_secret_from_settings(tmp_path: Path) -> None:
    (tmp_path / "dbfanout.toml").write_text(SAMPLE)
    cfg = load_config(app_root=tmp_path, settings={"ORDERS_DB_URL": "postgresql://u:s3cret@h/db"})
    orders = cfg.poller("orders")
    assert orders.source_url == "postgresql://u:s3cret@h/db"
    assert orders.pk == ("id",) and orders.queue == "orders-changes" and orders.settle_seconds == 2.0
    assert "s3cret" not in repr(cfg)  # secrets never printed


def test_config_path_comes_from_the_dbfanout_config_setting(tmp_path: Path) -> None:
    (tmp_path / "other.toml").write_text(SAMPLE)
    cfg = load_config(app_root=tmp_path, settings={"DBFANOUT_CONFIG": "other.toml", "ORDERS_DB_URL": "sqlite://"})
    assert cfg.path == tmp_path / "other.toml"


def _data(**changes: object) -> dict[str, object]:
    import tomllib

    data = tomllib.loads(SAMPLE)
    data["pollers"]["orders"].update(changes)
    return {k: v for k, v in data.items()}


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"batch_size": 0}, "pollers.orders.batch_size"),
        ({"pk": []}, "pollers.orders.pk"),
        ({"queue": ""}, "pollers.orders.queue"),
        ({"schedule": "* * * * *"}, "pollers.orders.schedule"),
        ({"handler": "no_colon"}, "pollers.orders.handler"),
        ({"query": "SELECT 1"}, "pollers.orders.table"),
        ({"bogus": 1}, "pollers.orders.bogus"),
        ({"null_cursor": "ignore"}, "pollers.orders.null_cursor"),
        ({"max_delivery_count": -1}, "pollers.orders.max_delivery_count"),
        ({"linger_seconds": -1}, "pollers.orders.linger_seconds"),
        ({"linger_seconds": 601}, "pollers.orders.linger_seconds"),
        ({"linger_seconds": "2"}, "pollers.orders.linger_seconds"),
        ({"poll_interval_ms": 5}, "pollers.orders.poll_interval_ms"),
        ({"poll_interval_ms": 0.5}, "pollers.orders.poll_interval_ms"),
        ({"wake": "loud"}, "pollers.orders.wake"),
        ({"wake": "notify"}, "pollers.orders.wake"),  # without a linger
        ({"wake": "notify", "linger_seconds": 2}, "pollers.orders.wake"),  # not PostgreSQL (sqlite://)
    ],
)
def test_each_bad_value_names_its_key(changes: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(_data(**changes), {"ORDERS_DB_URL": "sqlite://"})
    assert info.value.key == key


def test_missing_secret_setting_names_the_setting() -> None:
    with pytest.raises(ConfigError, match="ORDERS_DB_URL"):
        parse_config(_data(), {})


def test_missing_file_says_where_it_looked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(app_root=tmp_path, settings={})


OUTBOX = {"source_url": "sqlite://", "kind": "outbox", "table": "dbfanout_outbox", "queue": "changes"}


def test_an_outbox_poller_needs_only_its_table() -> None:
    data = {"app": {"name": "shop"}, "pollers": {"changes": {**OUTBOX, "outbox_retention_seconds": 3600}}}
    poller = parse_config(data, {}).poller("changes")
    assert (poller.kind, poller.table, poller.cursor, poller.pk) == ("outbox", "dbfanout_outbox", "id", ("id",))
    assert poller.outbox_retention_seconds == 3600.0
    assert parse_config(_data(), {"ORDERS_DB_URL": "sqlite://"}).poller("orders").kind == "keyset"


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"cursor": "id"}, "pollers.changes.cursor"),
        ({"query": "SELECT 1"}, "pollers.changes.query"),
        ({"table": None}, "pollers.changes.table"),
        ({"kind": "cdc"}, "pollers.changes.kind"),
        ({"outbox_retention_seconds": -1}, "pollers.changes.outbox_retention_seconds"),
        (
            {"kind": "keyset", "cursor": "c", "pk": "id", "outbox_retention_seconds": 60},
            "pollers.changes.outbox_retention_seconds",
        ),
    ],
)
def test_outbox_mistakes_name_their_key(changes: dict[str, object], key: str) -> None:
    raw = {k: v for k, v in {**OUTBOX, **changes}.items() if v is not None}
    with pytest.raises(ConfigError) as info:
        parse_config({"app": {"name": "shop"}, "pollers": {"changes": raw}}, {})
    assert info.value.key == key


def test_an_outbox_read_by_two_pollers_may_not_be_pruned_by_one() -> None:
    pollers: dict[str, dict[str, object]] = {
        "changes": {**OUTBOX, "outbox_retention_seconds": 60},
        "backfill": dict(OUTBOX),
    }
    with pytest.raises(ConfigError, match="backfill") as info:
        parse_config({"app": {"name": "shop"}, "pollers": pollers}, {})
    assert info.value.key == "pollers.changes.outbox_retention_seconds"
    pollers["changes"].pop("outbox_retention_seconds")
    assert len(parse_config({"app": {"name": "shop"}, "pollers": pollers}, {}).pollers) == 2


def test_max_delivery_count_defaults_to_the_transports_own() -> None:
    settings = {"ORDERS_DB_URL": "sqlite://"}
    assert parse_config(_data(), settings).poller("orders").deliveries == 10  # Service Bus
    queue = parse_config(_data(transport="storage-queue"), settings).poller("orders")
    assert queue.deliveries == 5  # host.json maxDequeueCount
    assert parse_config(_data(max_delivery_count=3), settings).poller("orders").deliveries == 3


def test_cursor_is_commit_time_is_off_unless_declared() -> None:
    settings = {"ORDERS_DB_URL": "sqlite://"}
    assert parse_config(_data(), settings).poller("orders").cursor_is_commit_time is False
    assert parse_config(_data(cursor_is_commit_time=True), settings).poller("orders").cursor_is_commit_time is True


def _pg_logical(**more: object) -> dict[str, object]:
    raw: dict[str, object] = {"kind": "pg_logical", "source_url": "postgresql://h/db", "tables": ["orders"]}
    return {"app": {"name": "t"}, "pollers": {"log": {**raw, "queue": "q", **more}}}


def test_snapshot_keys_of_a_pg_logical_poller_default_to_never_and_a_public_signal_table() -> None:
    log = parse_config(_pg_logical(), {}).pollers["log"]
    assert (log.snapshot, log.snapshot_chunk_size, log.signal_table) == ("never", 0, "public.dbfanout_signal")
    log = parse_config(_pg_logical(snapshot="initial", snapshot_chunk_size=200, signal_table="ops.sig"), {}).pollers[
        "log"
    ]
    assert (log.snapshot, log.snapshot_chunk_size, log.signal_table) == ("initial", 200, "ops.sig")
    assert parse_config(_pg_logical(signal_table="sig"), {}).pollers["log"].signal_table == "public.sig"


@pytest.mark.parametrize(
    ("more", "key"),
    [
        ({"snapshot": "always"}, "snapshot"),
        ({"snapshot_chunk_size": -1}, "snapshot_chunk_size"),
        ({"signal_table": 'x"; DROP TABLE y'}, "signal_table"),
    ],
)
def test_bad_snapshot_keys_name_their_key(more: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_config(_pg_logical(**more), {})
    assert exc.value.key == f"pollers.log.{key}"


def test_snapshot_keys_apply_to_pg_logical_pollers_only() -> None:
    raw = {"source_url": "sqlite://", "table": "t", "cursor": "v", "pk": "id", "queue": "q", "snapshot": "initial"}
    with pytest.raises(ConfigError) as exc:
        parse_config({"app": {"name": "t"}, "pollers": {"p": raw}}, {})
    assert exc.value.key == "pollers.p.snapshot"


def test_linger_is_off_by_default_and_the_lease_ttl_defaults_to_30_seconds() -> None:
    data = _data()
    del data["pollers"]["orders"]["lease_ttl_seconds"]  # type: ignore[index]
    orders = parse_config(data, {"ORDERS_DB_URL": "sqlite://"}).poller("orders")
    assert orders.linger_seconds == 0 and orders.poll_interval_ms == 250
    assert orders.lease_ttl_seconds == 30 and orders.time_budget_seconds == 20
    lingering = parse_config(_data(linger_seconds=4, poll_interval_ms=100), {"ORDERS_DB_URL": "sqlite://"})
    assert lingering.poller("orders").linger_seconds == 4.0
    assert lingering.poller("orders").poll_interval_ms == 100


def test_wake_notify_goes_with_a_linger_on_a_postgresql_table() -> None:
    data = _data(wake="notify", linger_seconds=2)
    orders = parse_config(data, {"ORDERS_DB_URL": "postgresql+psycopg://u@h/db"}).poller("orders")
    assert orders.wake == "notify"
    assert parse_config(_data(), {"ORDERS_DB_URL": "sqlite://"}).poller("orders").wake == "poll"


@pytest.mark.parametrize(
    ("table", "changes", "key", "suggestion"),
    [
        ("pollers", {"batch_sise": 100}, "pollers.orders.batch_sise", "batch_size"),
        ("pollers", {"linger": 4}, "pollers.orders.linger", "linger_seconds"),
        ("app", {"state_conection": "X"}, "app.state_conection", "state_connection"),
    ],
)
def test_a_misspelled_key_is_named_with_the_key_it_resembles(
    table: str, changes: dict[str, object], key: str, suggestion: str
) -> None:
    # Given a config with a misspelled key (issue 40)
    data = _data()
    target = data["app"] if table == "app" else data["pollers"]["orders"]  # type: ignore[index]
    target.update(changes)  # type: ignore[union-attr]
    # When it is parsed
    with pytest.raises(ConfigError) as raised:
        parse_config(data, {"ORDERS_DB_URL": "sqlite://"})
    # Then the error names the key and suggests the close one, without listing every key
    assert raised.value.key == key
    assert f"did you mean {suggestion}" in str(raised.value)
    assert "max_uncommitted_batches" not in str(raised.value) and "known keys" not in str(raised.value)


def test_an_unknown_key_like_no_known_one_points_at_the_list_of_keys() -> None:
    with pytest.raises(ConfigError, match="unknown key") as raised:
        parse_config(_data(zzzz=1), {"ORDERS_DB_URL": "sqlite://"})
    assert "did you mean" not in str(raised.value) and "Configure a poller" in str(raised.value)


def test_pollers_sharing_a_queue_must_agree_on_its_transport_when_the_config_loads() -> None:
    # Given two pollers on one queue, one of them over storage queues
    data = _data()
    data["pollers"]["other"] = {**data["pollers"]["orders"], "transport": "storage-queue"}  # type: ignore[index]
    # When it is parsed, Then the config itself refuses it (not only the worker's indexing)
    with pytest.raises(ConfigError, match="share queue orders-changes but not its transport"):
        parse_config(data, {"ORDERS_DB_URL": "sqlite://"})


def test_each_connection_is_looked_up_from_the_setting_its_app_key_names() -> None:
    # Given an app whose storage-queue transport has its own account, and no Service Bus setting
    data = _data()
    data["app"]["queue_connection"] = "QUEUES"  # type: ignore[index]
    settings = {"ORDERS_DB_URL": "sqlite://", "DBFANOUT_STATE": "state-conn", "QUEUES": "queue-conn"}
    config = parse_config(data, settings)
    # Then state and queue come from their settings, and a missing one is named
    assert config.connection("state").connection_string == "state-conn"
    assert config.connection("queue").connection_string == "queue-conn"
    assert config.connection_string("servicebus") == ""
    with pytest.raises(ConfigError) as raised:
        config.connection("servicebus")
    assert raised.value.key == "DBFANOUT_SERVICEBUS"
