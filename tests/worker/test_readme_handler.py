"""The README's handler, copied as a user would, works for a topic subscription (issue 22)."""

from __future__ import annotations

import logging
import re
import uuid
from pathlib import Path

import pytest

from shared.config import SubscriptionConfig
from tests.worker.support import POLLER, QUEUE, batch, delivery, make_config
from worker.runtime import Worker
from worker.settlement import Settle

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_handler() -> str:
    """The first Python block of the README's "Write a handler" section."""
    section = README.read_text().split("## Write a handler", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "the README's handler section has no Python example"
    return match.group(1)


def test_the_readme_handler_runs_on_a_topic_subscription(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given the README's example saved as a module of the app, named by a subscription's handler key
    module = f"readme_handler_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(readme_handler())
    monkeypatch.syspath_prepend(str(tmp_path))
    subs = {"audit": SubscriptionConfig("audit", f"{module}:handle")}
    worker = Worker(make_config(topic=QUEUE, subscriptions=subs), app_root=tmp_path)
    # When a two-event message arrives on that subscription
    with caplog.at_level(logging.INFO, logger="handlers.audit"):
        settled = worker.process(delivery(batch(2), message_id="m-7", delivery_count=2), "audit")
    # Then it completes, and the handler saw each event with the subscription and delivery count
    assert settled is Settle.COMPLETE
    lines = [r.getMessage() for r in caplog.records if r.name == "handlers.audit"]
    assert lines == [
        f"upsert {{'id': {i}}} of {POLLER} (event ev-{i}, subscription audit, delivery 2)" for i in range(2)
    ]
