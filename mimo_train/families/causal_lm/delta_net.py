"""Qwen3.5's gated delta-net layers (``linear_attn.``) as megatron-core's ``GatedDeltaNet``
(``self_attention.``, ``mcore.gated_delta_net``), weights both ways.

| transformers ``layers.N.linear_attn.…`` | megatron-core ``….self_attention.…`` | TP rank r |
|---|---|---|
| ``in_proj_qkv`` (q, k, v), ``in_proj_{z,b,a}`` | ``in_proj``: ``[q_r;k_r;v_r;z_r;b_r;a_r]`` | r |
| ``conv1d.weight`` (q, k, v channels) | ``conv1d.weight``: ``[q_r; k_r; v_r]`` | r |
| ``A_log``, ``dt_bias`` | ``A_log``, ``dt_bias`` | r |
| ``norm.weight`` (the gated norm, not zero-centred) | ``out_norm.weight`` | whole |
| ``out_proj.weight`` | ``out_proj.weight`` | columns |

r: each section's rows of TP rank r, q and k split by key heads, v, z, b, a by value heads.

megatron-core's checkpoints save ``in_proj`` and ``conv1d`` split into their named sections
(``….in_proj.weight.query`` …), so a checkpoint loads under any TP size; read in one process
(``mimo-export``) they are joined back in this order (``mcore.gated_delta_net.join_sections``):
the TP-1 layout, which ``to_hf`` takes as one part.
"""

from __future__ import annotations

import torch

from mimo_train.families.causal_lm.architecture import LinearAttention
from mimo_train.families.causal_lm.parts import RankParts


def _sections(linear: LinearAttention, tp: int) -> list[int]:
    """The rows of each ``in_proj`` section on one of ``tp`` ranks: q, k, v, z, b, a."""
    k, v, heads = linear.key_dim // tp, linear.value_dim // tp, linear.num_value_heads // tp
    return [k, k, v, v, heads, heads]


def to_megatron(parts: RankParts, linear: LinearAttention, src: str, dst: str) -> dict:
    """One TP rank's gated delta-net weights (``dst``) from transformers' (``src``), each
    section's rows read apart."""
    sections = [(linear.key_dim, 0), (linear.key_dim, linear.key_dim),
                (linear.value_dim, 2 * linear.key_dim)]
    qkv = [parts.rows(src + "in_proj_qkv.weight", *section) for section in sections]
    extra = [parts.rows(src + f"in_proj_{name}.weight") for name in ("z", "b", "a")]
    conv = [parts.rows(src + "conv1d.weight", *section) for section in sections]
    return {dst + "in_proj.weight": torch.cat([*qkv, *extra]),
            dst + "conv1d.weight": torch.cat(conv),
            dst + "A_log": parts.rows(src + "A_log"),
            dst + "dt_bias": parts.rows(src + "dt_bias"),
            dst + "out_norm.weight": parts.whole(src + "norm.weight"),
            dst + "out_proj.weight": parts.cols(src + "out_proj.weight")}


def to_hf(parts: list[dict], linear: LinearAttention, src: str, dst: str) -> dict:
    """``to_megatron`` undone over the TP ranks' ``parts``."""
    tp = len(parts)
    sections = [part[src + "in_proj.weight"].split(_sections(linear, tp)) for part in parts]
    q, k, v, z, b, a = (torch.cat([s[i] for s in sections]) for i in range(6))
    convs = [part[src + "conv1d.weight"].split(_sections(linear, tp)[:3]) for part in parts]
    conv = [torch.cat([c[i] for c in convs]) for i in range(3)]
    return {dst + "in_proj_qkv.weight": torch.cat([q, k, v]), dst + "in_proj_z.weight": z,
            dst + "in_proj_b.weight": b, dst + "in_proj_a.weight": a,
            dst + "conv1d.weight": torch.cat(conv),
            dst + "A_log": torch.cat([part[src + "A_log"] for part in parts]),
            dst + "dt_bias": torch.cat([part[src + "dt_bias"] for part in parts]),
            dst + "norm.weight": parts[0][src + "out_norm.weight"],
            dst + "out_proj.weight": torch.cat([part[src + "out_proj.weight"]
                                                for part in parts], 1)}


def adapter_rows(name: str, b: torch.Tensor, linear: LinearAttention) -> dict[str, torch.Tensor]:
    """The rows of a LoRA adapter's B (one process, the TP-1 layout) by the transformers
    layer each belongs to: ``in_proj``'s B as the weight splits, ``out_proj``'s whole."""
    if name == "out_proj":
        return {"out_proj": b}
    q, k, v, z, beta, alpha = b.split(_sections(linear, 1))
    return {"in_proj_qkv": torch.cat([q, k, v]), "in_proj_z": z, "in_proj_b": beta,
            "in_proj_a": alpha}
