"""The package's shape: the engine's imports point one way (no cycles), between its rooms too
(a folder, or a module of its own), none is hidden in a function, and the engine imports
neither the CLI nor the benchmark harness."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINE = "sekv_core"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> tuple[set[str], list[tuple[int, str]]]:
    """(modules imported at module level, [(line, module) imported inside a function])."""
    tree = ast.parse(path.read_text())
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    top, inner = set(), []

    def resolve(node: ast.ImportFrom | ast.Import) -> list[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        base = node.module or ""
        if node.level:
            parent = package.split(".")
            parent = parent[: len(parent) - node.level + 1]
            base = ".".join([*parent, base] if base else parent)
        return [f"{base}.{a.name}" for a in node.names] + [base]

    def walk(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue  # annotations only: not a runtime dependency
            if isinstance(child, ast.Import | ast.ImportFrom):
                for target in resolve(child):
                    if in_function:
                        inner.append((child.lineno, target))
                    else:
                        top.add(target)
            walk(child, in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef))

    walk(tree, False)
    return top, inner


def engine_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in (ROOT / ENGINE).rglob("*.py")}
    graph = {}
    for name, path in files.items():
        top, inner = imports(path)  # an import in a function is a dependency all the same
        graph[name] = {t for t in top | {t for _, t in inner} if t in files and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[str]:
    """Every import cycle a depth-first walk of ``graph`` meets, as ``a -> b -> a``."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    found = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                found.append(" -> ".join([*stack[stack.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_engine_imports_have_no_cycle():
    assert cycles(engine_graph()) == []


def room(module: str) -> str:
    """A module's room: its folder below the engine (``sekv_core.store``), else the module."""
    parts = module.split(".")
    return ".".join(parts[:2]) if (ROOT / ENGINE / parts[1]).is_dir() else module


def test_rooms_import_each_other_one_way():
    """A room (the store, the zoom, the native kernels, ...) never imports a module that
    imports it back, through any other room."""
    rooms: dict[str, set[str]] = {}
    for name, targets in engine_graph().items():
        if name == ENGINE:
            continue
        rooms.setdefault(room(name), set()).update(
            room(t) for t in targets if t != ENGINE and room(t) != room(name)
        )
    assert cycles(rooms) == []


def test_no_engine_import_is_hidden_in_a_function():
    hidden = [
        f"{p.relative_to(ROOT)}:{line} imports {target}"
        for p in (ROOT / ENGINE).rglob("*.py")
        for line, target in imports(p)[1]
        if target.startswith(ENGINE)
    ]
    assert hidden == []


def test_the_engine_imports_neither_the_cli_nor_the_benchmarks():
    outside = [
        f"{p.relative_to(ROOT)} imports {t}"
        for p in (ROOT / ENGINE).rglob("*.py")
        for t in set(imports(p)[0]) | {t for _, t in imports(p)[1]}
        if t.split(".")[0] in ("sekv_cli", "sekv_bench")
    ]
    assert outside == []
