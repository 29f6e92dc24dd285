"""LoRA adapters (``model.lora``): ``W x + alpha / rank * B A x`` on chosen linear layers of a
module's part, the part's own weights fixed (no gradient buffer, no optimizer state).

Hand-written: megatron-core has no adapters, and PEFT's layers wrap torch's ``nn.Linear`` only
(no tensor-parallel layers, no megatron-core sharded state dicts); Megatron-Bridge, which has
them, is not a dependency. Exported adapters take PEFT's file format (``hf.export``).

Parts are named as ``model.freeze`` names them: ``language``, an encoder module (its tower and
projection), ``<module>.encoder`` (the tower), ``<module>.projection``. A part's layers are named
from its root: the language model's as megatron-core names them, with global layer numbers
(``decoder.layers.3.self_attention.linear_qkv``; a gated delta-net layer's are
``self_attention.in_proj`` and ``self_attention.out_proj``), the tower's as transformers does
(``blocks.0.attn.qkv``), the projection's by index (``0``, ``2``). A target is a layer name
(``linear_qkv``: every layer of that name), a dotted path, an fnmatch pattern
(``decoder.layers.*.mlp.linear_fc1``) or ``all-linear`` (every linear layer but the language
model's output layer, as PEFT's ``all-linear``).

Tensor parallelism (the language model; encoders run whole on each rank): megatron-core's own
parallel layers hold A and B, so their communication gives each rank the gradients of the TP1
model's adapters:

- a column-parallel layer (``linear_qkv``, ``linear_fc1``, ``in_proj``: input whole, output
  split over TP): A is a ``ColumnParallelLinear`` split by its ``rank`` rows, its output
  gathered (so ``rank`` must be a multiple of TP), B a ``ColumnParallelLinear`` split by output
  rows as the layer is;
- a row-parallel layer (``linear_proj``, ``linear_fc2``, ``out_proj``: input split, output
  reduced): A is a ``RowParallelLinear`` split along its input as the layer is, B a
  ``ColumnParallelLinear`` split by output rows with its output gathered.

A layer's rows may be sections, each split over TP on its own: a gated delta-net's ``in_proj``
(q, k, v, z, beta, alpha: TP rank r holds ``[q_r; k_r; v_r; z_r; b_r; a_r]``), SwiGLU's
``linear_fc1`` (``[gate_r; up_r]``); so are its B's (``Sections``): B's master weight is drawn
in the TP-1 layout, its rows then put rank by rank in that order, so that megatron-core's split
into TP blocks gives each rank its own (any TP draws the same B).

Checkpoint names: a layer's own weights keep theirs (``...linear_qkv.weight``); its adapter's are
``...linear_qkv.lora.a.weight`` and ``...lora.b.weight``, global tensors ([rank, in] and
[out, rank]; SwiGLU's ``linear_fc1`` B stored as its gate and up halves, as megatron-core stores
the layer; ``in_proj``'s B section by section, ``...in_proj.lora.b.weight.query`` ..., as
megatron-core stores ``in_proj.weight``), so a LoRA checkpoint resumes under any TP and PP.
"""

from __future__ import annotations

import fnmatch
import math
import re
import zlib
from collections.abc import Iterable
from typing import NamedTuple

import torch

from mimo_data.loading.layout import LANGUAGE
from mimo_train.config import LoraConfig
from mimo_train.errors import TrainConfigError
from mimo_train.mcore import (ColumnParallelLinear, RowParallelLinear,
                              apply_swiglu_sharded_factory, saved_in_sections)
from mimo_train.model.parts import global_key
from mimo_train.plan import Adapted

ALL_LINEAR = "all-linear"
# the linear layers of each decoder layer of mimo's language model (megatron-core's local spec)
# (a gated delta-net layer's ``self_attention`` has ``in_proj`` and ``out_proj`` instead)
LANGUAGE_LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj",
                    "self_attention.in_proj", "self_attention.out_proj",
                    "mlp.linear_fc1", "mlp.linear_fc2")
_ADAPTER = re.compile(r"(^|\.)lora\.[ab]\.")


def is_adapter(name: str) -> bool:
    """Whether the parameter (or state-dict key) ``name`` is a LoRA adapter's."""
    return _ADAPTER.search(name) is not None


def check_language_targets(adapted: Iterable[Adapted], num_layers: int) -> None:
    """Every target of the language model's adapters names one of its linear layers (on
    every rank, whichever modules it holds)."""
    for each in adapted:
        if each.part.module == LANGUAGE:
            _check_targets(each, {f"decoder.layers.{i}.{n}" for i in range(num_layers)
                                  for n in LANGUAGE_LINEARS})


class LoraAdapter(torch.nn.Module):
    """``x -> scale * B(A(dropout(x)))`` beside a torch ``Linear`` (towers, projections)."""

    def __init__(self, in_features: int, out_features: int, spec: LoraConfig, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.a = torch.nn.Linear(in_features, spec.rank, bias=False)
        self.b = torch.nn.Linear(spec.rank, out_features, bias=False)
        _kaiming(self.a.weight)
        _b_init(spec)(self.b.weight)
        self.dropout = torch.nn.Dropout(spec.dropout)
        self.scale = spec.alpha / spec.rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(self.dropout(x))) * self.scale


