"""The language families: a transformers causal LM (Llama, Qwen2, Qwen3), or the language model
of a whole VLM (``registry.read_vlm``), as megatron-core's local-spec ``GPTModel``.

``read_architecture(path)`` reads the checkpoint's ``config.json`` into a ``LanguageArch``
(dims, rotary base and scaling, RMSNorm eps, tied embeddings, qkv bias, qk-norm), refusing what
megatron-core's local layers cannot reproduce. ``transformer_fields`` / ``gpt_fields`` turn it
into ``TransformerConfig`` and ``GPTModel`` arguments. ``to_megatron`` converts the transformers
weights into one TP/PP rank's part of the megatron state dict, ``to_hf`` merges TP parts back
(for export), and ``load_pretrained_language`` loads a rank's part into a built ``GPTModel``.

Name mapping (layer ``N`` global in transformers, local to the pipeline stage in megatron):

| transformers ``model.…`` | megatron-core | TP split |
|---|---|---|
| ``embed_tokens.weight`` | ``embedding.word_embeddings.weight`` | rows (vocab) |
| ``layers.N.input_layernorm.weight`` | ``decoder.layers.N.input_layernorm.weight`` | none |
| ``layers.N.self_attn.{q,k,v}_proj.{weight,bias}`` | ``….self_attention.linear_qkv.…`` | rows |
| ``layers.N.self_attn.{q,k}_norm.weight`` (Qwen3) | ``….{q,k}_layernorm.weight`` | none |
| ``layers.N.self_attn.o_proj.weight`` | ``….self_attention.linear_proj.weight`` | columns |
| ``layers.N.post_attention_layernorm.weight`` | ``….pre_mlp_layernorm.weight`` | none |
| ``layers.N.mlp.{gate,up}_proj.weight`` | ``….mlp.linear_fc1.weight`` | rows, per half |
| ``layers.N.mlp.down_proj.weight`` | ``….mlp.linear_fc2.weight`` | columns |
| ``norm.weight`` | ``decoder.final_layernorm.weight`` | none |
| ``lm_head.weight`` (or the embedding, tied) | ``output_layer.weight`` | rows (vocab) |

A whole VLM holds the same names under one of the prefixes its family module gives
(``VLM.language_prefixes``: ``model.language_model.`` in transformers 4.52+'s layout, the
family's original one otherwise): whichever the checkpoint has is ``LanguageArch.prefix``, and
its output layer's name ``LanguageArch.head``; a Qwen VL text config's ``mrope_section`` is
``LanguageArch.mrope_section``.

``linear_qkv`` holds, per query group, that group's query heads, then its key head, then its
value head (``[ng, (nh/ng + 2) · d, hidden]``): the layout ``SelfAttention`` splits; TP ranks
take whole groups. ``linear_fc1`` is ``[gate; up]`` (megatron's SwiGLU chunks the output in
two), so TP rank r holds ``[gate_r; up_r]``.

Vocabulary: megatron's vocabulary is the tokenizer's (modality tokens included) or the
checkpoint's, whichever is larger, padded (``registry.vocab_size``; the padding rows are
masked out of every softmax). Every row past the
checkpoint's vocabulary, in the embedding and the output layer, starts as the mean of the
checkpoint's rows (transformers' ``resize_token_embeddings`` starts new rows at that mean too):
a new token's input is an average token and its logit an average logit, so adding tokens does
not shift the pretrained model's predictions. No random draw is involved.

Why a module of its own: mbridge (which has these name tables) builds TransformerEngine specs
only (fused names such as ``linear_qkv.layer_norm_weight``) and its model builder no longer runs
with megatron-core 0.19.2; Megatron-Bridge brings a very large dependency set. Neither drives
the local-spec layers mimo uses on CPU. This module imports no megatron-core.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import lru_cache

import torch

from mimo_train.errors import TrainConfigError
from mimo_train.families.base import VLM, CheckpointWeights, checkpoint_value

# model_type -> (qkv bias, qk-norm) of the families this module maps
FAMILIES = {"llama": (False, False), "qwen2": (True, False), "qwen3": (False, True),
            "qwen3_moe": (False, True)}
# a whole VLM's text model_type -> the family of its decoder (Qwen2 with M-RoPE)
TEXT_FAMILIES = {"qwen2_vl_text": "qwen2", "qwen2_5_vl_text": "qwen2", "qwen3_vl_text": "qwen3",
                 "qwen3_vl_moe_text": "qwen3_moe"}
# text model_types whose M-RoPE interleaves the t/h/w frequencies (Qwen3-VL's
# ``recomposition_frequencies``) instead of giving each a contiguous section
INTERLEAVED_MROPE = frozenset({"qwen3_vl_text", "qwen3_vl_moe_text"})
# megatron-core's RotaryEmbedding applies llama3 scaling with these fixed values; only the
# factor is an argument
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class LanguageArch:
    """What megatron-core needs to rebuild a transformers causal LM."""
    family: str                     # llama | qwen2 | qwen3
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
    # a mixture of experts in every layer (Qwen3-MoE, Qwen3-VL-MoE): experts, how many each
    # token goes through (their weights renormalized over those), each one's MLP width
    experts: int = 0
    experts_per_token: int = 0
    expert_ffn_hidden_size: int = 0
    prefix: str = "model."          # of the decoder's weight names (a VLM: its language model's)
    head: str = "lm_head.weight"    # the output layer's weight name


def read_architecture(path: str, key: str = "model.language.pretrained",
                      vlm: VLM | None = None, weights: bool = True) -> LanguageArch:
    """The architecture of the transformers checkpoint ``path`` (directory or cached hub
    name), the language model of the whole ``vlm`` there if given; a ``TrainConfigError``
    naming ``key`` when megatron-core cannot reproduce it (``registry.language_arch`` reads the
    config and says whether ``path`` is a whole VLM). ``weights=False``: from ``config.json``
    alone, the dims only (a VLM's ``prefix`` and ``head`` are left at their defaults)."""
    return _read_architecture(path, key, vlm, weights)


@lru_cache(maxsize=8)
def _read_architecture(path: str, key: str, vlm: VLM | None, weights: bool) -> LanguageArch:
    from transformers import AutoConfig
    top = AutoConfig.from_pretrained(path)
    config, prefix, head = top, "model.", "lm_head.weight"
    if vlm is not None:
        if weights:
            held = CheckpointWeights(path, key)
            prefix = held.prefix_of(vlm.language_prefixes, "embed_tokens.weight")
            head = next((name for name in vlm.head_names if name in held), vlm.head_names[0])
        config = top.get_text_config()
    family = TEXT_FAMILIES.get(config.model_type, config.model_type)
    if family == "qwen3_moe" and vlm is None:
        raise TrainConfigError(f"{key}: {path} is a Qwen3-MoE language model alone, whose "
                               "checkpoints store each expert's weights apart "
                               "(experts.<e>.gate_proj, ...), which mimo does not map yet; "
                               "Qwen3-VL-MoE's fused experts are mapped")
    if family not in FAMILIES:
        raise TrainConfigError(f"{key}: {path} is a {family!r} model; the language model can "
                               f"be built from {sorted(FAMILIES)} checkpoints (or a whole VLM's "
                               "of those)")

    def value(name: str):
        return checkpoint_value(top, name, path, key)

    problems = []
    if getattr(config, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {config.hidden_act!r} (SwiGLU with silu is mapped)")
    if getattr(config, "attention_bias", False) and family != "qwen2":
        problems.append("attention_bias (bias on every attention projection)")
    if getattr(config, "mlp_bias", False):
        problems.append("mlp_bias")
    if getattr(config, "use_sliding_window", False):
        problems.append("use_sliding_window")
    if family == "qwen3_moe":
        if getattr(config, "mlp_only_layers", None) or \
                getattr(config, "decoder_sparse_step", 1) != 1:
            problems.append("dense MLP layers between the mixture-of-experts ones "
                            "(mlp_only_layers, decoder_sparse_step)")
        if getattr(config, "norm_topk_prob", True) is False:
            problems.append("norm_topk_prob false (routing weights not renormalized)")
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
        ffn_hidden_size=value("intermediate_size"), num_attention_heads=heads,
        num_query_groups=getattr(config, "num_key_value_heads", None) or heads,
        kv_channels=head_dim, vocab_size=value("vocab_size"),
        rotary_base=float(rope.get("rope_theta", 10000.0)), rope_scaling_factor=factor,
        norm_eps=float(value("rms_norm_eps")),
        # tying is the whole model's: transformers 5 ties a VLM's output layer by its top
        # config's flag (which it sets from a text config that asks for it)
        tied=bool(getattr(top, "tie_word_embeddings", False)),
        qkv_bias=qkv_bias, qk_norm=qk_norm, prefix=prefix, head=head,
        mrope_section=tuple(rope["mrope_section"]) if rope.get("mrope_section") else None,
        mrope_interleaved=config.model_type in INTERLEAVED_MROPE,
        **(dict(experts=config.num_experts, experts_per_token=config.num_experts_per_tok,
                expert_ffn_hidden_size=config.moe_intermediate_size)
           if family == "qwen3_moe" else {}))


def transformer_fields(arch: LanguageArch) -> dict:
    """``TransformerConfig`` fields reproducing the checkpoint's numerics."""
    return dict(num_layers=arch.num_layers, hidden_size=arch.hidden_size,
                ffn_hidden_size=arch.ffn_hidden_size,
                num_attention_heads=arch.num_attention_heads,
                num_query_groups=arch.num_query_groups, kv_channels=arch.kv_channels,
                normalization="RMSNorm", layernorm_epsilon=arch.norm_eps,
                gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                add_bias_linear=False, add_qkv_bias=arch.qkv_bias, qk_layernorm=arch.qk_norm,
                **(_moe_fields(arch) if arch.experts else {}))


def _moe_fields(arch: LanguageArch) -> dict:
    """megatron-core's MoE layer as transformers' Qwen3-MoE block: softmax over the top-k
    router logits (the same weights as transformers' softmax, top-k, renormalized), no
    load-balancing loss (it would make gradients depend on how tokens split into
    micro-batches), every expert whole on each rank (no expert parallelism)."""
    return dict(num_moe_experts=arch.experts, moe_router_topk=arch.experts_per_token,
                moe_ffn_hidden_size=arch.expert_ffn_hidden_size,
                moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                moe_grouped_gemm=False)


def gpt_fields(arch: LanguageArch) -> dict:
    """``GPTModel`` arguments: rotary embedding and tied embeddings."""
    return dict(position_embedding_type="rope", rotary_base=arch.rotary_base,
                rope_scaling=arch.rope_scaling_factor is not None,
                rope_scaling_factor=arch.rope_scaling_factor or 8.0,
                share_embeddings_and_output_weights=arch.tied)


def _extend_rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """``weight`` with rows appended up to ``rows``, each the mean of the existing rows."""
    extra = rows - weight.size(0)
    if extra < 0:
        raise TrainConfigError(f"the language vocabulary {rows} is smaller than the "
                               f"checkpoint's {weight.size(0)}")
    return torch.cat([weight, weight.mean(0, keepdim=True).expand(extra, -1)])


def _qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: LanguageArch) -> torch.Tensor:
    """q, k, v (weights or biases) in megatron's per-group [q…, k, v] layout."""
    groups, d = arch.num_query_groups, arch.kv_channels
    rest = q.shape[1:]
    return torch.cat([q.reshape(groups, -1, d, *rest), k.reshape(groups, 1, d, *rest),
                      v.reshape(groups, 1, d, *rest)], dim=1).reshape(-1, *rest)


