"""The handler of the schema-change end-to-end tests, copied into the test's app folder as ``schema_probe.py``.

``handle`` appends one line per event it is given (every delivery, duplicates included) to
``events.jsonl`` beside this file: the row's id, its ``version`` column, the op, the column names
of ``after`` and its ``n`` (None for a delete without ``after``); then it applies the batch with
the example handler (the target table).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from handlers.example import handle as apply_to_target
from shared.models import HandlerContext, RowChange

HERE = Path(__file__).resolve().parent
_lock = threading.Lock()


def handle(events: list[RowChange], context: HandlerContext) -> None:
    lines = [
        json.dumps(
            {
                "id": e.pk["id"],
                "version": (e.after or {}).get("version"),  # the write that made this row state
                "op": e.op,
                "columns": sorted(e.after) if e.after is not None else None,
                "n": (e.after or {}).get("n"),
            }
        )
        for e in events
    ]
    with _lock, (HERE / "events.jsonl").open("a") as out:
        out.write("".join(line + "\n" for line in lines))
    apply_to_target(events, context)
