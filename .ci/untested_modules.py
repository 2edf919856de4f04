"""Fails naming every module of the package that a test run (its .coverage data) never ran a
line of beyond its imports: no line inside any of its functions executed. Run after the fast
tier under coverage:

    python -m pytest -q -n 2 -m "not slow" --cov=shardflow --cov=passes --cov=models --cov=kernels \
        --cov-report= tests
    python .ci/untested_modules.py

Every .py file under the package's folders is checked, so a new module is checked from its
first commit."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import coverage

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("shardflow", "passes", "models", "kernels")  # shardflow/train and shardflow/rules among them


def function_lines(path: Path) -> set[int]:
    """The lines of the statements inside ``path``'s functions and methods: what importing the
    module does not run."""
    lines = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            body = node.body if isinstance(node.body, list) else [node.body]
            for stmt in body:
                lines.update(range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1))
    return lines


def untested(data: coverage.CoverageData) -> list[str]:
    measured = {Path(f).resolve(): f for f in data.measured_files()}
    out = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            inside = function_lines(path)
            if not inside:  # nothing but definitions and constants: importing it runs it all
                continue
            ran = set(data.lines(measured[path]) or ()) if path in measured else set()
            if not ran & inside:
                out.append(str(path.relative_to(ROOT)))
    return out


def main() -> int:
    data = coverage.CoverageData(basename=str(ROOT / ".coverage"))
    data.read()
    if not data.measured_files():
        print(f"no coverage data in {ROOT / '.coverage'}: run the fast tier under --cov first", file=sys.stderr)
        return 2
    missing = untested(data)
    for path in missing:
        print(f"{path}: no line beyond its imports ran in the tests", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
