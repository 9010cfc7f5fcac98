"""``dbfanout status`` and ``dlq peek`` as an operator reads them: one line per poller at 80
columns, dead letters counted as a problem, and an empty dead-letter queue said in words."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner, Result

from dbfanout.cli import app
from tests.cli.conftest import Workspace, dead_letter

pytestmark = pytest.mark.integration


def run_at(workspace: Workspace, columns: int, *args: str) -> Result:
    """``dbfanout ARGS`` on a terminal ``columns`` wide."""
    runner = CliRunner(env={"COLUMNS": str(columns)})
    return runner.invoke(app, [*args, "--config", str(workspace.config_path)])


def table_rows(output: str) -> list[str]:
    """The body lines of the one table in ``output`` (between the header rule and the bottom edge)."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("┡"))
    end = next(i for i, line in enumerate(lines) if line.startswith("└"))
    return lines[start + 1 : end]


def test_status_fits_80_columns_with_one_line_per_poller(workspace, bus):
    # Given two pollers that delivered, one with rows pending (long cursors, lease owners, queue names)
    workspace.add_backfill()
    workspace.source.upsert(range(1, 6))
    workspace.tick(sink=workspace.bus_sink(bus))
    workspace.tick("orders_backfill", sink=workspace.bus_sink(bus, "orders_backfill"))
    workspace.source.upsert(range(6, 9))
    # When the operator asks for the status on an 80-column terminal
    result = run_at(workspace, 80, "status")
    # Then the table has exactly one line per poller and no line is wider than the terminal
    assert result.exit_code == 0, result.output
    rows = table_rows(result.stdout)
    assert len(rows) == 2 and rows[0].split("│")[1].strip() in ("orders", "orders_bac…")
    assert all(len(line) <= 80 for line in result.stdout.splitlines()), result.stdout
    # And --wide still shows the details (the queue and its lease owner, the last batch)
    wide = run_at(workspace, 250, "status", "--wide")
    assert wide.exit_code == 0 and workspace.queue in wide.stdout and "token" in wide.stdout


def test_status_lists_a_dead_letter_as_a_problem_and_exits_1(workspace, bus):
    # Given a poller that delivered, and one of its messages in the dead-letter queue
    workspace.source.upsert([1])
    workspace.tick(sink=workspace.bus_sink(bus))
    before = run_at(workspace, 80, "status", "--json")
    assert before.exit_code == 0, before.output
    dead_letter(bus, workspace.queue, [b'{"n": 1}'])
    # When the operator asks for the status
    result = run_at(workspace, 80, "status")
    # Then the problem is listed with the command that shows it, and the exit code says so
    assert result.exit_code == 1, result.output
    said = " ".join(result.stdout.split())  # the findings below the table are prose: they may wrap
    assert f"problem orders: 1 dead-lettered message(s) in {workspace.queue}" in said
    assert f"`dbfanout dlq peek {workspace.queue}`" in said
    # And --json is the same document as before (the count was always there), with exit 1 too
    after = run_at(workspace, 80, "status", "--json")
    assert after.exit_code == 1
    assert set(json.loads(after.stdout)[0]) == set(json.loads(before.stdout)[0])
    assert json.loads(after.stdout)[0]["queue_depth"]["dead_lettered"] == 1


def test_peek_of_an_empty_dlq_says_it_is_empty(workspace):
    # Given a queue with nothing dead-lettered
    # When the operator peeks at its dead-letter queue, with and without a filter
    plain = run_at(workspace, 80, "dlq", "peek", workspace.queue)
    filtered = run_at(workspace, 80, "dlq", "peek", workspace.queue, "--reason", "HandlerFailed")
    # Then one line says so, instead of a table of headers
    assert plain.exit_code == 0, plain.output
    assert plain.stdout.strip() == f"{workspace.queue}/$DeadLetterQueue is empty"
    assert filtered.stdout.strip() == f"{workspace.queue}/$DeadLetterQueue: no message matches the filters"
    assert "│" not in plain.stdout + filtered.stdout
