"""docs/cases.md against the tests, and no pointer from code or tests to a document outside the repository."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = ROOT / "docs" / "cases.md"
CASE_ID = re.compile(r"(?:TR|T|X|S|H|R)\d+")


def _test_functions() -> dict[str, ast.FunctionDef]:
    """Every ``tests/test_*.py::test_*`` function, keyed by that path."""
    found = {}
    for f in sorted((ROOT / "tests").glob("test_*.py")):
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                found[f"tests/{f.name}::{node.name}"] = node
    return found


def _table() -> dict[str, list[str]]:
    """docs/cases.md's rows: case ID → the tests listed for it."""
    rows = {}
    for line in CASES.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and CASE_ID.fullmatch(cells[0]):
            rows[cells[0]] = re.findall(r"`([^`]+::[^`]+)`", cells[2])
    return rows


def test_every_listed_test_exists_and_every_case_has_one():
    tests, table = _test_functions(), _table()
    assert len(table) >= 39, f"docs/cases.md lists only {len(table)} cases"
    for case, listed in table.items():
        assert listed, f"case {case} has no test in docs/cases.md"
        missing = [t for t in listed if t not in tests]
        assert not missing, f"docs/cases.md lists tests that do not exist for {case}: {missing}"


def test_every_test_named_for_a_case_is_listed_under_it():
    table = _table()
    for path, node in _test_functions().items():
        named = {p.upper() for p in node.name.split("_")[1:] if CASE_ID.fullmatch(p.upper())}
        for case in named:
            assert case in table, f"{path} names case {case}, which docs/cases.md does not have"
            assert path in table[case], f"{path} names case {case} but docs/cases.md does not list it there"


def test_nothing_points_to_a_design_document_outside_the_repository():
    offenders = []
    for folder in ("train", "export", "serve", "tests", "benchmarks", "rust_runtime/src"):
        for f in (ROOT / folder).rglob("*"):
            if f.suffix not in {".py", ".rs", ".sh", ".md"} or f == Path(__file__):
                continue
            text = f.read_text(encoding="utf-8", errors="replace")
            for bad in ("DESIGN.md", "bugs.md", "shared/cases", "shared/notes"):
                if bad in text:
                    offenders.append(f"{f.relative_to(ROOT)}: {bad}")
    assert not offenders, "point to docs/design.md or docs/cases.md instead: " + "; ".join(offenders)
