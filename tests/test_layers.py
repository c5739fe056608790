"""The package's layers import one way only, and no module imports itself through a cycle.

Layers, lowest first (docs/design.md): core <- models <- apply, distributed <- measure <- profile
<- plan <- train <- cli. Imports inside functions count too: a lazy import is still a dependency.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "memfit"

# Rank of each top-level package; a module may import only from its own rank or below.
LAYERS = {
    "core": 0,
    "models": 1,
    "apply": 2,
    "distributed": 3,
    "measure": 4,
    "profile": 5,
    "plan": 6,
    "train": 7,
    "cli": 8,
    "integrations": 8,
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every memfit module that `path` imports, at any depth of the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("memfit"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("memfit"):
            found.add(node.module)
            # `from memfit.apply import selective` names a module, not an attribute.
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                if (SRC.parent / Path(*candidate.split("."))).with_suffix(".py").exists():
                    found.add(candidate)
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in SRC.rglob("*.py")}
    return {name: {m for m in _imports(path) if m in modules} for name, path in modules.items()}


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def test_every_package_has_a_layer():
    packages = {p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages <= set(LAYERS), f"give these packages a layer: {packages - set(LAYERS)}"
    loose = {p.name for p in SRC.glob("*.py")} - {"__init__.py", "__main__.py"}
    assert not loose, f"modules outside any layer: {loose}"


def test_imports_point_down():
    wrong = []
    for module, deps in _graph().items():
        own = _layer(module)
        if own is None:  # memfit/__init__.py re-exports the public API from every layer
            continue
        for dep in deps:
            dep_layer = _layer(dep)
            if dep_layer is not None and dep_layer > own:
                wrong.append(f"{module} imports {dep}")
    assert not wrong, "lower layers import higher ones:\n" + "\n".join(sorted(wrong))


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if dep.startswith(node + ".") or node.startswith(dep + "."):
                continue  # a package and its own submodules
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycles():
    graph = {k: v for k, v in _graph().items() if k != "memfit"}
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_cycle_finder_finds_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("path", sorted(SRC.rglob("*.py")), ids=lambda p: str(p.relative_to(SRC)))
def test_file_and_function_sizes(path: Path):
    text = path.read_text()
    assert text.count("\n") <= 400, f"{path.name} has {text.count(chr(10))} lines (limit 400)"
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            assert length <= 80, f"{path.name}:{node.name} is {length} lines (limit 80)"
