"""The public surface is exactly what __all__ says (STYLE R13)."""

from __future__ import annotations

import inspect

import shared


def test_shared_exports_exactly_all() -> None:
    names = {n for n, v in vars(shared).items() if not n.startswith("_") and not inspect.ismodule(v)}
    assert set(shared.__all__) == names
