"""What a transformers causal LM (or a whole VLM's language model) is, as megatron-core rebuilds
it: ``read_architecture`` reads the checkpoint's ``config.json`` into a ``LanguageArch``,
refusing what megatron-core's local layers cannot reproduce; ``transformer_fields`` and
``gpt_fields`` turn it into ``TransformerConfig`` and ``GPTModel`` arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from mimo_data.errors import listed
from mimo_train.errors import TrainConfigError
from mimo_train.families.base import (VLM, CheckpointWeights, checkpoint_value,
                                      loaded_weight_files, model_directory)

# model_type -> (qkv bias, qk-norm) of the families this package maps
FAMILIES = {"llama": (False, False), "qwen2": (True, False), "qwen3": (False, True),
            "qwen3_moe": (False, True), "qwen3_5": (False, True), "qwen3_5_moe": (False, True)}
# a whole VLM's text model_type -> the family of its decoder (Qwen2 with M-RoPE)
TEXT_FAMILIES = {"qwen2_vl_text": "qwen2", "qwen2_5_vl_text": "qwen2", "qwen3_vl_text": "qwen3",
                 "qwen3_vl_moe_text": "qwen3_moe", "qwen3_5_text": "qwen3_5",
                 "qwen3_5_moe_text": "qwen3_5_moe"}
# families whose layers are a mixture of experts
MIXTURES = frozenset({"qwen3_moe", "qwen3_5_moe"})
# families of Qwen3.5's hybrid decoder: gated delta-net layers beside gated full attention,
# zero-centred norms (1 + weight), partial rotary, a shared expert beside the routed ones
HYBRID = frozenset({"qwen3_5", "qwen3_5_moe"})
# the text configs whose transformers router renormalizes the top-k weights whatever
# norm_topk_prob says (their configs drop the key)
RENORMALIZING = frozenset({"qwen3_vl_moe_text", "qwen3_5_moe_text"})
# text model_types whose M-RoPE interleaves the t/h/w frequencies (Qwen3-VL's
# ``recomposition_frequencies``) instead of giving each a contiguous section
INTERLEAVED_MROPE = frozenset({"qwen3_vl_text", "qwen3_vl_moe_text", "qwen3_5_text",
                               "qwen3_5_moe_text"})
LINEAR, FULL = "linear_attention", "full_attention"      # Qwen3.5's layer_types
# megatron-core's RotaryEmbedding applies llama3 scaling with these fixed values; only the
# factor is an argument
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class LinearAttention:
    """The gated delta-net layers' dims (Qwen3.5's ``linear_*`` keys)."""
    conv_kernel: int
    key_head_dim: int
    value_head_dim: int
    num_key_heads: int
    num_value_heads: int

    @property
    def key_dim(self) -> int:
        return self.key_head_dim * self.num_key_heads

    @property
    def value_dim(self) -> int:
        return self.value_head_dim * self.num_value_heads


@dataclass(frozen=True)
class LanguageArch:
    """What megatron-core needs to rebuild a transformers causal LM."""
    family: str                     # a FAMILIES key
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    vocab_size: int
    rotary_base: float
    rope_scaling_factor: float | None   # llama3 scaling factor; None: no scaling
    norm_eps: float
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    mrope_section: tuple[int, ...] | None = None   # M-RoPE (Qwen2-VL): rotary pairs per t/h/w
    mrope_interleaved: bool = False                # Qwen3-VL: t/h/w frequencies interleaved
    # a mixture of experts in every layer (Qwen3-MoE, Qwen3-VL-MoE, Qwen3.5-MoE): experts, how
    # many each token goes through (their weights renormalized over those), each one's MLP
    # width; a shared expert beside them, its output scaled by a sigmoid gate (Qwen3.5-MoE)
    experts: int = 0
    experts_per_token: int = 0
    expert_ffn_hidden_size: int = 0
    shared_expert_ffn_hidden_size: int = 0
    # Qwen3.5: each layer's kind (LINEAR: gated delta-net, FULL: attention; () all FULL), the
    # delta-net dims, the sigmoid gate on the attention output (q_proj gives it beside the
    # query), the share of each head that rotates, norms of 1 + weight, the multi-token
    # prediction layers the checkpoint carries (kept, not trained)
    layer_types: tuple[str, ...] = ()
    linear: LinearAttention | None = None
    attention_gate: bool = False
    rotary_percent: float = 1.0
    zero_centered_norm: bool = False
    mtp_layers: int = 0
    prefix: str = "model."          # of the decoder's weight names (a VLM: its language model's)
    head: str = "lm_head.weight"    # the output layer's weight name
    # a tied checkpoint storing its output layer alone: the embedding is read from it
    embedding_stored_as: str | None = None

    @property
    def embedding(self) -> str:
        """The name the checkpoint's word embeddings are read from."""
        return self.embedding_stored_as or self.prefix + "embed_tokens.weight"

    def linear_layer(self, layer: int) -> bool:
        """Whether global ``layer`` is a gated delta-net (linear attention) layer."""
        return bool(self.layer_types) and self.layer_types[layer] == LINEAR


