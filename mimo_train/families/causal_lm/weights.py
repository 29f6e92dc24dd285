"""The language model's weights between transformers' names and megatron-core's: ``to_megatron``
gives one TP/PP rank's part of the megatron state dict (reading only that part: ``parts``),
``to_hf`` merges TP parts back (for export), ``adapters_to_hf`` names LoRA adapters as
transformers' layers,
``load_pretrained_language`` loads a rank's part into a built ``GPTModel``. Qwen3.5's gated
delta-net layers: ``delta_net``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

import torch

from mimo_train.errors import TrainConfigError
from mimo_train.families.base import CheckpointWeights, Tensors
import mimo_train.families.causal_lm.delta_net as delta_net
from mimo_train.families.causal_lm.architecture import LanguageArch
from mimo_train.families.causal_lm.parts import RankParts


def _vocabulary_rows(parts: RankParts, name: str, vocab_size: int) -> torch.Tensor:
    """This rank's rows of ``name`` (an embedding or output layer) extended to ``vocab_size``
    rows, each row past the checkpoint's the mean of its rows."""
    stored = parts.tensors.shape(name)[0]
    if vocab_size < stored:
        raise TrainConfigError(f"the language vocabulary {vocab_size} is smaller than the "
                               f"checkpoint's {stored}")
    rows = parts.span(vocab_size)
    if rows.stop <= stored:
        return parts.tensors.part(name, (rows,))
    # rows past the checkpoint's: their mean needs every row, so the whole is read (in fp32,
    # the mean's dtype)
    weight = parts.tensors.part(name).float()
    extra = vocab_size - stored
    return torch.cat([weight, weight.mean(0, keepdim=True).expand(extra, -1)])[rows].clone()


def _qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: LanguageArch,
         groups: int | None = None) -> torch.Tensor:
    """q, k, v (weights or biases) of ``groups`` query groups (default: all) in megatron's
    per-group layout: the group's query heads, (with the attention gate) its gate heads, its
    key head, its value head. transformers' gated ``q_proj`` holds each head's query then its
    gate."""
    groups, d = groups or arch.num_query_groups, arch.kv_channels
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


def to_megatron(hf: Callable[[str], torch.Tensor] | Tensors, arch: LanguageArch, *,
                tp_rank: int, tp_size: int, layers: Iterable[int], first_stage: bool,
                last_stage: bool, vocab_size: int, has: Callable[[str], bool] | None = None,
                experts: range | None = None,
                expert_tp: tuple[int, int] | None = None) -> dict:
    """One TP rank's megatron state dict for the global ``layers`` of its pipeline stage
    (numbered from 0 locally), from ``hf``: ``Tensors`` (``CheckpointWeights`` reads only the
    rank's parts, in the dtype stored), or a function giving a whole tensor by name (the parts
    cut from it); ``has(name)`` tells whether ``lm_head`` exists (tied checkpoints leave it
    out); ``experts``: the experts this rank holds, numbered from 0 locally (default: all);
    ``expert_tp``: its (rank, size) in the experts' tensor parallelism (default: tp's)."""
    state = {}
    for part in to_megatron_by_layer(hf, arch, tp_rank=tp_rank, tp_size=tp_size, layers=layers,
                                     first_stage=first_stage, last_stage=last_stage,
                                     vocab_size=vocab_size, has=has, experts=experts,
                                     expert_tp=expert_tp):
        state.update(part)
    return state


def to_megatron_by_layer(hf: Callable[[str], torch.Tensor] | Tensors, arch: LanguageArch, *,
                         tp_rank: int, tp_size: int, layers: Iterable[int], first_stage: bool,
                         last_stage: bool, vocab_size: int,
                         has: Callable[[str], bool] | None = None,
                         experts: range | None = None,
                         expert_tp: tuple[int, int] | None = None) -> Iterator[dict]:
    """``to_megatron``'s state a layer at a time (each read when asked for), then the
    embedding, final norm and output layer the stage holds: a loader holds one layer's part
    besides the model."""
    tensors = hf if isinstance(hf, Tensors) else Tensors(hf)
    parts = RankParts(tensors, tp_rank, tp_size)
    held = _Experts(experts, RankParts(tensors, *expert_tp) if expert_tp else parts)
    for local, layer in enumerate(layers):
        yield _layer_to_megatron(parts, arch, layer, f"decoder.layers.{local}.", held)
    state = {}
    if first_stage:
        state["embedding.word_embeddings.weight"] = _vocabulary_rows(
            parts, arch.embedding, vocab_size)
    if last_stage:
        state["decoder.final_layernorm.weight"] = parts.whole(arch.prefix + "norm.weight")
        untied = not arch.tied and (has is None or has(arch.head))
        output = arch.head if untied else arch.embedding
        state["output_layer.weight"] = _vocabulary_rows(parts, output, vocab_size)
    yield state


class _Experts(NamedTuple):
    """The experts a rank holds (None: all) and its parts of each (expert tensor parallelism)."""
    held: range | None
    parts: RankParts


