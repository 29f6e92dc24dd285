"""Which attention kernels a run uses, chosen once at start-up (``model.attention``).

The language model's core attention (``CoreAttention``, megatron-core's local
``DotProductAttention`` extended) has three backends:

- ``local``: megatron-core's local attention, ``[b, heads, s, s]`` scores in memory; packed,
  each sample through it one after another (a host loop over samples, per layer), under
  megatron-core's THD rotary, also per sample.
- ``sdpa``: ``scaled_dot_product_attention``, causal, no score matrix kept (flash or
  memory-efficient kernels on CUDA); packed, one SDPA call under a block-diagonal causal mask
  built on the device.
- ``varlen``: unpacked as ``sdpa``; packed, ``torch.nn.attention.varlen.varlen_attn`` over the
  sample boundaries (flash kernels: CUDA, bf16), grouped keys and values as they are.

``local`` is the reference: the CPU default and what ``sdpa`` and ``varlen`` are checked
against (tests/test_attention.py). ``auto`` picks ``local`` on the CPU, ``varlen`` on CUDA in
bf16 (on GPUs with flash kernels, compute capability 8.0 and up), else ``sdpa``.

Packed rows under ``sdpa`` / ``varlen`` need no per-sample loop anywhere: ``LanguageModel``
gives every token its rotary angle from its position id (positions restart at every sample),
and hands the row to megatron-core's attention as one sequence (``qkv_format`` sbhd, batch 1),
so megatron-core's own rotary is one operation per layer and ``CoreAttention`` keeps attention
inside each sample from ``cu_seqlens``. Nothing in either path reads a device tensor on the
host. TransformerEngine's attention (megatron-core's TE layer spec) is not used: mimo builds
local layer specs, whose parameter names its checkpoints and the transformers mapping use.

The encoders' transformers towers take ``attn_implementation``: ``flash_attention_2`` on CUDA
in bf16 when the ``flash-attn`` package is installed (Qwen2-VL's tower then attends over all
images at once by ``cu_seqlens``); else, where ``model.attention`` is ``auto`` or ``varlen`` and
the language model would get ``varlen``, ``varlen``: torch's varlen kernel over all items at
once in the towers that give their boundaries (the model package's tower attention), SDPA in the
others;
else ``sdpa`` (a setting of ``sdpa`` or ``local`` keeps the towers on transformers' own).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mimo_train.errors import TrainConfigError
from mimo_train.mcore import DotProductAttention, make_tp_sharded_tensor_for_checkpoint
from mimo_train.mcore.context_parallel import (heads_for, heads_to_sequence, sequence_to_heads,
                                               shard)
from mimo_train.mcore.deepstack import DeepstackLanguage
from mimo_train.mcore.rotary import InterleavedMultimodalRotaryEmbedding


@dataclass(frozen=True)
class AttentionChoice:
    """The kernels of a run: the language backend and the encoders' implementation."""
    language: str                   # local | sdpa | varlen
    encoders: str                   # sdpa | flash_attention_2 | varlen

    def describe(self) -> str:
        return f"attention: language {self.language}, encoders {self.encoders}"


@dataclass(frozen=True)
class Kernels:
    """What this machine offers (``available()``; tests pass their own)."""
    cuda: bool
    flash_capable: bool             # a GPU of compute capability 8.0 or more
    varlen: bool                    # torch.nn.attention.varlen
    flash_attn_2: bool              # the flash-attn package, for transformers


def available(device: torch.device) -> Kernels:
    from transformers.utils import is_flash_attn_2_available
    cuda = device.type == "cuda"
    return Kernels(cuda=cuda,
                   flash_capable=cuda and torch.cuda.get_device_capability(device)[0] >= 8,
                   varlen=importlib.util.find_spec("torch.nn.attention.varlen") is not None,
                   flash_attn_2=cuda and is_flash_attn_2_available())


