"""Rules the whole library keeps, read from its source: no runtime assert (they vanish under
``python -O``), no ``gc.collect()`` call outside the watchdog's opt-in audit, and nothing imported or
converted through numpy that setup.cfg's ``install_requires`` does not declare, no API newer than the
Python that ``setup.cfg`` declares, and no module-level mutable state in ``transfer/`` and ``rollout/``
beyond the one registry an engine's plug-in point forces."""

from __future__ import annotations

import ast
import configparser
import re
import sys
from pathlib import Path

import pytest

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

OPTIONAL_ENGINES = {  # a word in a module's name -> the packages that module may import when it is loaded
    "vllm": ("vllm",),
    "sglang": ("sglang",),
    "megatron": ("megatron",),
    "torchtitan": ("torchtitan",),
    "automodel": ("nemo_automodel",),
    "transformers": ("transformers",),  # engines/fsdp/_transformers.py: a transformers model's checkpoint names
    "verl": ("verl", "ray"),  # integrations/verl/colocated.py: verl's manager and engine classes, on its Ray actors
}
ENGINE_PACKAGES = {package for packages in OPTIONAL_ENGINES.values() for package in packages}


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
        # a module named after two engines (integrations/verl/vllm.py) may import both
        allowed = {package for word, packages in OPTIONAL_ENGINES.items() if word in module for package in packages}
        for name, line in _imported_when_loaded(tree, module, module in packages):
            root = name.split(".")[0]
            if root in sys.stdlib_module_names or root == "refitkit" or root == "__future__":
                continue
            if root in allowed:
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
        if name.split(".")[0] in ENGINE_PACKAGES
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


# --- no process-wide mutable state in transfer/ and rollout/ ------------------------------------------------------
# What one sync leaves for the next belongs to the object that owns that lifetime (a channel, a link, a worker's
# receiver), opened and closed by its user: a module-level cache is a sign that owner is missing, and it survives a
# fork silently. Module-level names whose value is not a plain constant must be listed here, each with its reason.

STATE_FREE_PACKAGES = ("refitkit/transfer", "refitkit/rollout")

ALLOWED_MODULE_STATE = {
    ("refitkit/rollout/sglang.py", "_SCHEDULER_RECEIVERS"): (
        "the one process-wide registry (SchedulerReceivers): SGLang's only plug-in point is a class-level hook and its "
        "updater a slots dataclass that cannot carry our state; locked, entries stamped with their pid"
    ),
    ("refitkit/transfer/protocol.py", "_brief_repr"): "a reprlib.Repr configured once at import, then only read",
}

# Tables written once at import and only read after (a dict of constants): allowed while the module never writes them.
READ_ONLY_TABLES = {
    ("refitkit/rollout/sglang.py", "REQUEST_FIELDS"): "each request op's fields and their types",
    ("refitkit/transfer/_ipc/sender.py", "_PHASE_OF"): "each send state's session phase",
    ("refitkit/transfer/_ipc/sender.py", "_NEXT"): "each send state's allowed next states",
    ("refitkit/transfer/_ipc/sender.py", "_BUCKET_NEXT"): "each bucket state's allowed next states",
    ("refitkit/transfer/_ipc/receiver.py", "_RECEIVE_PHASE_OF"): "each receive state's session phase",
    ("refitkit/transfer/_ipc/receiver.py", "_RECEIVE_NEXT"): "each receive state's allowed next states",
    ("refitkit/transfer/common.py", "_CHANNEL_NEXT"): "each channel state's allowed next states",
    ("refitkit/transfer/protocol.py", "SUPPORTED_DTYPES"): "dtype names on the wire and their torch dtypes",
    ("refitkit/transfer/protocol.py", "WIRE_DTYPE_NAMES"): "the reverse of SUPPORTED_DTYPES",
}

# Calls whose result is immutable, or a logger or a compiled pattern: fine at module level.
IMMUTABLE_RESULTS = {
    "frozenset",
    "tuple",
    "bytes",
    "str",
    "int",
    "float",
    "bool",
    "type",
    "object",  # a sentinel
    "logging.getLogger",
    "re.compile",
    "TypeVar",
    "typing.TypeVar",
    "NewType",
    "typing.NewType",
    "ParamSpec",
    "struct.Struct",
}
MUTATING_METHODS = frozenset(
    "append extend insert pop popitem remove clear update setdefault add discard move_to_end appendleft extendleft "
    "popleft rotate sort reverse".split()
)


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _mutable_kind(value: ast.expr) -> str | None:
    """What is mutable about a module-level value (None: a constant, an alias, a logger, a pattern, a type alias)."""
    if isinstance(value, (ast.Dict, ast.DictComp)):
        return "a dict"
    if isinstance(value, (ast.List, ast.ListComp)):
        return "a list"
    if isinstance(value, (ast.Set, ast.SetComp)):
        return "a set"
    if isinstance(value, ast.Tuple):
        return next(filter(None, map(_mutable_kind, value.elts)), None)
    if isinstance(value, ast.Call):
        name = _dotted(value.func)
        return None if name in IMMUTABLE_RESULTS else f"the result of {name or ast.unparse(value.func)}()"
    if isinstance(value, ast.IfExp):
        return _mutable_kind(value.body) or _mutable_kind(value.orelse)
    if isinstance(value, ast.BinOp):
        return _mutable_kind(value.left) or _mutable_kind(value.right)
    # constants, names and attributes (aliases: checked where defined), subscripts (type aliases), lambdas, f-strings
    return None


