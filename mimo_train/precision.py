"""Which dtype every part of a run holds.

Pretrained weights are read in fp32 whatever their stored dtype (fp32, bf16, fp16 all upcast
exactly), so every run starts from the same values; ``cast`` then moves a built module to the
run's dtype (``train.precision``). Under bf16, megatron-core's optimizer keeps fp32 main
weights and reduces gradients in fp32 (``grad_reduce_in_fp32``); the modules hold bf16 weights
with these fp32 exceptions:

- rotary frequencies (buffers named ``*inv_freq``: the Qwen2-VL vision tower's
  ``rotary_pos_emb.inv_freq`` and ``original_inv_freq``): in bf16 the angle of position p is off
  by up to p · 2⁻⁸ rad (0.1–0.25 rad at positions 64–128), which moves every rotated query and
  key. transformers keeps them fp32 when it loads a model in bf16, and megatron-core's own
  ``RotaryEmbedding`` holds its ``inv_freq`` as a plain fp32 attribute that no cast reaches.
- the loss: ``step.loss_func`` sums the per-token losses in fp32.

Parameters that are fixed tables in the original model (Whisper's sinusoidal position table)
carry ``FIXED`` and are never trained, whatever ``model.freeze`` says (``mark_fixed``).
"""

from __future__ import annotations

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# buffer-name suffixes that stay fp32 in every run (see the module docstring)
FP32_BUFFERS = ("inv_freq",)
FIXED = "mimo_fixed"                  # attribute of a parameter that is never trained


def run_dtype(precision: str) -> torch.dtype:
    """The dtype of the weights for ``train.precision``."""
    return DTYPES[precision]


def cast(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``module`` with its floating parameters and buffers in ``dtype``, rotary frequencies
    (``FP32_BUFFERS``) kept fp32; returns ``module``."""
    for sub in module.modules():
        for name, buffer in sub._buffers.items():
            if buffer is not None and buffer.is_floating_point():
                sub._buffers[name] = buffer.to(torch.float32 if name.endswith(FP32_BUFFERS)
                                               else dtype)
    for param in module.parameters():
        if param.is_floating_point():
            param.data = param.data.to(dtype)
    return module


def mark_fixed(module: torch.nn.Module, names: tuple[str, ...]) -> None:
    """Mark the parameters ``names`` of ``module`` as fixed tables: not trained."""
    for name in names:
        param = module.get_parameter(name)
        param.requires_grad_(False)
        setattr(param, FIXED, True)


def trainable(param: torch.nn.Parameter, frozen: bool) -> bool:
    """Whether ``param`` trains: its module is not frozen and it is no fixed table."""
    return not frozen and not getattr(param, FIXED, False)
