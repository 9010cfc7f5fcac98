"""scripts/run_sdk_samples.py: its Config.json is one the emulator accepts; skips are explicit."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from sbemulator import EmulatorConfig

SCRIPT = Path(__file__).parents[2] / "scripts" / "run_sdk_samples.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("run_sdk_samples", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def test_samples_get_their_own_entities_and_management_samples_are_skipped(tmp_path: Path):
    script = _script()
    for folder, names in (("sync_samples", ["send_queue", "mgmt_queue"]), ("async_samples", ["send_topic_async"])):
        (tmp_path / folder).mkdir()
        for name in names:
            (tmp_path / folder / f"{name}.py").write_text("")
    samples = script.discover(tmp_path, None)
    assert [(s.name, s.skip_reason is None) for s in samples] == [
        ("sync_samples/mgmt_queue", False),
        ("sync_samples/send_queue", True),
        ("async_samples/send_topic_async", True),
    ]
    config_path = tmp_path / "Config.json"
    script.write_config(config_path, [s for s in samples if s.skip_reason is None])
    config = EmulatorConfig.from_file(config_path)
    assert [q.name for q in config.queues] == ["q1", "sq1", "q2", "sq2"]
    assert [(t.name, [s.name for s in t.subscriptions]) for t in config.topics] == [("t1", ["s1"]), ("t2", ["s2"])]
