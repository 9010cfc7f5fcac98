"""Log formatters: every ``extra`` field rendered, as key=value text or as JSON."""

from __future__ import annotations

import json
import logging
import sys

from shared.logs import JsonFormatter, TextFormatter, ids


def _record(message: str, **fields: object) -> logging.LogRecord:
    record = logging.makeLogRecord({"name": "dbfanout.poller.tick", "levelname": "INFO", "msg": message})
    record.__dict__.update(ids(**fields))
    return record


def test_text_renders_fields_after_the_message_and_quotes_values_with_spaces() -> None:
    record = _record("batch enqueued", poller="orders", batch_id="b-1", events=3, error="Boom('a b')", gone=None)
    line = TextFormatter().format(record)
    assert line == "INFO dbfanout.poller.tick: batch enqueued poller=orders batch_id=b-1 events=3 error=\"Boom('a b')\""


def test_text_keeps_a_traceback_below_the_fields() -> None:
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        record = logging.makeLogRecord({"msg": "failed", "levelname": "ERROR", "exc_info": sys.exc_info()})
    record.__dict__.update(poller="orders")
    first, *rest = TextFormatter().format(record).splitlines()
    assert first.endswith("failed poller=orders") and rest[-1] == "RuntimeError: boom"


def test_json_carries_the_same_fields() -> None:
    doc = json.loads(JsonFormatter().format(_record("checkpoint committed", poller="orders", fencing_token=7)))
    assert doc["message"] == "checkpoint committed" and doc["poller"] == "orders" and doc["fencing_token"] == 7
