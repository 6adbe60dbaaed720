"""The package's own structure: no import cycles between its modules, and no function-level imports of its own
modules (the usual way to hide a cycle)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = "lightning_fsdp2"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> tuple[set[str], list[tuple[int, str]]]:
    """The package's modules ``path`` imports (anywhere), and the function-level ones with their line."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    modules = {_module_name(p) for p in (SRC / PACKAGE).rglob("*.py")}
    found: set[str] = set()
    nested: list[tuple[int, str]] = []

    def targets(node: ast.AST) -> list[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        assert isinstance(node, ast.ImportFrom)
        base = node.module or ""
        if node.level:
            base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
        # `from pkg import module` names a module too
        return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for target in targets(child):
                    if target.split(".")[0] == PACKAGE and target in modules and target != name:
                        found.add(target)
                        # Importing `pkg.sub.mod` runs `pkg/sub/__init__.py` first (unless this module is inside
                        # `pkg.sub`, whose __init__ is then already running): a dependency too. The top package's
                        # __init__ runs before any of its modules, so it is left out.
                        parent = target.rpartition(".")[0]
                        while parent.count(".") >= 1 and parent != name and not name.startswith(f"{parent}."):
                            found.add(parent)
                            parent = parent.rpartition(".")[0]
                        if in_function:
                            nested.append((child.lineno, target))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(tree, False)
    return found, nested


def _graph() -> tuple[dict[str, set[str]], dict[str, list[tuple[int, str]]]]:
    graph, nested = {}, {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        graph[_module_name(path)], nested[_module_name(path)] = _imports(path)
    return graph, nested


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := walk(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := walk(node)):
            return found
    return None


def test_the_package_has_no_import_cycles() -> None:
    graph, _ = _graph()
    # A package's __init__ is imported with any of its submodules: edges into a package are edges into its __init__.
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


def test_no_function_level_imports_of_the_package_itself() -> None:
    _, nested = _graph()
    found = {module: lines for module, lines in nested.items() if lines}
    assert not found, found
