"""What the GPU check asks of the machine itself, in a child process (``python probes.py``):
JSON lines on stdout as it goes, ``{"env": ...}``, then for each probe ``{"starting": name}``
and ``{"kernel": name, "found": ...}``.

- ``env``: versions, the GPU, and a bf16 matmul's TFLOP/s (8192^3, the practical peak);
- ``kernels``: a one-rank NCCL all-reduce, mimo's step timer (CUDA events) around matmuls,
  ``varlen_attn`` over three causal samples against SDPA on each sample alone (and on a packed
  8k row of grouped queries, the groups unrepeated against repeated), the image
  tower under mimo's varlen attention and fused elementwise regions against transformers' SDPA
  (``tower_varlen``), each fused region's compiled kernel against its formula (``fusions``),
  the gated delta-net's kernels (``delta_net``) as mimo's layer calls them
  (``mimo_train.mcore.delta_rule``: flash-linear-attention's where installed, else mimo's torch
  ones), a rank's experts as grouped GEMMs against a loop over them (``grouped_experts``),
  torch's AdamW over Qwen2-VL-2B's language model, foreach against fused (``adam``), and a
  linear layer's weight gradient made into its fp32 buffer by its GEMM against megatron-core's
  bf16 gradient and addition (``wgrad``), and the tower's attention (16 heads of 80) on
  flash's kernels, packed and batched, and cuDNN's, batched (``tower_attention``); each
  probe's failure is recorded and the next one still runs.

``delta_net``: Qwen3.5-4B's linear-attention shapes (16 key heads, 32 value heads of 128, a
convolution of 4 over q, k, v), bf16, four samples of 1000, 37, 2048 and 511 tokens packed in one
row (``cu_seqlens``) against each sample alone: the largest difference of the convolution's and
the delta rule's outputs and of every input's gradient, relative to the largest entry (packing
per sample: near bf16's rounding; ``ok`` under 5e-2); the same packed row run as one sequence (a
leaking state: far off); the packed output against mimo's fp32 torch kernels; and the
milliseconds of a packed forward and backward.
"""

from __future__ import annotations

import copy
import itertools
import json
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F


def env() -> dict:
    import megatron.core
    import transformers
    found: dict = {"python": sys.version.split()[0], "torch": torch.__version__,
                   "transformers": transformers.__version__,
                   "megatron_core": megatron.core.__version__,
                   "cuda": torch.cuda.is_available()}
    if found["cuda"]:
        p = torch.cuda.get_device_properties(0)
        found.update(gpu=p.name, capability=f"{p.major}.{p.minor}",
                     gpu_memory_gib=round(p.total_memory / 2**30, 1),
                     cuda_runtime=torch.version.cuda)
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        b = torch.randn_like(a)
        for _ in range(3):
            a @ b
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(20):
            a @ b
        torch.cuda.synchronize()
        found["bf16_matmul_tflops"] = round(
            20 * 2 * 8192**3 / (time.perf_counter() - started) / 1e12, 1)
    return found


