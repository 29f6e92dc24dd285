"""Host memory of importing a mixture-of-experts language model: one TP rank's part read in
parts (``CheckpointWeights.part``: safetensors slices, the dtype stored) against the whole
tensors read in fp32 and cut (the import before it), in the same run. Prints, per replica,
experts, TP, EP and read, the rank's parameters, the bytes read and the peak RSS above the
parameters (MB), split into the file's pages and anonymous memory.

The checkpoints: the Qwen3-VL-30B-A3B and Qwen3.5-35B-A3B replicas (``assets/models/published``,
4 layers, hidden 64) with 8 and 64 experts of ``--ffn`` (768) rows, 4 key-value heads (so that
TP 4 is a size megatron-core takes), seeded and saved in bf16 by transformers into
``--scratch``: experts dominate the language model, as at 235B.

Each import (TP rank 0's) runs in a process of its own (a forkserver's): the rank's fp32
parameters allocated first (what ``GPTModel`` holds before the load), the peak RSS reset
(``/proc/self/clear_refs``), then the import: in parts, a layer at a time, each copied into the
parameters (``load_pretrained_language``), or, as before, every tensor read whole in fp32 (each
once, one at a time: the import before held a layer's two fused expert tensors whole at once,
so its peak was higher still), the stage's whole state converted, then copied.

Printed per replica x experts x TP x EP (rank 0 holding the first E / EP experts) x read: the
rank's parameters (MB), the bytes read, the peak RSS above the parameters, and of it the
checkpoint's file pages mapped (safetensors maps the file: a whole read maps every page; a
rank's rows only theirs; its columns every page the rows cross) and the rest, anonymous
memory: copies, fp32 casts, the converted state. No figure is asserted. About two minutes on
2 cores.

    python tools/bench_import.py [--replicas qwen3-vl-moe qwen3.5-moe] [--experts 8 64]
                                 [--tp 1 2 4] [--ep 1 8] [--ffn 768] [--scratch DIR]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import multiprocessing
import os
import shutil
import tempfile

import torch

from mimo_data.process_memory import status_bytes
from mimo_train.families.base import CheckpointWeights, Tensors
from mimo_train.families.causal_lm.weights import to_megatron_by_layer
from mimo_train.families.registry import language_arch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PUBLISHED = os.path.join(ROOT, "assets", "models", "published")
# the replicas' experts as their checkpoints store them: Qwen3-VL-MoE's transposed (a TP
# rank's gate and up parts are columns), Qwen3.5-MoE's in transformers 5's layout (rows)
REPLICAS = {"qwen3-vl-moe": "Qwen--Qwen3-VL-30B-A3B-Instruct",
            "qwen3.5-moe": "Qwen--Qwen3.5-35B-A3B"}
MB = 2 ** 20


def make_variant(replica: str, out: str, experts: int, ffn: int) -> str:
    """The ``replica`` with ``experts`` experts of ``ffn`` rows and 4 key-value heads (and
    delta-net key heads) in ``out``: transformers' model seeded, its weights in bf16 with the
    fused experts as the replica stores them (transformers' own save writes Qwen3.5-MoE's
    experts one tensor each, which its hub checkpoints do not)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForImageTextToText
    if os.path.isfile(os.path.join(out, "model.safetensors")):
        return out
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(PUBLISHED, replica, "config.json")) as f:
        config = json.load(f)
    config["text_config"].update(num_experts=experts, moe_intermediate_size=ffn,
                                 num_key_value_heads=4)
    if "linear_num_key_heads" in config["text_config"]:
        config["text_config"]["linear_num_key_heads"] = 4
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(out),
                                                    dtype=torch.bfloat16)
    transposed = config["model_type"] == "qwen3_vl_moe"    # published [E, hidden, 2 x ffn]
    tensors = {name: (p.detach().transpose(1, 2) if transposed and name.endswith(
                   ("experts.gate_up_proj", "experts.down_proj")) else p.detach()).contiguous()
               for name, p in model.named_parameters()}
    save_file(tensors, os.path.join(out, "model.safetensors"))
    return out


def _shapes(path: str, arch, tp: int, ep: int) -> dict[str, torch.Size]:
    """The rank's state's shapes, from the stored shapes alone (meta tensors, nothing read)."""
    weights = CheckpointWeights(path)
    meta = Tensors(lambda name: torch.empty(weights.shape(name), device="meta"))
    return {k: v.shape for part in _import(meta, arch, tp, ep, weights.__contains__)
            for k, v in part.items()}


