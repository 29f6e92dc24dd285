"""The language model's weights between transformers' names and megatron-core's: ``to_megatron``
gives one TP/PP rank's part of the megatron state dict, ``to_hf`` merges TP parts back (for
export), ``adapters_to_hf`` names LoRA adapters as transformers' layers,
``load_pretrained_language`` loads a rank's part into a built ``GPTModel``. Qwen3.5's gated
delta-net layers: ``delta_net``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from mimo_train.errors import TrainConfigError
from mimo_train.families.base import CheckpointWeights
import mimo_train.families.causal_lm.delta_net as delta_net
from mimo_train.families.causal_lm.architecture import LanguageArch


def _extend_rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """``weight`` with rows appended up to ``rows``, each the mean of the existing rows."""
    extra = rows - weight.size(0)
    if extra < 0:
        raise TrainConfigError(f"the language vocabulary {rows} is smaller than the "
                               f"checkpoint's {weight.size(0)}")
    return torch.cat([weight, weight.mean(0, keepdim=True).expand(extra, -1)])


def _qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: LanguageArch) -> torch.Tensor:
    """q, k, v (weights or biases) in megatron's per-group layout: the group's query heads,
    (with the attention gate) its gate heads, its key head, its value head. transformers'
    gated ``q_proj`` holds each head's query then its gate."""
    groups, d = arch.num_query_groups, arch.kv_channels
    rest = q.shape[1:]
    if arch.attention_gate:
        heads = q.reshape(-1, 2, d, *rest)
        query = [heads[:, 0].reshape(groups, -1, d, *rest),
                 heads[:, 1].reshape(groups, -1, d, *rest)]
    else:
        query = [q.reshape(groups, -1, d, *rest)]
    return torch.cat([*query, k.reshape(groups, 1, d, *rest), v.reshape(groups, 1, d, *rest)],
                     dim=1).reshape(-1, *rest)


def _split_qkv(qkv: torch.Tensor, arch: LanguageArch):
    """``_qkv`` undone: transformers' q (with the gate, per head), k, v."""
    groups, d = arch.num_query_groups, arch.kv_channels
    per_group = arch.num_attention_heads // groups
    rest = qkv.shape[1:]
    if arch.attention_gate:
        query, gate, k, v = qkv.reshape(groups, 2 * per_group + 2, d, *rest).split(
            [per_group, per_group, 1, 1], dim=1)
        q = torch.stack([query.reshape(-1, d, *rest), gate.reshape(-1, d, *rest)], dim=1)
    else:
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
        if arch.linear_layer(layer):
            assert arch.linear is not None
            state.update(delta_net.to_megatron(hf, arch.linear, src + "linear_attn.",
                                               dst + "self_attention.", tp_rank, tp_size))
        else:
            state.update(_attention_to_megatron(hf, arch, attn, dst + "self_attention.",
                                                rows, cols))
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


def _attention_to_megatron(hf: Callable[[str], torch.Tensor], arch: LanguageArch, src: str,
                           dst: str, rows: Callable, cols: Callable) -> dict:
    """One attention block (``self_attn.``): q, k, v (with the gate) fused, the qk-norms, the
    output projection."""
    state = {dst + "linear_qkv.weight": rows(_qkv(
        hf(src + "q_proj.weight"), hf(src + "k_proj.weight"), hf(src + "v_proj.weight"), arch))}
    if arch.qkv_bias:
        state[dst + "linear_qkv.bias"] = rows(_qkv(
            hf(src + "q_proj.bias"), hf(src + "k_proj.bias"), hf(src + "v_proj.bias"), arch))
    if arch.qk_norm:
        state[dst + "q_layernorm.weight"] = hf(src + "q_norm.weight")
        state[dst + "k_layernorm.weight"] = hf(src + "k_norm.weight")
    state[dst + "linear_proj.weight"] = cols(hf(src + "o_proj.weight"))
    return state


