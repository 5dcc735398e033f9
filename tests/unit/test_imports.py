"""The package's import graph: no module imports another's underscore name, and no import circle exists
(a reader never has to hold a circle in their head). Every import statement counts, also inside functions."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "minisarathi"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> tuple[dict[str, set[str]], list[str]]:
    modules = {module_name(f): f for f in PACKAGE.rglob("*.py")}

    def owner(name: str) -> str | None:  # the package module a dotted name lives in
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges, private = {m: set() for m in modules}, []
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{module}: relative import (the package imports absolutely)"
                if not (node.module or "").startswith("minisarathi"):
                    continue
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    target = full if full in modules else owner(node.module)
                    if target and target != module:
                        edges[module].add(target)
                        if alias.name.startswith("_") and full not in modules:
                            private.append(f"{module} imports {full}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    target = owner(alias.name)
                    if target and target != module:
                        edges[module].add(target)
    return edges, private


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan's algorithm, iteratively)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]

    def visit(root):
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))

    for module in sorted(edges):
        if module not in index:
            visit(module)
    return found


def test_no_import_cycles_and_no_private_imports():
    edges, private = import_graph()
    assert len(edges) > 30  # the walk found the package
    assert cycles(edges) == []
    assert private == []


def test_the_cycle_finder_finds_a_planted_cycle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges) == [["a", "b", "c"]]


def test_the_doors_import_the_hub_not_each_other():
    edges, _ = import_graph()
    doors = {"minisarathi.server.msgpack_door", "minisarathi.server.http"}
    for door in doors:
        assert "minisarathi.server.hub" in edges[door], door
        assert not edges[door] & doors, door
