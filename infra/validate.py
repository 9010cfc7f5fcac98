#!/usr/bin/env python3
"""Offline gate for the Bicep templates in infra/ (no Bicep compiler, no network).

    python infra/validate.py                 # the repository's infra/, config from the repo root
    python infra/validate.py DIR [DIR ...]   # other copies (tests break copies on purpose)
    python infra/validate.py --json ...      # machine-readable: {dir: [problem, ...]}

Gates, each reported with the file and what failed:

1. syntax       every .bicep parses with tree-sitter-bicep: no ERROR and no MISSING node.
2. suppression  every inline `// checkov:skip=CKV_...: reason` gives a reason.
3. checkov      `checkov --framework bicep --skip-download` with CKV_PARSE_ERROR_FAIL=true and
                the custom checks in infra/checks: zero failed checks, zero files it cannot parse,
                and every custom check ran on at least one resource (a check that failed to load,
                or a resource type that was misspelled, would otherwise pass in silence).
4. consistency  infra/consistency.py: app settings, parameters, topics, roles and their scopes,
                outputs, and the config (--config PATH, repeatable; by default dbfanout.toml at the
                repository root, else dbfanout.toml.sample), including parameters entries no
                config names. Its warnings (for example a subscription no configured handler
                consumes) are printed but do not fail. This gate alone, without checkov or
                tree-sitter: `python infra/consistency.py` (any Python 3.11+).

Needs tree-sitter, tree-sitter-bicep and checkov (infra/requirements-validate.txt). Run from
another interpreter, it re-executes itself with the repository's .venv-infra when that exists.
Exit status: 0 clean (warnings allowed), 1 problems found, 2 tools missing.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
INFRA_VENV = REPO / ".venv-infra"
CUSTOM_CHECKS = ("CKV_DBF_1", "CKV_DBF_2", "CKV_DBF_3", "CKV_DBF_4", "CKV_DBF_5", "CKV_DBF_6")
_SKIP = re.compile(r"checkov:skip=(?P<id>[A-Z0-9_]+)(?P<rest>.*)")
_MIN_REASON = 15

try:  # the gate's own venv has these; imported by name so the app's type checker needs no stubs
    tree_sitter: Any = importlib.import_module("tree_sitter")
    tree_sitter_bicep: Any = importlib.import_module("tree_sitter_bicep")
except ImportError:  # pragma: no cover - depends on the interpreter
    tree_sitter = tree_sitter_bicep = None

sys.path.insert(0, str(HERE))
import consistency  # noqa: E402


@dataclass(frozen=True)
class Problem:
    gate: str
    check: str
    file: str
    message: str
    severity: str = "error"  # or "warning": printed, does not fail the gate

    def __str__(self) -> str:
        prefix = "WARNING " if self.severity == "warning" else ""
        return f"{prefix}{self.gate.upper()} {self.check} {self.file}: {self.message}"


def reexec_in_infra_venv() -> None:
    python = INFRA_VENV / "bin" / "python"
    if python.exists() and not os.environ.get("DBFANOUT_VALIDATE_REEXEC"):
        os.environ["DBFANOUT_VALIDATE_REEXEC"] = "1"
        os.execv(str(python), [str(python), __file__, *sys.argv[1:]])
    print(
        "validate.py: tree-sitter / tree-sitter-bicep missing. Install the gate's tools:\n"
        f"  python -m venv {INFRA_VENV} && {INFRA_VENV}/bin/pip install -r infra/requirements-validate.txt",
        file=sys.stderr,
    )
    sys.exit(2)


# ------------------------------------------------------------------------------------ 1. syntax


def syntax_problems(infra: Path) -> list[Problem]:
    parser = tree_sitter.Parser(tree_sitter.Language(tree_sitter_bicep.language()))
    problems: list[Problem] = []
    files = sorted(infra.rglob("*.bicep"))
    if not files:
        return [Problem("syntax", "no-files", str(infra), "no .bicep file found")]
    for path in files:
        source = path.read_bytes()
        tree = parser.parse(source)
        stack = [tree.root_node]
        while stack:
            node = stack.pop()
            if node.type == "ERROR" or node.is_missing:
                row, col = node.start_point
                what = (
                    f"missing {node.type}"
                    if node.is_missing
                    else ("cannot parse " + repr(source[node.start_byte : node.end_byte][:60].decode(errors="replace")))
                )
                problems.append(Problem("syntax", "tree-sitter-bicep", f"{path}:{row + 1}:{col + 1}", what))
                continue  # one report per broken region
            stack.extend(reversed(node.children))
    return problems


# ------------------------------------------------------------------------------- 2. suppression


def suppression_problems(infra: Path) -> list[Problem]:
    problems: list[Problem] = []
    for path in sorted(infra.rglob("*.bicep")):
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            m = _SKIP.search(line)
            if m and len(m.group("rest").lstrip(": ").strip()) < _MIN_REASON:
                problems.append(
                    Problem(
                        "suppression",
                        m.group("id"),
                        f"{path}:{n}",
                        "checkov:skip without a reason (write `// checkov:skip=ID: why`)",
                    )
                )
    return problems


# ----------------------------------------------------------------------------------- 3. checkov


def checkov_executable() -> str:
    beside = Path(sys.executable).parent / "checkov"
    found = str(beside) if beside.exists() else shutil.which("checkov")
    if not found:
        print("validate.py: checkov missing: pip install -r infra/requirements-validate.txt", file=sys.stderr)
        sys.exit(2)
    return found


def json_documents(text: str) -> list[object]:
    """checkov may print several JSON documents one after another (one per -d / framework)."""
    decoder, docs, pos = json.JSONDecoder(), [], 0
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos >= len(text):
            break
        doc, pos = decoder.raw_decode(text, pos)
        docs.append(doc)
    if not docs:
        raise ValueError("no JSON output")
    return docs


def checkov_problems(dirs: list[Path], checks_dir: Path) -> dict[Path, list[Problem]]:
    """checkov on each directory, as many at once as there are cores.

    One run per directory: checkov's Bicep graph resolves variables by name across every file it
    scans, so two copies of the same templates in one run would read each other's values.
    """
    with ThreadPoolExecutor(max_workers=max(1, min(len(dirs), os.cpu_count() or 1))) as pool:
        return dict(zip(dirs, pool.map(lambda d: _checkov_run(d, checks_dir), dirs), strict=True))


def _checkov_run(infra: Path, checks_dir: Path) -> list[Problem]:
    cmd = [
        checkov_executable(),
        "--framework",
        "bicep",
        "--skip-download",
        "--compact",
        "--external-checks-dir",
        str(checks_dir),
        "-o",
        "json",
        "-d",
        str(infra),
    ]
    env = {**os.environ, "CKV_PARSE_ERROR_FAIL": "true", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    try:
        docs = json_documents(proc.stdout)
    except ValueError:
        return [
            Problem(
                "checkov",
                "run",
                str(infra),
                f"checkov exit {proc.returncode}, unreadable output: {(proc.stderr or proc.stdout)[-800:]}",
            )
        ]
    reports = [r for doc in docs for r in (doc if isinstance(doc, list) else [doc]) if isinstance(r, dict)]
    problems: list[Problem] = []
    ran: set[str] = set()
    for report in reports:
        results = report.get("results", {})
        for path in results.get("parsing_errors", []):
            problems.append(
                Problem(
                    "checkov",
                    "parse-error",
                    path,
                    "checkov's Bicep parser cannot read this file (newer syntax?); its resources would go unchecked",
                )
            )
        for record in results.get("failed_checks", []):
            line = (record.get("file_line_range") or ["?"])[0]
            problems.append(
                Problem(
                    "checkov",
                    record["check_id"],
                    f"{record.get('file_abs_path')}:{line}",
                    f"{record.get('resource')}: {record.get('check_name')}",
                )
            )
        for key in ("passed_checks", "failed_checks", "skipped_checks"):
            ran |= {record["check_id"] for record in results.get(key, [])}
    for check_id in CUSTOM_CHECKS:
        if check_id not in ran:
            problems.append(
                Problem(
                    "checkov",
                    check_id,
                    str(infra),
                    "custom check never ran: it failed to load or no resource of its type was found",
                )
            )
    if proc.returncode not in (0, 1) or (proc.returncode == 1 and not problems):
        problems.append(Problem("checkov", "run", str(infra), f"checkov exit {proc.returncode}: {proc.stderr[-800:]}"))
    return problems


# ------------------------------------------------------------------------------- 4. consistency


def default_configs() -> list[Path]:
    return consistency.default_configs(REPO)


def consistency_problems(infra: Path, configs: list[Path]) -> list[Problem]:
    return [
        Problem("consistency", p.check, p.where, p.message, p.severity) for p in consistency.check_all(infra, configs)
    ]


# ---------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="*", type=Path, help="infra directories (default: this script's)")
    ap.add_argument(
        "--config",
        action="append",
        type=Path,
        default=None,
        help="dbfanout.toml to check the parameters against (repeatable)",
    )
    ap.add_argument("--checks-dir", type=Path, default=HERE / "checks", help="custom checkov checks")
    ap.add_argument("--skip-checkov", action="store_true", help="syntax, suppression and consistency only")
    ap.add_argument("--json", action="store_true", help="print {dir: [problem, ...]} as JSON")
    args = ap.parse_args(argv)
    if tree_sitter is None:
        reexec_in_infra_venv()
    dirs = [d.resolve() for d in (args.dirs or [HERE])]
    configs = args.config if args.config is not None else default_configs()

    found: dict[Path, list[Problem]] = {}
    for d in dirs:
        found[d] = syntax_problems(d) + suppression_problems(d) + consistency_problems(d, configs)
    if not args.skip_checkov:
        for d, problems in checkov_problems(dirs, args.checks_dir.resolve()).items():
            found[d] += problems

    if args.json:
        print(json.dumps({str(d): [asdict(p) for p in ps] for d, ps in found.items()}, indent=2))
    else:
        for d, problems in found.items():
            for p in problems:
                print(p)
            gates = "syntax, suppressions, consistency" + ("" if args.skip_checkov else ", checkov")
            errors = len(_errors(problems))
            warnings = f", {len(problems) - errors} warning(s)" if len(problems) > errors else ""
            print(f"{d}: {'FAILED, ' + str(errors) + ' problem(s)' if errors else 'OK'}{warnings} ({gates})")
    return 1 if any(_errors(ps) for ps in found.values()) else 0


def _errors(problems: list[Problem]) -> list[Problem]:
    return [p for p in problems if p.severity != "warning"]


if __name__ == "__main__":
    sys.exit(main())
