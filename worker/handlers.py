"""Finding and calling user handlers (``module:function``, sync or async)."""

from __future__ import annotations

import asyncio
import importlib
import inspect
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from shared.errors import ConfigError
from shared.models import HandlerContext, RowChange

__all__ = ["Handler", "call_handler", "load_handler"]

Handler = Callable[[list[RowChange], HandlerContext], Any]


def load_handler(spec: str, *, key: str, app_root: Path | None = None) -> Handler:
    """Import ``module:function`` from the app root (like the Functions host imports the app)."""
    module_name, _, attr = spec.partition(":")
    if app_root is not None and str(app_root) not in sys.path:
        sys.path.insert(0, str(app_root))
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(key, f"cannot import handler module {module_name!r}: {exc}") from exc
    handler = getattr(module, attr, None)
    if not callable(handler):
        raise ConfigError(key, f"module {module_name!r} has no callable {attr!r}")
    return handler  # type: ignore[no-any-return]


def call_handler(handler: Handler, events: Sequence[RowChange], context: HandlerContext) -> None:
    """Run a sync handler, or an async one to completion."""
    result = handler(list(events), context)
    if inspect.isawaitable(result):
        asyncio.run(_await(result))


async def _await(awaitable: Any) -> None:
    await awaitable
