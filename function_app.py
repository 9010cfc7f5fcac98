"""The Azure Functions app (Python v2 model): it only registers functions (STYLE R12).

One timer per poller (``poll_<poller>``) and one Service Bus trigger per queue
(``work_<queue>``), all read from ``dbfanout.toml`` (or the file ``DBFANOUT_CONFIG`` names).
Importing this module reads the config and opens no connection.
"""

from __future__ import annotations

from pathlib import Path

import azure.functions as func

from poller.functions import poller_blueprint
from poller.runtime import Runtimes
from shared.config import load_config
from shared.settings import load_settings
from worker.functions import WorkerApp, worker_blueprint

APP_ROOT = Path(__file__).resolve().parent

app = func.FunctionApp()
config = load_config(app_root=APP_ROOT, settings=load_settings(APP_ROOT))
_runtimes = Runtimes(config)  # built lazily on the first tick / message: indexing opens nothing
_worker_app = WorkerApp(config, app_root=APP_ROOT)
app.register_functions(poller_blueprint(config, _runtimes))
app.register_functions(worker_blueprint(config, _worker_app))


def shutdown() -> None:
    """Close database engines, senders and clients (``dbfanout run`` calls it on a graceful stop)."""
    _runtimes.close()
    _worker_app.close()
