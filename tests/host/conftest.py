from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


@pytest.fixture
def restore_environ() -> Iterator[None]:
    """The in-process host exports settings to os.environ (as the worker does); undo that."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
