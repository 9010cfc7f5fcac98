# mypy: ignore-errors
# (a checkov plug-in: checkov lives in .venv-infra, not in the app venv mypy runs in)
from __future__ import annotations

from checkov.common.models.enums import CheckCategories
from dbfanout_base import LiteralValueCheck


class ServiceBusTopicDuplicateDetection(LiteralValueCheck):
    """A topic poller re-sends a batch after a failed or ambiguous commit (W1/W5) with the same
    message id, as a queue poller does; without duplicate detection on the topic every subscription
    would get it twice. It can only be chosen when the topic is created."""

    def __init__(self) -> None:
        super().__init__(
            name="Service Bus topic detects duplicates: properties.requiresDuplicateDetection is literally true",
            id="CKV_DBF_6",
            categories=(CheckCategories.GENERAL_SECURITY,),
            supported_resources=("Microsoft.ServiceBus/namespaces/topics",),
        )

    def get_inspected_key(self) -> str:
        return "properties/requiresDuplicateDetection"

    def get_expected_value(self) -> bool:
        return True


check = ServiceBusTopicDuplicateDetection()
