"""The gated delta-net kernels (Qwen3.5's linear-attention layers), exact per sample when
sequences are packed, on every device.

Three functions with flash-linear-attention's (fla's) signatures and layouts, which
megatron-core's ``GatedDeltaNet`` calls (``mcore.gated_delta_net`` gives them to it when fla
cannot serve): ``causal_conv1d`` (the short causal convolution over q, k, v), ``l2norm`` and
``chunk_gated_delta_rule`` (the gated delta rule, chunked). Layouts are fla's: ``[batch, seq,
heads, dim]``; a packed row is batch 1 with ``cu_seqlens`` ``[n + 1]`` (int) giving the sample
boundaries. Each call uses fla's kernel when fla is importable and the tensor is on CUDA
(fla's kernels are Triton, GPU only), else the torch implementation below.

Packing stays per sample for the hybrid layers: every packed sample starts from a zero
recurrent state and a zero convolution window, exactly as if it ran alone. On a GPU with fla,
fla's kernels do it from ``cu_seqlens``; on the CPU, or a GPU without fla, the torch kernels
here do it (the recurrence restarts at each sample's first chunk, the convolution sees zeros
before each sample's first token). transformers' torch fallback (``torch_chunk_gated_delta_rule``
in ``models/qwen3_5/modeling_qwen3_5.py``) and megatron-core's ``deterministic_mode`` fallback
run a packed row as one sequence: state and window leak from one sample into the next (losses
collapse, NaN gradients). The gated full-attention layers keep attention inside each sample
from the same ``cu_seqlens`` (``mcore.attention``).

The torch versions are written here because no installed library has them: fla is Triton (GPU
only, not installable on the CPU machines), and the torch fallbacks of transformers and
megatron-core ignore ``cu_seqlens``. They run in fp32 internally (as transformers' does) and
stay vectorized: the chunked form (chunks of 64 tokens, the intra-chunk work done for all
chunks of all samples at once, a triangular solve for the WY form), only the inter-chunk
recurrence looping, over the longest sample's chunks, the states of all samples with a chunk
left at once (a packed 8k row of 24 samples: ~6 steps, not the row's ~140 chunks, each a few
kernels on a GPU); each sample's chunks start at a chunk boundary.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from mimo_data.modalities.base import to_device
from mimo_train.runtime.console import PREFIX, say

CHUNK = 64
ACTIVATIONS = (None, "silu", "swish")


@functools.cache
def _fla() -> dict[str, Any] | None:
    """fla's kernels (the import paths megatron-core 0.19.2 uses), or None when fla is absent
    or refuses its gated delta rule's backward pass here (``fla_refusal``)."""
    try:
        from fla.modules.convolution import causal_conv1d
        from fla.modules.l2norm import l2norm
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    if (reason := fla_refusal()) is not None:
        say(f"{PREFIX}{reason}")
        return None
    return {"causal_conv1d": causal_conv1d, "l2norm": l2norm,
            "chunk_gated_delta_rule": chunk_gated_delta_rule}


def fla_refusal() -> str | None:
    """Why fla's gated delta rule cannot train here, by fla's own flags, or None: on Hopper
    GPUs with Triton 3.4 to 3.7.0 (torch 2.11's) fla's backward kernel gives wrong gradients,
    so fla raises in the first backward pass unless its tilelang backend is installed
    (fla 0.6's ``chunk_bwd_dqkwg``, its issue #640; measured on an H200)."""
    import importlib.util
    try:
        from fla.ops.common import chunk_o
    except ImportError:
        return None
    broken = getattr(chunk_o, "IS_NVIDIA_HOPPER", False) and \
        getattr(chunk_o, "TRITON_ABOVE_3_4_0", False) and \
        not getattr(chunk_o, "TRITON_ABOVE_3_7_1", True)
    if not broken or importlib.util.find_spec("tilelang") is not None:
        return None
    return ("flash-linear-attention's gated delta rule is not used: with this Triton on a "
            "Hopper GPU its backward pass is wrong and it refuses to run (fla issue #640); "
            "mimo's torch kernels run instead (the same results, slower). For fla's speed: "
            "pip install 'triton>=3.7.1' or pip install tilelang")


def fla_usable() -> bool:
    """Whether fla's kernels can train here: importable and not refusing (``fla_refusal``)."""
    return _fla() is not None


