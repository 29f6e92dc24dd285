"""LoRA against full fine-tuning of the same model on CPU: trainable parameters, optimizer-state
bytes and peak memory of the rank, in one run. Prints them per variant with the first and
last loss, then the ratios LoRA / full.

Each variant trains ``--steps`` steps of the same config (default: SmolLM2-135M-Instruct as the
language model with the tiny image and audio encoders, colocated on one rank, fp32, the sample
corpus's shards, which ``mimo-shard build`` writes first; two micro-batches of
``--micro-batch-size`` samples a step, attention ``sdpa``: activations, the same in both
variants, kept small beside the weights) in a fresh process (``python
tools/bench_lora.py --run NAME OVERRIDES``: one rank, gloo), so that its peak resident memory
(``ru_maxrss``) is its own:

- ``full``: every weight trained;
- ``lora``: ``model.lora.language`` (rank ``--rank``, alpha 2 x rank, all linear layers), the
  encoders frozen (``model.freeze: [image, audio]``, their projections too), as LoRA recipes
  freeze what they do not adapt.

Printed per variant: parameters trained / total, optimizer-state bytes (Adam's two moments,
and fp32 main weights in bf16 runs: every tensor of megatron-core's optimizer state after the
steps), peak RSS, the first and last loss; then LoRA / full ratios. Nothing is asserted.

    python tools/bench_lora.py [--steps 3] [--rank 8] [--micro-batch-size 1] \
        [--config configs/train/...yaml]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "configs", "train", "smollm2_images_audio_colocated.yaml")
CORPUS = [os.path.join(REPO, "assets", "corpus", name) for name in (
    "llava.json", "llava.jsonl", "conversations.parquet", "speech.parquet",
    "speech_manifest.jsonl")]


def measure(overrides: list[str]) -> dict:
    """Train in this process (one rank) and measure it."""
    import torch

    from mimo_train.config import TrainConfig
    from mimo_train.plan import resolve
    from mimo_train.model.parts import unwrap
    from mimo_train.training.trainer import Trainer
    trainer = Trainer(resolve(TrainConfig.load(overrides[0], overrides[1:])))
    records = [r for r in trainer.run() if "loss" in r]
    parameters = [p for m in trainer.modules.values() for p in unwrap(m).parameters()]
    state = 0
    for optimizer in trainer.trained.values():
        for tensors in optimizer.optimizer.state.values():
            state += sum(t.numel() * t.element_size() for t in tensors.values()
                         if isinstance(t, torch.Tensor) and t.dim() > 0)
        for group in getattr(optimizer, "fp32_from_float16_groups", ()):
            state += sum(p.numel() * p.element_size() for p in group)
    return {"trained": sum(p.numel() for p in parameters if p.requires_grad),
            "total": sum(p.numel() for p in parameters), "optimizer_bytes": state,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "first_loss": records[0]["loss"], "last_loss": records[-1]["loss"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--config", default=CONFIG)
    parser.add_argument("--micro-batch-size", type=int, default=1,
                        help="samples a micro-batch, two micro-batches a step (activations "
                        "grow with it, the same in both variants)")
    args = parser.parse_args()
    if args.run:
        print("BENCH " + json.dumps(measure(args.run[1:])), flush=True)
        return
    with tempfile.TemporaryDirectory(prefix="bench_lora.") as tmp:
        shards = os.path.join(tmp, "shards")
        built = subprocess.run([os.path.join(os.path.dirname(sys.executable), "mimo-shard"),
                                "build", *CORPUS, "--output", shards, "--workers", "2"],
                               capture_output=True, text=True)
        if built.returncode:
            sys.exit(f"building the corpus's shards failed:\n{built.stderr[-3000:]}")
        common = [args.config, f"data.datasets=[{shards}]", f"train.steps={args.steps}",
                  "train.device=cpu", "train.precision=fp32", "optimizer.warmup_steps=0",
                  "checkpoint.dir=null", "train.log_interval=1000", "model.attention=sdpa",
                  f"train.micro_batch_size={args.micro_batch_size}",
                  f"train.global_batch_size={2 * args.micro_batch_size}"]
        variants = {"full": ["model.freeze=[]"],
                    "lora": ["model.freeze=[image, audio]",
                             f"model.lora={{language: {{rank: {args.rank}, "
                             f"alpha: {2 * args.rank}}}}}"]}
        found = {}
        for name, overrides in variants.items():
            run = subprocess.run([sys.executable, os.path.abspath(__file__), "--run", name,
                                  *common, *overrides], capture_output=True, text=True,
                                 env={"OMP_NUM_THREADS": "2", **os.environ})
            line = next((x for x in run.stdout.splitlines() if x.startswith("BENCH ")), None)
            if line is None:
                sys.exit(f"{name} failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
            found[name] = json.loads(line[len("BENCH "):])
    print(f"{'':6} {'trained params':>16} {'of':>12} {'optimizer state':>16} "
          f"{'peak RSS':>10} {'loss first -> last':>20}")
    for name, m in found.items():
        print(f"{name:6} {m['trained']:>16,} {m['total']:>12,} "
              f"{m['optimizer_bytes'] / 2**20:>12.1f} MiB {m['peak_rss'] / 2**20:>6.0f} MiB "
              f"{m['first_loss']:>9.4f} -> {m['last_loss']:.4f}")
    full, lora = found["full"], found["lora"]
    print(f"lora / full: trained parameters {lora['trained'] / full['trained']:.4f}, "
          f"optimizer state {lora['optimizer_bytes'] / full['optimizer_bytes']:.4f}, "
          f"peak RSS {lora['peak_rss'] / full['peak_rss']:.2f}")


if __name__ == "__main__":
    main()
