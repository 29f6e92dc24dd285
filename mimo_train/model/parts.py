"""Where a rank's modules sit in the built ``MimoModel``, and the names their weights have in the
whole model: ``global_key`` names a pipeline stage's layer by its index in the whole model
(stages hold ``decoder.layers.<local>``; the global index is ``local + first layer of the
stage``).
"""

from __future__ import annotations

import re

from mimo_data.loading.layout import LANGUAGE
from mimo_train.mcore import DistributedDataParallel
from mimo_train.mcore.grids import Infra

_LAYER = re.compile(r"^(decoder\.layers\.)(\d+)(\..*)$")


def unwrap(module):
    """The module inside megatron-core DDP."""
    return module.module if isinstance(module, DistributedDataParallel) else module


def module_of(model, name: str):
    """Module ``name`` of the ``MimoModel`` (DDP-wrapped once built)."""
    return model.language_model if name == LANGUAGE else model.modality_submodules[name]


def replace_module(model, name: str, module) -> None:
    """Put ``module`` in the place of module ``name`` (its DDP wrapper)."""
    if name == LANGUAGE:
        model.language_model = module
    else:
        model.modality_submodules[name] = module


def local_modules(model, infra: Infra) -> dict:
    """This rank's modules (DDP-wrapped), by name."""
    return {name: module_of(model, name) for name in infra.local}


def layer_offset(infra: Infra, name: str, num_layers: int) -> int:
    """Global index of this rank's first layer of module ``name`` (``num_layers``: the
    language model's)."""
    if name != LANGUAGE:
        return 0
    language = infra.role.module(LANGUAGE)
    return language.pp_rank * (num_layers // language.module.pp)


def global_key(key: str, offset: int) -> str:
    """State-dict key with the layer number of the whole model (``offset``: stage's first)."""
    match = _LAYER.match(key)
    return f"{match[1]}{int(match[2]) + offset}{match[3]}" if match else key