def read_architecture(path: str, key: str = "model.language.pretrained",
                      vlm: VLM | None = None, weights: bool = True) -> LanguageArch:
    """The architecture of the transformers checkpoint ``path`` (directory or cached hub
    name), the language model of the whole ``vlm`` there if given; a ``TrainConfigError``
    naming ``key`` when megatron-core cannot reproduce it (``registry.language_arch`` reads the
    config and says whether ``path`` is a whole VLM). ``weights=False``: from ``config.json``
    alone, the dims only (a VLM's ``prefix`` and ``head`` are left at their defaults)."""
    return _read_architecture(path, key, vlm, weights)


def _tied_embedding(weights: CheckpointWeights, embedding: str, head: str, path: str,
                    key: str) -> str | None:
    """The name a tied checkpoint stores its embedding under where that is not ``embedding``:
    ``head``, where its weights hold the output layer alone (transformers then ties the
    embedding to it, swapping the pair); None otherwise. ``TrainConfigError`` where its
    weights also hold an output layer ``head`` other than its ``embedding``: transformers then
    un-ties them (with a warning), and a tied model would train another model than the
    checkpoint. Compared a block of rows at a time (as transformers compares them: exactly),
    only where the head is stored."""
    if head in weights and embedding not in weights:
        return head
    if head not in weights or embedding not in weights:
        return None
    rows = weights.shape(embedding)[0]
    same = weights.shape(head) == weights.shape(embedding) and all(
        torch.equal(weights.part(head, (slice(i, i + 8192),)),
                    weights.part(embedding, (slice(i, i + 8192),)))
        for i in range(0, rows, 8192))
    if not same:
        raise TrainConfigError(
            f"{key}: {path}'s config.json ties the output layer to the embedding "
            f"(tie_word_embeddings: true), but its weights also hold a {head} other than "
            f"{embedding}: transformers then un-ties them (with a warning); mimo does not "
            f"guess. Set tie_word_embeddings to false in config.json to train both as stored, "
            f"or remove {head} from the weights to tie them")
    return None


