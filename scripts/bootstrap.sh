#!/usr/bin/env bash
# Installs what `make test` / `make demo` need, only when missing or out of date:
# a Python >= 3.11 virtualenv with dbfanout and its dev tools, and the pinned Azurite from npm.
# With --infra-gate (`make test`), also the offline infra gate's tools (checkov, tree-sitter-bicep)
# in their own virtualenv, INFRA_VENV (.venv-infra): checkov pins many packages, kept out of $VENV.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
INFRA_VENV=${INFRA_VENV:-.venv-infra}
with_infra_gate=0
for arg in "$@"; do
  case "$arg" in
    --infra-gate) with_infra_gate=1 ;;
    *) echo "usage: scripts/bootstrap.sh [--infra-gate]" >&2; exit 2 ;;
  esac
done

pick_python() {
  for candidate in "${PYTHON:-}" python3.13 python3.12 python3.11 python3; do
    [ -n "$candidate" ] || continue
    if command -v "$candidate" >/dev/null 2>&1 &&
       "$candidate" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null; then
      echo "$candidate"; return 0
    fi
  done
  echo "dbfanout needs Python >= 3.11 (set PYTHON=/path/to/python3.11)" >&2
  return 1
}

if [ ! -x "$VENV/bin/python" ]; then
  py=$(pick_python)
  echo "bootstrap: creating $VENV with $py"
  "$py" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi
stamp="$VENV/.dbfanout-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "bootstrap: installing dbfanout and dev tools into $VENV"
  "$VENV/bin/python" -m pip install -q -e '.[dev]'
  touch "$stamp"
fi
if [ ! -x node_modules/.bin/azurite ] || [ package-lock.json -nt node_modules/.package-lock.json ]; then
  command -v npm >/dev/null 2>&1 || { echo "bootstrap: Node.js >= 18 with npm is required (for Azurite)" >&2; exit 1; }
  echo "bootstrap: installing the pinned Azurite (npm ci)"
  npm ci --no-audit --no-fund --loglevel=error
fi

# The infra gate's tools: a failed install (no package registry) leaves the gate's tests to skip,
# with this reason in the run's skip summary, rather than failing the whole `make test`.
infra_stamp="$INFRA_VENV/.dbfanout-installed"
if [ "$with_infra_gate" = 1 ] && [ -f infra/requirements-validate.txt ] &&
   { [ ! -f "$infra_stamp" ] || [ infra/requirements-validate.txt -nt "$infra_stamp" ]; }; then
  echo "bootstrap: installing the offline infra gate's tools into $INFRA_VENV (once, ~1-2 min)"
  if { [ -x "$INFRA_VENV/bin/python" ] || "$(pick_python)" -m venv "$INFRA_VENV"; } &&
     "$INFRA_VENV/bin/python" -m pip install -q -r infra/requirements-validate.txt; then
    touch "$infra_stamp"
  else
    echo "bootstrap: could not install the infra gate's tools into $INFRA_VENV: tests/infra's gate tests will skip" >&2
  fi
fi