def fla_serves(tensor: torch.Tensor) -> bool:
    """Whether fla's kernels run for ``tensor``: fla usable and the tensor on CUDA."""
    return tensor.is_cuda and fla_usable()


# The boundaries last read to the host, with the tensors they were read from (newest last):
# every gated delta-net layer of a micro-batch gets the same ``cu_seqlens`` tensors (the
# query's and the key's), each read once (on a GPU each read waits for the device; four a
# layer otherwise).
_HOST_BOUNDS: list[tuple[weakref.ref, list[int]]] = []
_HOST_BOUNDS_KEPT = 4


def host_bounds(cu_seqlens: torch.Tensor) -> list[int]:
    """``cu_seqlens`` as ints, read from the device once per tensor (not modified in place:
    a packed micro-batch's boundaries are made once, then only read)."""
    for tensor, bounds in _HOST_BOUNDS:
        if tensor() is cu_seqlens:
            return bounds
    bounds = [int(b) for b in cu_seqlens.tolist()]
    _HOST_BOUNDS.append((weakref.ref(cu_seqlens), bounds))
    del _HOST_BOUNDS[:-_HOST_BOUNDS_KEPT]
    return bounds


def _bounds(cu_seqlens: torch.Tensor | None, batch: int, tokens: int) -> list[int]:
    """The sample boundaries within a row: ``cu_seqlens`` (packed, batch 1), else the whole
    row is one sample."""
    if cu_seqlens is None:
        return [0, tokens]
    if batch != 1:
        raise ValueError(f"packed inputs (cu_seqlens) have batch 1, not {batch}")
    bounds = host_bounds(cu_seqlens)
    if bounds[0] != 0 or bounds[-1] != tokens or \
            any(later < earlier for earlier, later in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens {bounds} does not split {tokens} tokens")
    return bounds


@functools.lru_cache(maxsize=8)         # a micro-batch's layers share their boundaries
@torch.inference_mode(False)            # kept for later training steps: not inference tensors
def _conv_plan(bounds: tuple[int, ...], width: int, device: torch.device
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each token goes in the convolution's row of samples each after a window of
    ``width`` zeros, each sample's window and its last ``width`` places there: made on the
    host, on ``device`` once."""
    edges = torch.tensor(bounds)
    samples, tokens = len(bounds) - 1, bounds[-1]
    sample = torch.repeat_interleave(torch.arange(samples), edges.diff(), output_size=tokens)
    position = torch.arange(tokens) + width * (sample + 1)
    window = (edges[:-1, None] + width * torch.arange(samples)[:, None]
              + torch.arange(width))                                  # [samples, W]
    last = (edges[1:, None] + width * torch.arange(1, samples + 1)[:, None]
            - width + torch.arange(width))                            # [samples, W]
    return (to_device(position, device), to_device(window.reshape(-1), device),
            to_device(last.reshape(-1), device))


@dataclass(frozen=True)
class _RulePlan:
    """The recurrence's order of a row's chunks: samples longest first (``order``, and each
    sample's ``rank`` there), step j holds the j-th chunk of the ``active[j]`` samples that
    have one, the steps one after another; ``position``: each token's place in that order
    (its chunk's slot x CHUNK + its place in the chunk)."""
    chunks: int                 # slots in all
    active: list[int]
    order: torch.Tensor
    rank: torch.Tensor
    position: torch.Tensor


@functools.lru_cache(maxsize=8)         # a micro-batch's layers share their boundaries
@torch.inference_mode(False)            # kept for later training steps: not inference tensors
def _rule_plan(bounds: tuple[int, ...], device: torch.device) -> _RulePlan:
    """The row's ``_RulePlan``: made on the host, on ``device`` once."""
    edges = torch.tensor(bounds)
    lengths = edges.diff()
    counts = [-(-int(n) // CHUNK) for n in lengths]
    order = sorted(range(len(counts)), key=lambda n: -counts[n])
    rank = torch.empty(len(counts), dtype=torch.long)
    rank[torch.tensor(order, dtype=torch.long)] = torch.arange(len(counts))
    active = [sum(count > j for count in counts) for j in range(max(counts, default=0))]
    starts = [0]
    for width in active:
        starts.append(starts[-1] + width)
    sample = torch.repeat_interleave(torch.arange(len(counts)), lengths, output_size=bounds[-1])
    within = torch.arange(bounds[-1]) - edges[sample]
    slot = torch.tensor(starts, dtype=torch.long)[within // CHUNK] + rank[sample]
    return _RulePlan(starts[-1], active, to_device(torch.tensor(order, dtype=torch.long), device),
                     to_device(rank, device), to_device(slot * CHUNK + within % CHUNK, device))


def l2norm(x: torch.Tensor, eps: float = 1e-6, output_dtype: torch.dtype | None = None
           ) -> torch.Tensor:
    """``x / sqrt(sum(x²) + eps)`` over the last dimension, computed in fp32 (fla's)."""
    if fla_serves(x):
        return _fla()["l2norm"](x, eps=eps, output_dtype=output_dtype)  # type: ignore[index]
    x32 = x.float()
    y = x32 * torch.rsqrt((x32 * x32).sum(-1, keepdim=True) + eps)
    return y.to(output_dtype or x.dtype)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor | None = None,
                  bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                  initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                  activation: str | None = None, cu_seqlens: torch.Tensor | None = None,
                  **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Depthwise causal convolution of ``x`` ``[B, T, D]`` with ``weight`` ``[D, W]`` (fla's
    ``fla.modules.convolution.causal_conv1d``): ``y[t] = act(sum_j weight[:, j] ·
    x[t - W + 1 + j] + bias) (+ residual)``, where tokens before a sample's first are
    ``initial_state[n, :, 1:]`` (``[N, D, W]``, fla's cache layout) or zeros. Returns ``(y,
    final_state)``: the last ``W`` inputs of each sample (``[N, D, W]``, the initial state
    shifted in before a short sample) when ``output_final_state``, else None."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r}: one of {ACTIVATIONS}")
    if fla_serves(x):
        return _fla()["causal_conv1d"](  # type: ignore[index]
            x=x, weight=weight, bias=bias, residual=residual, initial_state=initial_state,
            output_final_state=output_final_state, activation=activation,
            cu_seqlens=cu_seqlens, **kwargs)
    batch, tokens, dim = x.shape
    if weight is None:
        raise ValueError("the torch causal_conv1d needs the weight [D, W]")
    width = weight.shape[-1]
    bounds = _bounds(cu_seqlens, batch, tokens)
    samples = len(bounds) - 1
    # each sample's tokens after a window of W: [batch, D, T + samples·W]
    position, window, last = _conv_plan(tuple(bounds), width, x.device)
    size = tokens + samples * width
    rows = x.float().transpose(1, 2)
    padded = rows.new_zeros(batch, dim, size).index_copy(2, position, rows)
    if initial_state is not None:     # [N, D, W] into each sample's window
        state = initial_state.float().reshape(batch, samples, dim, width)
        padded = padded.index_copy(2, window,
                                   state.permute(0, 2, 1, 3).reshape(batch, dim, -1))
    y = F.conv1d(padded, weight.float()[:, None, :],
                 None if bias is None else bias.float(), groups=dim)   # [batch, D, size - W + 1]
    y = y.index_select(2, position - width + 1).transpose(1, 2)
    if activation is not None:
        y = F.silu(y)
    if residual is not None:
        y = y + residual.float()
    final = None
    if output_final_state:
        final = padded.index_select(2, last).reshape(batch, dim, samples, width)
        final = final.permute(0, 2, 1, 3).reshape(batch * samples, dim, width).to(x.dtype)
    return y.to(x.dtype), final


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, scale: float | None = None,
                           initial_state: torch.Tensor | None = None,
                           output_final_state: bool = False,
                           use_qk_l2norm_in_kernel: bool = False,
                           cu_seqlens: torch.Tensor | None = None, **kwargs
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule (fla's ``fla.ops.gated_delta_rule.chunk_gated_delta_rule``): per
    token, ``S = exp(g) S``, ``S += k (beta (v - S^T k))^T``, ``o = S^T (scale q)``, the state
    ``S`` ``[K, V]`` per value head. ``q``, ``k``: ``[B, T, H, K]``; ``v``: ``[B, T, HV, V]``
    (HV a multiple of H: each q/k head serves HV / H consecutive value heads); ``g`` (log
    decay), ``beta``: ``[B, T, HV]``; ``scale``: default ``K ** -0.5``; ``initial_state``:
    ``[N, HV, K, V]``, one per sample (N = B unpacked, the number of samples packed); packed
    samples (``cu_seqlens``) start from theirs, or zeros. Returns ``(o [B, T, HV, V]`` in
    q's dtype, ``final_state [N, HV, K, V]`` fp32 when ``output_final_state``, else None)."""
    if fla_serves(q):
        return _fla()["chunk_gated_delta_rule"](  # type: ignore[index]
            q, k, v, g, beta, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens, **kwargs)
    dtype = q.dtype
    batch, tokens, heads, k_dim = k.shape
    v_heads = v.shape[2]
    if v_heads % heads:
        raise ValueError(f"{v_heads} value heads are not a multiple of {heads} key heads")
    bounds = _bounds(cu_seqlens, batch, tokens)
    samples = len(bounds) - 1
    if initial_state is not None and initial_state.shape[0] != batch * samples:
        raise ValueError(f"initial_state has {initial_state.shape[0]} states for "
                         f"{batch * samples} sequences")
    scale = k_dim ** -0.5 if scale is None else scale
    q, k = (t.repeat_interleave(v_heads // heads, dim=2) for t in (q, k))
    # fp32, heads first: [B, HV, T, dim]
    q, k, v, g, beta = (t.float().transpose(1, 2) for t in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q = q * scale

    # each sample's tokens from a chunk boundary on, zeros after its last (the padding
    # neither decays, g = 0, nor writes, k = 0 and beta = 0, the state; its outputs are
    # dropped), the chunks in the recurrence's order (``_RulePlan``)
    plan = _rule_plan(tuple(bounds), q.device)
    size = CHUNK * plan.chunks

    def chunked(t: torch.Tensor) -> torch.Tensor:    # [B, HV, T, ...] -> [B, HV, chunks, C, ...]
        padded = t.new_zeros(*t.shape[:2], size, *t.shape[3:]).index_copy(2, plan.position, t)
        return padded.reshape(*t.shape[:2], plan.chunks, CHUNK, *t.shape[3:])

    q, k, v, g, beta = (chunked(t) for t in (q, k, v, g, beta))
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]

    # within each chunk, all chunks at once: cumulated log decay, the pairwise decays
    # exp(G_i - G_j) (i >= j), the WY form of the chunk's delta updates by a triangular solve
    cum = g.cumsum(-1)
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay           # strictly lower part used
    intra = (q @ k.transpose(-1, -2)) * decay
    values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None],
                                               upper=False, unitriangular=True)
    q_decayed = q * cum.exp()[..., None]
    k_decayed = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]

    # across chunks: the recurrence, every sample's j-th chunk at step j, a state [K, V] per
    # sample from its own initial state (as many steps as the longest sample has chunks, not
    # as the row has); a sample whose chunks are done leaves the states stepped (the longest
    # first: those left are the first ones), so the steps' work is the row's chunks
    v_dim = v.shape[-1]
    if initial_state is None:
        state = q.new_zeros(batch, v_heads, samples, k_dim, v_dim)
    else:               # [samples x batch, HV, K, V], sample-major -> [B, HV, samples, K, V]
        state = initial_state.float().reshape(samples, batch, v_heads, k_dim, v_dim) \
            .index_select(0, plan.order).permute(1, 2, 0, 3, 4)
    outputs, done = [], []
    # each step's chunks, split once (a slice per step would make each step's gradient as
    # large as the row's in the backward pass; the split's joins them once)
    by_step = zip(plan.active, *(torch.split(t, plan.active, dim=2) for t in (
        values, k_cumdecay, q_decayed, intra, k_decayed, chunk_decay)))
    for active, values_j, k_cumdecay_j, q_decayed_j, intra_j, k_decayed_j, decay_j in by_step:
        if active < state.shape[2]:
            done.append(state[:, :, active:])
            state = state[:, :, :active]
        v_new = values_j - k_cumdecay_j @ state
        outputs.append(q_decayed_j @ state + intra_j @ v_new)
        state = state * decay_j + k_decayed_j.transpose(-1, -2) @ v_new
    out = torch.cat(outputs, dim=2).reshape(batch, v_heads, size, v_dim) if outputs else \
        q.new_zeros(batch, v_heads, 0, v_dim)
    out = out.index_select(2, plan.position).transpose(1, 2).to(dtype)
    final = None
    if output_final_state:      # back in the samples' order
        final = torch.cat([state, *reversed(done)], dim=2).index_select(2, plan.rank) \
            .permute(2, 0, 1, 3, 4).reshape(samples * batch, v_heads, k_dim, v_dim)
    return out.contiguous(), final