def _experts_to_megatron(hf: Callable[[str], torch.Tensor], arch: LanguageArch, src: str,
                         dst: str, rows: Callable, cols: Callable) -> dict:
    """One mixture-of-experts layer: the router (``gate.weight``) and each expert's
    ``linear_fc1`` / ``linear_fc2`` from the fused ``experts.gate_up_proj`` (gate, then up)
    and ``experts.down_proj`` (``expert_matrices``); TP splits each expert as a dense MLP.
    Qwen3.5-MoE's shared expert (``shared_expert.*``) and its gate (``shared_expert_gate``)
    as megatron-core's ``shared_experts``."""
    gate_up, down = expert_matrices(hf(src + "experts.gate_up_proj"),
                                    hf(src + "experts.down_proj"), arch)
    state = {dst + "router.weight": hf(src + "gate.weight")}
    for e in range(gate_up.size(0)):
        gate, up = gate_up[e].chunk(2)
        state[f"{dst}experts.local_experts.{e}.linear_fc1.weight"] = torch.cat([rows(gate),
                                                                               rows(up)])
        state[f"{dst}experts.local_experts.{e}.linear_fc2.weight"] = cols(down[e])
    if arch.shared_expert_ffn_hidden_size:
        shared = src + "shared_expert."
        state[dst + "shared_experts.linear_fc1.weight"] = torch.cat(
            [rows(hf(shared + "gate_proj.weight")), rows(hf(shared + "up_proj.weight"))])
        state[dst + "shared_experts.linear_fc2.weight"] = cols(hf(shared + "down_proj.weight"))
        state[dst + "shared_experts.gate_weight"] = hf(src + "shared_expert_gate.weight")
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
    hf = {dst + "gate.weight": first[src + "router.weight"],
          dst + "experts.gate_up_proj": torch.stack(gate_up).contiguous(),
          dst + "experts.down_proj": torch.stack(down).contiguous()}
    if src + "shared_experts.gate_weight" in first:
        halves = [part[src + "shared_experts.linear_fc1.weight"].chunk(2) for part in parts]
        hf[dst + "shared_expert.gate_proj.weight"] = torch.cat([g for g, _ in halves])
        hf[dst + "shared_expert.up_proj.weight"] = torch.cat([u for _, u in halves])
        hf[dst + "shared_expert.down_proj.weight"] = torch.cat(
            [part[src + "shared_experts.linear_fc2.weight"] for part in parts], 1)
        hf[dst + "shared_expert_gate.weight"] = first[src + "shared_experts.gate_weight"]
    return hf


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
        if arch.linear_layer(layer):
            assert arch.linear is not None
            hf.update(delta_net.to_hf(parts, arch.linear, src + "self_attention.",
                                      dst + "linear_attn."))
        else:
            hf.update(_attention_to_hf(parts, arch, src + "self_attention.", attn))
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


def _attention_to_hf(parts: list[dict], arch: LanguageArch, src: str, dst: str) -> dict:
    """``_attention_to_megatron`` undone over the TP ranks' ``parts``."""
    first, hf = parts[0], {}
    for kind in ("weight", "bias"):
        key = f"{src}linear_qkv.{kind}"
        if key in first:
            q, k, v = _split_qkv(torch.cat([part[key] for part in parts]), arch)
            hf.update({f"{dst}q_proj.{kind}": q, f"{dst}k_proj.{kind}": k,
                       f"{dst}v_proj.{kind}": v})
    for norm in ("q", "k"):
        key = f"{src}{norm}_layernorm.weight"
        if key in first:
            hf[f"{dst}{norm}_norm.weight"] = first[key]
    hf[dst + "o_proj.weight"] = torch.cat([part[src + "linear_proj.weight"] for part in parts],
                                          1)
    return hf


def adapters_to_hf(state: dict, arch: LanguageArch) -> dict[str, tuple]:
    """The LoRA adapters of a whole language model's state dict (one process, global layer
    numbers; ``mimo_train.model.lora``) by the transformers layer they apply to:
    ``{layer path: (A, B)}``. A fused megatron-core layer's adapter is one per transformers
    layer it holds, with the same A and its rows of B: ``linear_qkv``'s B split as the weight
    is (``q_proj``, ``k_proj``, ``v_proj``), ``linear_fc1``'s into ``gate_proj`` and
    ``up_proj``, a gated delta-net's ``in_proj`` into ``in_proj_qkv``, ``in_proj_z``,
    ``in_proj_b``, ``in_proj_a``."""
    found: dict[str, tuple] = {}
    for key in state:
        if not key.endswith(".lora.a.weight") or not key.startswith("decoder.layers."):
            continue
        layer_key = key[:-len(".lora.a.weight")]
        a, b = state[key], state[layer_key + ".lora.b.weight"]
        _, _, index, block, name = layer_key.split(".")
        if block == "self_attention" and arch.linear_layer(int(index)):
            assert arch.linear is not None
            dst = f"{arch.prefix}layers.{index}.linear_attn."
            found.update({dst + n: (a, rows) for n, rows in
                          delta_net.adapter_rows(name, b, arch.linear).items()})
            continue
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