def _kaiming(weight: torch.Tensor) -> None:
    """torch's Linear initialization, PEFT's for A."""
    torch.nn.init.kaiming_uniform_(weight, a=math.sqrt(5))


def _b_init(spec: LoraConfig):
    """PEFT's initialization of B: zero, or as A (``init_lora_weights: false``)."""
    return torch.nn.init.zeros_ if spec.init_lora_weights else _kaiming


def _add_adapter_output(linear, args, output):
    """Forward hook of a torch ``Linear`` holding ``lora``."""
    return output + linear.lora(args[0])


class Sections(NamedTuple):
    """A column-parallel layer's output rows on each TP rank as sections (a gated delta-net's
    ``in_proj``): their names and each one's rows on one rank."""
    names: tuple[str, ...]
    rows: tuple[int, ...]


def _rank_by_rank(init, sections: Sections, tp: int):
    """``init`` of a master weight drawn in the TP-1 layout (each section whole, one after
    another), its rows then ordered rank by rank, each rank's rows of every section in turn:
    megatron-core's CPU initialization splits the master weight into ``tp`` blocks of rows."""
    def draw(weight: torch.Tensor) -> None:
        init(weight)
        whole = weight.split([rows * tp for rows in sections.rows])
        weight.copy_(torch.cat([section.chunk(tp)[rank] for rank in range(tp)
                                for section in whole]))
    return draw


class ParallelLoraAdapter(torch.nn.Module):
    """The adapter of a megatron-core parallel linear layer (see the module docstring);
    ``sections``: the layer's output rows per TP rank as sections, B's too."""

    def __init__(self, base, spec: LoraConfig, seed: int, sections: Sections | None = None):
        super().__init__()
        column = isinstance(base, ColumnParallelLinear)
        torch.manual_seed(seed)       # the master weights are drawn whole, then split: any TP
        a_init, b_init = _kaiming, _b_init(spec)
        if sections is not None:
            b_init = _rank_by_rank(b_init, sections, base.tp_group.size())
        common = dict(config=base.config, bias=False, tp_group=base.tp_group)
        if column:
            self.a = ColumnParallelLinear(base.input_size, spec.rank, init_method=a_init,
                                          gather_output=True, **common)
        else:
            self.a = RowParallelLinear(base.input_size, spec.rank, init_method=a_init,
                                       input_is_parallel=True, skip_bias_add=True, **common)
        self.b = ColumnParallelLinear(spec.rank, base.output_size, init_method=b_init,
                                      gather_output=not column, **common)
        self.dropout = torch.nn.Dropout(spec.dropout)
        self.scale = spec.alpha / spec.rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(self.dropout(x))[0])[0] * self.scale


class LoraParallelLinear(torch.nn.Module):
    """A megatron-core parallel linear layer and its adapter, in the layer's place; its state
    dict keeps the layer's own names (``weight``, not ``base.weight``). ``gated``: SwiGLU's
    ``linear_fc1`` (B saved by halves as megatron-core saves the layer); else ``sections``: the
    layer's rows per TP rank as sections (a gated delta-net's ``in_proj``: B saved by them)."""

    def __init__(self, base, adapter: ParallelLoraAdapter, gated: bool,
                 sections: Sections | None = None):
        super().__init__()
        self.base, self.lora, self.gated, self.sections = base, adapter, gated, sections
        self.register_state_dict_post_hook(_without_base)
        self.register_load_state_dict_pre_hook(_with_base)

    def forward(self, x: torch.Tensor, *args, **kwargs):
        output, bias = self.base(x, *args, **kwargs)
        return output + self.lora(x), bias

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        state = self.base.sharded_state_dict(prefix, sharded_offsets, metadata)
        for name in ("a", "b"):
            part = getattr(self.lora, name).sharded_state_dict(f"{prefix}lora.{name}.",
                                                               sharded_offsets, metadata)
            key = f"{prefix}lora.b.weight"
            if self.gated and key in part:           # [gate rows; up rows] per TP rank
                part[key] = apply_swiglu_sharded_factory(
                    part[key], sharded_offsets,
                    (metadata or {}).get("singleton_local_shards", False))
            elif self.sections is not None and key in part:
                part[key] = saved_in_sections(part[key], self.sections.rows,
                                              self.sections.names)
            state.update(part)
        return state


def _without_base(module, state_dict, prefix, local_metadata) -> None:
    for key in [k for k in state_dict if k.startswith(prefix + "base.")]:
        state_dict[prefix + key[len(prefix) + len("base."):]] = state_dict.pop(key)


def _with_base(module, state_dict, prefix, *args) -> None:
    for key in [k for k in state_dict if k.startswith(prefix)
                and not k.startswith((prefix + "lora.", prefix + "base."))]:
        state_dict[prefix + "base." + key[len(prefix):]] = state_dict.pop(key)


def _seed(seed: int, name: str) -> int:
    """The seed of one layer's adapter: the same whichever rank builds it."""
    return seed * 1_000_003 + zlib.crc32(name.encode())


