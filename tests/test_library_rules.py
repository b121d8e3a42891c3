"""Rules the whole library keeps, read from its source: no runtime assert (they vanish under
``python -O``), and no ``gc.collect()`` call outside the watchdog's opt-in audit."""

from __future__ import annotations

import ast
from pathlib import Path

import refitkit

PACKAGE = Path(refitkit.__file__).parent


def _modules() -> list[tuple[str, ast.Module]]:
    return [(str(path.relative_to(PACKAGE.parent)), ast.parse(path.read_text(), str(path))) for path in sorted(PACKAGE.rglob("*.py"))]


def test_the_library_has_no_runtime_asserts():
    found = [f"{name}:{node.lineno}" for name, tree in _modules() for node in ast.walk(tree) if isinstance(node, ast.Assert)]
    assert found == [], f"assert statements (gone under python -O): raise refitkit's own errors instead: {found}"


def test_only_the_watchdog_audit_calls_gc_collect():
    calls = []
    for name, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "collect":
                if isinstance(node.func.value, ast.Name) and node.func.value.id == "gc":
                    calls.append(f"{name}:{node.lineno}")
    assert all(call.startswith("refitkit/watchdog/") for call in calls), calls


def test_the_suites_own_asserts_still_check_under_python_O():
    # make test runs this suite with `python -O`: a test whose asserts vanished would pass vacuously
    import pytest

    with pytest.raises(AssertionError):
        assert 1 == 2
