"""The queue side: decode batches, run user handlers, split failing messages, settle."""

from worker.runtime import Delivery, Worker
from worker.settlement import Settle, decide
from worker.split import Splitter

__all__ = ["Delivery", "Settle", "Splitter", "Worker", "decide"]
