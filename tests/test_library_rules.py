"""Rules the whole library keeps, read from its source: no runtime assert (they vanish under
``python -O``), no ``gc.collect()`` call outside the watchdog's opt-in audit, and no API newer than the
Python that ``setup.cfg`` declares."""

from __future__ import annotations

import ast
import configparser
import re
from pathlib import Path

import refitkit

PACKAGE = Path(refitkit.__file__).parent
ROOT = Path(__file__).resolve().parents[1]

# APIs whose use needs a newer Python than some still-supported one: name -> the first Python that has it.
# On an older Python each fails only when reached, often inside an error handler, where the AttributeError
# then hides the failure being reported.
NEWER_PYTHON_APIS = {
    "add_note": (3, 11),  # BaseException.add_note
    "ExceptionGroup": (3, 11),
    "BaseExceptionGroup": (3, 11),
    "except*": (3, 11),
    "tomllib": (3, 11),
    "StrEnum": (3, 11),  # enum.StrEnum
    "TaskGroup": (3, 11),  # asyncio.TaskGroup
    "Self": (3, 11),  # typing.Self
    "UTC": (3, 11),  # datetime.UTC
}


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


def _declared_python() -> tuple[tuple[int, int], list[tuple[int, int]]]:
    """setup.cfg's ``python_requires`` floor and its ``Programming Language :: Python :: 3.N`` classifiers."""
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    requires = config["options"]["python_requires"].strip()
    match = re.fullmatch(r">=\s*3\.(\d+)", requires)
    assert match is not None, f"python_requires {requires!r}: expected the form >=3.N"
    classifiers = re.findall(r"Programming Language :: Python :: 3\.(\d+)$", config["metadata"]["classifiers"], re.MULTILINE)
    return (3, int(match[1])), sorted((3, int(minor)) for minor in classifiers)


def _newer_apis_used() -> dict[str, list[str]]:
    used: dict[str, list[str]] = {}
    for name, tree in _modules():
        for node in ast.walk(tree):
            found: list[str] = []
            if isinstance(node, ast.Attribute):
                found = [node.attr]
            elif isinstance(node, ast.Name):
                found = [node.id]
            elif isinstance(node, ast.Import):
                found = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                found = [node.module or ""] + [alias.name for alias in node.names]
            elif type(node).__name__ == "TryStar":
                found = ["except*"]
            for api in found:
                if api in NEWER_PYTHON_APIS:
                    used.setdefault(api, []).append(f"{name}:{node.lineno}")
    return used


def test_the_declared_python_has_every_api_the_library_uses():
    floor, _ = _declared_python()
    too_new = {api: places for api, places in _newer_apis_used().items() if NEWER_PYTHON_APIS[api] > floor}
    assert too_new == {}, (
        f"setup.cfg declares python_requires >={floor[0]}.{floor[1]}, but refitkit uses APIs that Python lacks "
        f"(declare the Python NEWER_PYTHON_APIS names for them): {too_new}"
    )


def test_python_requires_is_the_lowest_python_classifier_and_the_readme_names_no_other():
    floor, classifiers = _declared_python()
    assert classifiers and classifiers[0] == floor, f"python_requires >={floor[0]}.{floor[1]} but the classifiers list {classifiers}"
    named = sorted({(3, int(minor)) for minor in re.findall(r"Python 3\.(\d+)", (ROOT / "README.md").read_text())})
    assert set(named) <= set(classifiers), f"README.md names Python {named}, setup.cfg's classifiers {classifiers}"
