"""The console script says how to get the operator tools when they are not installed."""

from __future__ import annotations

import sys

import pytest

from dbfanout.entry import main


def test_missing_operator_extra_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given an install without the cli extra (typer absent)
    monkeypatch.delitem(sys.modules, "dbfanout.cli", raising=False)
    monkeypatch.setitem(sys.modules, "typer", None)
    # When the dbfanout command starts; Then it exits 2 naming the extra
    with pytest.raises(SystemExit) as info:
        main()
    assert info.value.code == 2
    assert "pip install 'dbfanout[cli]'" in capsys.readouterr().err