def _module_assignments(tree: ast.Module) -> list[tuple[str, int, ast.expr]]:
    """(name, line, value) of each name bound at module level (branches and try blocks included, not functions or
    classes)."""
    found: list[tuple[str, int, ast.expr]] = []

    def names(target: ast.expr) -> list[str]:
        if isinstance(target, ast.Name):
            return [target.id]
        if isinstance(target, (ast.Tuple, ast.List)):
            return [name for element in target.elts for name in names(element)]
        return []  # an attribute or item set at import: its object is checked where it is bound

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                        found.extend(
                            (name, node.lineno, value)
                            for element, value in zip(target.elts, node.value.elts)
                            for name in names(element)
                        )
                    else:
                        found.extend((name, node.lineno, node.value) for name in names(target))
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and node.value is not None:
                found.extend((name, node.lineno, node.value) for name in names(node.target))
            elif isinstance(node, ast.If):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                for block in (node.body, node.orelse, node.finalbody, *(handler.body for handler in node.handlers)):
                    visit(block)
            elif isinstance(node, ast.With):
                visit(node.body)

    visit(tree.body)
    return found


def _written(tree: ast.Module, name: str) -> list[int]:
    """Lines where the module writes into ``name`` (an item stored or deleted, a mutating method called)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)):
            if _dotted(node.value) == name:
                lines.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in MUTATING_METHODS and _dotted(node.func.value) == name:
                lines.append(node.lineno)
    return lines


def _state_modules() -> list[tuple[str, ast.Module]]:
    return [(name, tree) for name, tree in _modules() if name.startswith(STATE_FREE_PACKAGES)]


def module_state_violations(modules: list[tuple[str, ast.Module]]) -> list[str]:
    """Each module-level mutable object and each ``global`` statement not allowed above, as a message."""
    allowed = ALLOWED_MODULE_STATE
    found = []
    for path, tree in modules:
        for name, line, value in _module_assignments(tree):
            kind = _mutable_kind(value)
            if kind is None or name == "__all__" or (path, name) in allowed:
                continue
            if (path, name) in READ_ONLY_TABLES:
                found.extend(
                    f"{path}:{written} writes into the read-only table {name} (defined at line {line}): build it whole "
                    "at import, or give what changes an owner"
                    for written in _written(tree, name)
                )
                continue
            found.append(
                f"{path}:{line} {name} is {kind}, module-level state shared by the whole process and inherited by a "
                "fork: keep it on the object that owns its lifetime (a channel, a link, a worker's receiver), or make "
                "it a constant (tuple, frozenset); a registry an engine's plug-in point forces goes in "
                "ALLOWED_MODULE_STATE with its reason"
            )
        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                for name in node.names:
                    if (path, name) not in allowed:
                        found.append(
                            f"{path}:{node.lineno} `global {name}` rebinds module-level state: keep it on the object "
                            "that owns its lifetime"
                        )
    return found


def test_transfer_and_rollout_keep_no_module_level_mutable_state():
    modules = _state_modules()
    assert len(modules) > 20, f"the rule reads transfer/ and rollout/: it found {len(modules)} modules"
    found = module_state_violations(modules)
    assert found == [], "\n".join(found)


def test_every_allowed_module_state_entry_still_exists():
    bound = {(path, name) for path, tree in _state_modules() for name, _, _ in _module_assignments(tree)}
    listed = {**ALLOWED_MODULE_STATE, **READ_ONLY_TABLES}
    stale = sorted(f"{path}: {name}" for path, name in listed if (path, name) not in bound)
    assert stale == [], f"these are gone: take them off the lists in tests/test_library_rules.py: {stale}"


@pytest.mark.parametrize(
    "planted, expected",
    [
        ("_cache = {}\n", "refitkit/rollout/planted.py:3 _cache is a dict, module-level state shared"),
        ("_lock = threading.Lock()\n", "refitkit/rollout/planted.py:3 _lock is the result of threading.Lock()"),
        ("_by = weakref.WeakKeyDictionary()\n", "_by is the result of weakref.WeakKeyDictionary()"),
        ("_seen: set[str] = set()\n", "refitkit/rollout/planted.py:3 _seen is the result of set()"),
        (
            "_count = 0\n\n\ndef bump():\n    global _count\n    _count += 1\n",
            "refitkit/rollout/planted.py:7 `global _count` rebinds module-level state",
        ),
        ("REQUEST_FIELDS = {}\n", "REQUEST_FIELDS is a dict"),  # read-only tables are listed per module
    ],
)
def test_the_module_state_rule_catches_a_planted_cache(planted, expected):
    tree = ast.parse(f"import threading\nimport weakref\n{planted}")
    found = module_state_violations([("refitkit/rollout/planted.py", tree)])
    assert len(found) == 1, found
    if expected is not None:
        assert expected in found[0]
    clean = ast.parse('import logging, re\nlog = logging.getLogger(__name__)\n_NAME = re.compile("x")\nA = (1, "b")\n')
    assert module_state_violations([("refitkit/rollout/planted.py", clean)]) == []
