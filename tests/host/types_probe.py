"""The handler of the every-type end-to-end tests, copied into the test's app folder as ``types_probe.py``.

``handle`` pickles each batch it is given (every delivery, duplicates included) to a file of its
own in ``events/`` beside this file: per event its poller, ``change``, ``pk``, ``before`` and
``after``, each value exactly as the handler got it (its Python type kept, which JSON would lose).
The file is written under a temporary name, then renamed, so a reader never sees half a batch.
"""

from __future__ import annotations

import pickle
import uuid
from pathlib import Path

from shared.models import HandlerContext, RowChange

HERE = Path(__file__).resolve().parent


def handle(events: list[RowChange], context: HandlerContext) -> None:
    records = [
        {"poller": e.poller, "change": e.change, "pk": dict(e.pk), "before": e.before, "after": e.after} for e in events
    ]
    folder = HERE / "events"
    folder.mkdir(exist_ok=True)
    name = uuid.uuid4().hex
    partial = folder / f".{name}.partial"
    partial.write_bytes(pickle.dumps(records))
    partial.rename(folder / f"{name}.pickle")
