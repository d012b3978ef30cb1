"""Every unit test module carries ``pytest.mark.unit`` and a timeout at module level, so
``pytest -m unit`` runs all of them and none can hang CI. Read from the source with ``ast``:
a new tests/unit/test_*.py without the markers fails here, naming the file."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

UNIT = Path(__file__).resolve().parent
MIN_TIMEOUT_S = 60


def marker_name(node: ast.expr) -> str | None:
    """``unit`` for ``pytest.mark.unit``, ``timeout`` for ``pytest.mark.timeout(60)``."""
    if isinstance(node, ast.Call):
        node = node.func
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "mark"
            and isinstance(node.value.value, ast.Name) and node.value.value.id == "pytest"):
        return node.attr
    return None


def elements(value: ast.expr) -> list[ast.expr]:
    return list(value.elts) if isinstance(value, (ast.List, ast.Tuple)) else [value]


def module_marks(path: Path) -> list[ast.expr]:
    """The marker expressions of the module-level ``pytestmark`` (the last assignment, plus any ``+=``)."""
    marks: list[ast.expr] = []
    for stmt in ast.parse(path.read_text(), filename=str(path)).body:
        if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in stmt.targets):
            marks = elements(stmt.value)
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == "pytestmark" and stmt.value:
            marks = elements(stmt.value)
        elif isinstance(stmt, ast.AugAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == "pytestmark":
            marks += elements(stmt.value)
    return marks


def timeout_s(mark: ast.expr) -> float | None:
    if marker_name(mark) == "timeout" and isinstance(mark, ast.Call) and mark.args and isinstance(mark.args[0], ast.Constant):
        return mark.args[0].value
    return None


def unit_files() -> list[Path]:
    files = sorted(UNIT.glob("test_*.py"))
    assert len(files) > 10, f"found only {len(files)} unit test files under {UNIT}"
    return files


def test_every_unit_test_module_is_marked_unit():
    missing = [p.name for p in unit_files() if "unit" not in {marker_name(m) for m in module_marks(p)}]
    assert not missing, f"add pytest.mark.unit to the module-level pytestmark of: {', '.join(missing)}"


def test_every_unit_test_module_has_a_timeout_of_at_least_a_minute():
    bad = []
    for p in unit_files():
        limits = [t for t in map(timeout_s, module_marks(p)) if t is not None]
        if not limits or min(limits) < MIN_TIMEOUT_S:
            bad.append(f"{p.name} ({limits[0] if limits else 'none'})")
    assert not bad, f"give these a module-level pytest.mark.timeout({MIN_TIMEOUT_S}) or more: {', '.join(bad)}"


def test_the_guard_reads_markers_as_pytest_would(tmp_path):
    cases = {
        "pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]\n": ("unit", 60),
        "pytestmark = pytest.mark.timeout(30)\n": (None, 30),
        "pytestmark = pytest.mark.ray\npytestmark += [pytest.mark.unit]\n": ("unit", None),
        "def f():\n    pytestmark = pytest.mark.unit\n": (None, None),  # not module level
    }
    for i, (source, (unit, limit)) in enumerate(cases.items()):
        path = tmp_path / f"test_{i}.py"
        path.write_text(source)
        marks = module_marks(path)
        assert ("unit" if "unit" in {marker_name(m) for m in marks} else None) == unit, source
        assert next((t for t in map(timeout_s, marks) if t is not None), None) == limit, source
