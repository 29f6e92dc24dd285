"""LoRA adapters (``model.lora``): ``W x + alpha / rank * B A x`` on chosen linear layers of a
module's part, the part's own weights fixed (no gradient buffer, no optimizer state).

Hand-written: megatron-core has no adapters, and PEFT's layers wrap torch's ``nn.Linear`` only
(no tensor-parallel layers, no megatron-core sharded state dicts); Megatron-Bridge, which has
them, is not a dependency. Exported adapters take PEFT's file format (``hf.export``).

Parts are named as ``model.freeze`` names them: ``language``, an encoder module (its tower and
projection), ``<module>.encoder`` (the tower), ``<module>.projection``. A part's layers are named
from its root: the language model's as megatron-core names them, with global layer numbers
(``decoder.layers.3.self_attention.linear_qkv``; a gated delta-net layer's are
``self_attention.in_proj`` and ``self_attention.out_proj``; a mixture of experts' shared expert's
``mlp.shared_experts.linear_fc1`` / ``linear_fc2``, each routed expert's
``mlp.experts.local_experts.<e>.linear_fc1`` / ``linear_fc2`` with the layer's global expert
number e, whichever expert-parallel rank holds it; the router is no linear layer and stays
un-adapted), the tower's as transformers does (``blocks.0.attn.qkv``), the projection's by index
(``0``, ``2``). A target is a layer name (``linear_qkv``: every layer of that name, so
``linear_fc1`` takes in the shared and the routed experts'), a dotted path
(``shared_experts.linear_fc1``), an fnmatch pattern (``decoder.layers.*.mlp.linear_fc1``,
``*.local_experts.*``) or ``all-linear`` (every linear layer but the language model's output
layer and the routed experts', as PEFT's ``all-linear`` on the transformers model, which holds
the routed experts as fused parameters; ``plan.parts.target_matches``).

Tensor parallelism (the language model; encoders run whole on each rank): megatron-core's own
parallel layers hold A and B, so their communication gives each rank the gradients of the TP1
model's adapters:

- a column-parallel layer (``linear_qkv``, ``linear_fc1``, ``in_proj``: input whole, output
  split over TP): A is a ``ColumnParallelLinear`` split by its ``rank`` rows, its output
  gathered (so ``rank`` must be a multiple of TP), B a ``ColumnParallelLinear`` split by output
  rows as the layer is, its input's gradient summed over TP;
- a row-parallel layer (``linear_proj``, ``linear_fc2``, ``out_proj``: input split, output
  reduced): A is a ``RowParallelLinear`` split along its input as the layer is, its output
  summed over TP, B a ``ColumnParallelLinear`` split by output rows with its output gathered.

Under sequence parallelism (a column-parallel layer's input split over TP along the sequence, a
row-parallel layer's output reduce-scattered along it) A of a column-parallel layer gathers the
sequence as the layer does, and a row-parallel layer's adapter keeps its rank's part of the
sequence (its gradient gathered back); B never takes a split sequence.

A routed expert's layers (megatron-core's ``SequentialMLP``) are split over the expert tensor
parallelism (``etp``) and take the tokens the dispatcher sends them, whole on each etp rank;
the dispatcher adds up the etp ranks' outputs and input gradients. Their adapters keep to that:
a column-parallel ``linear_fc1``'s A leaves its input's gradient partial (``is_expert``; its
rank rows split over etp, so ``rank`` must split over etp too), a row-parallel ``linear_fc2``'s
adapter gives B A x as rank r's rows of it in place, zero elsewhere; their weights are reduced
over the expert data parallelism as the expert's (``allreduce`` as megatron-core marks it).

A layer's rows may be sections, each split over TP on its own: a gated delta-net's ``in_proj``
(q, k, v, z, beta, alpha: TP rank r holds ``[q_r; k_r; v_r; z_r; b_r; a_r]``), SwiGLU's
``linear_fc1`` (``[gate_r; up_r]``); so are its B's (``Sections``): B's master weight is drawn
in the TP-1 layout, its rows then put rank by rank in that order, so that megatron-core's split
into TP blocks gives each rank its own (any TP draws the same B).

Checkpoint names: a layer's own weights keep theirs (``...linear_qkv.weight``); its adapter's are
``...linear_qkv.lora.a.weight`` and ``...lora.b.weight``, global tensors ([rank, in] and
[out, rank]; SwiGLU's ``linear_fc1`` B stored as its gate and up halves, as megatron-core stores
the layer; ``in_proj``'s B section by section, ``...in_proj.lora.b.weight.query`` ..., as
megatron-core stores ``in_proj.weight``; a routed expert's stacked along the expert axis, as
megatron-core stores the expert's weights; an adapter that some of the layers megatron-core
stacks have and others not, as its layer's own tensor, ``decoder.layers.<i>.`` + its name), so
a LoRA checkpoint resumes under any TP, PP and EP.
"""

