"""``dbfanout demo``: the whole pipeline on one machine, with a poison row and a DLQ replay.

Azurite (state blobs) and the Service Bus emulator start on free ports; a writer thread changes a
SQLite ``orders`` table; the real ``function_app.py`` runs under ``dbfanout run``; the demo
handler replicates into a SQLite target; the summary checks the target against the source.
"""

from dbfanout.demo.runner import DemoOptions, run_demo

__all__ = ["DemoOptions", "run_demo"]