@lru_cache(maxsize=8)
def _read_architecture(path: str, key: str, vlm: VLM | None, weights: bool) -> LanguageArch:
    from transformers import AutoConfig
    top = AutoConfig.from_pretrained(path)
    config, prefix, head = top, "model.", "lm_head.weight"
    # tying is the whole model's: transformers 5 ties a VLM's output layer by its top
    # config's flag (which it sets from a text config that asks for it)
    tied = bool(getattr(top, "tie_word_embeddings", False))
    if vlm is not None:
        if weights:
            held = CheckpointWeights(path, key)
            head = next((name for name in vlm.head_names if name in held), vlm.head_names[0])
            try:
                prefix = held.prefix_of(vlm.language_prefixes, "embed_tokens.weight")
            except TrainConfigError:
                if not (tied and head in held):
                    raise
                # the head alone, tied (``_tied_embedding``): the final norm's prefix
                prefix = held.prefix_of(vlm.language_prefixes, "norm.weight")
        config = top.get_text_config()
    stored_as = None
    if tied and weights and any(name.endswith(".safetensors")
                                for name in loaded_weight_files(model_directory(path))):
        stored_as = _tied_embedding(CheckpointWeights(path, key), prefix + "embed_tokens.weight",
                                    head, path, key)
    family = TEXT_FAMILIES.get(config.model_type, config.model_type)
    if family == "qwen3_moe" and vlm is None:
        raise TrainConfigError(f"{key}: {path} is a Qwen3-MoE language model alone, whose "
                               "checkpoints store each expert's weights apart "
                               "(experts.<e>.gate_proj, ...), which mimo does not map yet; "
                               "Qwen3-VL-MoE's fused experts are mapped")
    if family not in FAMILIES:
        raise TrainConfigError(f"{key}: {path} is a {family!r} model; the language model can "
                               f"be built from {listed(sorted(FAMILIES))} checkpoints (or a whole "
                               "VLM's "
                               "of those)")

    def value(name: str):
        return checkpoint_value(top, name, path, key)

    problems = _unmapped(config, family)
    rope = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = rope.get("rope_type", "default")
    factor = None
    if rope_type == "llama3":
        fixed = {k: rope.get(k) for k in _LLAMA3_FIXED}
        if fixed != _LLAMA3_FIXED:
            problems.append(f"llama3 rope scaling with {fixed} (megatron-core fixes "
                            f"{_LLAMA3_FIXED}; only the factor may vary)")
        factor = float(rope["factor"])
    elif rope_type != "default":
        problems.append(f"rope scaling {rope_type!r} (default and llama3 are supported)")
    if problems:
        raise TrainConfigError(f"{key}: {path} uses {'; '.join(problems)}, which megatron-core's "
                               "local layers do not reproduce")
    heads = value("num_attention_heads")
    head_dim = getattr(config, "head_dim", None) or value("hidden_size") // heads
    qkv_bias, qk_norm = FAMILIES[family]
    return LanguageArch(
        family=family, num_layers=value("num_hidden_layers"), hidden_size=value("hidden_size"),
        ffn_hidden_size=getattr(config, "intermediate_size", None) or 0,
        num_attention_heads=heads,
        num_query_groups=getattr(config, "num_key_value_heads", None) or heads,
        kv_channels=head_dim, vocab_size=value("vocab_size"),
        rotary_base=float(rope.get("rope_theta", 10000.0)), rope_scaling_factor=factor,
        norm_eps=float(value("rms_norm_eps")),
        tied=tied,
        qkv_bias=qkv_bias, qk_norm=qk_norm, prefix=prefix, head=head,
        embedding_stored_as=stored_as,
        mrope_section=tuple(rope["mrope_section"]) if rope.get("mrope_section") else None,
        mrope_interleaved=config.model_type in INTERLEAVED_MROPE,
        **(dict(experts=config.num_experts, experts_per_token=config.num_experts_per_tok,
                expert_ffn_hidden_size=config.moe_intermediate_size,
                shared_expert_ffn_hidden_size=getattr(
                    config, "shared_expert_intermediate_size", None) or 0)
           if family in MIXTURES else {}),
        **(_hybrid(config, rope) if family in HYBRID else {}))


