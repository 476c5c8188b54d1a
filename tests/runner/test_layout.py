"""The runner's layout: sub-packages by concern, no import circle between modules or between the
sub-packages, and each command-line tool still a module ``python -m`` runs.

Imports are read from the source (top-level statements, ``if TYPE_CHECKING`` blocks excluded): an
import inside a function is a deliberate late import (an optional package, a heavy one) and cannot
form a circle at import time.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.library.test_import_boundary import _circle as _cycle

RUNNER = os.path.join(ROOT, "distlib", "runner")
SUBPACKAGES = ("data", "hf", "models", "observability", "tasks", "training")
COMMANDS = ("config", "export", "plan", "tokenize")  # python -m distlib.runner.<command>


def _modules() -> dict[str, str]:
    """module name -> path, for every module of distlib (the library and the runner)."""
    out = {}
    for folder, dirs, files in os.walk(os.path.join(ROOT, "distlib")):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        package = os.path.relpath(folder, ROOT).replace(os.sep, ".")
        for f in files:
            if f.endswith(".py"):
                out[package if f == "__init__.py" else f"{package}.{f[:-3]}"] = os.path.join(folder, f)
    return out


def _is_type_checking(node: ast.If) -> bool:
    return (
        isinstance(node.test, ast.Name)
        and node.test.id == "TYPE_CHECKING"
        or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING")
    )


def _top_level_imports(path: str, name: str, modules: dict[str, str]) -> set[str]:
    tree = ast.parse(open(path).read(), path)
    found: set[str] = set()
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                found.add(base)
                found.update(f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules)
            elif isinstance(node, ast.If) and not _is_type_checking(node):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)

    visit(tree.body)
    # importing a.b.c runs a, a.b and a.b.c; but the packages above this module are already being
    # imported when it runs
    above = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    out = set()
    for imported in found:
        parts = imported.split(".")
        out.update(m for m in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if m in modules)
    out -= above | {name}
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _top_level_imports(path, name, modules) for name, path in modules.items()}


def test_no_module_imports_itself_through_others():
    assert _cycle(_graph()) is None, f"import circle: {' -> '.join(_cycle(_graph()))}"


def _room(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] != ["distlib", "runner"]:
        return None
    return parts[2] if len(parts) > 3 and parts[2] in SUBPACKAGES else "runner"


def test_the_runners_sub_packages_form_no_circle():
    rooms: dict[str, set[str]] = {}
    for module, imports in _graph().items():
        if (room := _room(module)) in SUBPACKAGES:
            rooms.setdefault(room, set()).update(r for m in imports if (r := _room(m)) in SUBPACKAGES and r != room)
    assert _cycle(rooms) is None, f"sub-package circle: {' -> '.join(_cycle(rooms))}"


def test_the_circle_finder_finds_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_runner_has_no_loose_module_beside_its_rooms():
    loose = sorted(f[:-3] for f in os.listdir(RUNNER) if f.endswith(".py") and f != "__init__.py")
    # the recipe's own vocabulary (config, the components it names), the command-line tools, and the
    # training command: `python -m distlib.runner` (__main__, cli: the entry, main: one run start to exit)
    assert set(loose) <= {"components", *COMMANDS, "__main__", "cli", "main"}, loose
    for room in SUBPACKAGES:
        assert os.path.isfile(os.path.join(RUNNER, room, "__init__.py")), room


@pytest.mark.parametrize("command", [c for c in COMMANDS if os.path.exists(os.path.join(RUNNER, f"{c}.py"))])
def test_each_command_line_tool_runs_as_a_module(command):
    out = subprocess.run([sys.executable, "-m", f"distlib.runner.{command}", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert f"distlib.runner.{command}" in out.stdout or "usage" in out.stdout


def _third_party_imports() -> set[str]:
    """The top-level names of every package distlib's code imports (late imports included), but
    the standard library's and distlib's own."""
    names = set()
    for path in _modules().values():
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n not in ("distlib", "__future__")}


def test_every_package_the_code_imports_is_declared():
    import importlib.metadata
    import re

    import tomllib

    project = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"]
    requirements = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    declared = {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower().replace("_", "-") for r in requirements}
    distributions = importlib.metadata.packages_distributions()
    undeclared = {}
    for name in sorted(_third_party_imports()):
        dists = {d.lower().replace("_", "-") for d in distributions.get(name, [name])}
        if not dists & declared:
            undeclared[name] = sorted(dists)
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"


def test_the_training_command_runs_as_the_package_and_answers_help():
    out = subprocess.run([sys.executable, "-m", "distlib.runner", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0 and "distlib-train" in out.stdout and "overrides" in out.stdout, out.stderr
