"""Handlers of the topic end-to-end test, copied into the test's app folder as ``topic_probe.py``.

``record`` appends one line per event it is given (every delivery, duplicates included) to
``seen-<subscription>.jsonl`` beside this file; ``record_unless_poisoned`` first fails the whole
call when it holds the row whose ``id`` is in ``poison-id`` (a file beside this one).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from shared.models import HandlerContext, RowChange

HERE = Path(__file__).resolve().parent
_lock = threading.Lock()


def record(events: list[RowChange], context: HandlerContext) -> None:
    lines = [
        json.dumps(
            {
                "event_id": e.event_id,
                "id": e.pk["id"],
                "subscription": context.subscription,
                "message_id": context.message_id,
                "target": context.application_properties.get("dbfanout-to"),
            }
        )
        for e in events
    ]
    with _lock, (HERE / f"seen-{context.subscription}.jsonl").open("a") as out:
        out.write("".join(line + "\n" for line in lines))


def record_unless_poisoned(events: list[RowChange], context: HandlerContext) -> None:
    poison = int((HERE / "poison-id").read_text())
    if any(e.pk["id"] == poison for e in events):
        raise ValueError(f"row {poison} is poison")
    record(events, context)
