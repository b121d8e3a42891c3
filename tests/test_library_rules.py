"""Rules the whole library keeps, read from its source: no runtime assert (they vanish under
``python -O``), no ``gc.collect()`` call outside the watchdog's opt-in audit, and nothing imported or
converted through numpy that setup.cfg's ``install_requires`` does not declare, and no API newer than the
Python that ``setup.cfg`` declares."""

from __future__ import annotations

import ast
import configparser
import re
import sys
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
    return [
        (str(path.relative_to(PACKAGE.parent)), ast.parse(path.read_text(), str(path)))
        for path in sorted(PACKAGE.rglob("*.py"))
    ]


def test_the_library_has_no_runtime_asserts():
    found = [
        f"{name}:{node.lineno}" for name, tree in _modules() for node in ast.walk(tree) if isinstance(node, ast.Assert)
    ]
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


# --- the installed package declares what it imports ----------------------------------------------------------------
# `pip install .` brings torch and setup.cfg's install_requires, nothing else: a module that imports another package
# when it is imported, or converts through numpy, fails there (CI's core venv has the test extras and never sees it).
# Optional engines are the exception: their packages are imported only by modules named after them, and only lazily
# (what those modules import at their top must still be declared, since `refitkit.rollout` imports rollout/vllm.py).

OPTIONAL_ENGINES = {
    "vllm": "vllm",
    "sglang": "sglang",
    "megatron": "megatron",
    "torchtitan": "torchtitan",
    "automodel": "nemo_automodel",
}


def _install_requires() -> set[str]:
    import configparser

    config = configparser.ConfigParser()
    config.read(PACKAGE.parent / "setup.cfg")
    names = set()
    for line in config["options"]["install_requires"].splitlines():
        match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", line.split("#")[0].strip())
        if match:
            names.add(_canonical(match.group()))
    return names


def _canonical(distribution: str) -> str:
    return re.sub(r"[-_.]+", "-", distribution).lower()


def _module_name(relative: str) -> str:
    return relative.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def _imported_when_loaded(tree: ast.Module, module: str, is_package: bool) -> list[tuple[str, int]]:
    """(dotted name, line) of each import the module runs when it is itself imported: its top level, class bodies and
    branches, but not function bodies, `if TYPE_CHECKING:` blocks, or imports guarded by `except ImportError`."""
    found: list[tuple[str, int]] = []

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if isinstance(node, ast.Import):
                found.extend((alias.name, node.lineno) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = module.split(".") if is_package else module.split(".")[:-1]
                    base = base[: len(base) - node.level + 1]
                    parent = ".".join(base + ([node.module] if node.module else []))
                else:
                    parent = node.module or ""
                found.append((parent, node.lineno))
                found.extend((f"{parent}.{alias.name}", node.lineno) for alias in node.names)
            elif isinstance(node, ast.If):
                if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                guarded = any(
                    isinstance(handler.type, ast.Name) and handler.type.id in ("ImportError", "ModuleNotFoundError")
                    for handler in node.handlers
                )
                if not guarded:
                    visit(node.body)
                visit(node.orelse)
                visit(node.finalbody)
                for handler in node.handlers:
                    visit(handler.body)
            elif isinstance(node, (ast.ClassDef, ast.With, ast.For, ast.While)):
                visit(node.body)

    visit(tree.body)
    return found


def _undeclared_imports() -> list[str]:
    import importlib.metadata

    declared = _install_requires()
    to_distributions = importlib.metadata.packages_distributions()
    modules = {_module_name(name): (name, tree) for name, tree in _modules()}
    packages = {_module_name(name) for name, _ in _modules() if name.endswith("__init__.py")}
    found = []
    for module, (path, tree) in sorted(modules.items()):
        engine = next((word for word in OPTIONAL_ENGINES if word in module), None)
        for name, line in _imported_when_loaded(tree, module, module in packages):
            root = name.split(".")[0]
            if root in sys.stdlib_module_names or root == "refitkit" or root == "__future__":
                continue
            if engine is not None and root == OPTIONAL_ENGINES[engine]:
                continue  # the module is named after its engine: refitkit imports it lazily (checked below)
            distributions = {_canonical(d) for d in to_distributions.get(root, [])}
            if not distributions & declared:
                found.append(f"{path}:{line} imports {name} ({', '.join(sorted(distributions)) or 'not installed'})")
    return found


def _optional_engine_modules_pulled_in_eagerly() -> list[str]:
    """A module named after an optional engine imports it at its top: no module of another name may import it so."""
    modules = {_module_name(name): (name, tree) for name, tree in _modules()}
    packages = {_module_name(name) for name, _ in _modules() if name.endswith("__init__.py")}
    needs_engine = {
        module
        for module, (_, tree) in modules.items()
        for name, _ in _imported_when_loaded(tree, module, module in packages)
        if name.split(".")[0] in OPTIONAL_ENGINES.values()
    }
    found = []
    for module, (path, tree) in sorted(modules.items()):
        for name, line in _imported_when_loaded(tree, module, module in packages):
            if name in needs_engine and name != module:
                found.append(f"{path}:{line} imports {name} when it is loaded")
    return found


def test_what_the_library_imports_when_loaded_is_declared_in_install_requires():
    found = _undeclared_imports()
    assert found == [], (
        f"declare these in setup.cfg's install_requires, or import them lazily with the extra named: {found}"
    )


def test_modules_that_need_an_optional_engine_are_imported_lazily():
    found = _optional_engine_modules_pulled_in_eagerly()
    assert found == [], f"`import refitkit` must work without the optional engines: {found}"


def test_numpy_conversions_have_numpy_declared():
    # torch does not require numpy: without it every `.numpy()` raises "Numpy is not available"
    uses = [
        f"{name}:{node.lineno}"
        for name, tree in _modules()
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "numpy"
    ]
    assert uses, "the rule reads `.numpy()` calls: it found none, so it checks nothing"
    assert "numpy" in _install_requires(), f"these call .numpy() but setup.cfg's install_requires lacks numpy: {uses}"


def _declared_python() -> tuple[tuple[int, int], list[tuple[int, int]]]:
    """setup.cfg's ``python_requires`` floor and its ``Programming Language :: Python :: 3.N`` classifiers."""
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    requires = config["options"]["python_requires"].strip()
    match = re.fullmatch(r">=\s*3\.(\d+)", requires)
    assert match is not None, f"python_requires {requires!r}: expected the form >=3.N"
    classifiers = re.findall(
        r"Programming Language :: Python :: 3\.(\d+)$", config["metadata"]["classifiers"], re.MULTILINE
    )
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
    assert classifiers and classifiers[0] == floor, (
        f"python_requires >={floor[0]}.{floor[1]} but the classifiers list {classifiers}"
    )
    named = sorted({(3, int(minor)) for minor in re.findall(r"Python 3\.(\d+)", (ROOT / "README.md").read_text())})
    assert set(named) <= set(classifiers), f"README.md names Python {named}, setup.cfg's classifiers {classifiers}"
