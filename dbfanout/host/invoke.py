"""Calling a user function the way the Python worker does (sync or ``async def``)."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

from dbfanout.host.app_loader import FunctionSpec

__all__ = ["invoke"]


def invoke(spec: FunctionSpec, argument: Any) -> Any:
    """Call ``spec`` with its trigger argument bound by name; await a coroutine to completion."""
    result = spec.call(**{spec.arg_name: argument})
    if inspect.isawaitable(result):
        return asyncio.run(_await(result))
    return result


async def _await(awaitable: Any) -> Any:
    return await awaitable
