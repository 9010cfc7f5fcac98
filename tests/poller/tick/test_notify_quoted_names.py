"""Issue 39: the notify trigger of ``wake = "notify"`` lands on the table config names, quoted.

A mixed-case, schema-qualified table (``public.Lg_x``) beside its lower-case twin (``lg_x``): the
trigger is created on the mixed-case one only, and a write to it wakes the poller's LISTEN on its
channel (a mixed-case poller name becomes a lower-case channel with a hash).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from dbfanout.ops.notify import create_notify_triggers, drop_notify_triggers, missing_notify_triggers
from poller.tick.wake import NotifyWaker, notify_channel
from shared.config import PollerConfig
from tests.poller.source_fixtures import poller_config
from tests.support.databases import unique_name

pytestmark = pytest.mark.integration


@pytest.fixture
def mixed_case(pg_url: str) -> Iterator[tuple[sa.Engine, PollerConfig, str, str]]:
    engine = sa.create_engine(pg_url)
    twin = unique_name("lg")
    mixed = twin.capitalize()
    with engine.begin() as conn:
        conn.exec_driver_sql(f'CREATE TABLE public."{mixed}" (id bigint PRIMARY KEY, c bigint NOT NULL)')
        conn.exec_driver_sql(f"CREATE TABLE {twin} (id bigint PRIMARY KEY, c bigint NOT NULL)")
    poller = poller_config(pg_url, name=f"Orders-{twin}", table=f"public.{mixed}", wake="notify")
    try:
        yield engine, poller, mixed, twin
    finally:
        drop_notify_triggers(poller)
        with engine.begin() as conn:
            conn.exec_driver_sql(f'DROP TABLE IF EXISTS public."{mixed}"')
            conn.exec_driver_sql(f"DROP TABLE IF EXISTS {twin}")
        engine.dispose()


def test_the_notify_trigger_lands_on_the_mixed_case_table_and_wakes_its_channel(
    mixed_case: tuple[sa.Engine, PollerConfig, str, str],
) -> None:
    engine, poller, mixed, twin = mixed_case
    # When the trigger is created as validate --fix does
    assert create_notify_triggers(poller) and missing_notify_triggers(poller) == []
    # Then it is on the mixed-case table only
    with engine.connect() as conn:
        on = conn.execute(
            sa.text("SELECT tgrelid::regclass::text FROM pg_trigger WHERE tgname LIKE 'dbfanout_notify_%' AND tgrelid"
                    " IN (CAST(:mixed AS regclass), CAST(:twin AS regclass))"),
            {"mixed": f'public."{mixed}"', "twin": twin},
        ).scalars().all()  # fmt: skip
    assert on == [f'"{mixed}"']
    # And a write to it wakes a LISTEN on the poller's channel (a lower-case identifier)
    assert notify_channel(poller) == notify_channel(poller).lower()
    waker = NotifyWaker(poller)
    try:
        waker.listen()
        assert waker.ready
        with engine.begin() as conn:
            conn.exec_driver_sql(f'INSERT INTO public."{mixed}" VALUES (1, 1)')
        assert waker.wait(10)
    finally:
        waker.close()
