"""The house rules a test can hold: no two project modules import each other in a circle."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _project_imports() -> dict[str, set[str]]:
    """module -> the project modules it imports (lazy imports inside functions included)."""
    paths = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for pkg in ("dflash", "dflash_tui") for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in paths.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                deps.add(node.module)
                deps.update(f"{node.module}.{a.name}" for a in node.names)
        graph[mod] = {d for d in deps if d in paths and d != mod}
    return graph


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` as the modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(mod: str, path: list[str]) -> list[str] | None:
        state[mod] = 1
        for dep in sorted(graph.get(mod, ())):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (circle := visit(dep, [*path, dep])):
                return circle
        state[mod] = 2
        return None

    for mod in sorted(graph):
        if mod not in state and (circle := visit(mod, [mod])):
            return circle
    return None


def test_the_circle_finder_finds_one() -> None:
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_circle_between_project_modules() -> None:
    graph = _project_imports()
    # a module importing its own package (which Python imports first anyway) is not a circle
    graph = {mod: {d for d in deps if not mod.startswith(d + ".")} for mod, deps in graph.items()}
    assert find_circle(graph) is None, " -> ".join(find_circle(graph) or [])