def _split_qkv(qkv: torch.Tensor, arch: LanguageArch):
    groups, d = arch.num_query_groups, arch.kv_channels
    per_group = arch.num_attention_heads // groups
    rest = qkv.shape[1:]
    q, k, v = qkv.reshape(groups, per_group + 2, d, *rest).split([per_group, 1, 1], dim=1)
    return (q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest))


def to_megatron(hf: Callable[[str], torch.Tensor], arch: LanguageArch, *, tp_rank: int,
                tp_size: int, layers: Iterable[int], first_stage: bool, last_stage: bool,
                vocab_size: int, has: Callable[[str], bool] | None = None) -> dict:
    """One TP rank's megatron state dict for the global ``layers`` of its pipeline stage
    (numbered from 0 locally), from ``hf(name)``; ``has(name)`` tells whether ``lm_head``
    exists (tied checkpoints leave it out)."""
    def rows(tensor):             # column-parallel: output features
        return tensor.chunk(tp_size, dim=0)[tp_rank].clone()

    def cols(tensor):             # row-parallel: input features
        return tensor.chunk(tp_size, dim=1)[tp_rank].clone()

    state = {}
    for local, layer in enumerate(layers):
        src, dst = f"{arch.prefix}layers.{layer}.", f"decoder.layers.{local}."
        attn, mlp = src + "self_attn.", src + "mlp."
        state[dst + "input_layernorm.weight"] = hf(src + "input_layernorm.weight")
        state[dst + "self_attention.linear_qkv.weight"] = rows(_qkv(
            hf(attn + "q_proj.weight"), hf(attn + "k_proj.weight"), hf(attn + "v_proj.weight"),
            arch))
        if arch.qkv_bias:
            state[dst + "self_attention.linear_qkv.bias"] = rows(_qkv(
                hf(attn + "q_proj.bias"), hf(attn + "k_proj.bias"), hf(attn + "v_proj.bias"),
                arch))
        if arch.qk_norm:
            state[dst + "self_attention.q_layernorm.weight"] = hf(attn + "q_norm.weight")
            state[dst + "self_attention.k_layernorm.weight"] = hf(attn + "k_norm.weight")
        state[dst + "self_attention.linear_proj.weight"] = cols(hf(attn + "o_proj.weight"))
        state[dst + "pre_mlp_layernorm.weight"] = hf(src + "post_attention_layernorm.weight")
        if arch.experts:
            state.update(_experts_to_megatron(hf, arch, mlp, dst + "mlp.", rows, cols))
            continue
        state[dst + "mlp.linear_fc1.weight"] = torch.cat(
            [rows(hf(mlp + "gate_proj.weight")), rows(hf(mlp + "up_proj.weight"))])
        state[dst + "mlp.linear_fc2.weight"] = cols(hf(mlp + "down_proj.weight"))
    if first_stage:
        state["embedding.word_embeddings.weight"] = rows(
            _extend_rows(hf(arch.prefix + "embed_tokens.weight"), vocab_size))
    if last_stage:
        state["decoder.final_layernorm.weight"] = hf(arch.prefix + "norm.weight")
        untied = not arch.tied and (has is None or has(arch.head))
        output = hf(arch.head) if untied else hf(arch.prefix + "embed_tokens.weight")
        state["output_layer.weight"] = rows(_extend_rows(output, vocab_size))
    return state


