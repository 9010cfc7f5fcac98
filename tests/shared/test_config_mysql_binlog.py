"""dbfanout.toml for kind = "mysql_binlog": its keys, its defaults, and what it refuses (each error names its key)."""

from __future__ import annotations

import pytest

from poller.sources.factory import open_source
from shared.config import parse_config
from shared.errors import ConfigError


def _binlog(**more: object) -> dict[str, object]:
    raw: dict[str, object] = {"kind": "mysql_binlog", "source_url": "mysql+pymysql://u@h/shop", "tables": ["orders"]}
    return {"app": {"name": "t"}, "pollers": {"log": {**raw, "queue": "q", **more}}}


def test_a_binlog_poller_names_its_tables_and_gets_a_stable_server_id_from_its_name() -> None:
    log = parse_config(_binlog(), {}).pollers["log"]
    assert (log.kind, log.tables, log.table, log.pk, log.settle_seconds) == (
        "mysql_binlog", ("orders",), "orders", (), 0.0,
    )  # fmt: skip
    assert 1_000_000_000 <= log.server_id < 2_000_000_000
    assert parse_config(_binlog(), {}).pollers["log"].server_id == log.server_id  # the same on every load
    assert parse_config(_binlog(server_id=77, pk=["id"]), {}).pollers["log"].server_id == 77


def test_one_table_may_be_given_as_table() -> None:
    raw = {"kind": "mysql_binlog", "source_url": "mysql+pymysql://u@h/shop", "table": "shop.orders", "queue": "q"}
    assert parse_config({"app": {"name": "t"}, "pollers": {"log": raw}}, {}).pollers["log"].tables == ("shop.orders",)


def test_snapshot_keys_apply_to_binlog_pollers_the_signal_table_in_the_source_database() -> None:
    log = parse_config(_binlog(snapshot="initial", snapshot_chunk_size=100), {}).pollers["log"]
    assert (log.snapshot, log.snapshot_chunk_size, log.signal_table) == ("initial", 100, "public.dbfanout_signal")
    assert parse_config(_binlog(signal_table="shop.sig"), {}).pollers["log"].signal_table == "shop.sig"


@pytest.mark.parametrize(
    ("more", "key"),
    [
        ({"cursor": "updated_at"}, "cursor"),
        ({"slot": "s"}, "slot"),
        ({"publication": "p"}, "publication"),
        ({"server_id": 0}, "server_id"),
        ({"server_id": "one"}, "server_id"),
        ({"tables": []}, "tables"),
        ({"tables": ["a.b.c"]}, "tables"),
    ],
)
def test_bad_keys_of_a_binlog_poller_name_their_key(more: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_config(_binlog(**more), {})
    assert exc.value.key == f"pollers.log.{key}"


def test_server_id_applies_to_binlog_pollers_only() -> None:
    raw = {"source_url": "sqlite://", "table": "t", "cursor": "v", "pk": "id", "queue": "q", "server_id": 5}
    with pytest.raises(ConfigError) as exc:
        parse_config({"app": {"name": "t"}, "pollers": {"p": raw}}, {})
    assert exc.value.key == "pollers.p.server_id"


def test_a_binlog_poller_on_another_database_is_refused_when_it_opens() -> None:
    cfg = parse_config(_binlog(source_url="sqlite://"), {}).pollers["log"]
    with pytest.raises(ConfigError) as exc:
        open_source(cfg)
    assert exc.value.key == "pollers.log.kind" and "MariaDB" in str(exc.value)


def test_qualified_tables_need_no_database_in_the_url_unless_the_signal_table_is_needed() -> None:
    # Without a database in the URL the default signal table has nowhere to live: a poller that
    # streams only still opens (snapshot requests cannot reach it); one with snapshot = "initial" is refused
    url = "mysql+pymysql://u@h"
    open_source(parse_config(_binlog(source_url=url, tables=["shop.orders"]), {}).pollers["log"]).close()
    initial = parse_config(_binlog(source_url=url, tables=["shop.orders"], snapshot="initial"), {}).pollers["log"]
    with pytest.raises(ConfigError) as exc:
        open_source(initial)
    assert exc.value.key == "pollers.log.signal_table" and exc.value.hint and "shop.dbfanout_signal" in exc.value.hint
    named = _binlog(source_url=url, tables=["shop.orders"], snapshot="initial", signal_table="shop.sig")
    open_source(parse_config(named, {}).pollers["log"]).close()


def test_an_unqualified_table_needs_a_database_in_the_url() -> None:
    cfg = parse_config(_binlog(source_url="mysql+pymysql://u@h"), {}).pollers["log"]
    with pytest.raises(ConfigError) as exc:
        open_source(cfg)
    assert exc.value.key == "pollers.log.tables"
