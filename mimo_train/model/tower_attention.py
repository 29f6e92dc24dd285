"""The encoder towers' attention: all items of a micro-batch in one varlen kernel call.

transformers' Qwen2-VL-family towers (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5) attend within
each image, frame or window (``cu_seqlens``). Under ``sdpa`` they split every layer's queries,
keys and values per item on the host (``lengths.tolist()``) and call SDPA once per item: on a
GPU ~40 images a micro-batch make ~40 small kernels per layer, forward and backward, and the
GPU waits for the host (the H200 profile of the packed 8k case: cuDNN SDPA the top kernels,
41% of the step idle). An implementation whose name says "flash" instead gets the whole row at
once with its boundaries (``is_flash_attention_requested``, transformers 5.17 and 5.24 alike),
which transformers serves only with the flash-attn package or a hub kernel; ``VARLEN`` here is
torch's own ``varlen_attn`` (flash kernels, CUDA, bf16) registered under such a name.

``AttentionChoice.encoders == "varlen"`` (``mcore.attention.choose``: CUDA, bf16, a
flash-capable GPU, no flash-attn) puts it on towers that give boundaries
(``Encoder.attends_by_boundaries``); other towers and choices keep transformers' own
implementations. tests/test_tower_attention.py checks the tower's output and gradients against
transformers' own ``sdpa`` with the kernel replaced by a stand-in (the kernel needs CUDA); the
GPU check's ``varlen`` probe checks the kernel itself, causal and not.
"""

from __future__ import annotations

import torch

VARLEN = "mimo_flash_varlen"     # "flash" in it: transformers then hands over the boundaries


def varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask: torch.Tensor | None,
                     scaling: float | None = None, dropout: float = 0.0,
                     cu_seq_lens_q: torch.Tensor | None = None,
                     cu_seq_lens_k: torch.Tensor | None = None,
                     max_length_q: int | None = None, max_length_k: int | None = None,
                     is_causal: bool = False, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: ``query`` ``[1, heads, tokens, dim]`` (the
    items one after another, ``cu_seq_lens_*`` their boundaries) -> ``[1, tokens, heads,
    dim]``. A call without boundaries (a tower that does not give them) is transformers'
    SDPA."""
    if cu_seq_lens_q is None or cu_seq_lens_k is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, is_causal=is_causal,
                                      **kwargs)
    if dropout:
        raise ValueError("the towers' varlen attention takes no dropout "
                         "(model.attention: sdpa runs transformers' own)")
    from torch.nn.attention.varlen import varlen_attn
    # [t, h, d]; squeezed, not indexed: indexing's backward writes the gradient into zeros
    q, k, v = (t.squeeze(0).transpose(0, 1).contiguous() for t in (query, key, value))
    out = varlen_attn(q, k, v, cu_seq_lens_q.to(torch.int32), cu_seq_lens_k.to(torch.int32),
                      _longest(cu_seq_lens_q, max_length_q), _longest(cu_seq_lens_k, max_length_k),
                      scale=scaling, window_size=(-1, 0) if is_causal else (-1, -1))
    return out.unsqueeze(0), None


def _longest(bounds: torch.Tensor, given: int | None) -> int:
    """The longest item: as transformers gives it (a host int), else read from the bounds."""
    return int(given) if given is not None else int((bounds[1:] - bounds[:-1]).max())


def set_attention(tower: torch.nn.Module, implementation: str, by_boundaries: bool) -> str:
    """Give a transformers ``tower`` ``implementation`` (``AttentionChoice.encoders``):
    ``varlen`` is ``VARLEN`` where the tower gives boundaries (``by_boundaries``), else SDPA.
    Returns the name transformers' attention functions now serve the tower under."""
    if implementation != "varlen":
        tower.set_attn_implementation(implementation)
        return implementation
    tower.set_attn_implementation("sdpa")          # checks the tower takes the interface
    if not by_boundaries:
        return "sdpa"
    serve_attention(tower, VARLEN, varlen_attention)
    return VARLEN


def serve_attention(model: torch.nn.Module, name: str, function) -> None:
    """``function`` registered with transformers' ``AttentionInterface`` as ``name`` and set
    on every config of ``model``: directly, as ``set_attn_implementation`` would load the
    flash-attn package (or a hub kernel) for a name that says "flash"."""
    from transformers import AttentionInterface, PreTrainedConfig
    AttentionInterface.register(name, function)
    for module in model.modules():
        config = getattr(module, "config", None)
        if isinstance(config, PreTrainedConfig):
            config._attn_implementation = name
