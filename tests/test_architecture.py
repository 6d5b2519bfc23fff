"""The modules of dashboard, runs and evidence import each other without a
cycle, and in the layer order docs/DESIGN.md states: `dashboard` on top,
`runs` and `evidence` below it, never importing it.  Every import counts,
wherever it is written (an import inside a function hides a cycle, or a
layer crossed, it does not remove it)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("dashboard", "runs", "evidence")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports, from the source."""
    files = {
        module_name(path): path
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if "migrations" not in path.parts
    }
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from runs import sweep` imports the module runs.sweep.
                for alias in node.names:
                    submodule = f"{node.module}.{alias.name}"
                    targets.add(submodule if submodule in files else node.module)
        graph[name] = {target for target in targets if target in files and target != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle, as the modules along it, or [] when there is none."""
    done: set[str] = set()
    path: list[str] = []

    def visit(module: str) -> list[str]:
        if module in path:
            return [*path[path.index(module) :], module]
        if module in done:
            return []
        path.append(module)
        for target in sorted(graph[module]):
            if cycle := visit(target):
                return cycle
        path.pop()
        done.add(module)
        return []

    for module in sorted(graph):
        if cycle := visit(module):
            return cycle
    return []


def test_the_finder_sees_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_no_import_cycle_between_modules() -> None:
    graph = import_graph()
    assert "runs.models" in graph and "runs.timeline" in graph["runs.models"]
    assert find_cycle(graph) == []


# The project's wiring in the `dashboard` package: what manage.py, a worker
# and a benchmark's worker process load before any app (settings, the Celery
# app).  A module below may use it as any Django code uses settings; the
# rest of `dashboard` is the operator UI (pages, the JSON API, charts'
# callers, URLs, which import the views), which nothing below may reach.
WIRING = {"dashboard", "dashboard.settings", "dashboard.celery"}
# Django's admin pages for the models of runs and evidence: Django finds
# them only inside their app, yet they are pages (they use dashboard's
# guards for a request's parameters).  They belong to the top layer, and no
# module below imports them.
ADMIN_PAGES = {"runs.admin", "evidence.admin"}


def reached(graph: dict[str, set[str]], start: str) -> dict[str, list[str]]:
    """Every module `start` imports, directly or not, with a shortest path to it."""
    paths = {start: [start]}
    queue = [start]
    while queue:
        module = queue.pop(0)
        for target in sorted(graph[module]):
            if target not in paths:
                paths[target] = [*paths[module], target]
                queue.append(target)
    return paths


def ui_reached_from_below(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import paths by which a module of runs or evidence reaches a
    dashboard module that is not wiring."""
    below = [
        module
        for module in sorted(graph)
        if module.split(".")[0] in ("runs", "evidence") and module not in ADMIN_PAGES
    ]
    return [
        path
        for module in below
        for target, path in reached(graph, module).items()
        if target.split(".")[0] == "dashboard" and target not in WIRING
    ]


def test_the_layer_check_sees_an_import_from_below_even_through_another_module() -> None:
    graph = {
        "runs.a": {"runs.b"},
        "runs.b": {"dashboard.celery"},
        "dashboard.celery": {"dashboard.views"},
        "dashboard.views": {"runs.a"},
        "evidence.c": {"dashboard.settings"},
        "runs.admin": {"dashboard.security"},
        "dashboard.security": set(),
        "dashboard.settings": set(),
    }
    assert ui_reached_from_below(graph) == [
        ["runs.a", "runs.b", "dashboard.celery", "dashboard.views"],
        ["runs.b", "dashboard.celery", "dashboard.views"],
    ]


def test_runs_and_evidence_reach_no_dashboard_module_but_the_wiring() -> None:
    """Words shown to operators (runs.words, runs.inbox), a run's facts and
    charts (evidence.run_facts, evidence.charts) sit below all who show
    them: the pages, the `outcomes` command, a bundle's report."""
    graph = import_graph()
    assert set(graph) >= WIRING | ADMIN_PAGES
    assert "runs.words" in graph["runs.management.commands.outcomes"]
    assert ui_reached_from_below(graph) == []


def test_nothing_below_imports_the_admin_pages() -> None:
    graph = import_graph()
    importers = {
        module
        for module, targets in graph.items()
        if targets & ADMIN_PAGES and module.split(".")[0] in ("runs", "evidence")
    }
    assert importers <= ADMIN_PAGES