def choose(setting: str, dtype: torch.dtype, kernels: Kernels) -> AttentionChoice:
    """The kernels for ``model.attention`` (see the module docstring); ``TrainConfigError``
    when the setting asks for one this machine or precision cannot run."""
    half = dtype in (torch.bfloat16, torch.float16)
    fast = kernels.cuda and kernels.flash_capable and half
    missing = [why for why, ok in (
        ("needs CUDA", kernels.cuda), ("needs bf16 (train.precision=bf16)", half),
        ("needs a GPU of compute capability 8.0 or more", kernels.flash_capable),
        ("needs torch.nn.attention.varlen (torch 2.10+)", kernels.varlen)) if not ok]
    if setting == "auto":
        language = "local" if not kernels.cuda else "sdpa" if missing else "varlen"
    elif setting == "varlen" and missing:
        raise TrainConfigError(f"model.attention is varlen, which {missing[0]}: use sdpa or auto")
    else:
        language = setting
    encoders = "flash_attention_2" if fast and kernels.flash_attn_2 else \
        "varlen" if language == "varlen" else "sdpa"
    return AttentionChoice(language, encoders)


class CoreAttention(DotProductAttention):
    """megatron-core's local ``DotProductAttention`` with the ``backend`` of the run; also
    takes packed batches (``packed_seq_params``): THD for ``local``, one sbhd row for the
    others (``LanguageModel``). Under context parallelism the backend runs between the
    all-to-alls over heads of ``mcore.context_parallel`` (megatron-core's class asserts cp1:
    it gets the config at cp1, and this class does the rest)."""

    def __init__(self, config, *args, backend: str = "local", **kwargs):
        cp = config.context_parallel_size
        super().__init__(dataclasses.replace(config, context_parallel_size=1) if cp > 1
                         else config, *args, **kwargs)
        self.backend = backend
        self.cp_group = self.pg_collection.cp if cp > 1 else None

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if self.cp_group is None:
            return self._attend(query, key, value, attention_mask, attn_mask_type,
                                attention_bias, packed_seq_params)
        group = self.cp_group
        key, value = heads_for(key, value, query.size(-2), group.size())
        query, key, value = (heads_to_sequence(t, group) for t in (query, key, value))
        with self._heads(query.size(-2), key.size(-2)):
            out = self._attend(query, key, value, attention_mask, attn_mask_type,
                               attention_bias, packed_seq_params)
        s, b = out.shape[:2]
        return sequence_to_heads(out.reshape(s, b, query.size(-2), -1), group).flatten(2)

    @contextlib.contextmanager
    def _heads(self, heads: int, groups: int):
        """This rank's share of the heads between the all-to-alls, as megatron-core's
        attention reads them."""
        names = ("num_attention_heads_per_partition", "num_query_groups_per_partition",
                 "hidden_size_per_partition")
        saved = [getattr(self, name) for name in names]
        for name, value in zip(names, (heads, groups,
                                       heads * self.hidden_size_per_attention_head)):
            setattr(self, name, value)
        try:
            yield
        finally:
            for name, value in zip(names, saved):
                setattr(self, name, value)

    def _attend(self, query, key, value, attention_mask, attn_mask_type, attention_bias,
                packed_seq_params):
        if self.backend == "local":
            if packed_seq_params is None:
                return super().forward(query, key, value, attention_mask, attn_mask_type,
                                       attention_bias)
            return self._per_sample(query, key, value, attn_mask_type, attention_bias,
                                    packed_seq_params.cu_seqlens_q)
        if self.backend == "varlen" and packed_seq_params is not None:
            return self._varlen(query, key, value, packed_seq_params)
        return self._sdpa(query, key, value, packed_seq_params)

    def _per_sample(self, query, key, value, attn_mask_type, attention_bias, cu_seqlens):
        """THD ``[tokens, heads, dim]`` (or one row of them, M-RoPE): each sample as a batch of
        one, ``[s, 1, h, d]``, under
        the causal mask the local attention makes for it (the CPU reference; ``tolist`` reads
        the boundaries on the host)."""
        bounds = cu_seqlens.tolist()

        def part(tensor, start, end):       # THD [t, h, d], or one sbhd row [t, 1, h, d]
            return tensor[start:end] if tensor.dim() == 4 else tensor[start:end, None]

        return torch.cat([super(CoreAttention, self).forward(
            part(query, start, end), part(key, start, end), part(value, start, end), None,
            attn_mask_type, attention_bias) for start, end in zip(bounds, bounds[1:])])

    def _sdpa(self, query, key, value, packed_seq_params):
        """``[s, b, heads, dim]`` through SDPA: causal, or block-diagonal causal over the
        packed row's samples."""
        s, b = query.shape[:2]
        key, value = self._one_head_per_query(key, value)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))       # [b, h, s, d]
        mask = None if packed_seq_params is None else _packed_mask(packed_seq_params, s)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                             scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    def _varlen(self, query, key, value, packed_seq_params):
        """The packed row ``[tokens, 1, heads, dim]`` through the varlen kernel, grouped keys
        and values as they are: flash kernels take fewer key/value heads than query heads (query
        head ``i`` reads group ``i // (heads / groups)``, megatron-core's order), so the
        repeat's kernels (two forward, two reductions backward) and the repeated copies the
        kernel would keep for its backward pass are not made."""
        from torch.nn.attention.varlen import varlen_attn
        # squeezed, not indexed: indexing's backward writes the gradient into zeros; the
        # values contiguous: as a view of the fused QKV output they would keep all of it
        q, k, v = query.squeeze(1), key.squeeze(1), value.squeeze(1).contiguous()
        cu = packed_seq_params.cu_seqlens_q.to(torch.int32)
        longest = packed_seq_params.max_seqlen_q
        out = varlen_attn(q, k, v, cu, cu, longest, longest, scale=self.softmax_scale,
                          window_size=(-1, 0))                             # (-1, 0): causal
        return out.reshape(out.size(0), 1, -1)

    def _one_head_per_query(self, key, value):
        """Grouped key/value heads repeated for each query head of the group (megatron-core's
        order; ``[..., heads, dim]``): SDPA's GQA mode runs only its math kernel under a mask
        or in fp32, so its fused kernels get the heads spelled out."""
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if groups == 1:
            return key, value
        return key.repeat_interleave(groups, dim=-2), value.repeat_interleave(groups, dim=-2)