from __future__ import annotations

import copy
import math
import re
import zlib
from collections.abc import Iterable
from typing import NamedTuple

import torch

from mimo_data.loading.layout import LANGUAGE
from mimo_train.config import LoraConfig
from mimo_train.mcore import (ColumnParallelLinear, RowParallelLinear,
                              apply_swiglu_sharded_factory, saved_in_sections,
                              scatter_to_sequence_parallel_region)
from mimo_train.model.parts import global_key
from mimo_train.plan import Adapted
from mimo_train.plan.lora_targets import check_targets
from mimo_train.plan.parts import ROUTED_EXPERTS
from mimo_train.plan.parts import target_matches as matches
_ADAPTER = re.compile(r"(^|\.)lora\.[ab]\.")


def is_adapter(name: str) -> bool:
    """Whether the parameter (or state-dict key) ``name`` is a LoRA adapter's."""
    return _ADAPTER.search(name) is not None


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
        expert = bool(base.is_expert)            # a routed expert's: its group the expert TP
        tp = base.tp_group.size()
        torch.manual_seed(seed)       # the master weights are drawn whole, then split: any TP
        a_init, b_init = _kaiming, _b_init(spec)
        if sections is not None:
            b_init = _rank_by_rank(b_init, sections, tp)
        # the adapter's layers take whole sequences: all but A of a column-parallel layer,
        # which gathers a sequence-parallel input as the layer does
        whole = copy.copy(base.config)
        whole.sequence_parallel = False
        common = dict(bias=False, tp_group=base.tp_group)
        if column:              # an expert's input is whole on each rank, its dgrad partial
            self.a = ColumnParallelLinear(base.input_size, spec.rank, init_method=a_init,
                                          gather_output=True, is_expert=expert,
                                          config=whole if expert else base.config, **common)
        else:
            self.a = RowParallelLinear(base.input_size, spec.rank, init_method=a_init,
                                       input_is_parallel=True, skip_bias_add=True,
                                       config=whole, **common)
        self.b = ColumnParallelLinear(spec.rank, base.output_size, init_method=b_init,
                                      gather_output=not (column or expert), config=whole,
                                      **common)
        # a row-parallel layer's output: sequence parallel, this rank's part of the sequence;
        # an expert's (each rank's partial sum, added up by the token dispatcher), its rows
        # of B A x in place, zero elsewhere
        self.sequence_chunk = not column and not expert and base.config.sequence_parallel \
            and tp > 1
        self.own_rows = not column and expert and tp > 1
        if expert:          # reduced over the expert data parallelism, as the layer's weight
            for parameter in self.parameters():
                parameter.allreduce = getattr(base.weight, "allreduce", True)
        self.dropout = torch.nn.Dropout(spec.dropout)
        self.scale = spec.alpha / spec.rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.b(self.a(self.dropout(x))[0])[0] * self.scale
        group = self.b.tp_group
        if self.sequence_chunk:
            return scatter_to_sequence_parallel_region(out, group)
        if self.own_rows:
            rows, rank = out.size(-1), group.rank()
            return torch.nn.functional.pad(out, (rank * rows, (group.size() - 1 - rank) * rows))
        return out


