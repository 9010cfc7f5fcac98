"""Loading a Functions app the way the Python worker does, and reading its bindings.

Settings go into ``os.environ`` before the import (``function_app.py`` reads its config at
import time); the environment wins over ``local.settings.json`` Values, like ``func start``.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.errors import ConfigError
from shared.settings import load_settings

__all__ = ["DEFAULT_APP", "FunctionSpec", "apply_settings", "discover", "load_app"]

DEFAULT_APP = "function_app:app"


@dataclass(frozen=True, slots=True)
class FunctionSpec:
    """One indexed function: its name, its trigger binding (function.json form) and its code."""

    name: str
    trigger: Mapping[str, Any]
    call: Callable[..., Any] = field(repr=False)
    other_bindings: tuple[Mapping[str, Any], ...] = ()

    @property
    def trigger_type(self) -> str:
        return str(self.trigger.get("type", ""))

    @property
    def arg_name(self) -> str:
        return str(self.trigger["name"])


def apply_settings(app_root: Path, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Merge settings (environment over local.settings.json) and export them to ``os.environ``."""
    settings = load_settings(app_root)
    settings.update(extra or {})
    for name, value in settings.items():
        # The environment already wins in ``settings``; only fill what it lacks (and the extras).
        if os.environ.get(name) != value:
            os.environ[name] = value
    return settings


def load_app(spec: str, app_root: Path) -> Any:
    """Import ``module:attr`` (default ``function_app:app``) with the app root first on sys.path."""
    module_name, _, attr = (spec or DEFAULT_APP).partition(":")
    attr = attr or "app"
    root = str(app_root.resolve())
    if root in sys.path:
        sys.path.remove(root)
    sys.path.insert(0, root)  # the app root shadows same-named modules, as on Azure
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        raise ConfigError("--app", f"cannot import {module_name!r} from {root}", hint=_missing_app_hint(root)) from exc
    app = getattr(module, attr, None)
    if app is None or not callable(getattr(app, "get_functions", None)):
        raise ConfigError("--app", f"{module_name}.{attr} is not an azure.functions FunctionApp")
    return app


def _missing_app_hint(root: str) -> str:
    """What to do when the app module is missing: make this folder an app, or go to the app."""
    here = Path(root)
    if (here / "dbfanout.toml").exists() or (here / "handlers").is_dir():
        # An app folder without its entry point: init writes function_app.py and host.json back.
        return "run `dbfanout init` here: it writes the missing function_app.py and host.json"
    return (
        "this folder is not a dbfanout app: run `dbfanout init` here to make it one (docs/first-app.md), "
        "or run from the folder that holds function_app.py (or pass --app-root DIR)"
    )


def discover(app: Any) -> list[FunctionSpec]:
    """Every function of the app with its trigger, from ``get_functions()`` (as the worker indexes)."""
    specs: list[FunctionSpec] = []
    for function in app.get_functions():
        doc = json.loads(function.get_function_json())
        bindings = doc.get("bindings", [])
        triggers = [b for b in bindings if str(b.get("type", "")).endswith("Trigger")]
        if len(triggers) != 1:
            raise ConfigError(function.get_function_name(), f"has {len(triggers)} triggers; a function needs one")
        others = tuple(b for b in bindings if b is not triggers[0])
        specs.append(FunctionSpec(function.get_function_name(), triggers[0], function.get_user_function(), others))
    return specs
