"""The operators one training step dispatches, by phase, with mimo's fusions and with
megatron-core's own paths: the figure that bounds mimo on a GPU today (the 2026-11-30 H200
runs: 31-45% of the GPU's time idle while the host dispatched ~28.5k operators a step for
Qwen2-VL-2B in packed 8k, docs/benchmarks.md), counted on the CPU, where counts do not move with
the machine.

The model is Qwen2-VL-2B's published config.json (28 language layers with grouped keys and
values, M-RoPE, a 32-layer tower; ``tools/published``) at narrow widths (64; random weights,
seeded), the replica's tokenizer and processor files; the data the corpus's image and video
conversations replicated (``replicate_corpus``), packed to 8k, micro-batches of 4, two a step,
``model.attention: sdpa`` (the language model's packed row in one call, as varlen on a GPU;
the tower's attention runs once per image here, once per micro-batch on a GPU). Each variant
trains two steps in a fresh one-rank process (``torchrun``) and profiles the second:

- ``mimo``: as the trainer runs;
- ``megatron-core``: the language model's rotary, the bf16 main weights' copy, DDP's
  gradient additions, the splice of the rows into the word embeddings, the linear layers'
  weight gradients and the optimizer's step on megatron-core's own operations
  (``mcore.rope_fusion``, ``mcore.multi_tensor.foreach_copy``, ``mcore.grad_accumulation``,
  ``mcore.splice``, ``mcore.wgrad_fusion``, ``mcore.optimizer_step`` undone: its
  ``MimoOptimizer.step``, which reads the norm on the host).

One difference from a GPU's counts stays: ``mcore.wgrad_fusion`` makes a linear weight's
gradient into its fp32 buffer with one GEMM on a GPU (bf16 factors, fp32 accumulator), on the
CPU with that GEMM and two casts of its factors to fp32 (no such kernel there): two operators a
weight and micro-batch that a GPU does not dispatch, ~970 a step for the 2B's 112 language and
130 tower linear weights and two micro-batches. Against megatron-core's path a language weight
counts two more (the casts; ``addmm_`` and megatron-core's ``empty`` placeholder replace its
matmul and DDP's ``add_``), a tower weight as many (two fewer views).

Operators are the profiler's outermost ``aten::`` calls (``runtime.profile``'s
``operators_per_step``), by phase: the language model's and the tower's layers (forward), the
rest of the forward pass, the backward pass, the optimizer step; ``views`` are the ones that
never launch a kernel on a GPU (views, reshapes, detaches), ``others`` the rest (most launch
one; casts to the tensor's own dtype and allocations do not). With ``--compile`` the fused
formulas are compiled on the CPU too (inductor; a C++ compiler needed), as on a GPU: one
operator each. Then the ratio megatron-core / mimo of each; with ``--names`` mimo's most
frequent operators per phase, and the backward pass's by the autograd node that ran them.
Nothing is asserted.

    python tools/bench_operators.py [--work DIR] [--compile] [--names]
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PUBLISHED = os.path.join(REPO, "tools", "published", "Qwen--Qwen2-VL-2B-Instruct")
REPLICA = os.path.join(REPO, "assets", "models", "published", "Qwen--Qwen2-VL-2B-Instruct")
VARIANTS = ("mimo", "megatron-core")
PHASES = ("language layers", "tower layers", "forward, other", "backward", "optimizer",
          "outside")
# operators that never launch a kernel on a GPU
VIEWS = {"aten::view", "aten::reshape", "aten::_unsafe_view", "aten::t", "aten::transpose",
         "aten::detach", "aten::detach_", "aten::squeeze", "aten::unsqueeze", "aten::permute",
         "aten::expand", "aten::slice", "aten::select", "aten::alias", "aten::as_strided",
         "aten::split", "aten::chunk", "aten::narrow", "aten::unbind", "aten::split_with_sizes",
         "aten::view_as", "aten::lift_fresh", "aten::resolve_conj", "aten::resolve_neg",
         "aten::flatten", "aten::expand_as", "aten::contiguous"}


def narrow_checkpoint(out: str) -> str:
    """Qwen2-VL-2B's published config at widths of 64 (4 heads, 2 key-value groups; tower 2
    heads), random bf16 weights; the replica's tokenizer, template and processor files."""
    import torch
    import transformers
    if os.path.exists(os.path.join(out, "model.safetensors")):
        return out
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(PUBLISHED, "config.json")) as f:
        config = json.load(f)
    config.update(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2)
    config["rope_scaling"] = {**config["rope_scaling"], "mrope_section": [2, 3, 3]}
    config["vision_config"].update(embed_dim=64, num_heads=2, hidden_size=64)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    for name in os.listdir(REPLICA):
        path = os.path.join(REPLICA, name)
        if os.path.isfile(path) and not name.endswith(".safetensors") and \
                name != "config.json" and not name.startswith("."):
            shutil.copy(path, os.path.join(out, name))
    torch.manual_seed(3)
    model = transformers.Qwen2VLForConditionalGeneration._from_config(
        transformers.AutoConfig.from_pretrained(out), dtype=torch.bfloat16)
    model.save_pretrained(out)
    return out


