"""The language model's layer specs for a pipeline stage: megatron-core's local
``TransformerLayer`` (``get_gpt_layer_local_spec``: the attention with mimo's ``CoreAttention``,
a dense MLP or a mixture of experts with its shared expert, the experts ``GroupedExperts``),
and for a hybrid decoder (Qwen3.5)
the gated delta-net layer (``gated_delta_net.module_spec``) at each linear-attention layer.

The norms are megatron-core's own (``WrappedTorchNorm``) where it can take them; under sequence
parallelism or with zero-centred norms (``layernorm_zero_centered_gamma``, which
``WrappedTorchNorm`` refuses) they are ``norms.SequenceParallelNorm`` (and ``HeadNorm`` for the
qk-norms), the block's final norm included; the delta-net's gated norm is its own
(``GatedNorm``: Qwen3.5 does not zero-centre it).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Sequence

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from mimo_train.mcore.attention import CoreAttention
from mimo_train.mcore.gated_delta_net import module_spec as gated_delta_net_spec
from mimo_train.mcore.grouped_experts import GroupedExperts
from mimo_train.mcore.norms import HeadNorm, SequenceParallelNorm


def language_block_spec(config, *, backend: str, experts: int = 0, qk_norm: bool = False,
                        linear_layers: Sequence[bool] = (), first_layer: int = 0,
                        seed: int | None = None) -> ModuleSpec | TransformerBlockSubmodules:
    """The block of this pipeline stage's layers (global ``first_layer`` on, as many as
    ``config`` gives a stage): attention with ``CoreAttention`` of ``backend``, ``experts``
    routed experts (0: a dense MLP), qk-norms, a gated delta-net where ``linear_layers`` (one
    flag per global layer) says so. One ``TransformerLayer`` spec where every layer is alike and
    megatron-core's norms serve. ``seed``: each layer draws its weights from (``seed``, its
    global number) (``_seeded``); None: from the RNG as the caller left it."""
    layer = get_gpt_layer_local_spec(num_experts=experts or None, moe_grouped_gemm=False,
                                     normalization=config.normalization, qk_layernorm=qk_norm)
    if seed is not None:
        layer.module = _seeded(layer.module, seed, first_layer)
    if experts:                  # SequentialMLP's experts, as grouped GEMMs where exact
        moe = layer.submodules.mlp.keywords["submodules"]
        moe.experts = functools.partial(GroupedExperts, *moe.experts.args,
                                        **moe.experts.keywords)
    layer.submodules.self_attention.submodules.core_attention = ModuleSpec(
        module=CoreAttention, params=dict(backend=backend))
    own_norms = config.sequence_parallel or config.layernorm_zero_centered_gamma
    if not own_norms and not any(linear_layers):
        return layer
    if own_norms:
        _own_norms(layer)
    linear = copy.deepcopy(layer)
    linear.submodules.self_attention = gated_delta_net_spec()
    count = config.num_layers // config.pipeline_model_parallel_size
    flags = list(linear_layers) or [False] * config.num_layers
    return TransformerBlockSubmodules(
        layer_specs=[linear if flags[i] else layer
                     for i in range(first_layer, first_layer + count)],
        layer_norm=SequenceParallelNorm if own_norms else layer.submodules.input_layernorm)


def _seeded(layer: type, seed: int, first_layer: int) -> type:
    """``layer`` (a layer class) seeding the CPU RNG, where weights are drawn, from ``seed``
    and its global number before it draws them: a pipeline stage builds only its own layers
    (megatron-core's ``layer_number``: 1 for the stage's first, global ``first_layer``), and
    each starts from the weights one stage would give it."""
    class Seeded(layer):
        def __init__(self, *args, layer_number: int = 1, **kwargs):
            torch.manual_seed(seed + 7_919 * (first_layer + layer_number))
            super().__init__(*args, layer_number=layer_number, **kwargs)
    Seeded.__name__ = Seeded.__qualname__ = f"Seeded{layer.__name__}"
    return Seeded


def _own_norms(layer: ModuleSpec) -> None:
    """``layer``'s norms as ``SequenceParallelNorm`` (the qk-norms ``HeadNorm``)."""
    submodules = layer.submodules
    submodules.input_layernorm = SequenceParallelNorm
    submodules.pre_mlp_layernorm = SequenceParallelNorm
    attention = submodules.self_attention.submodules
    for name in ("q_layernorm", "k_layernorm"):
        if getattr(attention, name, None) is not None and \
                getattr(getattr(attention, name), "__name__", "") != "IdentityOp":
            setattr(attention, name, HeadNorm)
