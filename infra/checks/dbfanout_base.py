# mypy: ignore-errors
# (a checkov plug-in: checkov lives in .venv-infra, not in the app venv mypy runs in)
"""Shared base for dbfanout's checkov checks.

Checkov hands a Bicep resource over as a dict. A resource under a condition
(`= if (x) {...}`) or a loop (`= [for ...: {...}]`) arrives wrapped in
{"condition"/"loop_type", "config": {...}}; checkov's own ARM base only unwraps the loop, so
these checks unwrap both, or a property hidden behind a condition would pass unseen.

Values must be literal: an expression (a parameter, a ternary) cannot be proven safe offline, so
it fails. Keys are matched case-insensitively, as Bicep and ARM do.
"""

from __future__ import annotations

from typing import Any

from checkov.arm.base_resource_value_check import BaseResourceValueCheck
from checkov.common.models.enums import CheckResult

MISSING = object()


def unwrap(conf: Any) -> Any:
    """The resource body inside any condition / loop wrappers."""
    while isinstance(conf, dict) and "config" in conf and ("condition" in conf or "loop_type" in conf):
        conf = conf["config"]
    return conf


def get_path(conf: Any, path: str) -> Any:
    """Value at 'a/b/c' (case-insensitive keys), or MISSING."""
    value = unwrap(conf)
    for key in path.split("/"):
        if not isinstance(value, dict):
            return MISSING
        match = [k for k in value if isinstance(k, str) and k.lower() == key.lower()]
        if not match:
            return MISSING
        value = value[match[0]]
    return value


class LiteralValueCheck(BaseResourceValueCheck):
    """Passes only when the inspected key holds exactly the expected literal (bool compared by identity)."""

    def scan_resource_conf(self, conf: dict[str, Any]) -> CheckResult:
        value = get_path(conf, self.get_inspected_key())
        if isinstance(value, list) and len(value) == 1:  # the ARM parser wraps scalars in lists
            value = value[0]
        expected = self.get_expected_value()
        if value is MISSING:
            return CheckResult.FAILED
        if isinstance(expected, bool):
            return CheckResult.PASSED if value is expected else CheckResult.FAILED
        return CheckResult.PASSED if value == expected else CheckResult.FAILED
