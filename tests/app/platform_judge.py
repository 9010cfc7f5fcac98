"""Index ``function_app.py`` the way the platform's Python worker does, in one launch mode.

Run as a subprocess by ``test_platform_launch.py``, never imported by the tests. The indexing and
the per-function checks are the real ``azure-functions-runtime`` ones (``loader.index_function_app``
and ``functions.Registry.add_indexed_function``: the binding annotation checks of the 4.x worker's
``azure_functions_worker/functions.py``). What this script reproduces is how each launch mode
arranges ``sys.path`` before the app is imported:

- ``coretools``: this file is copied as ``<workers>/python/3.x/LINUX/X64/worker.py`` and run as a
  script, so its folder, holding a plain module ``worker``, is ``sys.path[0]``; the app folder is
  appended (as ``DependencyManager`` does for the working directory).
- ``placeholder``: the same launcher starts before the app is known and imports the SDK; on
  specialization the app folder is appended and the importer cache cleared (the 4.x worker's
  ``Dispatcher._handle__function_environment_reload_request``).
- ``warm``: run with ``-m`` from the app folder (``python -m azure_functions_worker``), so the app
  folder is ``sys.path[0]``.

Prints ``{"functions": {name: function.json}}`` on success; any load error exits non-zero.

``--invoke FILE`` then runs invocations (a JSON list of ``{"function", "input": {kind: value},
"metadata": {name: {kind: value}}, "expect_error": bool}``; ``bytes`` values in base64) the way the runtime's
``invocation_request`` does: each parameter is converted by the runtime's own
``bindings.meta.from_incoming_proto`` from the host's TypedData, and the function is called with them.
"""

from __future__ import annotations

import argparse
import base64
import importlib
import json
import os
import sys
import types


class _BindingInfo:
    """The two proto enums the registry compares against (values from the worker's FunctionRpc.proto)."""

    undefined = 0  # DataType
    out = 1  # Direction: in = 0, out = 1, inout = 2
    inout = 2


PROTOS = types.SimpleNamespace(BindingInfo=_BindingInfo)


class _TypedData:
    """The host's ``TypedData`` message: one field of the ``data`` oneof set."""

    def __init__(self, kind: str, value: object) -> None:
        self._kind = kind
        setattr(self, kind, base64.b64decode(str(value)) if kind == "bytes" else value)

    def WhichOneof(self, group: str) -> str:  # the protobuf API
        return self._kind


class _ParameterBinding:
    """The host's ``ParameterBinding``: a name and its data."""

    def __init__(self, name: str, data: _TypedData) -> None:
        self.name, self.data = name, data

    def WhichOneof(self, group: str) -> str:  # the protobuf API
        return "data"


def _typed(spec: dict[str, object]) -> _TypedData:
    ((kind, value),) = spec.items()
    return _TypedData(kind, value)


def invoke(meta: types.ModuleType, info: object, invocation: dict[str, object]) -> dict[str, str] | None:
    """Convert the inputs as ``invocation_request`` does, then call the function (sync functions).

    With ``"expect_error": true`` the function must raise: its exception's type and text (what the
    worker reports to the host, which logs it) are returned instead of failing the judge."""
    metadata = {k: _typed(v) for k, v in dict(invocation.get("metadata") or {}).items()}  # type: ignore[call-overload]
    args = {}
    for name, param in info.input_types.items():  # type: ignore[attr-defined]
        trigger = meta.is_trigger_binding(param.binding_name)
        args[name] = meta.from_incoming_proto(
            param.binding_name,
            _ParameterBinding(name, _typed(invocation["input"])),  # type: ignore[arg-type]
            trigger_metadata=metadata if trigger else None,
            pytype=param.pytype,
            function_name=info.name,  # type: ignore[attr-defined]
        )
    name = info.name  # type: ignore[attr-defined]
    try:
        result = info.func(**args)  # type: ignore[attr-defined]
    except Exception as exc:
        if not invocation.get("expect_error"):
            raise
        return {"function": name, "type": type(exc).__name__, "message": str(exc)}
    assert not invocation.get("expect_error"), f"{name} was expected to raise and returned {result!r}"
    assert result is None, f"{name} returned {result!r}"
    return None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("coretools", "placeholder", "warm"), required=True)
    parser.add_argument("--app", required=True)
    parser.add_argument("--site", action="append", default=[], help="the worker's own packages (first wins)")
    parser.add_argument("--invoke", help="a JSON file of invocations to run after indexing")
    args = parser.parse_args()
    for offset, site in enumerate(args.site):  # the worker's dependencies come right after its folder
        sys.path.insert(1 + offset, site)
    if args.mode == "placeholder":
        importlib.import_module("azure.functions")  # loaded before the app folder is known
        sys.path.append(args.app)
        sys.path_importer_cache.clear()
    elif args.mode == "coretools":
        sys.path.append(args.app)
    os.chdir(args.app)

    meta = importlib.import_module("azure_functions_runtime.bindings.meta")
    registry_module = importlib.import_module("azure_functions_runtime.functions")
    loader = importlib.import_module("azure_functions_runtime.loader")
    meta.load_binding_registry()
    registry = registry_module.Registry()
    indexed, infos, errors = {}, {}, []
    for function in loader.index_function_app(os.path.join(args.app, "function_app.py")):
        name = function.get_function_name()
        infos[name] = registry.add_indexed_function(function, PROTOS)  # raises FunctionLoadError like the worker
        indexed[name] = json.loads(function.get_function_json())
    if args.invoke:
        with open(args.invoke) as f:
            for invocation in json.load(f):
                error = invoke(meta, infos[invocation["function"]], invocation)
                if error is not None:
                    errors.append(error)
    sdk = importlib.import_module("azure.functions")
    print(json.dumps({"functions": indexed, "azure_functions": sdk.__version__, "errors": errors}))


if __name__ == "__main__":
    main()
