"""The language model's layer norms under sequence parallelism
(``model.language.sequence_parallel``).

megatron-core's local layer spec builds its norms with ``WrappedTorchNorm``, which refuses
``sequence_parallel`` (``transformer/torch_norm.py``: "sequence parallel not supported by
torch LayerNorm"): with it, each tensor-parallel rank normalizes only its part of the
sequence, so the norm weights' gradients must be summed over the TP ranks, which megatron-core's
``finalize_model_grads`` does for parameters marked ``sequence_parallel`` (TransformerEngine's
and apex's norms mark theirs; torch's do not exist for it). ``SequenceParallelNorm`` is torch's
``LayerNorm`` / ``RMSNorm`` with that mark; ``block_spec`` puts it in a local layer spec, the
block's final norm included. Neither TransformerEngine nor apex is needed (none is installed on
CPU, nor on the GPU machines this project checks on).
"""

from __future__ import annotations

import torch

from megatron.core.transformer.transformer_block import TransformerBlockSubmodules


class SequenceParallelNorm:
    """torch's norm of ``config.normalization``, its parameters marked ``sequence_parallel``
    (their gradients summed over the TP group in ``finalize_model_grads``)."""

    marked = True

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_):
        kinds = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        norm = kinds[config.normalization](normalized_shape=hidden_size, eps=eps)
        for parameter in norm.parameters():
            parameter.sequence_parallel = config.sequence_parallel and cls.marked
        return norm


class HeadNorm(SequenceParallelNorm):
    """The query and key norms (qk-norm): they normalize each head of the whole sequence
    after the TP all-gather, so their weights are not marked (``finalize_model_grads`` sums
    their gradients over the TP ranks by name)."""
    marked = False


def block_spec(layer_spec, config) -> TransformerBlockSubmodules | object:
    """``layer_spec`` (a local ``TransformerLayer`` spec) as the block of this pipeline
    stage's layers with ``SequenceParallelNorm`` norms, when ``config`` is sequence parallel;
    otherwise ``layer_spec`` itself. The language model's layers split evenly over the
    stages (``model.build`` checks it)."""
    if not config.sequence_parallel:
        return layer_spec
    submodules = layer_spec.submodules
    submodules.input_layernorm = SequenceParallelNorm
    submodules.pre_mlp_layernorm = SequenceParallelNorm
    attention = submodules.self_attention.submodules
    for name in ("q_layernorm", "k_layernorm"):
        if getattr(attention, name, None) is not None and \
                getattr(getattr(attention, name), "__name__", "") != "IdentityOp":
            setattr(attention, name, HeadNorm)
    layers = config.num_layers // config.pipeline_model_parallel_size
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * layers,
                                      layer_norm=SequenceParallelNorm)
