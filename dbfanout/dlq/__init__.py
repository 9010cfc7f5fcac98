"""The dead-letter feature of the operator side, in one place: ``dbfanout dlq peek|export|replay|purge``.

- :mod:`~dbfanout.dlq.command` — the ``dlq`` command group (flags, confirmation, exit codes);
  :mod:`~dbfanout.dlq.render` — its tables and reports.
- :mod:`~dbfanout.dlq.selection` — which messages a command acts on, and the receive scan.
- :mod:`~dbfanout.dlq.deadletter` — a Service Bus dead-letter queue: peek, export, purge.
- :mod:`~dbfanout.dlq.replay` — replay that cannot lose a message (send, then complete).
- :mod:`~dbfanout.dlq.poison` — a storage queue's ``-poison`` queue behind the same commands.
- :mod:`~dbfanout.dlq.explain` — each dead letter joined to its failure record.
- :mod:`~dbfanout.dlq.timeparse` — ``--since`` and ``--older-than``.

The worker's side stays where the Functions app can import it: :mod:`shared.failures` writes the
failure records (``dbfanout/`` is not deployed); :mod:`dbfanout.ops.bus` holds the Service Bus
views that ``status`` and ``validate`` share.
"""

__all__: list[str] = []
