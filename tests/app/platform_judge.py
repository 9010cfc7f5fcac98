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
"""

from __future__ import annotations

import argparse
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("coretools", "placeholder", "warm"), required=True)
    parser.add_argument("--app", required=True)
    parser.add_argument("--site", action="append", default=[], help="the worker's own packages (first wins)")
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
    indexed = {}
    for function in loader.index_function_app(os.path.join(args.app, "function_app.py")):
        registry.add_indexed_function(function, PROTOS)  # raises FunctionLoadError like the worker
        indexed[function.get_function_name()] = json.loads(function.get_function_json())
    sdk = importlib.import_module("azure.functions")
    print(json.dumps({"functions": indexed, "azure_functions": sdk.__version__}))


if __name__ == "__main__":
    main()
