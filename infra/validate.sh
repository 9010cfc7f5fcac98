#!/usr/bin/env bash
# Offline Bicep gate (see infra/validate.py): syntax, suppressions, checkov + custom checks, consistency.
# Needs .venv-infra: python3 -m venv .venv-infra && .venv-infra/bin/pip install -r infra/requirements-validate.txt
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
exec "$root/.venv-infra/bin/python" "$root/infra/validate.py" "$@"
