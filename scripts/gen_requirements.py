"""Write ``requirements.txt`` from ``pyproject.toml``'s runtime dependencies.

Azure Functions remote build (Flex Consumption, ``func azure functionapp publish``) installs
``requirements.txt``, not the project metadata, so the file is generated and a test keeps it in
sync. ``azure-functions-worker`` is never listed: the platform provides the worker.

Database drivers are yours to choose, so they live in ``requirements-drivers.txt`` (edit it by
hand; the generated file includes it with ``-r``, which pip, and so the remote build, resolves
relative to ``requirements.txt``). ``dbfanout[postgres]`` cannot go there: dbfanout itself is not
on a package registry, so a remote build cannot resolve it; name the driver package instead.

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
DRIVERS_FILE = "requirements-drivers.txt"


def _name(requirement: str) -> str:
    match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement)
    return (match.group(0) if match else requirement).lower().replace("_", "-")


def render(pyproject: Path = ROOT / "pyproject.toml") -> str:
    """The requirements.txt text for the runtime dependencies of ``pyproject``."""
    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    deps = [d for d in project.get("dependencies", []) if _name(d) not in EXCLUDED]
    body = "".join(f"{d}\n" for d in sorted(deps, key=_name))
    return f"{HEADER}{body}# Your database drivers (edit {DRIVERS_FILE}, not this file):\n-r {DRIVERS_FILE}\n"


def driver_problems(drivers: Path) -> list[str]:
    """What in ``requirements-drivers.txt`` a remote build could not install."""
    if not drivers.exists():
        return [f"{drivers} is missing: requirements.txt includes it (create it, even empty)"]
    problems = []
    for n, line in enumerate(drivers.read_text(encoding="utf-8").splitlines(), 1):
        requirement = line.split("#", 1)[0].strip()
        if requirement and _name(requirement) == "dbfanout":
            problems.append(
                f"{drivers.name}:{n}: {requirement!r} cannot resolve in a remote build (dbfanout is not on a "
                "package registry); name the driver itself, e.g. psycopg[binary]>=3.1,<4 or pymysql>=1.1,<2"
            )
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="fail if requirements.txt is out of date")
    parser.add_argument("--output", type=Path, default=ROOT / "requirements.txt")
    args = parser.parse_args(argv)
    text = render()
    problems = driver_problems(args.output.with_name(DRIVERS_FILE))
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        return 1
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
