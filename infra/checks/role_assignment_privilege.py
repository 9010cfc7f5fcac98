# mypy: ignore-errors
# (a checkov plug-in: checkov lives in .venv-infra, not in the app venv mypy runs in)
from __future__ import annotations

import re
from typing import Any

from checkov.arm.base_resource_check import BaseResourceCheck
from checkov.common.models.enums import CheckCategories, CheckResult
from dbfanout_base import MISSING, get_path

# Built-in roles that are never needed by dbfanout: Owner, Contributor, Azure Service Bus Data Owner.
FORBIDDEN_ROLE_IDS = {
    "8e3af657-a8ff-443c-a75c-2fe8c4bcb635": "Owner",
    "b24988ac-6210-42ed-a3a3-c4c7c3b5d7ae": "Contributor",
    "090c5cfd-751d-490a-894a-3ce6f1109419": "Azure Service Bus Data Owner",
}
GUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")


def accessed(value: Any) -> Any:
    """`roles.owner` arrives as a property accessor on the inlined `roles` object: pick the member,
    so one role table in a `var` does not make every assignment look like every role."""
    operator = value.get("operator") if isinstance(value, dict) else None
    if isinstance(operator, dict) and operator.get("type") == "property_accessor":
        operands = operator.get("operands", {})
        target, member = accessed(operands.get("operand_1")), operands.get("operand_2")
        if isinstance(target, dict) and isinstance(member, str) and member in target:
            return accessed(target[member])
    return value


def strings_in(value: Any) -> list[str]:
    """Every string inside an expression tree as checkov renders it (variables already inlined)."""
    value = accessed(value)
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in strings_in(k) + strings_in(v)]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in strings_in(v)]
    return []


class NoPrivilegedRoleAssignment(BaseResourceCheck):
    """Fails a role assignment that grants Owner, Contributor or Azure Service Bus Data Owner.

    It also fails one whose role definition GUID cannot be read offline (for example a role id
    passed in as a parameter), because such an assignment could grant anything: write role ids as
    literal GUIDs or in a `var` of the same file.
    """

    def __init__(self) -> None:
        super().__init__(
            name="Role assignment grants a readable role that is not Owner, Contributor or Service Bus Data Owner",
            id="CKV_DBF_5",
            categories=(CheckCategories.IAM,),
            supported_resources=("Microsoft.Authorization/roleAssignments",),
        )

    def scan_resource_conf(self, conf: dict[str, Any]) -> CheckResult:
        role = get_path(conf, "properties/roleDefinitionId")
        if role is MISSING:
            return CheckResult.FAILED
        guids = {g.lower() for s in strings_in(role) for g in GUID.findall(s)}
        if not guids or guids & FORBIDDEN_ROLE_IDS.keys():
            return CheckResult.FAILED
        return CheckResult.PASSED


check = NoPrivilegedRoleAssignment()
