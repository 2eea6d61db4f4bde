"""No import cycle among Conveyor's modules (imports at module level, where a cycle
breaks start-up order; a function-level import runs after every module is loaded)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("protocol", "service", "kernels")


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _graph() -> dict[str, set[str]]:
    files = {_module(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        deps: set[str] = set()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:  # module level only (also inside if/try at top level)
            for sub in ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else [node]:
                if isinstance(sub, ast.Import):
                    deps |= {a.name for a in sub.names}
                elif isinstance(sub, ast.ImportFrom) and sub.module and sub.level == 0:
                    deps.add(sub.module)
                    deps |= {f"{sub.module}.{a.name}" for a in sub.names}
        # a submodule importing its own package (e.g. `from kernels import x` inside
        # kernels/) finds it being initialised: not a cycle that can break start-up
        graph[name] = {d for d in deps if d in files and d != name
                       and not name.startswith(d + ".")}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_no_module_level_import_cycle():
    graph = _graph()
    assert "service.front.app" in graph and "service.engine_client" in graph
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


def test_the_front_is_typed_against_the_contract_not_the_engine():
    graph = _graph()
    front = [m for m in graph if m.startswith("service.front") or m in (
        "service.socket_actor", "service.connection")]
    for m in front:
        assert "service.engine" not in graph[m], m
