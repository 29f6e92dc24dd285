"""The package layout holds (docs/architecture.md, "The package map"): read from the source's own
imports (``ast``, every import, inside functions too), no module of ``mimo_data`` or
``mimo_train`` is in an import circle, ``mimo_data`` never imports ``mimo_train``, each
layer of either imports only layers below it, and no family module imports the registry;
and only ``mimo_train.mcore`` reaches into megatron-core (``mcore/__init__``): no other module
imports it, takes a private name from it or from ``mcore``, reads a private attribute of what
they give, or patches it.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

from conftest import REPO

# each package's layers from the bottom up; a module may import its own layer's and lower
# ones'
LAYERS = {
    "mimo_train": [("errors", "precision", "checkpoint_folders"), ("runtime",), ("config",),
                   ("mcore",), ("families",), ("plan",), ("components", "model", "planning"),
                   ("training", "hf"), ("cli", "__main__", "inspect_cli")],
    "mimo_data": [("errors", "arguments", "files", "tally", "stats", "process_memory",
                   "worker_pool", "hub", "interrupts", "forkserver_hook", "stdout"),
                  ("modalities",), ("shards",), ("preprocess",), ("loading",), ("inspect",)]}


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
    package, *rest = module.split(".")
    part = rest[0] if rest else "__init__"
    layers = LAYERS[package]
    return next((i for i, names in enumerate(layers) if part in names), len(layers))


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
            elif module.split(".")[0] == target.split(".")[0] and "." in module \
                    and "." in target and _layer(target) > _layer(module):
                wrong.append(f"{module} -> {target} (up the layers)")
            elif module.startswith("mimo_train.families.") and \
                    target == "mimo_train.families.registry" and \
                    module != "mimo_train.families.registry":
                wrong.append(f"{module} -> {target} (a family imports the registry)")
    assert not wrong, "\n".join(sorted(wrong))


def test_the_package_map_names_every_module():
    """docs/architecture.md's map names each module of both packages (a new one is added to
    it where it is added to the tree)."""
    import re
    text = (REPO / "docs" / "architecture.md").read_text()
    unnamed = [str(path.relative_to(REPO)) for package in ("mimo_data", "mimo_train")
               for path in sorted((REPO / package).rglob("*.py"))
               if path.stem not in ("__init__", "__main__")
               and not re.search(rf"\b{re.escape(path.stem)}\b", text)]
    assert not unnamed, f"docs/architecture.md does not name: {', '.join(unnamed)}"


def test_the_checks_see_a_circle_and_an_upward_import():
    """The checks above fail on what they look for (a circle of two, an import upwards)."""
    assert _cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert _layer("mimo_train.config") < _layer("mimo_train.families.registry")
    assert _layer("mimo_train.runtime.console") < _layer("mimo_train.mcore.grids")
    assert _layer("mimo_data.tally") < _layer("mimo_data.loading.packing")
    assert _layer("mimo_data.shards.build") < _layer("mimo_data.preprocess.preprocessor")


# ------------------------------------------------------------- only mcore reaches megatron-core

GATEWAY = "mimo_train.mcore"
# Private attributes of other libraries' objects read outside mcore, each with its reason:
# (module, attribute)
OTHER_LIBRARIES = {
    ("mimo_train.precision", "_buffers"),              # torch.nn.Module's buffers, reassigned
    ("mimo_train.families.qwen2_vl", "_from_config"),  # transformers' model from its config
    ("mimo_train.families.siglip", "_from_config"),
    # transformers' config property that holds the attention implementation (its setter):
    # set_attn_implementation would load the flash-attn package for mimo's varlen name
    ("mimo_train.model.tower_attention", "_attn_implementation"),
    # torch.compile's error at its recompile limit under fullgraph (no public name)
    ("mimo_train.runtime.compile", "_dynamo"),
    ("mimo_data.worker_pool", "_exit"),         # os._exit: documented, the child's way out
    # os._exit from a watching thread (signal.signal works in the main thread alone)
    ("mimo_train.runtime.preemption", "_exit"),
    # the executor's workers, to kill them: Python 3.12 has no public way (3.14's
    # terminate_workers)
    ("mimo_data.worker_pool", "_processes"),
}
HARMLESS = {"__name__", "__qualname__", "__module__", "__doc__"}


def _private(name: str) -> bool:
    """A private name, dunders included (``__dataclass_fields__``) but ``HARMLESS``."""
    return name.startswith("_") and name not in HARMLESS


def _dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def _root(node: ast.expr) -> ast.expr:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


def _megatron_reaches(module: str, source: str) -> list[str]:
    """What ``module`` (outside ``mcore``) does that only ``mcore`` may, as far as its source
    tells: (a) import megatron-core, or a private name from it or from ``mcore``; (b) read a
    private attribute (dunders too) of a name taken from either or of what calling one made,
    or one not a dunder of any object but ``self`` / ``cls`` (but ``OTHER_LIBRARIES``), or
    name one in ``getattr`` / ``setattr`` / ``delattr`` / ``hasattr``; (c) patch one: assign
    an attribute of a name taken from either, replace a method of what calling one made (its
    class defines the attribute as a function), ``setattr`` / ``delattr`` on either."""
    tree = ast.parse(source)
    found: list[str] = []
    taken: dict[str, object] = {}      # name -> what it was bound to from megatron-core / mcore
    made: dict[str, object] = {}       # name -> the class of the object a call of one made

    def gateway_object(origin: str, name: str):
        return getattr(importlib.import_module(origin), name, None)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "megatron":
                    found.append(f"imports {alias.name}")
                elif alias.name.startswith(GATEWAY):
                    taken[(alias.asname or alias.name).split(".")[0]] = None
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            source_module = node.module
            if source_module.split(".")[0] == "megatron":
                found.append(f"imports {source_module}")
            gateway = source_module.startswith(GATEWAY) or (
                source_module == "mimo_train" and any(a.name == "mcore" for a in node.names))
            if not gateway and source_module.split(".")[0] != "megatron":
                continue
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"imports the private {alias.name} from {source_module}")
                taken[alias.asname or alias.name] = gateway_object(source_module, alias.name) \
                    if gateway else None
    for node in ast.walk(tree):                 # what calls of those names made
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and \
                isinstance(node.value.func, ast.Name) and node.value.func.id in taken:
            for target in node.targets:
                if isinstance(target, ast.Name):
                    made[target.id] = taken[node.value.func.id]

    def megatrons(node: ast.expr) -> str | None:
        root = _root(node)
        if isinstance(root, ast.Name) and (root.id in taken or root.id in made):
            return root.id
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            owner = node.value
            mine = isinstance(owner, ast.Name) and owner.id in ("self", "cls") or \
                isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and \
                owner.func.id == "super"
            if megatrons(owner) or not (mine or _dunder(node.attr) or
                                        (module, node.attr) in OTHER_LIBRARIES):
                found.append(f"line {node.lineno}: reads the private .{node.attr} of "
                             f"{ast.unparse(owner)}")
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if not isinstance(target, ast.Attribute):
                    continue
                owner, root = target.value, _root(target.value)
                if isinstance(root, ast.Name) and root.id in taken:
                    found.append(f"line {node.lineno}: patches {ast.unparse(target)}")
                elif isinstance(owner, ast.Name) and owner.id in made and \
                        callable(getattr(made[owner.id], target.attr, None)):
                    found.append(f"line {node.lineno}: replaces the method "
                                 f"{ast.unparse(target)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("getattr", "setattr", "delattr", "hasattr") and node.args:
            name = node.args[1] if len(node.args) > 1 else None
            if isinstance(name, ast.Constant) and isinstance(name.value, str) and \
                    _private(name.value) and ast.unparse(node.args[0]) not in ("self", "cls"):
                found.append(f"line {node.lineno}: {node.func.id} of the private {name.value}")
            elif node.func.id in ("setattr", "delattr") and megatrons(node.args[0]):
                found.append(f"line {node.lineno}: {node.func.id} on {ast.unparse(node.args[0])}")
    return found


def test_only_mcore_reaches_into_megatron_core():
    reaches, gateway_users = [], 0
    for package in ("mimo_data", "mimo_train"):
        for path in sorted((REPO / package).rglob("*.py")):
            module = _module_name(path)
            if module == GATEWAY or module.startswith(GATEWAY + "."):
                continue
            source = path.read_text()
            gateway_users += GATEWAY in source
            reaches += [f"{module}: {what}" for what in _megatron_reaches(module, source)]
    assert gateway_users >= 8                   # the reading found mcore's users
    assert not reaches, "\n".join(reaches)


def test_the_reach_check_sees_imports_private_names_and_patches():
    """The check above fails on each thing it looks for, and passes public uses."""
    source = """
