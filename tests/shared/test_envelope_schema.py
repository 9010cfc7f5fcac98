"""Message bodies validate against the JSON Schema shipped for other-language consumers."""

from __future__ import annotations

import datetime as dt
import json
import uuid
from decimal import Decimal
from pathlib import Path

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.claimcheck import CLAIM_KEY
from shared.codec import loads
from shared.ids import source_fingerprint
from shared.messages import pack_batch
from shared.models import Batch, Lsn, RowChange

SCHEMA = json.loads((Path(__file__).parents[2] / "schemas" / "dbfanout.batch.v1.schema.json").read_text())
FP = source_fingerprint({"url": "sqlite://", "table": "orders"})
values = st.one_of(
    st.none(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.text(max_size=10),
    st.decimals(allow_nan=False, allow_infinity=False),
    st.uuids(),
    st.datetimes(timezones=st.just(dt.UTC)),
    st.dates(),
    st.binary(max_size=8),
    st.booleans(),
)


@settings(max_examples=100, deadline=None)
@given(after=st.dictionaries(st.text(min_size=1, max_size=6), values, max_size=6), delete=st.booleans())
def test_every_body_the_poller_sends_validates(after: dict[str, object], delete: bool) -> None:
    events = (
        RowChange("ev-1", "delete" if delete else "upsert", {"id": 10**20}, dt.datetime.now(dt.UTC), after, "orders"),
        RowChange(
            "ev-2", "upsert", {"a": uuid.uuid4(), "b": 2}, (Decimal("1.5"), 3), {CLAIM_KEY: {"blob": "x"}}, "orders"
        ),
        RowChange("ev-3", "delete", {"aggregate": "42"}, 7, None, "orders", change="order.deleted"),
        # pg_logical: the cursor is (commit LSN, position); a delete's old key or row is before
        RowChange("ev-4", "delete", {"id": 1}, (Lsn(2**33 + 5), 0), None, "orders", before=after, change="delete"),
        # every event may name its table; a snapshot's row is change "read"
        RowChange("ev-5", "upsert", {"id": 1}, (Lsn(9), 0), {"id": 1}, "orders", change="read", table="public.orders"),
    )
    for message in pack_batch(Batch("orders", "batch-1", FP, events), 256 * 1024):
        jsonschema.validate(loads(message.body), SCHEMA)


@pytest.mark.parametrize(
    "body",
    [
        {"schema": "dbfanout.batch/2", "poller": "p", "batch_id": "b", "source_fingerprint": FP, "events": []},
        {
            "schema": "dbfanout.batch/1",
            "poller": "p",
            "batch_id": "b",
            "source_fingerprint": FP,
            "events": [{"op": "x"}],
        },
    ],
)
def test_the_schema_rejects_foreign_bodies(body: dict[str, object]) -> None:
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(body, SCHEMA)
