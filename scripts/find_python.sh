#!/usr/bin/env bash
# Prints the path of a working python<VERSION> (e.g. 3.13): on PATH, else a pyenv install (pyenv's
# shims refuse a version that is not selected). Exits 1 when this machine has none.
set -uo pipefail
version=${1:?usage: find_python.sh VERSION}
for candidate in "$(command -v "python$version" 2>/dev/null)" "$HOME"/.pyenv/versions/"$version".*/bin/"python$version"; do
  [ -n "$candidate" ] && [ -x "$candidate" ] || continue
  if "$candidate" -c 'import ssl, sqlite3, venv' >/dev/null 2>&1; then
    echo "$candidate"
    exit 0
  fi
done
exit 1