def training_config(work: str) -> str:
    """The shards, the checkpoint's own preprocessing at 8k and the run's config; their path."""
    import yaml

    from mimo_train.families.registry import preprocessing_for
    sys.path.insert(0, os.path.join(REPO, "tools"))
    from replicate_corpus import CORPUS_INPUTS, replicated_dataset
    checkpoint = narrow_checkpoint(os.path.join(work, "checkpoint"))
    shards = os.path.join(work, "shards")
    if not os.path.exists(os.path.join(shards, "index.json")):
        os.replace(replicated_dataset(
            os.path.join(REPO, "assets", "corpus"), 32, work,
            inputs=CORPUS_INPUTS + ("video.jsonl",),
            keep=lambda r: all(m["modality"] in ("image", "video") for m in r["media"]),
            kind=lambda r: "video" if any(m["modality"] == "video" for m in r["media"])
            else "image"), shards)
    preprocess = {**preprocessing_for(checkpoint), "seq_length": 8192}
    with open(os.path.join(work, "preprocess.yaml"), "w") as f:
        yaml.safe_dump(preprocess, f)
    config = {
        "data": {"datasets": [shards], "preprocess": os.path.join(work, "preprocess.yaml"),
                 "num_workers": 0, "packing": True},
        "layout": "language=dp1;image=dp1,off0,video",
        "optimizer": {"lr": 3e-4},
        "train": {"seed": 3, "device": "cpu", "precision": "bf16", "steps": 2,
                  "global_batch_size": 8, "micro_batch_size": 4, "log_interval": 1,
                  "profile": {"dir": os.path.join(work, "profile"), "start": 2, "steps": 1}},
        "model": {"pretrained": checkpoint, "attention": "sdpa"}}
    path = os.path.join(work, "train.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    return path


def _ranged(name: str, function):
    import torch

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        with torch.profiler.record_function(name):
            return function(*args, **kwargs)
    return wrapper


def megatron_step(optimizer):
    """megatron-core's own ``MimoOptimizer.step`` (its norm and agreements read on the host)
    in place of ``mcore.optimizer_step.step_on_device``, with its outcome as that gives it."""
    import torch
    success, norm, _ = optimizer.step()
    return torch.tensor([0.0 if success else 1.0, float("nan") if norm is None else norm])


def child(variant: str, config: str, out: str, compiled: bool) -> None:
    """One variant's training under torchrun; its counts by phase into ``out``."""
    import torch
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.optimizer import optimizer as megatron_optimizer
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer import attention, transformer_layer
    from transformers.models.qwen2_vl import modeling_qwen2_vl

    import mimo_train.mcore  # noqa: F401  (its patches first, then this variant's)
    from mimo_train.cli import main
    from mimo_train.mcore import (DistributedDataParallel, MimoModel, grad_accumulation,
                                  multi_tensor, rope_fusion, wgrad_fusion)
    from mimo_train.mcore.splice import SplicingMimoModel
    from mimo_train.model import tower_fusions
    from mimo_train.runtime import profile
    from mimo_train.runtime.compile import Compiler
    from mimo_train.training import trainer
    if variant == "megatron-core":
        attention.apply_rotary_pos_emb = rope_utils.apply_rotary_pos_emb
        DistributedDataParallel._make_backward_post_hook = grad_accumulation.MEGATRON_HOOK
        for name in ("get_text_embeddings", "align_embeddings_by_token_positions"):
            setattr(SplicingMimoModel, name, getattr(MimoModel, name))
        megatron_optimizer._multi_tensor_copy_this_to_that = multi_tensor.MEGATRON_COPY
        wgrad_fusion.supported = lambda device: False
        trainer.step_on_device = megatron_step
    # the tensors small at Qwen2-VL-2B's published widths (biases, norms) are small here, not
    # its weights (at widths of 64 every tensor has fewer than grad_accumulation.SMALL values)
    grad_accumulation.SMALL = 1024
    if compiled:
        rope_fusion.COMPILER = Compiler(devices=("cpu",))
        tower_fusions.COMPILER = Compiler(devices=("cpu",))
    ranges = [(transformer_layer.TransformerLayer, "forward", "language layers"),
              (modeling_qwen2_vl.Qwen2VLVisionBlock, "forward", "tower layers"),
              (trainer, "step_on_device", "optimizer")]
    for owner, method, label in ranges:
        setattr(owner, method, _ranged(f"bench:{label}", getattr(owner, method)))
    schedules.backward_step = _ranged("bench:backward", schedules.backward_step)
    schedules.forward_step = _ranged("bench:forward, other", schedules.forward_step)
    summarize = profile.summarize

    def counting(profiler, steps, top=8):
        counts: dict[str, collections.Counter] = {p: collections.Counter() for p in PHASES}
        names: dict[str, collections.Counter] = {p: collections.Counter() for p in PHASES}
        nodes: collections.Counter = collections.Counter()     # backward: by autograd node
        events = profiler.events()
        # the profiled step's, not the lead-in's
        begun = min((e.time_range.start for e in profile.step_marks(events)), default=-1e300)
        for event in events:
            if not event.name.startswith("aten::") or event.time_range.start < begun or \
                    event.device_type != torch.autograd.DeviceType.CPU:
                continue
            parent, labels = event.cpu_parent, []
            while parent is not None and not parent.name.startswith("aten::"):
                labels.append(parent.name)
                parent = parent.cpu_parent
            if parent is not None:          # inside another operator: its own work
                continue
            phase = next((p for p in PHASES[:5] if f"bench:{p}" in labels), "outside")
            counts[phase]["views" if event.name in VIEWS else "others"] += 1
            if event.name not in VIEWS:
                names[phase][event.name] += 1
                node = next((label.split(": ", 1)[1] for label in labels
                             if label.startswith("autograd::engine::evaluate_function")), "")
                if phase == "backward":
                    nodes[f"{event.name[6:]} in {node or 'no node'}"] += 1
        with open(out, "w") as f:
            json.dump({**{p: {**counts[p], "names": dict(names[p].most_common(12))}
                          for p in PHASES}, "nodes": dict(nodes.most_common(16))}, f)
        return summarize(profiler, steps, top)
    profile.summarize = counting
    code = main(["--config", config])
    if code:
        sys.exit(code)


def run(work: str, compiled: bool) -> dict[str, dict]:
    config = training_config(work)
    found = {}
    for variant in VARIANTS:
        out = os.path.join(work, f"{variant}.json")
        env = {**os.environ, "PYTHONPATH": REPO, "CUDA_VISIBLE_DEVICES": ""}
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
                        os.path.abspath(__file__), "--child", variant, "--config", config,
                        "--out", out] + (["--compile"] if compiled else []),
                       check=True, env=env, stdout=subprocess.DEVNULL)
        with open(out) as f:
            found[variant] = json.load(f)
    return found