def _import(source, arch, tp: int, ep: int, has):
    """Rank 0's import at ``tp`` and ``ep`` (its first E / ep experts)."""
    return to_megatron_by_layer(source, arch, tp_rank=0, tp_size=tp,
                                layers=range(arch.num_layers), first_stage=True,
                                last_stage=True, vocab_size=arch.vocab_size, has=has,
                                experts=range(arch.experts // ep))


def _measure(path: str, tp: int, ep: int, read: str, results) -> None:
    """One import in this (forked) process: its figures into ``results``."""
    arch = language_arch(path)
    params = {k: torch.ones(shape) for k, shape in _shapes(path, arch, tp, ep).items()}
    weights, counted = CheckpointWeights(path), [0]
    part = weights.part

    def counting(name: str, index: tuple[slice, ...] = ()) -> torch.Tensor:
        tensor = part(name, index)
        counted[0] += tensor.numel() * tensor.element_size()
        return tensor

    class Whole(Tensors):
        """The import before parts: each tensor read whole in fp32, then cut."""

        def shape(self, name: str) -> tuple[int, ...]:
            return weights.shape(name)

    @functools.lru_cache(maxsize=1)     # the gate and up sections: one read, as before
    def whole(name: str) -> torch.Tensor:
        tensor = weights(name)
        counted[0] += tensor.numel() * part(name).element_size()  # stored: a view, unread
        return tensor

    weights.part = counting                          # type: ignore[method-assign]
    start = status_bytes("VmRSS", "RssFile")
    with open("/proc/self/clear_refs", "w") as f:   # the peak RSS from here
        f.write("5")
    if read == "parts":                 # as load_pretrained_language: a layer at a time
        for state in _import(weights, arch, tp, ep, weights.__contains__):
            for key, value in state.items():
                params[key].copy_(value)
    else:                               # as before: the stage's whole state, then the copy
        state = {k: v for part in _import(Whole(whole), arch, tp, ep, weights.__contains__)
                 for k, v in part.items()}
        for key, value in state.items():
            params[key].copy_(value)
    end = status_bytes("VmHWM", "RssFile")
    results.put(dict(params=sum(p.numel() * 4 for p in params.values()), read=counted[0],
                     peak=end["VmHWM"] - start["VmRSS"],
                     file=end["RssFile"] - start["RssFile"]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", nargs="+", choices=sorted(REPLICAS),
                        default=sorted(REPLICAS))
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--ep", type=int, nargs="+", default=[1],
                        help="expert-parallel sizes (rank 0 holds the first E / ep experts)")
    parser.add_argument("--ffn", type=int, default=768)
    parser.add_argument("--scratch", help="where the variants are saved (kept; default: a "
                                          "temporary folder, removed)")
    args = parser.parse_args(argv)
    scratch = args.scratch or tempfile.mkdtemp(prefix="bench-import-")
    # a fresh process per import, forked from a server that has imported torch and run
    # nothing: a fork of this process, whose torch has run threads, may wait on their locks
    fork = multiprocessing.get_context("forkserver")
    fork.set_forkserver_preload(["torch", "mimo_train.families.causal_lm.weights",
                                 "mimo_train.families.registry"])
    print(f"{'replica':>12} {'experts':>7} {'tp':>3} {'ep':>3} {'read':>6} {'params MB':>10} "
          f"{'read MB':>8} {'peak MB':>8} {'file MB':>8} {'anon MB':>8}")
    try:
        for replica, experts in itertools.product(args.replicas, args.experts):
            path = make_variant(REPLICAS[replica],
                                os.path.join(scratch, f"{replica}-{experts}-ffn{args.ffn}"),
                                experts, args.ffn)
            for tp, ep, read in itertools.product(args.tp, args.ep, ("whole", "parts")):
                if experts % ep:
                    print(f"{replica:>12} {experts:>7} {tp:>3} {ep:>3}  skipped: {experts} "
                          f"experts do not divide over ep {ep}", flush=True)
                    continue
                results = fork.Queue()
                child = fork.Process(target=_measure, args=(path, tp, ep, read, results))
                child.start()
                child.join()
                if child.exitcode:
                    raise SystemExit(f"the import of {path} at TP {tp}, EP {ep} ({read}) "
                                     f"failed: exit status {child.exitcode}")
                got = results.get()
                print(f"{replica:>12} {experts:>7} {tp:>3} {ep:>3} {read:>6} "
                      f"{got['params'] / MB:>10.1f} {got['read'] / MB:>8.1f} "
                      f"{got['peak'] / MB:>8.1f} {got['file'] / MB:>8.1f} "
                      f"{(got['peak'] - got['file']) / MB:>8.1f}", flush=True)
    finally:
        if not args.scratch:
            shutil.rmtree(scratch)


if __name__ == "__main__":
    main()