def _experts_to_megatron(hf: Callable[[str], torch.Tensor], arch: LanguageArch, src: str,
                         dst: str, rows: Callable, cols: Callable) -> dict:
    """One mixture-of-experts layer: the router (``gate.weight``) and each expert's
    ``linear_fc1`` / ``linear_fc2`` from the fused ``experts.gate_up_proj`` (gate, then up)
    and ``experts.down_proj`` (``expert_matrices``); TP splits each expert as a dense MLP."""
    gate_up, down = expert_matrices(hf(src + "experts.gate_up_proj"),
                                    hf(src + "experts.down_proj"), arch)
    state = {dst + "router.weight": hf(src + "gate.weight")}
    for e in range(gate_up.size(0)):
        gate, up = gate_up[e].chunk(2)
        state[f"{dst}experts.local_experts.{e}.linear_fc1.weight"] = torch.cat([rows(gate),
                                                                               rows(up)])
        state[f"{dst}experts.local_experts.{e}.linear_fc2.weight"] = cols(down[e])
    return state


def expert_matrices(gate_up: torch.Tensor, down: torch.Tensor, arch: LanguageArch
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused experts as ``[E, 2 · ffn, hidden]`` and ``[E, hidden, ffn]`` (transformers 5's
    in-memory layout, as it saves them) from either that layout or the published one
    (``[E, hidden, 2 · ffn]``, ``[E, ffn, hidden]``: Qwen3-VL-MoE's checkpoints, which
    transformers transposes on load); where both fit (hidden = 2 · ffn), transformers' own
    reading: the in-memory layout."""
    hidden, ffn = arch.hidden_size, arch.expert_ffn_hidden_size
    return (_in_memory(gate_up, (2 * ffn, hidden), "experts.gate_up_proj"),
            _in_memory(down, (hidden, ffn), "experts.down_proj"))


def _in_memory(fused: torch.Tensor, shape: tuple[int, int], name: str) -> torch.Tensor:
    """``fused`` ``[E, *shape]``, transposed from ``[E, *reversed(shape)]`` if stored so."""
    if tuple(fused.shape[1:]) == shape:
        return fused
    if tuple(fused.shape[1:]) == shape[::-1]:
        return fused.transpose(1, 2)
    raise TrainConfigError(f"the checkpoint's {name} has shape {tuple(fused.shape)}, neither "
                           f"[experts, {shape[0]}, {shape[1]}] nor its transpose: not the "
                           "architecture its config.json describes")


def _experts_to_hf(parts: list[dict], src: str, dst: str) -> dict:
    """``_experts_to_megatron`` undone over the TP ranks' ``parts``, in transformers 5's
    layout (``hf.export`` writes a checkpoint's own)."""
    first = parts[0]
    experts = len({k for k in first if k.startswith(src + "experts.local_experts.")
                   and k.endswith(".linear_fc1.weight")})
    gate_up, down = [], []
    for e in range(experts):
        expert = f"{src}experts.local_experts.{e}."
        halves = [part[expert + "linear_fc1.weight"].chunk(2) for part in parts]
        gate_up.append(torch.cat([*(g for g, _ in halves), *(u for _, u in halves)]))
        down.append(torch.cat([part[expert + "linear_fc2.weight"] for part in parts], 1))
    return {dst + "gate.weight": first[src + "router.weight"],
            dst + "experts.gate_up_proj": torch.stack(gate_up).contiguous(),
            dst + "experts.down_proj": torch.stack(down).contiguous()}


def to_hf(parts: list[dict], arch: LanguageArch, vocab_rows: int | None = None) -> dict:
    """transformers weights from the megatron state dicts of all TP ranks of one or more
    pipeline stages (``parts[r]``: TP rank r, *global* layer numbers); the vocabulary is cut
    to ``vocab_rows`` (default: the checkpoint's)."""
    rows = vocab_rows or arch.vocab_size

    def merged(key, dim):
        return torch.cat([part[key] for part in parts], dim=dim)

    first = parts[0]
    hf = {}
    layers = sorted({int(k.split(".")[2]) for k in first if k.startswith("decoder.layers.")})
    for layer in layers:
        src, dst = f"decoder.layers.{layer}.", f"{arch.prefix}layers.{layer}."
        attn, mlp = dst + "self_attn.", dst + "mlp."
        hf[dst + "input_layernorm.weight"] = first[src + "input_layernorm.weight"]
        for kind in ("weight", "bias"):
            key = f"{src}self_attention.linear_qkv.{kind}"
            if key in first:
                q, k, v = _split_qkv(merged(key, 0), arch)
                hf.update({f"{attn}q_proj.{kind}": q, f"{attn}k_proj.{kind}": k,
                           f"{attn}v_proj.{kind}": v})
        for norm in ("q", "k"):
            key = f"{src}self_attention.{norm}_layernorm.weight"
            if key in first:
                hf[f"{attn}{norm}_norm.weight"] = first[key]
        hf[attn + "o_proj.weight"] = merged(src + "self_attention.linear_proj.weight", 1)
        hf[dst + "post_attention_layernorm.weight"] = first[src + "pre_mlp_layernorm.weight"]
        if arch.experts:
            hf.update(_experts_to_hf(parts, src + "mlp.", mlp))
            continue
        halves = [part[src + "mlp.linear_fc1.weight"].chunk(2) for part in parts]
        hf[mlp + "gate_proj.weight"] = torch.cat([gate for gate, _ in halves])
        hf[mlp + "up_proj.weight"] = torch.cat([up for _, up in halves])
        hf[mlp + "down_proj.weight"] = merged(src + "mlp.linear_fc2.weight", 1)
    if "embedding.word_embeddings.weight" in first:
        hf[arch.prefix + "embed_tokens.weight"] = merged("embedding.word_embeddings.weight",
                                                          0)[:rows]
    if "decoder.final_layernorm.weight" in first:
        hf[arch.prefix + "norm.weight"] = first["decoder.final_layernorm.weight"]
    if "output_layer.weight" in first and not arch.tied:
        hf[arch.head] = merged("output_layer.weight", 0)[:rows]
    return hf


def adapters_to_hf(state: dict, arch: LanguageArch) -> dict[str, tuple]:
    """The LoRA adapters of a whole language model's state dict (one process, global layer
    numbers; ``mimo_train.model.lora``) by the transformers layer they apply to:
    ``{layer path: (A, B)}``. A fused megatron-core layer's adapter is one per transformers
    layer it holds, with the same A and its rows of B: ``linear_qkv``'s B split as the weight
    is (``q_proj``, ``k_proj``, ``v_proj``), ``linear_fc1``'s into ``gate_proj`` and
    ``up_proj``."""
    found: dict[str, tuple] = {}
    for key in state:
        if not key.endswith(".lora.a.weight") or not key.startswith("decoder.layers."):
            continue
        layer_key = key[:-len(".lora.a.weight")]
        a, b = state[key], state[layer_key + ".lora.b.weight"]
        _, _, index, block, name = layer_key.split(".")
        dst = f"{arch.prefix}layers.{index}." + ("self_attn." if block == "self_attention"
                                                 else "mlp.")
        if name == "linear_qkv":
            found.update({dst + n: (a, rows) for n, rows in
                          zip(("q_proj", "k_proj", "v_proj"), _split_qkv(b, arch))})
        elif name == "linear_fc1":
            found.update({dst + n: (a, rows) for n, rows in
                          zip(("gate_proj", "up_proj"), b.chunk(2))})
        else:
            found[dst + {"linear_proj": "o_proj", "linear_fc2": "down_proj"}[name]] = (a, b)
    return found


def load_pretrained_language(model: torch.nn.Module, path: str, arch: LanguageArch, *,
                             tp_rank: int, tp_size: int, layer_offset: int,
                             vocab_size: int) -> None:
    """Load this rank's part of the checkpoint ``path`` into ``model``, a built ``GPTModel``
    (not DDP-wrapped) holding the stage's layers from global ``layer_offset`` on; every weight
    of ``model`` must come from the checkpoint."""
    own = {k: v for k, v in model.state_dict().items() if not k.endswith("._extra_state")}
    num_layers = len({k.split(".")[2] for k in own if k.startswith("decoder.layers.")})
    weights = CheckpointWeights(path)
    state = to_megatron(weights, arch, tp_rank=tp_rank, tp_size=tp_size,
                        layers=range(layer_offset, layer_offset + num_layers),
                        first_stage=getattr(model, "pre_process", True),
                        last_stage=getattr(model, "post_process", True),
                        vocab_size=vocab_size, has=weights.__contains__)
    missing = sorted(set(own) - set(state))
    wrong = [f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)}" for k, v in own.items()
             if k in state and state[k].shape != v.shape]
    if missing or wrong:
        raise TrainConfigError(f"model.language.pretrained {path} does not fit the language "
                               f"model: missing {missing[:3]}, shapes {wrong[:3]}")
    model.load_state_dict({k: state[k] for k in own}, strict=False)
