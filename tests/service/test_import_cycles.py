"""No import cycle among Conveyor's modules: imports at module level (where a cycle breaks
start-up order) and inside functions (where a cycle still ties two layers together)."""

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


def _typing_only(node: ast.AST) -> bool:
    """`if TYPE_CHECKING:` (a block that never runs: annotations only)."""
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"
        or isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(node: ast.AST):
    """Every import statement under `node` that can run: at module level, inside functions
    and classes, under if / try; not under `if TYPE_CHECKING:`."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        elif not _typing_only(child):
            yield from _imports(child)


def _graph() -> dict[str, set[str]]:
    files = {_module(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        deps: set[str] = set()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for sub in _imports(tree):
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


def test_no_import_cycle():
    graph = _graph()
    assert "service.front.app" in graph and "service.engine.client" in graph
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


def test_nothing_imports_the_command_line():
    graph = _graph()
    assert [m for m, deps in graph.items() if "service.cli" in deps] == []


# What the front may take from the async engine: the contract, the stream type, the prompt
# types (and the sampling defaults the contract's facts are typed with).
FRONT_MAY_IMPORT = {"service.engine.client", "service.engine.stream",
                    "service.engine.request_input", "service.engine.sampling_defaults"}


def test_the_front_is_typed_against_the_contract_not_the_engine():
    graph = _graph()
    front = [m for m in graph if m.startswith("service.front.") and m != "service.front.serve"]
    assert "service.front.ws.stream" in front
    for m in front:
        engine = {d for d in graph[m] if d == "service.engine" or d.startswith("service.engine.")}
        assert engine <= FRONT_MAY_IMPORT, (m, engine - FRONT_MAY_IMPORT)