def _packed_mask(packed_seq_params, tokens: int) -> torch.Tensor:
    """The micro-batch's block-diagonal causal mask, built once: every layer's attention gets
    the same ``PackedSeqParams``, which keeps it (so backward keeps one mask, not one per
    layer)."""
    mask = getattr(packed_seq_params, "block_causal_mask", None)
    if mask is None:
        mask = block_causal_mask(packed_seq_params.cu_seqlens_q, tokens)
        packed_seq_params.block_causal_mask = mask
    return mask


def block_causal_mask(cu_seqlens: torch.Tensor, tokens: int) -> torch.Tensor:
    """``[tokens, tokens]`` True where a token may attend: an earlier (or the same) token of
    its own sample; built on ``cu_seqlens``'s device, without reading it on the host."""
    position = torch.arange(tokens, device=cu_seqlens.device)
    sample = torch.searchsorted(cu_seqlens[1:].to(torch.int64), position, right=True)
    return (sample[:, None] == sample[None, :]) & (position[:, None] >= position[None, :])


class LanguageModel(DeepstackLanguage):
    """``GPTModel`` that hands packed rows to its attention as one sbhd sequence when the
    backend is not ``local`` (``packed_rows``): every token's rotary angle comes from its
    position id, so positions restart at each sample without megatron-core's per-sample THD
    rotary loop, and ``CoreAttention`` keeps attention within each sample. It adds deepstack
    features after its first layers (``mcore.deepstack``) and, with ``mrope_interleaved``,
    lays its M-RoPE out interleaved (``mcore.rotary``)."""

    def __init__(self, *, packed_rows: bool, mrope_interleaved: bool = False, **kwargs):
        super().__init__(**kwargs)
        if packed_rows and self.position_embedding_type not in ("rope", "mrope"):
            raise ValueError(f"packed rows need rotary positions, not "
                             f"{self.position_embedding_type!r}: use model.attention=local")
        if mrope_interleaved:       # transformers' Qwen3-VL: no interpolation, pairs split
            assert self.position_embedding_type == "mrope" and not self.config.rotary_interleaved \
                and kwargs.get("seq_len_interpolation_factor") is None
            self.rotary_pos_emb = InterleavedMultimodalRotaryEmbedding(
                kv_channels=self.config.kv_channels,
                rotary_percent=kwargs.get("rotary_percent", 1.0),
                rotary_base=kwargs.get("rotary_base", 10000))
        self.enable_deepstack()
        # context parallelism: rotary angles for the whole sequence, then this rank's part
        # (contiguous, mcore.context_parallel; megatron-core's own cut is Transformer Engine's
        # load-balanced one)
        self.cp_group = self.pg_collection.cp if self.config.context_parallel_size > 1 else None
        if self.cp_group is not None and self.position_embedding_type in ("rope", "mrope"):
            self.rotary_pos_emb.cp_group = None
        # M-RoPE angles are computed token by token from the position ids: packed rows always
        # go as one sequence (megatron-core's THD rotary would give every sample the first
        # sample's angles), as they do under context parallelism (attention sees the whole
        # sequence of its heads, the rotary angles are this rank's tokens')
        self.packed_rows = packed_rows or self.position_embedding_type == "mrope" \
            or self.cp_group is not None

    def forward(self, *args, **kwargs):
        output = super().forward(*args, **kwargs)
        return output if self.post_process else self.carry_deepstack(output)

    def tie_embeddings_and_output_weights_state_dict(
            self, sharded_state_dict: dict, output_layer_weight_key: str,
            first_stage_word_emb_key: str, metadata: dict | None = None) -> None:
        """megatron-core's, with the last stage's replica id from this model's own
        data-parallel group (``metadata["dp_cp_group"]``): megatron-core's reads parallel_state's
        global groups, which mimo never initializes (each module's groups come from its
        ``HyperCommGrid``), so a model with tied embeddings under pipeline stages could not be
        checkpointed."""
        if not self.post_process or self.pre_process or getattr(self, "mtp_process", False):
            super().tie_embeddings_and_output_weights_state_dict(
                sharded_state_dict, output_layer_weight_key, first_stage_word_emb_key,
                metadata or {})
            return
        group = (metadata or {})["dp_cp_group"]
        sharded_state_dict[output_layer_weight_key] = make_tp_sharded_tensor_for_checkpoint(
            tensor=self.shared_embedding_or_output_weight(), key=first_stage_word_emb_key,
            replica_id=(1, 0, group.rank()), allow_shape_mismatch=True,
            tp_group=self.tp_group, dp_cp_group=group)

    def _preprocess(self, input_ids, position_ids, decoder_input=None, inference_context=None,
                    packed_seq_params=None, padding_mask=None):
        out = super()._preprocess(input_ids, position_ids, decoder_input, inference_context,
                                  packed_seq_params, padding_mask)
        hidden = out[0]
        # megatron-core's full recompute checkpoints layers reentrantly: a block whose input
        # needs no gradient (frozen embeddings, no trained tower in the micro-batch) makes none
        # for the weights inside it, which LoRA trains. The input then asks for one, as PEFT's
        # enable_input_require_grads does.
        if self.config.recompute_granularity == "full" and torch.is_grad_enabled() \
                and hidden is not None and not hidden.requires_grad:
            hidden.requires_grad_(True)
        rotary = out[1]
        if self.packed_rows and packed_seq_params is not None \
                and packed_seq_params.qkv_format == "thd":
            if rotary is not None and self.position_embedding_type == "rope":
                rotary = rotary[position_ids.reshape(-1)]           # [tokens, 1, 1, dim]
            # the same object reaches every layer's attention for this micro-batch
            packed_seq_params.qkv_format = "sbhd"
        if rotary is not None and self.cp_group is not None:
            rotary = shard(rotary, 0, self.cp_group)                # [tokens / cp, ...]
        return (out[0], rotary, *out[2:])
