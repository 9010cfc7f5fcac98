"""What the poller, the worker and user handlers share: the handler API, models and errors."""

from shared import errors as _errors
from shared.errors import *  # noqa: F403 - every public error, as shared.errors.__all__ lists them
from shared.models import Batch, Checkpoint, HandlerContext, Lease, Position, RowChange, StateDoc

__all__ = [
    *_errors.__all__,
    "Batch",
    "Checkpoint",
    "HandlerContext",
    "Lease",
    "Position",
    "RowChange",
    "StateDoc",
]
