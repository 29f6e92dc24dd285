"""What the GPU check asks of the machine itself, in a child process (``python probes.py``):
one JSON line on stdout, ``{"env": ..., "kernels": ...}``.

- ``env``: versions, the GPU, and a bf16 matmul's TFLOP/s (8192^3, the practical peak);
- ``kernels``: a one-rank NCCL all-reduce, mimo's step timer (CUDA events) around matmuls, and
  ``varlen_attn`` over three causal samples against SDPA on each sample alone; each probe's
  failure is recorded and the next one still runs.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time

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


def varlen() -> dict:
    from torch.nn.attention.varlen import varlen_attn
    torch.manual_seed(0)
    lengths, heads, dim = [37, 5, 90], 4, 64
    q, k, v = (torch.randn(sum(lengths), heads, dim, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    cu = torch.tensor([0, 37, 42, 132], device="cuda", dtype=torch.int32)
    out = varlen_attn(q, k, v, cu, cu, max(lengths), max(lengths),
                      window_size=(-1, 0))                     # (-1, 0): causal
    reference, at = [], 0
    for n in lengths:
        one_q, one_k, one_v = (t[at:at + n].transpose(0, 1)[None] for t in (q, k, v))
        reference.append(F.scaled_dot_product_attention(one_q, one_k, one_v, is_causal=True)[0]
                         .transpose(0, 1))
        at += n
    diff = (out.float() - torch.cat(reference).float()).abs().max().item()
    return {"ok": diff < 2e-2, "max_abs_diff_vs_sdpa": diff}


def kernels() -> dict:
    if not torch.cuda.is_available():
        return {name: {"ok": None, "skipped": "no CUDA"}
                for name in ("nccl", "cuda_events", "varlen_kernel")}
    found = {}
    for name, probe in (("nccl", nccl), ("cuda_events", events), ("varlen_kernel", varlen)):
        try:
            found[name] = probe()
        except Exception as error:          # each probe's failure is a finding, not the end
            found[name] = {"ok": False, "error": f"{type(error).__name__}: {str(error)[:300]}"}
    return found


if __name__ == "__main__":
    print(json.dumps({"env": env(), "kernels": kernels()}))