def _layer_to_megatron(parts: RankParts, arch: LanguageArch, layer: int, dst: str,
                       experts: _Experts) -> dict:
    """Global decoder layer ``layer`` as megatron's ``dst``."""
    src = f"{arch.prefix}layers.{layer}."
    attn, mlp = src + "self_attn.", src + "mlp."
    state = {dst + "input_layernorm.weight": parts.whole(src + "input_layernorm.weight")}
    if arch.linear_layer(layer):
        assert arch.linear is not None
        state.update(delta_net.to_megatron(parts, arch.linear, src + "linear_attn.",
                                           dst + "self_attention."))
    else:
        state.update(_attention_to_megatron(parts, arch, attn, dst + "self_attention."))
    state[dst + "pre_mlp_layernorm.weight"] = parts.whole(src + "post_attention_layernorm.weight")
    if arch.experts:
        state.update(_experts_to_megatron(parts, arch, mlp, dst + "mlp.", experts))
        return state
    state[dst + "mlp.linear_fc1.weight"] = torch.cat(
        [parts.rows(mlp + "gate_proj.weight"), parts.rows(mlp + "up_proj.weight")])
    state[dst + "mlp.linear_fc2.weight"] = parts.cols(mlp + "down_proj.weight")
    return state


def _attention_to_megatron(parts: RankParts, arch: LanguageArch, src: str, dst: str) -> dict:
    """One attention block (``self_attn.``): q, k, v (with the gate) fused, the qk-norms, the
    output projection."""
    state = {dst + "linear_qkv.weight": _qkv_rows(parts, arch, src, "weight")}
    if arch.qkv_bias:
        state[dst + "linear_qkv.bias"] = _qkv_rows(parts, arch, src, "bias")
    if arch.qk_norm:
        state[dst + "q_layernorm.weight"] = parts.whole(src + "q_norm.weight")
        state[dst + "k_layernorm.weight"] = parts.whole(src + "k_norm.weight")
    state[dst + "linear_proj.weight"] = parts.cols(src + "o_proj.weight")
    return state


def _qkv_rows(parts: RankParts, arch: LanguageArch, src: str, kind: str) -> torch.Tensor:
    """This rank's rows of the fused q, k, v ``kind`` (weight or bias): its query groups'
    heads of each."""
    groups, d = arch.num_query_groups, arch.kv_channels
    names = [f"{src}{proj}_proj.{kind}" for proj in "qkv"]
    if groups % parts.tp_size:
        # a rank's rows would cut a query group (megatron-core refuses this TP size): cut
        # from the whole, as megatron's layout orders it
        q, k, v = (parts.whole(name) for name in names)
        whole = _qkv(q, k, v, arch)
        return whole[parts.span(whole.size(0))].clone()
    held = parts.span(groups)
    query_rows = parts.tensors.shape(names[0])[0] // groups       # with the gate heads
    q = parts.tensors.part(names[0], (slice(held.start * query_rows, held.stop * query_rows),))
    k, v = (parts.tensors.part(name, (slice(held.start * d, held.stop * d),))
            for name in names[1:])
    return _qkv(q, k, v, arch, held.stop - held.start)


def _experts_to_megatron(parts: RankParts, arch: LanguageArch, src: str, dst: str,
                         experts: _Experts) -> dict:
    """One mixture-of-experts layer: the router (``gate.weight``) and each held expert's
    ``linear_fc1`` / ``linear_fc2`` from the fused ``experts.gate_up_proj`` (gate, then up)
    and ``experts.down_proj``, read as this rank's rows of each expert (``_fused_parts``);
    expert tensor parallelism splits each expert as TP splits a dense MLP. Qwen3.5-MoE's
    shared expert (``shared_expert.*``, split by the dense TP) and its gate
    (``shared_expert_gate``) as megatron-core's ``shared_experts``."""
    gate_up, down = src + "experts.gate_up_proj", src + "experts.down_proj"
    count = parts.tensors.shape(gate_up)[0]
    for name in (gate_up, down):    # transformers refuses a size mismatch too
        if parts.tensors.shape(name)[0] != arch.experts:
            raise TrainConfigError(
                f"the checkpoint's {name} holds {parts.tensors.shape(name)[0]} experts, its "
                f"config.json names {arch.experts} (num_experts): not the architecture its "
                "config.json describes")
    held = range(count) if experts.held is None else experts.held
    if held.step != 1 or not 0 <= held.start <= held.stop <= count:
        raise ValueError(f"experts {held} are not a run of the checkpoint's "
                         f"{count} experts in {gate_up}")
    ffn, hidden, mine = arch.expert_ffn_hidden_size, arch.hidden_size, experts.parts
    gate, up, down_rows = (
        _fused_part(mine, gate_up, (2 * ffn, hidden), held, mine.span(ffn)),
        _fused_part(mine, gate_up, (2 * ffn, hidden), held, mine.span(ffn, ffn)),
        _fused_part(mine, down, (hidden, ffn), held, mine.span(ffn), columns=True))
    state = {dst + "router.weight": parts.whole(src + "gate.weight")}
    for e in range(len(held)):
        state[f"{dst}experts.local_experts.{e}.linear_fc1.weight"] = torch.cat([gate[e], up[e]])
        state[f"{dst}experts.local_experts.{e}.linear_fc2.weight"] = down_rows[e].contiguous()
    if arch.shared_expert_ffn_hidden_size:
        shared = src + "shared_expert."
        state[dst + "shared_experts.linear_fc1.weight"] = torch.cat(
            [parts.rows(shared + "gate_proj.weight"), parts.rows(shared + "up_proj.weight")])
        state[dst + "shared_experts.linear_fc2.weight"] = parts.cols(shared + "down_proj.weight")
        state[dst + "shared_experts.gate_weight"] = parts.whole(src + "shared_expert_gate.weight")
    return state


