# mypy: ignore-errors
# (a checkov plug-in: checkov lives in .venv-infra, not in the app venv mypy runs in)
from __future__ import annotations

from checkov.common.models.enums import CheckCategories
from dbfanout_base import LiteralValueCheck


class StorageSharedKeyDisabled(LiteralValueCheck):
    """An account key can rewrite the state blobs and break the lease/ETag fencing: keys stay off."""

    def __init__(self) -> None:
        super().__init__(
            name="Storage account forbids shared keys: properties.allowSharedKeyAccess is literally false",
            id="CKV_DBF_2",
            categories=(CheckCategories.IAM,),
            supported_resources=("Microsoft.Storage/storageAccounts",),
        )

    def get_inspected_key(self) -> str:
        return "properties/allowSharedKeyAccess"

    def get_expected_value(self) -> bool:
        return False


check = StorageSharedKeyDisabled()