def _unmapped(config, family: str) -> list[str]:
    """What of the text ``config`` megatron-core's local layers would not reproduce."""
    problems = []
    if getattr(config, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {config.hidden_act!r} (SwiGLU with silu is mapped)")
    if getattr(config, "attention_bias", False) and family != "qwen2":
        problems.append("attention_bias (bias on every attention projection)")
    if getattr(config, "mlp_bias", False):
        problems.append("mlp_bias")
    if getattr(config, "use_sliding_window", False):
        problems.append("use_sliding_window")
    if family in MIXTURES:
        if getattr(config, "mlp_only_layers", None) or \
                getattr(config, "decoder_sparse_step", 1) != 1:
            problems.append("dense MLP layers between the mixture-of-experts ones "
                            "(mlp_only_layers, decoder_sparse_step)")
        if config.num_experts_per_tok == 1:
            problems.append("num_experts_per_tok 1 (megatron-core's router takes top-1 "
                            "routing only with the softmax before the top-k, which gives "
                            "the expert another weight than transformers' renormalized one)")
        # (transformers' Qwen3-VL-MoE and Qwen3.5-MoE routers renormalize whatever it says)
        if getattr(config, "norm_topk_prob", True) is False and \
                config.model_type not in RENORMALIZING:
            problems.append("norm_topk_prob false (routing weights not renormalized)")
    if family in HYBRID:
        kinds = set(getattr(config, "layer_types", None) or ())
        if not kinds <= {LINEAR, FULL}:
            problems.append(f"layer_types {listed(sorted(kinds - {LINEAR, FULL}))}")
        if getattr(config, "attn_output_gate", True) is False:
            problems.append("attn_output_gate false (transformers' Qwen3.5 gates every "
                            "attention output)")
        if getattr(config, "mtp_use_dedicated_embeddings", False):
            problems.append("mtp_use_dedicated_embeddings")
    return problems


def _hybrid(config, rope: dict) -> dict:
    """``LanguageArch`` fields of Qwen3.5's hybrid decoder from its text ``config``."""
    return dict(
        layer_types=tuple(config.layer_types),
        linear=LinearAttention(config.linear_conv_kernel_dim, config.linear_key_head_dim,
                               config.linear_value_head_dim, config.linear_num_key_heads,
                               config.linear_num_value_heads),
        attention_gate=True, zero_centered_norm=True,
        rotary_percent=float(rope.get("partial_rotary_factor",
                                      getattr(config, "partial_rotary_factor", 1.0))),
        mtp_layers=getattr(config, "mtp_num_hidden_layers", 0) or 0)


def transformer_fields(arch: LanguageArch) -> dict:
    """``TransformerConfig`` fields reproducing the checkpoint's numerics."""
    return dict(num_layers=arch.num_layers, hidden_size=arch.hidden_size,
                ffn_hidden_size=arch.ffn_hidden_size or arch.expert_ffn_hidden_size,
                num_attention_heads=arch.num_attention_heads,
                num_query_groups=arch.num_query_groups, kv_channels=arch.kv_channels,
                normalization="RMSNorm", layernorm_epsilon=arch.norm_eps,
                gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                add_bias_linear=False, add_qkv_bias=arch.qkv_bias, qk_layernorm=arch.qk_norm,
                attention_output_gate=arch.attention_gate,
                layernorm_zero_centered_gamma=arch.zero_centered_norm,
                **(_moe_fields(arch) if arch.experts else {}),
                **(_linear_fields(arch) if arch.linear else {}))


def _moe_fields(arch: LanguageArch) -> dict:
    """megatron-core's MoE layer as transformers' Qwen3-MoE block: softmax over the top-k
    router logits (the same weights as transformers' softmax, top-k, renormalized), no
    load-balancing loss (it would make gradients depend on how tokens split into
    micro-batches), every expert whole on each rank (no expert parallelism); Qwen3.5-MoE's
    shared expert beside them, scaled by its sigmoid gate."""
    shared = arch.shared_expert_ffn_hidden_size
    return dict(num_moe_experts=arch.experts, moe_router_topk=arch.experts_per_token,
                moe_ffn_hidden_size=arch.expert_ffn_hidden_size,
                moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                moe_grouped_gemm=False,
                **(dict(moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=True)
                   if shared else {}))


def _linear_fields(arch: LanguageArch) -> dict:
    """megatron-core's gated delta-net layers (``mcore.gated_delta_net``) where Qwen3.5 has
    linear attention."""
    linear = arch.linear
    assert linear is not None
    return dict(experimental_attention_variant="gated_delta_net",
                linear_attention_freq=[int(arch.linear_layer(i)) for i in range(arch.num_layers)],
                linear_conv_kernel_dim=linear.conv_kernel,
                linear_key_head_dim=linear.key_head_dim,
                linear_value_head_dim=linear.value_head_dim,
                linear_num_key_heads=linear.num_key_heads,
                linear_num_value_heads=linear.num_value_heads)


def gpt_fields(arch: LanguageArch) -> dict:
    """``GPTModel`` arguments: rotary embedding (the share of each head it turns) and tied
    embeddings."""
    return dict(position_embedding_type="rope", rotary_base=arch.rotary_base,
                rotary_percent=arch.rotary_percent,
                rope_scaling=arch.rope_scaling_factor is not None,
                rope_scaling_factor=arch.rope_scaling_factor or 8.0,
                share_embeddings_and_output_weights=arch.tied)
