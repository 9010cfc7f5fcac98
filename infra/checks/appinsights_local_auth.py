# mypy: ignore-errors
# (a checkov plug-in: checkov lives in .venv-infra, not in the app venv mypy runs in)
from __future__ import annotations

from checkov.common.models.enums import CheckCategories
from dbfanout_base import LiteralValueCheck


class AppInsightsLocalAuthDisabled(LiteralValueCheck):
    """Telemetry ingestion needs an Entra token (APPLICATIONINSIGHTS_AUTHENTICATION_STRING), not the key."""

    def __init__(self) -> None:
        super().__init__(
            name="Application Insights has local auth disabled: properties.DisableLocalAuth is literally true",
            id="CKV_DBF_4",
            categories=(CheckCategories.IAM,),
            supported_resources=("Microsoft.Insights/components",),
        )

    def get_inspected_key(self) -> str:
        return "properties/DisableLocalAuth"

    def get_expected_value(self) -> bool:
        return True


check = AppInsightsLocalAuthDisabled()
