"""The end of a run lists the skips grouped by reason, above pytest's own closing line (which CI
reads as the run's last line). Without workers: tests/suite/test_private_postgres.py's skip test."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SKIPPING = {
    "test_first.py": (
        "import pytest\n\n"
        "@pytest.mark.parametrize('i', range(3))\n"
        "def test_needs_a_server(i):\n"
        "    pytest.skip('the server is not reachable')\n\n"
        "def test_runs():\n"
        "    pass\n"
    ),
    "test_second.py": (
        "import pytest\n\n"
        "pytestmark = pytest.mark.skipif(True, reason='the tools are not installed')\n\n"
        "def test_gate():\n"
        "    pass\n"
    ),
    "test_third.py": (
        "import pytest\n\n"
        "@pytest.mark.skipif(True, reason='the server is not reachable')\n"
        "def test_other():\n"
        "    pass\n"
    ),
}


def test_the_skips_are_listed_by_reason_just_above_pytests_closing_line_under_xdist(tmp_path: Path) -> None:
    # Given tests that skip for two reasons, in three files
    for name, text in SKIPPING.items():
        (tmp_path / name).write_text(text)
    # When pytest runs them in two xdist workers (whose reports reach the controller), with the
    # suite's conftest as a plugin (the files are outside tests/)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-q", "-n", "2",
         "--rootdir", str(tmp_path), str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    lines = done.stdout.splitlines()
    assert done.returncode == 0, done.stdout[-3000:]
    # Then one block names each reason once, with its count and files, most frequent first
    start = next(i for i, line in enumerate(lines) if "5 skipped, by reason" in line)
    block = lines[start + 1 : start + 3]
    assert block[0].split()[:1] == ["4"] and "the server is not reachable" in block[0]
    assert "test_first.py" in block[0] and "test_third.py" in block[0]
    assert block[1].split()[:1] == ["1"] and "the tools are not installed" in block[1] and "test_second.py" in block[1]
    # And pytest's own summary stays the last line
    assert "1 passed, 5 skipped" in lines[-1]
    assert start < len(lines) - 1
