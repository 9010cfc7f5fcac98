"""Property: whatever the interleaving of writes, page sizes, ticks and pruning, the handler sees
exactly the changes written, in commit order, once each (SQLite; the real tick and source)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from poller.sources.factory import open_source
from poller.state.memory import MemoryStateStore
from poller.tick.lifecycle import run_tick
from tests.poller.outbox_support import Outbox, outbox_poller
from tests.poller.tick_support import RecordingSink

write = st.tuples(st.just("write"), st.integers(0, 3), st.sampled_from(["insert", "update", "delete", "x.deleted"]))
tick = st.tuples(st.just("tick"), st.integers(1, 6), st.integers(1, 3))
steps = st.lists(st.one_of(write, tick), max_size=40)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=steps, retention=st.sampled_from([None, 0.0]))
def test_every_change_arrives_once_in_commit_order(
    tmp_path: Path, steps: list[tuple[str, int, Any]], retention: float | None
) -> None:
    box = Outbox(f"sqlite:///{tmp_path / 'props.db'}")
    try:
        base = outbox_poller(str(box.engine.url), box.name, outbox_retention_seconds=retention)
        source, store, sink = open_source(base), MemoryStateStore(base.name), RecordingSink()
        written: list[tuple[str, str, int]] = []
        for step in steps:
            if step[0] == "write":
                _, aggregate, change = step
                written.append((str(aggregate), str(change), len(written)))
                box.write(str(aggregate), str(change), {"seq": len(written) - 1})
            else:
                _, batch_size, batches = step
                run_tick(replace(base, batch_size=batch_size, max_batches_per_tick=batches), source, store, sink)
        for _ in range(len(written) + 1):  # drain: one row per page at worst
            if run_tick(base, source, store, sink).stop_reason == "caught_up":
                break
        events = [e for b in sink.accepted for e in b.events]
        assert [(e.pk["aggregate"], e.change, e.after["seq"]) for e in events] == written  # type: ignore[index]
        assert [e.op for e in events] == ["delete" if c in ("delete", "x.deleted") else "upsert" for _, c, _ in written]
        if retention == 0.0 and written:
            run_tick(base, source, store, sink)  # prunes what the drain landed
            assert len(box.ids()) == 1  # only the newest row stays
    finally:
        box.drop()