def _fused_part(parts: RankParts, name: str, shape: tuple[int, int], held: range,
                section: slice, columns: bool = False) -> torch.Tensor:
    """The ``held`` experts' rows ``section`` (``columns``: columns) of the fused ``name``
    in transformers 5's in-memory layout ``[E, *shape]`` (as it saves them), read from that
    layout or the published one (``[E, *reversed(shape)]``: Qwen3-VL-MoE's checkpoints, which
    transformers transposes on load); where both fit (a square ``shape``), transformers' own
    reading: the in-memory layout."""
    stored = parts.tensors.shape(name)
    experts = slice(held.start, held.stop)
    if stored[1:] == shape:
        index = (experts, slice(None), section) if columns else (experts, section)
        return parts.tensors.part(name, index)
    if stored[1:] == shape[::-1]:
        index = (experts, section) if columns else (experts, slice(None), section)
        return parts.tensors.part(name, index).transpose(1, 2)
    raise TrainConfigError(f"the checkpoint's {name} has shape {stored}, neither "
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
    ``in_proj_b``, ``in_proj_a``; a mixture of experts' shared expert's as the dense MLP's
    (``mlp.shared_expert.gate_proj`` ...). The routed experts' are left out: transformers
    holds them fused, one parameter per layer (``hf.adapters`` writes them as PEFT's
    ``target_parameters``)."""
    found: dict[str, tuple] = {}
    for key in state:
        if not key.endswith(".lora.a.weight") or not key.startswith("decoder.layers."):
            continue
        layer_key = key[:-len(".lora.a.weight")]
        a, b = state[key], state[layer_key + ".lora.b.weight"]
        _, _, index, block, *inner, name = layer_key.split(".")
        if "experts" in inner:                              # a routed expert's
            continue
        if block == "self_attention" and arch.linear_layer(int(index)):
            assert arch.linear is not None
            dst = f"{arch.prefix}layers.{index}.linear_attn."
            found.update({dst + n: (a, rows) for n, rows in
                          delta_net.adapter_rows(name, b, arch.linear).items()})
            continue
        dst = f"{arch.prefix}layers.{index}." + (
            "self_attn." if block == "self_attention" else
            "mlp.shared_expert." if inner == ["shared_experts"] else "mlp.")
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
                             vocab_size: int, experts: range | None = None,
                             expert_tp: tuple[int, int] | None = None) -> None:
    """Load this rank's part of the checkpoint ``path`` into ``model``, a built ``GPTModel``
    (not DDP-wrapped) holding the stage's layers from global ``layer_offset`` on and the
    ``experts`` of each mixture-of-experts layer (default: all), its ``expert_tp`` (rank,
    size) share of each (default: the TP's); every weight of ``model``
    must come from the checkpoint. Only the rank's parts are read, in the dtype stored, a layer
    at a time: besides the model, the host holds one layer's part."""
    own = {k: v for k, v in model.state_dict().items() if not k.endswith("._extra_state")}
    num_layers = len({k.split(".")[2] for k in own if k.startswith("decoder.layers.")})
    weights = CheckpointWeights(path)
    missing = set(own)
    for state in to_megatron_by_layer(
            weights, arch, tp_rank=tp_rank, tp_size=tp_size,
            layers=range(layer_offset, layer_offset + num_layers),
            first_stage=getattr(model, "pre_process", True),
            last_stage=getattr(model, "post_process", True), vocab_size=vocab_size,
            has=weights.__contains__, experts=experts, expert_tp=expert_tp):
        found = {k: v for k, v in state.items() if k in own}
        wrong = [f"{k} {tuple(v.shape)} vs {tuple(own[k].shape)}" for k, v in found.items()
                 if v.shape != own[k].shape]
        if wrong:
            raise _does_not_fit(path, [], wrong)
        model.load_state_dict(found, strict=False)
        missing -= set(found)
    if missing:
        raise _does_not_fit(path, sorted(missing), [])


def _does_not_fit(path: str, missing: list[str], wrong: list[str]) -> TrainConfigError:
    return TrainConfigError(f"model.language.pretrained {path} does not fit the language "
                            f"model: missing {missing[:3]}, shapes {wrong[:3]}")