def _linears(root: torch.nn.Module, language: bool) -> dict[str, torch.nn.Module]:
    """The part's linear layers by name from ``root``."""
    kinds = (ColumnParallelLinear, RowParallelLinear) if language else (torch.nn.Linear,)
    return {name: module for name, module in root.named_modules()
            if isinstance(module, kinds) and name and not name.startswith("output_layer")
            and ".lora." not in f".{name}."}


def matches(target: str, name: str) -> bool:
    return target == ALL_LINEAR or name == target or name.endswith("." + target) or \
        fnmatch.fnmatchcase(name, target)


def add_adapters(module: torch.nn.Module, adapted: Adapted, seed: int,
                 layer_offset: int) -> None:
    """Put adapters on the targeted linear layers of ``adapted``'s part of ``module`` (this
    rank's, not yet DDP-wrapped). ``layer_offset``: the global number of the stage's first
    layer."""
    part, spec = adapted.part, adapted.spec
    language = part.module == LANGUAGE
    root = module
    if part.part == "encoder":
        root = module.encoders[next(iter(module.encoders))].encoder.model
    elif part.part == "projection":
        root = module.input_projections[0]
    layers = _linears(root, language)
    names = {(global_key(f"{n}.w", layer_offset)[:-2] if language else n): n for n in layers}
    if not language:      # the language model's: check_language_targets, on every rank
        _check_targets(adapted, set(names))
    for name, local in names.items():
        if not any(matches(t, name) for t in spec.targets):
            continue
        layer = layers[local]
        key = f"{part.name}:{name}"
        if language:
            gated = local.endswith("linear_fc1") and layer.config.gated_linear_unit
            parent, _, child = local.rpartition(".")
            owner = root.get_submodule(parent)
            sections = _sections(owner) if child == "in_proj" else None
            if gated:                                # [gate_r; up_r] on TP rank r
                half = layer.output_size_per_partition // 2
                sections = Sections(("gate", "up"), (half, half))
            owner.register_module(child, LoraParallelLinear(
                layer, ParallelLoraAdapter(layer, spec, _seed(seed, key), sections), gated,
                sections))
        else:
            layer.register_module("lora", LoraAdapter(layer.in_features, layer.out_features,
                                                      spec, _seed(seed, key)))
            layer.register_forward_hook(_add_adapter_output)


def _sections(layer: torch.nn.Module) -> Sections | None:
    """The sections of a gated delta-net's ``in_proj`` rows on each TP rank (megatron-core's
    ``in_proj_split_names`` / ``in_proj_split_sections``), None for another layer."""
    rows = getattr(layer, "in_proj_split_sections", None)
    if rows is None:
        return None
    return Sections(tuple(layer.in_proj_split_names), tuple(rows))


def _check_targets(adapted: Adapted, names: set[str]) -> None:
    """Every target of ``adapted`` names one of its part's linear layers ``names``."""
    for target in adapted.spec.targets:
        if not any(matches(target, n) for n in names):
            shown = sorted({re.sub(r"\.\d+\.", ".*.", n) for n in names})
            raise TrainConfigError(f"model.lora.{adapted.part.name}.targets has {target!r}, "
                                   f"which names none of its linear layers: {shown[:12]}")


def bases(cfg) -> list[tuple[str, str]]:
    """Where a LoRA run's fixed weights come from: ``(config key, path)`` of
    ``model.init_from`` (which replaces the others), else of each pretrained checkpoint."""
    model = cfg.model
    if model.init_from:
        return [("model.init_from", model.init_from)]
    found = [("model.pretrained", model.pretrained)] if model.pretrained else []
    if model.language.pretrained and model.language.pretrained != model.pretrained:
        found.append(("model.language.pretrained", model.language.pretrained))
    found += [(f"model.encoders.{name}.pretrained", spec.pretrained)
              for name, spec in model.encoders.items()
              if spec.pretrained and spec.pretrained != model.pretrained]
    return found


def spec_of(adapted: Iterable[Adapted], module: str, key: str) -> LoraConfig:
    """The ``model.lora`` settings of the adapter at state-dict key ``key`` of ``module``."""
    return next(a.spec for a in adapted
                if a.part.module == module and key.startswith(a.part.prefix))


def merged(module: str, state: dict, adapted: Iterable[Adapted]) -> dict:
    """A module's state dict (one process, whole tensors) with each adapter folded into its
    layer's weight, ``W + alpha / rank * B @ A`` computed in fp32 and stored in W's dtype, and
    the adapter keys dropped (``adapted``: the plan's parts under LoRA)."""
    out = {k: v for k, v in state.items() if not is_adapter(k)}
    for key in state:
        if not key.endswith("lora.a.weight"):
            continue
        layer = key[:-len("lora.a.weight")]
        spec = spec_of(adapted, module, key)
        a, b = state[key].float(), state[layer + "lora.b.weight"].float()
        weight = out[layer + "weight"]
        out[layer + "weight"] = (weight.float() + spec.alpha / spec.rank * (b @ a)
                                 ).to(weight.dtype)
    return out
