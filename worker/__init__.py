"""The queue side: decode batches, run user handlers, split failing messages, settle; hooks observe."""

from worker.hooks import Hook
from worker.runtime import Delivery, Worker
from worker.settlement import Settle, decide
from worker.split import Splitter

__all__ = ["Delivery", "Hook", "Settle", "Splitter", "Worker", "decide"]
