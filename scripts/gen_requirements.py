"""Write ``requirements.txt`` from ``pyproject.toml``'s runtime dependencies.

Azure Functions remote build (Flex Consumption, ``func azure functionapp publish``) installs
``requirements.txt``, not the project metadata, so the file is generated and a test keeps it in
sync. ``azure-functions-worker`` is never listed: the platform provides the worker.

    python scripts/gen_requirements.py            # rewrite requirements.txt
    python scripts/gen_requirements.py --check    # exit 1 when the committed file is stale
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEADER = (
    "# Generated from pyproject.toml by scripts/gen_requirements.py - do not edit by hand.\n"
    "# Installed by the Azure Functions remote build. azure-functions-worker is provided by the platform.\n"
)
# Never deployed: the platform ships the worker, and these are the project's local-only tools.
EXCLUDED = {"azure-functions-worker"}


def _name(requirement: str) -> str:
    match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement)
    return (match.group(0) if match else requirement).lower().replace("_", "-")


def render(pyproject: Path = ROOT / "pyproject.toml") -> str:
    """The requirements.txt text for the runtime dependencies of ``pyproject``."""
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    deps = [d for d in project.get("dependencies", []) if _name(d) not in EXCLUDED]
    return HEADER + "".join(f"{d}\n" for d in sorted(deps, key=_name))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="fail if requirements.txt is out of date")
    parser.add_argument("--output", type=Path, default=ROOT / "requirements.txt")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.output.read_text(encoding="utf-8") if args.output.exists() else ""
        if current != text:
            print(f"{args.output} is out of date: run python scripts/gen_requirements.py", file=sys.stderr)
            return 1
        return 0
    args.output.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
