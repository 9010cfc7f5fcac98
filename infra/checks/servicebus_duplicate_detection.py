# mypy: ignore-errors
# (a checkov plug-in: checkov lives in .venv-infra, not in the app venv mypy runs in)
from __future__ import annotations

from checkov.common.models.enums import CheckCategories
from dbfanout_base import LiteralValueCheck


class ServiceBusQueueDuplicateDetection(LiteralValueCheck):
    """A batch re-sent after a failed or ambiguous commit (W1/W5) carries the same message id; only
    duplicate detection drops it. It can only be chosen when the queue is created."""

    def __init__(self) -> None:
        super().__init__(
            name="Service Bus queue detects duplicates: properties.requiresDuplicateDetection is literally true",
            id="CKV_DBF_3",
            categories=(CheckCategories.GENERAL_SECURITY,),
            supported_resources=("Microsoft.ServiceBus/namespaces/queues",),
        )

    def get_inspected_key(self) -> str:
        return "properties/requiresDuplicateDetection"

    def get_expected_value(self) -> bool:
        return True


check = ServiceBusQueueDuplicateDetection()