def nccl() -> dict:
    store = dist.FileStore(tempfile.mktemp(), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1,
                            device_id=torch.device("cuda:0"))
    t = torch.full((4,), 3.0, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    backend = dist.get_backend()
    dist.destroy_process_group()
    return {"ok": bool((t == 3.0).all()), "backend": backend,
            "nccl_version": ".".join(map(str, torch.cuda.nccl.version()))}


def events() -> dict:
    from mimo_train.components.metrics import Timer
    a = torch.randn(4096, 4096, device="cuda")
    timer = Timer(torch.device("cuda"))
    for _ in range(10):
        a @ a
    seconds = timer.stop().seconds()
    return {"ok": seconds > 0, "seconds": seconds}


LANGUAGE_ROW = (340,) * 24             # a packed 8k row of the corpus's conversations


def varlen(device: str = "cuda", grouped_lengths: tuple[int, ...] = LANGUAGE_ROW) -> dict:
    """``varlen_attn`` over three causal samples against SDPA on each alone
    (``max_abs_diff_vs_sdpa``); then Qwen2-VL-2B's language attention (12 query heads, 2
    key/value groups of 128) on a packed row of ``grouped_lengths``, the groups as mimo's
    packed rows give them against repeated to the query heads (what it gave before):
    ``grouped_max_rel_diff``, the outputs' and gradients' largest difference relative to the
    repeated one's largest entry (query head i reads group i // 6, megatron-core's order; ``ok``
    under 1e-2), and each one's forward and backward
    milliseconds (``grouped_ms``, ``repeated_ms``)."""
    from torch.nn.attention.varlen import varlen_attn
    torch.manual_seed(0)
    lengths, heads, dim = [37, 5, 90], 4, 64
    q, k, v = (torch.randn(sum(lengths), heads, dim, device=device, dtype=torch.bfloat16)
               for _ in range(3))
    cu = torch.tensor([0, 37, 42, 132], device=device, dtype=torch.int32)
    out = varlen_attn(q, k, v, cu, cu, max(lengths), max(lengths),
                      window_size=(-1, 0))                     # (-1, 0): causal
    reference, at = [], 0
    for n in lengths:
        one_q, one_k, one_v = (t[at:at + n].transpose(0, 1)[None] for t in (q, k, v))
        reference.append(F.scaled_dot_product_attention(one_q, one_k, one_v, is_causal=True)[0]
                         .transpose(0, 1))
        at += n
    diff = (out.float() - torch.cat(reference).float()).abs().max().item()
    grouped = _grouped_varlen(device, list(grouped_lengths))
    return {"ok": diff < 2e-2 and grouped["grouped_max_rel_diff"] < 1e-2,
            "max_abs_diff_vs_sdpa": diff, **grouped}


def _grouped_varlen(device: str, lengths: list[int], heads: int = 12, groups: int = 2,
                    dim: int = 128) -> dict:
    from torch.nn.attention.varlen import varlen_attn
    torch.manual_seed(0)
    tokens, longest = sum(lengths), max(lengths)
    q = torch.randn(tokens, heads, dim, device=device, dtype=torch.bfloat16,
                    requires_grad=True)
    k, v = (torch.randn(tokens, groups, dim, device=device, dtype=torch.bfloat16,
                        requires_grad=True) for _ in range(2))
    cu = torch.tensor([0, *itertools.accumulate(lengths)], device=device, dtype=torch.int32)
    grad = torch.randn(tokens, heads, dim, device=device, dtype=torch.bfloat16)
    synchronize = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def attend(repeat: bool) -> list[torch.Tensor]:
        """The output and the gradients of q, k and v."""
        keys, values = (t.repeat_interleave(heads // groups, dim=1) if repeat else t
                        for t in (k, v))
        out = varlen_attn(q, keys, values, cu, cu, longest, longest, window_size=(-1, 0))
        return [out.detach(), *torch.autograd.grad(out, (q, k, v), grad)]

    def timed(repeat: bool) -> float:
        for _ in range(2):
            attend(repeat)
        synchronize()
        started = time.perf_counter()
        for _ in range(5):
            attend(repeat)
        synchronize()
        return (time.perf_counter() - started) / 5 * 1e3

    difference = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                     for a, b in zip(attend(False), attend(True)))
    return {"grouped_max_rel_diff": difference, "grouped_ms": round(timed(False), 3),
            "repeated_ms": round(timed(True), 3)}


TOWER = "tools/published/Qwen--Qwen2-VL-2B-Instruct"
TOWER_IMAGES = 16                        # of 36 x 36 patches (324 tokens: a 512 x 512 photo)


def tower_varlen(device: str = "cuda", images: int = TOWER_IMAGES, side: int = 36) -> dict:
    """Qwen2-VL-2B's published tower (32 layers of 1280), bf16, a micro-batch of ``images``
    as transformers runs it (``sdpa``: a host split and an SDPA call per image and layer, its
    grid-derived inputs made on the GPU), with mimo's varlen attention alone (``varlen``,
    ``mimo_train.model.tower_attention``: one call per layer; those inputs made on the host,
    ``Qwen2VLVision.run_tower``), and as the trainer builds it (``fused``: also
    ``mimo_train.model.tower_fusions``' compiled rotary and QuickGELU): each one's rows and a
    gradient apart from transformers' (relative to the largest entry), the milliseconds of a
    forward and backward, and of the first one (the fused tower's: compiling its kernels)."""
    import copy

    from transformers import AutoConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import (
        Qwen2VisionTransformerPretrainedModel)

    from mimo_train.families.qwen2_vl import Qwen2VLVision
    from mimo_train.model.tower_attention import VARLEN, set_attention
    from mimo_train.model.tower_fusions import fuse
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(TOWER).vision_config
    sdpa = Qwen2VisionTransformerPretrainedModel._from_config(
        config, dtype=torch.bfloat16).to(device)
    sdpa.set_attn_implementation("sdpa")
    varlen = copy.deepcopy(sdpa)
    set_attention(varlen, "varlen", by_boundaries=True)
    fused = copy.deepcopy(varlen)
    fuse(fused, VARLEN)
    columns = config.in_channels * config.temporal_patch_size * config.patch_size ** 2
    grid = torch.tensor([[1, side, side]] * images)
    pixels = torch.randn(images * side * side, columns, device=device, dtype=torch.bfloat16)

    def transformers_run(tower):
        return tower(hidden_states=pixels, grid_thw=grid.to(device))

    def mimo_run(tower):
        return Qwen2VLVision.run_tower(tower, pixels, grid)

    def step(tower, run):
        run(tower).pooler_output.float().square().mean().backward()

    def timed(tower, run):
        torch.cuda.synchronize()
        started = time.perf_counter()
        step(tower, run)
        torch.cuda.synchronize()
        first = time.perf_counter() - started
        step(tower, run)
        tower.zero_grad()
        torch.cuda.synchronize()            # the warm-up's backward is not the timed steps'
        started = time.perf_counter()
        for _ in range(3):
            rows = run(tower).pooler_output
            rows.float().square().mean().backward()
        torch.cuda.synchronize()
        grad = tower.blocks[0].attn.qkv.weight.grad.float()
        return rows.detach().float(), grad, (time.perf_counter() - started) / 3 * 1e3, first

    expected, expected_grad, sdpa_ms, _ = timed(sdpa, transformers_run)
    result: dict = {"images": images, "patches": images * side * side,
                    "sdpa_fwd_bwd_ms": round(sdpa_ms, 1)}
    for name, tower in (("varlen", varlen), ("fused", fused)):
        found, grad, ms, first = timed(tower, mimo_run)
        result |= {f"max_rel_diff_rows_{name}":
                   ((found - expected).abs().max() / expected.abs().max()).item(),
                   f"max_rel_diff_grad_{name}":
                   ((grad - expected_grad).abs().max() / expected_grad.abs().max()).item(),
                   f"{name}_fwd_bwd_ms": round(ms, 1), f"{name}_first_call_s": round(first, 1)}
    result |= {"sdpa_over_varlen": round(sdpa_ms / result["varlen_fwd_bwd_ms"], 2),
               "varlen_over_fused": round(result["varlen_fwd_bwd_ms"]
                                          / result["fused_fwd_bwd_ms"], 2)}
    return {"ok": all(value < 5e-2 for key, value in result.items()
                      if key.startswith("max_rel_diff")), **result}


FUSION_TOKENS = TOWER_IMAGES * 36 * 36


def fusions(device: str = "cuda", tokens: int = FUSION_TOKENS) -> dict:
    """Each formula of ``mimo_train.model.tower_fusions`` on ``tokens`` patches at the sizes
    of Qwen2-VL-2B's tower (the attention's split and rotary, QuickGELU) and Qwen2.5-VL's
    (RMSNorm, gated SiLU), and of ``mimo_train.mcore.rope_fusion`` on a packed 8k row's
    queries of Qwen2-VL-2B's language model (``rope``: 12 heads of 128), bf16, compiled as
    the trainer runs it on a GPU against as written (transformers' and megatron-core's
    operations): the largest difference relative to the largest entry, whether the outputs'
    memory layouts are the same (what the next operation reads), and the milliseconds of
    each."""
    from mimo_train.mcore import rope_fusion
    from mimo_train.model import tower_fusions as fused
    torch.manual_seed(0)

    def bf16(*shape):
        return torch.randn(*shape, device=device, dtype=torch.bfloat16)
    qkv, table = bf16(tokens, 3, 16, 80), torch.randn(2, tokens, 80, device=device)
    mlp, grad_mlp, hidden, grad_hidden, weight = (bf16(tokens, 5120), bf16(tokens, 5120),
                                                  bf16(tokens, 1280), bf16(tokens, 1280),
                                                  bf16(1280))
    gate, up, grad_gate = bf16(tokens, 3420), bf16(tokens, 3420), bf16(tokens, 3420)
    queries, angles = bf16(8192, 1, 16, 128), torch.rand(8192, 1, 1, 128, device=device) * 8e3
    cases: list[tuple[Callable, tuple]] = [
        (fused.split_rotary, (qkv, *table)),                 # the QKV output, as in the tower
        (fused.split_rotary_backward, (*(bf16(tokens, 16, 80) for _ in range(3)), *table)),
        (fused.quick_gelu, (mlp,)), (fused.quick_gelu_backward, (mlp, grad_mlp)),
        (fused.rms_norm, (hidden, weight, 1e-6)),
        (fused.rms_norm_backward, (hidden, weight, grad_hidden, 1e-6)),
        (fused.rms_norm_weight_backward, (hidden, grad_hidden, 1e-6)),
        (fused.silu_gate, (gate, up)), (fused.silu_gate_backward, (gate, up, grad_gate)),
        (rope_fusion.rope, (queries[:, :, :12], angles, 1.0)),
        (rope_fusion.rope_backward, (bf16(8192, 1, 12, 128), angles, 1.0))]

    def timed(run, *args) -> float:
        run(*args)
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(10):
            run(*args)
        torch.cuda.synchronize()
        return (time.perf_counter() - started) / 10 * 1e3

    found: dict = {}
    for formula, args in cases:
        written, compiled = formula(*args), fused.COMPILER(formula, *args)
        pairs = list(zip(written, compiled)) if isinstance(written, tuple) else \
            [(written, compiled)]
        difference = max(((b.float() - a.float()).abs().max() / a.float().abs().max()).item()
                         for a, b in pairs)
        written_ms, compiled_ms = timed(formula, *args), timed(fused.COMPILER, formula, *args)
        found[formula.__name__] = {"max_rel_diff": difference,
                                   "same_strides": all(a.stride() == b.stride()
                                                       for a, b in pairs),
                                   "written_ms": round(written_ms, 3),
                                   "compiled_ms": round(compiled_ms, 3),
                                   "speedup": round(written_ms / compiled_ms, 2)}
    found["patch_embed"] = _patch_embed(device, tokens, timed)
    return {"ok": all(case["ok"] if "ok" in case else
                      case["max_rel_diff"] < 1e-2 and case["same_strides"]
                      for case in found.values()),
            "tokens": tokens, **found}


def _patch_embed(device: str, tokens: int, timed: Callable) -> dict:
    """Qwen2-VL-2B's patch embedding (``tokens`` patches of 3 x 2 x 14 x 14 values to 1280),
    bf16, forward and the weight's gradient: ``tower_fusions.PatchMatmul``'s matmul against
    transformers' Conv3d as written, each one's largest difference from the exact values
    (fp64, relative to the largest entry; ``ok``: the matmul's within 1e-2 or no further than
    the Conv3d's), and the milliseconds of each."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import PatchEmbed

    from mimo_train.model.tower_fusions import PatchMatmul
    written = PatchEmbed(14, 2, 3, 1280).to(device, torch.bfloat16)
    matmul = PatchMatmul(copy.deepcopy(written))
    pixels = torch.randn(tokens, 3 * 2 * 14 * 14, device=device, dtype=torch.bfloat16)
    grad = torch.randn(tokens, 1280, device=device, dtype=torch.bfloat16)
    weight = written.proj.weight.detach().flatten(1).double()
    exact = (pixels.double() @ weight.t(), (grad.double().t() @ pixels.double()).view_as(
        written.proj.weight))

    def step(module):
        module.proj.weight.grad = None
        rows = module(pixels)
        rows.backward(grad)
        return rows, module.proj.weight.grad

    def difference(module) -> float:
        return max(((b.double() - a).abs().max() / a.abs().max()).item()
                   for a, b in zip(exact, step(module)))
    ours, theirs = difference(matmul), difference(written)
    written_ms, matmul_ms = timed(step, written), timed(step, matmul)
    return {"ok": ours < 1e-2 or ours <= theirs, "max_rel_diff": ours,
            "written_rel_diff": theirs, "written_ms": round(written_ms, 3),
            "matmul_ms": round(matmul_ms, 3), "speedup": round(written_ms / matmul_ms, 2)}


DELTA_NET_LENGTHS = [1000, 37, 2048, 511]


def delta_net(device: str = "cuda", lengths: list[int] = DELTA_NET_LENGTHS) -> dict:
    from mimo_train.mcore import delta_rule
    torch.manual_seed(0)
    tokens, key_heads, value_heads, dim, width = sum(lengths), 16, 32, 128, 4
    channels = (2 * key_heads + value_heads) * dim
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    cu = torch.tensor(bounds, device=device, dtype=torch.int32)

    def leaf(*shape, scale=1.0):
        return (torch.randn(*shape, device=device) * scale).bfloat16().requires_grad_()
    x, weight = leaf(1, tokens, channels), leaf(channels, width, scale=0.5)
    q, k = (leaf(1, tokens, key_heads, dim) for _ in range(2))
    v = leaf(1, tokens, value_heads, dim)
    g = (-torch.rand(1, tokens, value_heads, device=device)).bfloat16().requires_grad_()
    beta = torch.rand(1, tokens, value_heads, device=device).bfloat16().requires_grad_()
    inputs = (x, weight, q, k, v, g, beta)

    def run(fla: bool, cu_seqlens, span=slice(None)):
        """conv and rule outputs on tokens ``span``, and their gradients (a fixed probe)."""
        for t in inputs:
            t.grad = None
        serve = delta_rule.fla_serves if fla else (lambda tensor: False)
        saved, delta_rule.fla_serves = delta_rule.fla_serves, serve
        try:
            conv, _ = delta_rule.causal_conv1d(x[:, span], weight, activation="silu",
                                               cu_seqlens=cu_seqlens)
            rule, _ = delta_rule.chunk_gated_delta_rule(
                q[:, span], k[:, span], v[:, span], g[:, span], beta[:, span],
                cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True)
        finally:
            delta_rule.fla_serves = saved
        (conv.float().sum() + rule.float().square().sum()).backward()
        return [conv.detach().float(), rule.detach().float()], \
            [t.grad.float().clone() for t in inputs]

    def largest(a, b):
        """the largest difference of ``a`` from ``b``, relative to ``b``'s largest entry"""
        return max(((u - w).abs().max() / w.abs().max()).item() for u, w in zip(a, b))
    fla = delta_rule.fla_serves(q)
    packed, packed_grads = run(fla, cu)
    pieces: list[list[torch.Tensor]] = [[], []]
    piece_grads = [torch.zeros_like(t, dtype=torch.float) for t in inputs]
    for start, end in zip(bounds, bounds[1:]):
        outputs, grads = run(fla, None, slice(start, end))
        for i, out in enumerate(outputs):
            pieces[i].append(out)
        piece_grads = [a + b for a, b in zip(piece_grads, grads)]
    alone = [torch.cat(p, dim=1) for p in pieces]
    leaking, _ = run(fla, None)
    torch_kernels, _ = run(False, cu)
    synchronize = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    synchronize()
    started = time.perf_counter()
    for _ in range(5):
        run(fla, cu)
    synchronize()
    per_sample = largest(packed, alone)
    return {"ok": per_sample < 5e-2, "kernel": "fla" if fla else "torch",
            "tokens": tokens, "samples": len(lengths),
            "packed_vs_alone_max_rel": per_sample,
            "packed_vs_alone_grad_max_rel": largest(packed_grads, piece_grads),
            "one_sequence_vs_alone_max_rel": largest(leaking, alone),
            "vs_torch_kernels_max_rel": largest(packed, torch_kernels),
            "packed_fwd_bwd_ms": round((time.perf_counter() - started) / 5 * 1e3, 2)}


def grouped_experts(device: str = "cuda") -> dict:
    """A rank's local experts as grouped GEMMs (``mcore.grouped_experts.grouped_swiglu``)
    against a loop over them, as megatron-core's ``SequentialMLP`` runs them (its token counts
    read on the host, two GEMMs per expert), bf16, forward and backward: Qwen3-VL-30B-A3B's
    experts (hidden 2048, 768 rows each) at ep 8 (16 local), 8192 routed rows spread
    unevenly; the largest output difference relative to the largest entry and each's ms."""
    from mimo_train.mcore.grouped_experts import _runs, grouped_swiglu
    torch.manual_seed(0)
    experts, hidden, ffn, rows = 16, 2048, 768, 8192
    counts = torch.bincount(torch.multinomial(torch.rand(experts) ** 3, rows,
                                              replacement=True), minlength=experts)
    fc1 = [(torch.randn(2 * ffn, hidden, device=device) * 0.02).bfloat16().requires_grad_()
           for _ in range(experts)]
    fc2 = [(torch.randn(hidden, ffn, device=device) * 0.02).bfloat16().requires_grad_()
           for _ in range(experts)]
    x = torch.randn(rows, hidden, device=device).bfloat16().requires_grad_()
    probs = torch.rand(rows, device=device).requires_grad_()

    def loop():
        sizes = counts.tolist()
        out = []
        for e, (part, p) in enumerate(zip(x.split(sizes), probs.split(sizes))):
            gate, up = F.linear(part, fc1[e]).chunk(2, dim=-1)
            out.append(F.linear((F.silu(gate) * up * p[:, None]).bfloat16(), fc2[e]))
        return torch.cat(out)

    def grouped():
        return grouped_swiglu(x, probs, counts, fc1, fc2)

    def timed(run):
        for _ in range(2):
            run().float().square().sum().backward()
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(5):
            out = run()
            out.float().square().sum().backward()
        torch.cuda.synchronize()
        return out.detach().float(), (time.perf_counter() - started) / 5 * 1e3
    usable = _runs(torch.device(device), torch.bfloat16)
    expected, loop_ms = timed(loop)
    found, grouped_ms = timed(grouped)
    difference = ((found - expected).abs().max() / expected.abs().max()).item()
    return {"ok": usable and difference < 2e-2, "grouped_mm_runs": usable,
            "max_rel_diff": difference, "loop_fwd_bwd_ms": round(loop_ms, 2),
            "grouped_fwd_bwd_ms": round(grouped_ms, 2),
            "loop_over_grouped": round(loop_ms / grouped_ms, 2)}


# Qwen2-VL-2B's language model as megatron-core holds its fp32 main weights: the (tied)
# embedding, then per layer the fused QKV and its bias (12 query, 2 key-value heads of 128),
# the output projection, the gated MLP's two matmuls (8960 wide) and two norms
ADAM_SHAPES = [(151936, 1536)] + 28 * [(2048, 1536), (2048,), (1536, 1536), (17920, 1536),
                                       (1536, 8960), (1536,), (1536,)]


def adam(device: str = "cuda", shapes: list[tuple[int, ...]] = ADAM_SHAPES) -> dict:
    """torch's AdamW over ``shapes`` (fp32 weights and gradients, weight decay): torch's
    default on a GPU (foreach), which megatron-core builds without TransformerEngine or apex,
    against the fused update mimo asks for (``mimo_train.mcore.fused_adam``): each one's ms a
    step, its peak memory above the weights, gradients and moments it holds (foreach: a copy of
    the second moments), and the fused weights' largest difference from the foreach ones after
    the same steps, relative to the largest change the steps made."""
    torch.manual_seed(0)
    start = [torch.randn(shape, device=device) * 0.02 for shape in shapes]
    grads = [torch.randn_like(w) * 1e-3 for w in start]
    cuda = device == "cuda"

    def run(fused: bool):
        weights = [w.clone().requires_grad_() for w in start]
        for weight, grad in zip(weights, grads):
            weight.grad = grad
        optimizer = torch.optim.AdamW(weights, lr=1e-4, weight_decay=0.1, fused=fused,
                                      foreach=not fused)
        optimizer.step()                                # makes the moments
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        held = torch.cuda.memory_allocated() if cuda else None
        began = time.perf_counter()
        for _ in range(5):
            optimizer.step()
        if cuda:
            torch.cuda.synchronize()
        ms = (time.perf_counter() - began) / 5 * 1e3
        extra = (torch.cuda.max_memory_allocated() - held) / 2**20 if held is not None else None
        return [w.detach() for w in weights], ms, extra
    foreach, foreach_ms, foreach_extra = run(False)
    fused, fused_ms, fused_extra = run(True)
    change = max((w - s).abs().max().item() for w, s in zip(foreach, start))
    difference = max((a - b).abs().max().item() for a, b in zip(fused, foreach)) / change
    return {"ok": difference < 1e-3, "parameters": sum(w.numel() for w in start),
            "max_rel_diff": difference, "foreach_ms": round(foreach_ms, 2),
            "fused_ms": round(fused_ms, 2), "foreach_over_fused": round(foreach_ms / fused_ms, 2),
            "foreach_step_extra_mib": None if foreach_extra is None else round(foreach_extra),
            "fused_step_extra_mib": None if fused_extra is None else round(fused_extra)}


WGRAD_SHAPE = (8192, 1536, 2 * 8960)      # a packed 8k row through Qwen2-VL-2B's fc1


def wgrad(device: str = "cuda", shape: tuple[int, int, int] = WGRAD_SHAPE) -> dict:
    """``mimo_train.mcore.wgrad_fusion`` on a bf16 linear layer of ``shape`` (tokens, in, out)
    into an fp32 buffer holding a gradient already: whether the device runs it (``supported``;
    where not, the trainer keeps megatron-core's unfused path), the buffer's largest
    difference from the exact sum (fp64, relative to its largest entry) fused and unfused
    (megatron-core's bf16 weight gradient, then DDP's ``add_``; ``ok``: fused no further than
    unfused), and the milliseconds of each."""
    from mimo_train.mcore import wgrad_fusion
    tokens, width, out = shape
    generator = torch.Generator(device).manual_seed(0)
    inputs, grads = (torch.randn(tokens, n, device=device, generator=generator,
                                 dtype=torch.bfloat16) for n in (width, out))
    start = torch.randn(out, width, device=device, generator=generator)
    exact = start.double() + grads.double().t() @ inputs.double()

    def fused(buffer):
        wgrad_fusion.accumulate(inputs, grads, buffer)

    def unfused(buffer):
        buffer.add_(grads.t() @ inputs)

    def timed(run) -> float:
        buffer = start.clone()
        run(buffer)
        if device != "cpu":
            torch.cuda.synchronize()
        began = time.perf_counter()
        for _ in range(10):
            run(buffer)
        if device != "cpu":
            torch.cuda.synchronize()
        return (time.perf_counter() - began) / 10 * 1e3

    def difference(run) -> float:
        buffer = start.clone()
        run(buffer)
        return ((buffer.double() - exact).abs().max() / exact.abs().max()).item()
    supported = wgrad_fusion.supported(device)
    result: dict = {"supported": supported, "shape": list(shape),
                    "unfused_rel_diff": difference(unfused), "unfused_ms": round(timed(unfused), 3)}
    if not supported:           # not a failure: the trainer keeps the unfused path
        return {"ok": None, "skipped": "this torch's addmm takes no fp32 addend with bf16 "
                "factors: the trainer keeps megatron-core's unfused path", **result}
    result |= {"fused_rel_diff": difference(fused), "fused_ms": round(timed(fused), 3)}
    result["speedup"] = round(result["unfused_ms"] / result["fused_ms"], 2)
    return {"ok": result["fused_rel_diff"] <= result["unfused_rel_diff"], **result}


def _batched(backend) -> Callable:
    """SDPA on ``backend`` alone, the images as a batch (equal sizes: no bounds needed)."""
    from torch.nn.attention import sdpa_kernel

    def attend(q, k, v, cu, longest):
        images = cu.numel() - 1
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(
                *(t.reshape(images, longest, *t.shape[1:]).transpose(1, 2) for t in (q, k, v)))
        return out.transpose(1, 2).reshape(q.shape)
    return attend


def tower_kernels() -> dict[str, Callable]:
    """The attention kernels ``tower_attention`` compares (CUDA): each takes packed
    ``[tokens, heads, width]`` q, k, v, the images' bounds and the longest image."""
    from torch.nn.attention import SDPBackend
    from torch.nn.attention.varlen import varlen_attn
    return {"flash_varlen": lambda q, k, v, cu, longest: varlen_attn(q, k, v, cu, cu, longest,
                                                                     longest),
            "flash_batched": _batched(SDPBackend.FLASH_ATTENTION),
            # cuDNN over the packed items (its aten operators with the bounds) is left out:
            # torch's backward of them reads the head width as the longest item and writes
            # past its buffers (pytorch/pytorch#186142, unfixed in 2.11)
            "cudnn_batched": _batched(SDPBackend.CUDNN_ATTENTION)}


def tower_attention(device: str = "cuda", images: int = TOWER_IMAGES, side: int = 36,
                    heads: int = 16, width: int = 80,
                    kernels: dict[str, Callable] | None = None) -> dict:
    """The Qwen2-VL-2B tower's attention alone (16 heads of 80, ``images`` of ``side``^2
    patches packed, bf16, each image attending to itself) on each kernel that takes it
    (``tower_kernels``): ``flash_varlen`` is mimo's (torch's ``varlen_attn``: flash runs a
    width of 80 as 96; the tower's backward was the packed 8k step's largest kernel,
    docs/benchmarks.md), cuDNN's takes 80 as it is (here on equal-sized images as a batch, as
    is flash's for comparison). Each kernel's output and q, k, v
    gradients apart from fp32 SDPA on each image (relative to the largest entry), its
    forward and backward milliseconds, or its error; ``ok``: every kernel that ran within
    2e-2, and one did."""
    kernels = kernels if kernels is not None else tower_kernels()
    torch.manual_seed(0)
    tokens = images * side * side
    leaves = [torch.randn(tokens, heads, width, device=device, dtype=torch.bfloat16,
                          requires_grad=True) for _ in range(3)]
    grad = torch.randn(tokens, heads, width, device=device, dtype=torch.bfloat16)
    cu = torch.arange(0, tokens + 1, side * side, device=device, dtype=torch.int32)
    synchronize = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    exact = [t.detach().float().requires_grad_() for t in leaves]
    out = F.scaled_dot_product_attention(
        *(t.reshape(images, side * side, heads, width).transpose(1, 2) for t in exact))
    out = out.transpose(1, 2).reshape(tokens, heads, width)
    expected = [out.detach(), *torch.autograd.grad(out, exact, grad.float())]

    def attend(kernel) -> list[torch.Tensor]:
        found = kernel(*leaves, cu, side * side)
        return [found.detach(), *torch.autograd.grad(found, leaves, grad)]

    result: dict = {"images": images, "patches": tokens, "heads": heads, "width": width}
    broken = None               # a CUDA error: the device may be unusable for what follows
    for name, kernel in kernels.items():
        if broken is not None:
            result[name] = {"error": f"not run: {broken} failed with a CUDA error"}
            continue
        try:
            found = attend(kernel)
            synchronize()
            started = time.perf_counter()
            for _ in range(5):
                attend(kernel)
            synchronize()
            result[name] = {
                "fwd_bwd_ms": round((time.perf_counter() - started) / 5 * 1e3, 3),
                "max_rel_diff": max(((a.float() - b).abs().max() / b.abs().max()).item()
                                    for a, b in zip(found, expected))}
        except Exception as error:        # a kernel refusing this shape: a finding
            result[name] = {"error": f"{type(error).__name__}: {str(error)[:200]}"}
            if "CUDA error" in str(error):
                broken = name
    ran = [v for k, v in result.items() if k in kernels and "error" not in v]
    return {"ok": bool(ran) and all(v["max_rel_diff"] < 2e-2 for v in ran), **result}


def kernels(report: Callable[[dict], None] = lambda line: None) -> dict:
    """Each probe's figures by name; ``report`` gets ``{"starting": name}`` before each and
    ``{"kernel": name, "found": ...}`` after it."""
    probes: tuple[tuple[str, Callable[[], dict]], ...] = (
        ("nccl", nccl), ("cuda_events", events), ("varlen_kernel", varlen),
        ("tower_varlen", tower_varlen), ("fusions", fusions), ("delta_net", delta_net),
        ("grouped_experts", grouped_experts), ("adam", adam), ("wgrad", wgrad),
        ("tower_attention", tower_attention))
    if not torch.cuda.is_available():
        return {name: {"ok": None, "skipped": "no CUDA"} for name, _ in probes}
    found = {}
    for name, probe in probes:
        report({"starting": name})
        started = time.perf_counter()
        try:
            found[name] = probe()
        except Exception as error:          # each probe's failure is a finding, not the end
            found[name] = {"ok": False, "error": f"{type(error).__name__}: {str(error)[:300]}"}
        # what each takes of the probes' limit (the last ones are cut off first)
        found[name]["seconds"] = round(time.perf_counter() - started, 1)
        report({"kernel": name, "found": found[name]})
    return found


def _line(record: dict) -> None:
    """One JSON line on stdout, at once: what the parent keeps if this process is stopped or
    dies in a later probe (``tools/gpu_check/run.py``'s ``probe``)."""
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    import argparse
    argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0]).parse_args()
    _line({"env": env()})
    kernels(_line)