def report(found: dict[str, dict], names: bool) -> None:
    print(f"{'phase':<16} {'mimo others':>12} {'views':>7} {'megatron-core others':>21} "
          f"{'views':>7} {'others megatron-core / mimo':>28}")
    totals: dict[str, collections.Counter] = {v: collections.Counter() for v in VARIANTS}
    for phase in PHASES:
        ours, theirs = found["mimo"][phase], found["megatron-core"][phase]
        ours, theirs = ({k: v for k, v in d.items() if k != "names"} for d in (ours, theirs))
        totals["mimo"].update(ours)
        totals["megatron-core"].update(theirs)
        ratio = theirs.get("others", 0) / max(ours.get("others", 0), 1)
        print(f"{phase:<16} {ours.get('others', 0):>12} {ours.get('views', 0):>7} "
              f"{theirs.get('others', 0):>21} {theirs.get('views', 0):>7} {ratio:>28.2f}")
    ours, theirs = totals["mimo"], totals["megatron-core"]
    print(f"{'step':<16} {ours['others']:>12} {ours['views']:>7} {theirs['others']:>21} "
          f"{theirs['views']:>7} {theirs['others'] / max(ours['others'], 1):>28.2f}")
    if names:
        for phase in PHASES:
            print(f"mimo's most frequent others, {phase}: " + ", ".join(
                f"{name[6:]} {n}" for name, n in found["mimo"][phase]["names"].items()))
        print("mimo's most frequent others in the backward pass, by autograd node: " + ", ".join(
            f"{name} {n}" for name, n in found["mimo"]["nodes"].items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", help="where the checkpoint, shards and runs go "
                        "(default: a temporary folder, removed after)")
    parser.add_argument("--compile", action="store_true",
                        help="compile the fused formulas on the CPU (inductor), as on a GPU")
    parser.add_argument("--names", action="store_true",
                        help="also mimo's most frequent operators per phase, views left out")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.config, args.out, args.compile)
        return
    if args.work:
        report(run(args.work, args.compile), args.names)
        return
    with tempfile.TemporaryDirectory() as work:
        report(run(work, args.compile), args.names)


if __name__ == "__main__":
    main()
