"""The package layout holds (docs/architecture.md, "The package map"): read from the source's own
imports (``ast``, every import, inside functions too), no module of ``mimo_data`` or
``mimo_train`` is in an import circle, ``mimo_data`` never imports ``mimo_train``, each
``mimo_train`` layer imports only layers below it, and no family module imports the registry.
"""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

# mimo_train's layers from the bottom up; a module may import its own layer's and lower ones'
LAYERS = [("errors", "precision"), ("runtime",), ("config",), ("mcore",), ("families",),
          ("plan",), ("components", "model", "planning"), ("training", "hf"),
          ("cli", "__main__", "inspect_cli")]


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """module -> the mimo modules it imports (a package import counts as its ``__init__``;
    ``from package import module`` as that module)."""
    paths = [p for package in ("mimo_data", "mimo_train") for p in (REPO / package).rglob("*.py")]
    known = {_module_name(p) for p in paths}
    graph: dict[str, set[str]] = {}
    for path in paths:
        name = _module_name(path)
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets.add(node.module)
                targets |= {f"{node.module}.{alias.name}" for alias in node.names}
        graph[name] = {t for t in targets if t in known and t != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle, or None."""
    state: dict[str, int] = {}               # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (found := visit(target)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _layer(module: str) -> int:
    part = module.split(".")[1] if "." in module else "__init__"
    return next((i for i, names in enumerate(LAYERS) if part in names), len(LAYERS))


def test_no_import_circle():
    graph = _imports()
    assert len(graph) > 80 and any(graph.values())          # the reading found the modules
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_imports_run_down_the_layers():
    wrong = []
    for module, targets in _imports().items():
        for target in targets:
            if module.startswith("mimo_data") and target.startswith("mimo_train"):
                wrong.append(f"{module} -> {target} (mimo_data never imports mimo_train)")
            elif module.startswith("mimo_train.") and target.startswith("mimo_train.") and \
                    _layer(target) > _layer(module):
                wrong.append(f"{module} -> {target} (up the layers)")
            elif module.startswith("mimo_train.families.") and \
                    target == "mimo_train.families.registry" and \
                    module != "mimo_train.families.registry":
                wrong.append(f"{module} -> {target} (a family imports the registry)")
    assert not wrong, "\n".join(sorted(wrong))


def test_the_checks_see_a_circle_and_an_upward_import():
    """The checks above fail on what they look for (a circle of two, an import upwards)."""
    assert _cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert _layer("mimo_train.config") < _layer("mimo_train.families.registry")
    assert _layer("mimo_train.runtime.console") < _layer("mimo_train.mcore.grids")
