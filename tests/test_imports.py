"""Layers import downward only: the package's import graph (every `import`, lazy ones inside functions too)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "pipelinerl"
ROLE_PACKAGES = ("actor", "inference", "launch", "trainer", "weights", "streams", "tasks", "rl", "eval",
                 "plan", "cli")


def _graph() -> dict[str, set[str]]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        mods[name] = path

    def resolve(name: str) -> str:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for name, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pipelinerl"):
                deps.add(resolve(node.module))
                deps.update(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in mods)
            elif isinstance(node, ast.Import):
                deps.update(resolve(a.name) for a in node.names if a.name.startswith("pipelinerl"))
        # importing pipelinerl.a.b runs the package pipelinerl.a's __init__ first: a cycle through it is one too
        deps |= {parent for dep in deps for parent in _parents(dep) if parent in mods}
        graph[name] = deps - {name} - set(_parents(name))
    return graph


def _parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(2, len(parts))]


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(component)

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_config_imports_no_role_package():
    graph = _graph()
    bad = {(m, d) for m, deps in graph.items() if m.startswith("pipelinerl.config") for d in deps
           if d.split(".")[1] in ROLE_PACKAGES}
    assert not bad, bad


def test_no_import_cycle():
    assert _cycles(_graph()) == []


def test_importing_eval_sets_first_works():
    """The cycle the graph above now sees (eval.sets -> actor.client -> the actor package's __init__ -> ...), run
    for real in a fresh interpreter."""
    import subprocess
    import sys

    for module in ("pipelinerl.eval.sets", "pipelinerl.eval.servers", "pipelinerl.eval.command",
                   "pipelinerl.tiny.warm_start"):
        out = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
