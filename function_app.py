"""The Azure Functions app (Python v2 model): it only registers functions (STYLE R12).

One timer per poller (``poll_<poller>``), one Service Bus trigger per queue (``work_<queue>``)
and one per topic subscription (``work_<topic>_<subscription>``), all read from ``dbfanout.toml``
(or the file ``DBFANOUT_CONFIG`` names).
Importing this module reads the config and opens no connection.
"""

# ruff: noqa: E402  -- the app's imports must follow _own_packages_first()
from __future__ import annotations

import atexit
import gc
import sys
from pathlib import Path

APP_ROOT = Path(__file__).resolve().parent


def _own_packages_first() -> None:
    """Make ``poller``, ``worker`` and ``shared`` resolve to this folder's packages in every launch mode.

    Core Tools starts the platform's Python worker as ``<workers>/python/3.x/.../worker.py``, so that
    folder (holding a plain module ``worker``) is ``sys.path[0]``; in placeholder mode (Flex / Linux
    Consumption cold start) the app folder is only appended after it. Putting this folder first makes
    both look like the warm ``python -m azure_functions_worker`` start, where the app folder (the
    working directory) already is ``sys.path[0]``.
    """
    root = str(APP_ROOT)
    if sys.path[:1] != [root]:
        while root in sys.path:
            sys.path.remove(root)
        sys.path.insert(0, root)
    loaded = sys.modules.get("worker")
    if loaded is not None and not hasattr(loaded, "__path__"):
        del sys.modules["worker"]  # a plain module (the platform's launcher), not our package


_own_packages_first()

import azure.functions as func

from poller.functions import poller_blueprint
from poller.runtime import Runtimes
from shared.config import load_config
from shared.otel_setup import configure_telemetry, shutdown_telemetry
from shared.settings import load_settings
from worker.functions import WorkerApp, worker_blueprint

app = func.FunctionApp()
_settings = load_settings(APP_ROOT)
# Metrics and spans to Azure Monitor (APPLICATIONINSIGHTS_CONNECTION_STRING) or OTLP
# (OTEL_EXPORTER_OTLP_ENDPOINT); nothing when neither is set. Opens no connection here.
configure_telemetry(_settings)
# Lenient: a poller whose source_url setting is missing fails its own ticks; the rest still run.
config = load_config(app_root=APP_ROOT, settings=_settings, lenient_settings=True)
_runtimes = Runtimes(config)  # built lazily on the first tick / message: indexing opens nothing
_worker_app = WorkerApp(config, app_root=APP_ROOT)
app.register_functions(poller_blueprint(config, _runtimes))
app.register_functions(worker_blueprint(config, _worker_app))
# What was built so far (the modules and SDKs, the config) lives as long as the process: keep it
# out of the cyclic collector, whose full collections would otherwise scan it again every few
# thousand events a busy tick or handler builds (about 25 ms each, a live change's latency during
# a snapshot or a catch-up: BENCHMARKS.md, snapshots).
gc.collect()
gc.freeze()
# A busy tick or batch allocates tens of thousands of short-lived containers, which refcounting
# frees; a young-generation pass every 700 of them mostly scans objects about to die. Every
# 20,000 costs a tenth to a sixth less CPU per change (BENCHMARKS.md, issue 41); a higher
# threshold the process already set is kept.
_young, *_older = gc.get_threshold()
gc.set_threshold(max(_young, 20_000), *_older)


def shutdown() -> None:
    """Release the pollers' kept leases, close engines, senders and clients (idempotent).

    ``dbfanout run`` calls it on a graceful stop. The Azure Functions Python worker (4.x) offers
    the app no shutdown callback: it has no handler for the host's WorkerTerminate message and
    installs no signal handler, so ``atexit`` (registered below) runs only when its interpreter
    exits normally. A worker the host kills runs nothing: its leases lapse after
    ``lease_ttl_seconds`` (docs/operations.md, sticky leases).
    """
    _runtimes.close()
    _worker_app.close()
    shutdown_telemetry()  # flush what an SDK exporter still holds


atexit.register(shutdown)
