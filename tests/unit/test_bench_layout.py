"""ops/bench's shape, read from the tree: one runner, one module per scenario, no circle.

* Every scenario the runner lists is a module of devkit/benchmarks/scenarios, and every module
  there is listed.
* A scenario imports the runner and its support modules, never another scenario; the runner and
  its support modules import no scenario (a scenario that needs another's figures asks the
  runner by name).
* The folder imports itself without a cycle (imports inside functions count).
* It stays within the size the benchmarks were cut to (issue 42): a scenario added is a scenario
  paid for by the ones already there.
"""
from __future__ import annotations

import ast
from pathlib import Path

from devkit.benchmarks import runner

ROOT = Path(__file__).resolve().parents[2]
FOLDER = ROOT / "devkit" / "benchmarks"
PACKAGE = "devkit.benchmarks"
SCENARIOS = f"{PACKAGE}.scenarios"
MAX_LINES = 3_600


def modules() -> dict[str, Path]:
    out = {}
    for path in FOLDER.rglob("*.py"):
        parts = path.relative_to(FOLDER).with_suffix("").parts
        name = ".".join((PACKAGE, *parts)).removesuffix(".__init__")
        out[name] = path
    return out


def imports_of(name: str, path: Path) -> set[str]:
    """The devkit.benchmarks modules a file imports, relative imports resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    known = modules()
    return {m for m in found if m in known and m != name}


def is_scenario(name: str) -> bool:
    return name.startswith(SCENARIOS + ".")


def test_every_listed_scenario_is_a_module_and_every_module_is_listed():
    files = {n.removeprefix(SCENARIOS + ".") for n in modules() if is_scenario(n)}
    assert set(runner.SCENARIOS.values()) == files
    assert set(runner.ALL) <= set(runner.SCENARIOS)


def test_each_scenario_module_runs_and_reports():
    for name in runner.SCENARIOS:
        module = runner.scenario(name)
        assert callable(module.run) and callable(module.report), name


def test_a_scenario_imports_no_other_scenario_and_nothing_else_imports_a_scenario():
    offences = []
    for name, path in modules().items():
        for imported in imports_of(name, path):
            if is_scenario(imported):
                offences.append(f"{name} imports {imported}")
    assert offences == []


def test_the_benchmarks_import_each_other_without_a_cycle():
    graph = {name: imports_of(name, path) for name, path in modules().items()}
    done: set[str] = set()

    def visit(name: str, trail: tuple[str, ...]) -> None:
        assert name not in trail, " -> ".join((*trail, name))
        if name in done:
            return
        for imported in graph[name]:
            visit(imported, (*trail, name))
        done.add(name)

    for name in graph:
        visit(name, ())


def test_the_benchmarks_stay_within_their_size():
    lines = sum(len(p.read_text().splitlines()) for p in modules().values())
    assert lines <= MAX_LINES, f"devkit/benchmarks has {lines} lines of Python (at most {MAX_LINES})"
