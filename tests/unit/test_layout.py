"""The house's rules, read from the tree: what is installed, who imports whom.

* ``pip install .`` installs the product only (ingest, workers, ledger, ``ledgerctl``):
  no benchmark, chaos, sabotage, simulator or test module.
* The product never imports the development toolkit or the tests.
* The product's modules import each other without a cycle (imports inside
  functions count: a cycle hidden in a method is still a cycle).
* Its packages import downwards only: ledger, then workers, then ingest and ops
  (which never import each other).
"""
from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest
from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("ingest", "workers", "ledger", "ops")


def installed_packages() -> set[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    return set(find_packages(where=str(ROOT), include=config["include"], exclude=config.get("exclude", ())))


def installed_modules() -> dict[str, Path]:
    modules = {}
    for package in installed_packages():
        folder = ROOT / package.replace(".", "/")
        for path in folder.glob("*.py"):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            modules[name] = path
    return modules


def imports_of(path: Path) -> set[str]:
    """Every module an import statement in the file names, wherever the statement is."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_the_installed_packages_are_the_product_alone():
    assert installed_packages() == {"ingest", "workers", "workers.billing", "ledger", "ledger.migrations",
                                    "ledger.sql", "ops", "ops.cli", "ops.console"}


def test_the_only_installed_ops_module_is_the_cli():
    assert sorted(p.name for p in (ROOT / "ops").glob("*.py")) == ["__init__.py"]
    assert sorted(p.name for p in (ROOT / "ops" / "cli").glob("*.py")) == [
        "__init__.py", "base.py", "console.py", "events.py", "objects.py", "outbox.py", "reproject.py", "retention.py",
        "stripe.py"]


@pytest.mark.parametrize("module", sorted(installed_modules()))
def test_a_product_module_never_imports_the_toolkit_or_the_tests(module):
    named = imports_of(installed_modules()[module])
    assert not {m for m in named if m.split(".")[0] in ("devkit", "tests")}


# Each product package's place: a module imports only packages of a lower rank, and its own.
PACKAGE_RANK = {"ledger": 0, "workers": 1, "ingest": 2, "ops": 2}


@pytest.mark.parametrize("module", sorted(installed_modules()))
def test_a_product_package_imports_only_the_packages_below_it(module):
    own = module.split(".")[0]
    named = {m.split(".")[0] for m in imports_of(installed_modules()[module])}
    upward = {p for p in named if p in PACKAGE_RANK and p != own and PACKAGE_RANK[p] >= PACKAGE_RANK[own]}
    assert not upward, f"{module} imports {sorted(upward)}: the order is ledger, workers, then ingest and ops"


# The ledger's door: its statement runner and its SQL registry, used by its classes alone. The devkit's
# benchmarks read the registry's text on purpose, to time and explain the ledger's own statements.
LEDGER_INTERNALS = {"ledger.statements", "ledger.statements.run_statement", "ledger.queries.SQL"}


@pytest.mark.parametrize("module", sorted(m for m in installed_modules() if m.split(".")[0] != "ledger"))
def test_only_the_ledger_runs_statements_on_the_ledger(module):
    reached = imports_of(installed_modules()[module]) & LEDGER_INTERNALS
    assert not reached, f"{module} imports {sorted(reached)}: statements on ledger.* go through a ledger class"


def test_the_product_imports_without_a_cycle():
    modules = installed_modules()
    graph = {name: {m for m in imports_of(path) if m in modules and m != name} for name, path in modules.items()}
    # A package's __init__ is imported with any of its modules, so a module importing its own package is no edge.
    graph = {name: {m for m in deps if not name.startswith(m + ".")} for name, deps in graph.items()}
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(name):] + [name]))
        if name in done:
            return
        for dep in sorted(graph[name]):
            visit(dep, [*path, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])