class LoraParallelLinear(torch.nn.Module):
    """A megatron-core parallel linear layer and its adapter, in the layer's place; its state
    dict keeps the layer's own names (``weight``, not ``base.weight``). ``gated``: SwiGLU's
    ``linear_fc1`` (B saved by halves as megatron-core saves the layer); else ``sections``: the
    layer's rows per TP rank as sections (a gated delta-net's ``in_proj``: B saved by them)."""

    def __init__(self, base, adapter: ParallelLoraAdapter, gated: bool,
                 sections: Sections | None = None, every_layer: bool = True):
        super().__init__()
        self.base, self.lora, self.gated, self.sections = base, adapter, gated, sections
        self.every_layer = every_layer
        self.register_state_dict_post_hook(_without_base)
        self.register_load_state_dict_pre_hook(_with_base)

    def forward(self, x: torch.Tensor, *args, **kwargs):
        output, bias = self.base(x, *args, **kwargs)
        return output + self.lora(x), bias

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        state = self.base.sharded_state_dict(prefix, sharded_offsets, metadata)
        saved, offsets = prefix, tuple(sharded_offsets)
        if not self.every_layer and sharded_offsets:
            # megatron-core stacks alike layers' tensors along a first axis of every layer
            # (offset (0, layer, layers)), which an adapter of some layers' cannot fill: it
            # is saved as its layer's own tensor under its global number, as megatron-core
            # saves layers that differ (the block then cuts ``layers.<local>.`` out of keys)
            (axis, layer, _), *rest = sharded_offsets
            head, found, tail = prefix.partition(".layers.")
            local, _, inner = tail.partition(".")
            if axis != 0 or not found or not local.isdigit():
                raise RuntimeError(f"{prefix}: not a layer of megatron-core's stacked layers "
                                   f"(offsets {sharded_offsets}); its adapter cannot be saved")
            saved, offsets = f"{head}.layers.{local}.{layer}.{inner}", tuple(rest)
        for name in ("a", "b"):
            part = getattr(self.lora, name).sharded_state_dict(f"{prefix}lora.{name}.",
                                                               offsets, metadata)
            for value in part.values():      # the saved names; the state dict's stay
                value.key = saved + value.key[len(prefix):]
            key = f"{prefix}lora.b.weight"
            if self.gated and key in part:           # [gate rows; up rows] per TP rank
                part[key] = apply_swiglu_sharded_factory(
                    part[key], offsets, (metadata or {}).get("singleton_local_shards", False))
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
    names = {(_global_name(root, n, layer_offset) if language else n): n for n in layers}
    if not language:      # the language model's: plan.lora_targets, on every rank
        check_targets(adapted, set(names))
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
                sections, _in_every_layer(name, spec.targets, layer.config.num_layers)))
        else:
            layer.register_module("lora", LoraAdapter(layer.in_features, layer.out_features,
                                                      spec, _seed(seed, key)))
            layer.register_forward_hook(_add_adapter_output)


def _in_every_layer(name: str, targets: list[str], num_layers: int) -> bool:
    """Whether the targets adapt the language model's layer ``name``
    (``decoder.layers.<i>.<rest>``) in every decoder layer, not only in some."""
    rest = name.split(".", 3)[3]
    return all(any(matches(t, f"decoder.layers.{i}.{rest}") for t in targets)
               for i in range(num_layers))


def _global_name(root: torch.nn.Module, local: str, layer_offset: int) -> str:
    """A language model's layer ``local`` (this stage's, this rank's experts) named with its
    global layer number and, a routed expert's, the layer's global expert number
    (expert-parallel rank r holds experts r * E / ep on)."""
    name = global_key(f"{local}.w", layer_offset)[:-2]
    head, found, tail = name.partition(f".{ROUTED_EXPERTS}")
    if not found:
        return name
    experts = root.get_submodule(local.partition(f".{ROUTED_EXPERTS}")[0] + ".mlp.experts")
    index, _, rest = tail.partition(".")
    number = experts.ep_group.rank() * experts.num_local_experts + int(index)
    return f"{head}.{ROUTED_EXPERTS}{number}.{rest}"


def _sections(layer: torch.nn.Module) -> Sections | None:
    """The sections of a gated delta-net's ``in_proj`` rows on each TP rank (megatron-core's
    ``in_proj_split_names`` / ``in_proj_split_sections``), None for another layer."""
    rows = getattr(layer, "in_proj_split_sections", None)
    if rows is None:
        return None
    return Sections(tuple(layer.in_proj_split_names), tuple(rows))


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
