# mypy: ignore-errors
# (a checkov plug-in: checkov lives in .venv-infra, not in the app venv mypy runs in)
from __future__ import annotations

from checkov.common.models.enums import CheckCategories
from dbfanout_base import LiteralValueCheck


class ServiceBusLocalAuthDisabled(LiteralValueCheck):
    """SAS keys would bypass the per-queue Sender/Receiver roles: the namespace must accept Entra only."""

    def __init__(self) -> None:
        super().__init__(
            name="Service Bus namespace has SAS key auth disabled: properties.disableLocalAuth is literally true",
            id="CKV_DBF_1",
            categories=(CheckCategories.IAM,),
            supported_resources=("Microsoft.ServiceBus/namespaces",),
        )

    def get_inspected_key(self) -> str:
        return "properties/disableLocalAuth"

    def get_expected_value(self) -> bool:
        return True


check = ServiceBusLocalAuthDisabled()
