"""The language model's own layer norms: under sequence parallelism
(``model.language.sequence_parallel``) and zero-centred (Qwen3.5's ``1 + weight``).

megatron-core's local layer spec builds its norms with ``WrappedTorchNorm``, which refuses
``sequence_parallel`` (``transformer/torch_norm.py``: "sequence parallel not supported by
torch LayerNorm") and ``layernorm_zero_centered_gamma``. Under sequence parallelism each
tensor-parallel rank normalizes only its part of the sequence, so the norm weights' gradients
must be summed over the TP ranks, which megatron-core's ``finalize_model_grads`` does for
parameters marked ``sequence_parallel`` (TransformerEngine's and apex's norms mark theirs;
torch's do not exist for it). ``SequenceParallelNorm`` is torch's ``LayerNorm`` / ``RMSNorm``
(``ZeroCenteredRMSNorm`` with zero-centred norms) with that mark; ``layer_specs`` puts it in the
language model's layers, the block's final norm included. Neither TransformerEngine nor apex is
needed (none is installed on CPU, nor on the GPU machines this project checks on).
"""

from __future__ import annotations

import torch



class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm that scales by ``1 + weight`` (the weight starts at zero), computed in fp32 and
    cast back: transformers' ``Qwen3_5RMSNorm``, through torch's ``rms_norm`` (one fused kernel
    on a GPU, where transformers' runs five elementwise ones and a reduction)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.rms_norm(x.float(), (x.size(-1),), 1.0 + self.weight.float(),
                                            self.eps).type_as(x)


class SequenceParallelNorm:
    """torch's norm of ``config.normalization`` (zero-centred with
    ``layernorm_zero_centered_gamma``), its parameters marked ``sequence_parallel`` (their
    gradients summed over the TP group in ``finalize_model_grads``)."""

    marked = True

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_):
        if config.layernorm_zero_centered_gamma:
            assert config.normalization == "RMSNorm", "zero-centred norms are RMSNorms here"
            norm: torch.nn.Module = ZeroCenteredRMSNorm(hidden_size, eps)
        else:
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
