"""The import graph of the repo's packages has no cycle: arrows between modules go one way only, so
each module can be read, tested and imported without the ones above it.

Imports are found by parsing each file with `ast`, including imports inside functions (a lazy
import is still an arrow). `import data.x`, `from data import x` (x a module) and `from data.x
import y` all count as an arrow to data.x; `from data import name` (a name in data/__init__.py) is
an arrow to the package `data`.
"""

import ast
import os

import pytest

from conftest import REPO

PACKAGES = ("bench", "data", "train")


def module_name(path):
    rel = os.path.relpath(path, REPO)[: -len(".py")].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def repo_modules():
    modules = {}
    for package in PACKAGES:
        for root, _, files in os.walk(os.path.join(REPO, package)):
            for f in files:
                if f.endswith(".py"):
                    modules[module_name(os.path.join(root, f))] = os.path.join(root, f)
    return modules


def imports_of(path, modules):
    """The repo modules that the file at `path` imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            names = [n if n in modules else node.module for n in names]  # a submodule, else the module itself
        else:
            continue
        found |= {n for n in names if n in modules}
    return found


def graph():
    modules = repo_modules()
    return {name: imports_of(path, modules) - {name} for name, path in modules.items()}


def find_cycle(edges, within):
    """One cycle among the modules in `within` (a list of names, the first repeated last), or None."""
    state = {}  # name -> "open" while on the path, "done" after

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            if nxt not in within:
                continue
            if state.get(nxt) == "open":
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt, path + [nxt])):
                return cycle
        state[node] = "done"
        return None

    for start in sorted(within):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


def in_package(package):
    return {m for m in graph() if m == package or m.startswith(package + ".")}


@pytest.mark.parametrize(
    "package",
    [
        "data",
        "bench",
        "train",
    ],
)
def test_no_import_cycle_within(package):
    cycle = find_cycle(graph(), in_package(package))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_import_cycle_across_train_data_and_bench():
    cycle = find_cycle(graph(), set(graph()))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def cycle_through(edges, node):
    """A path from `node` back to itself over the whole graph, or None."""
    stack, came_from = [node], {}
    while stack:
        current = stack.pop()
        for nxt in sorted(edges.get(current, ())):
            if nxt == node:
                path = [current]
                while path[-1] != node:
                    path.append(came_from[path[-1]])
                return path[::-1] + [node]
            if nxt not in came_from:
                came_from[nxt] = current
                stack.append(nxt)
    return None


def test_no_cycle_passes_through_data_or_bench():
    """Whatever else a cycle passes through (train/ included), none passes through data/ or bench/;
    and data/ imports nothing of train/ or bench/."""
    edges = graph()
    for node in sorted(in_package("data") | in_package("bench")):
        cycle = cycle_through(edges, node)
        assert cycle is None, "import cycle: " + " -> ".join(cycle)
    assert not {m for d in in_package("data") for m in edges[d] if not m.startswith("data")}, (
        "data/ imports a module of train/ or bench/"
    )


def test_the_checker_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}, {"a", "b", "c"}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}, {"a", "b"}) is None
    assert cycle_through({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, "b") == ["b", "c", "a", "b"]
    assert cycle_through({"a": {"b"}, "b": set(), "d": {"a"}}, "a") is None