import megatron.core
from megatron.core import parallel_state
from mimo_train.mcore import _get_pg_collection_for_optimizer, DistributedOptimizer, parallel_state
from mimo_train.mcore import TransformerConfig, get_megatron_optimizer
from mimo_train.mcore.grids import _collection
from mimo_train import mcore

parallel_state._GLOBAL_MEMORY_BUFFER
TransformerConfig.__dataclass_fields__
mcore.filesystem_async._results_queue = None
DistributedOptimizer.step = lambda self: None
optimizer = get_megatron_optimizer(config, chunks)
optimizer._set_main_param_and_optimizer_states = None
optimizer.chained_optimizers[0]._copy_main_params_to_model_params()
inner = DistributedOptimizer(*args)
inner.step = None
setattr(parallel_state, "x", 1)
getattr(inner, "_set_main_param_and_optimizer_states")
other._private_thing
"""
    found = _megatron_reaches("mimo_train.components.x", source)
    assert sorted(found) == sorted([
        "imports megatron.core", "imports megatron.core",
        "imports the private _get_pg_collection_for_optimizer from mimo_train.mcore",
        "imports the private _collection from mimo_train.mcore.grids",
        "line 9: reads the private ._GLOBAL_MEMORY_BUFFER of parallel_state",
        "line 10: reads the private .__dataclass_fields__ of TransformerConfig",
        "line 11: reads the private ._results_queue of mcore.filesystem_async",
        "line 11: patches mcore.filesystem_async._results_queue",
        "line 12: patches DistributedOptimizer.step",
        "line 14: reads the private ._set_main_param_and_optimizer_states of optimizer",
        "line 15: reads the private ._copy_main_params_to_model_params of "
        "optimizer.chained_optimizers[0]",
        "line 17: replaces the method inner.step",
        "line 18: setattr on parallel_state",
        "line 19: getattr of the private _set_main_param_and_optimizer_states",
        "line 20: reads the private ._private_thing of other"]), found
    public = """
from mimo_train.mcore import TransformerConfig, get_megatron_optimizer
from mimo_train.mcore.bridge_routing import RoutedMimoModel

config = TransformerConfig(num_layers=1)
config.finalize_model_grads_func = finalize
model = RoutedMimoModel(mimo_config)
model.model_type = None
self._own = get_megatron_optimizer(config, chunks).chained_optimizers
super()._also_own()
"""
    assert _megatron_reaches("mimo_train.components.x", public) == []
