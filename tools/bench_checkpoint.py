"""Checkpoint cost: mimo's save (digests by the writers, fully parallel, synchronous and
asynchronous) against a plain megatron-core save of the same state, in the same run, on 1 and
4 ranks. Prints each save's and verification's seconds per world size (the maximum over the
ranks) and their ratios.

The state: the real SmolLM2-135M-Instruct (set-up's ``assets/models/smollm2-135m-instruct``) as
the language model, trained, with its Adam state after one training step, layout
``language=dpN``; text-only samples written at bench time from the sample corpus's
conversations. Each world size runs under ``torchrun --nproc-per-node N`` (gloo), one thread
per process, and measures, every figure the maximum over the ranks of a barrier-to-barrier
time:

- plain: ``dist_checkpointing.save(..., verify_integrity=True)``, megatron-core's synchronous
  save with its manifest (rank 0 hashes every file; its default strategy: a replicated
  tensor is written by rank 0);
- sync: ``checkpoint.Saver(asynchronous=False).save`` (fully parallel save, each rank hashes
  what it wrote);
- async: ``checkpoint.Saver(asynchronous=True)``, then training steps, each followed by
  ``poll``, until the save is final (``latest`` moved; at most ``--max-steps``, then
  ``wait``). The stall is the time the step loop spends in ``save`` (planning, the fork) and
  in the ``poll`` calls (the finalizing one: rank 0's manifest and ``latest``); "complete" the
  time from ``save`` to the final poll; "steps" how many training steps ran meanwhile; "step"
  and "during" the median step seconds before and during the save (the writer processes
  share the cores);
- verify: megatron-core's ``verify_integrity_manifest`` (rank 0 hashes, the others wait)
  against ``digests.verify`` (each rank hashes a share), on the sync checkpoint.

Printed: each figure per world size, and the ratios the issue targets: async stall / sync
save (target <= 0.3) and verify seconds per rank, 4 ranks against 1 (falling with the ranks).
No figure is asserted. About 10 minutes on 2 cores (4 ranks share 2 cores: their figures show
the cores' contention, not only the checkpoint's).

    python tools/bench_checkpoint.py [--ranks 1 4] [--steps 3] [--max-steps 20] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "assets", "models", "smollm2-135m-instruct")
MARKER = re.compile(r"(Image \d+: )?<(image|audio)>\n?")


def write_dataset(work: str) -> tuple[str, str]:
    """(shards, preprocessing YAML): the corpus's conversations, media markers removed."""
    import pyarrow.parquet as pq
    import yaml

    table = pq.read_table(os.path.join(ROOT, "assets", "corpus", "conversations.parquet"))
    records = [{"id": f"c{i}-{j}", "conversations": [
        {"from": "human" if m["role"] == "user" else "gpt",
         "value": MARKER.sub("", m["content"]).strip() or "Describe it."}
        for m in row["messages"]]}
        for j in range(8) for i, row in enumerate(table.to_pylist())]
    source = os.path.join(work, "conversations.json")
    with open(source, "w") as f:
        json.dump(records, f)
    shards = os.path.join(work, "shards")
    subprocess.run([os.path.join(os.path.dirname(sys.executable), "mimo-shard"), "build",
                    source, "--output", shards, "--workers", "0", "--no-progress"],
                   check=True, capture_output=True, text=True)
    preprocess = os.path.join(work, "preprocess.yaml")
    with open(preprocess, "w") as f:
        yaml.safe_dump({"tokenizer": MODEL, "seq_length": 256, "modalities": {}}, f)
    return shards, preprocess


# ----------------------------------------------------------------------------------- worker

def worker(out: str, work: str, shards: str, preprocess: str, steps: int,
           max_steps: int) -> None:
    """One rank of ``torchrun``: the figures above, written to ``out/rank_R.json``."""
    import torch.distributed as dist

    from mimo_train import checkpoint_folders
    from mimo_train.components import checkpoint, digests
    from mimo_train.config import TrainConfig
    from mimo_train.plan import resolve
    from mimo_train.mcore import dist_checkpointing
    from mimo_train.training.trainer import Trainer
    from megatron.core.dist_checkpointing.validation import verify_integrity_manifest

    world = int(os.environ["WORLD_SIZE"])
    plan = resolve(TrainConfig.load(None, [
        f"data.datasets=[{shards}]", f"data.preprocess={preprocess}",
        f"layout=language=dp{world}", f"model.language.pretrained={MODEL}",
        f"train.global_batch_size={world}", "train.micro_batch_size=1",
        f"train.steps={steps + max_steps + 2}", "train.log_interval=1000",
        "optimizer.warmup_steps=0",
        "train.device=cpu"]))
    trainer = Trainer(plan)
    batches = trainer.batches(trainer.loader)

    def step() -> float:
        start = time.perf_counter()
        trainer.train_step(batches)
        trainer.settle()                        # its outcome read, its learning rates stepped
        return time.perf_counter() - start

    def timed(function) -> float:
        dist.barrier()
        start = time.perf_counter()
        function()
        dist.barrier()
        return time.perf_counter() - start

    step()                                               # Adam's state exists from here
    state = trainer.training_state()
    figures: dict = {}
    plain = os.path.join(work, "plain")

    def plain_save() -> None:
        if dist.get_rank() == 0:
            os.makedirs(plain)
        dist.barrier()
        dist_checkpointing.save(checkpoint._sharded(state, trainer.step, False, True), plain,
                                verify_integrity=True)

    figures["plain_save_s"] = timed(plain_save)
    sync = checkpoint.Saver(os.path.join(work, "sync"), asynchronous=False)
    figures["sync_save_s"] = timed(lambda: sync.save(trainer.step, state, trainer._meta()))
    directory = checkpoint_folders.step_dir(os.path.join(work, "sync"), trainer.step)
    figures["files"] = sorted(os.listdir(directory))
    figures["bytes"] = sum(os.path.getsize(os.path.join(directory, name))
                           for name in os.listdir(directory))
    figures["plain_verify_s"] = timed(lambda: verify_integrity_manifest(plain))
    figures["verify_s"] = timed(lambda: digests.verify(directory))

    before = [step() for _ in range(steps)]
    saver = checkpoint.Saver(os.path.join(work, "async"), asynchronous=True)
    dist.barrier()
    start = time.perf_counter()
    saver.save(trainer.step, state, trainer._meta())
    figures["async_call_s"] = time.perf_counter() - start
    during: list[float] = []
    polls, done = 0.0, False
    while not done and len(during) < max_steps:
        during.append(step())
        polled = time.perf_counter()
        done = bool(saver.poll())
        polls += time.perf_counter() - polled
    polled = time.perf_counter()
    saver.wait()                        # only when it outlasted max_steps: counted as stall
    polls += time.perf_counter() - polled
    figures["async_complete_s"] = time.perf_counter() - start
    figures["async_poll_s"] = polls
    figures["async_stall_s"] = figures["async_call_s"] + polls
    figures["async_steps"] = len(during)
    figures["step_s"] = statistics.median(before)
    figures["step_during_save_s"] = statistics.median(during)
    with open(os.path.join(out, f"rank_{dist.get_rank()}.json"), "w") as f:
        json.dump(figures, f)
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------ main

def run(ranks: int, work: str, shards: str, preprocess: str, steps: int,
        max_steps: int) -> dict:
    out = os.path.join(work, f"out{ranks}")
    scratch = os.path.join(work, f"ranks{ranks}")
    os.makedirs(out)
    os.makedirs(scratch)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=ROOT)
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={ranks}", os.path.abspath(__file__), "--worker", out, scratch,
         shards, preprocess, str(steps), str(max_steps)],
        env=env, cwd=ROOT, capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"{ranks} rank(s) failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    shutil.rmtree(scratch)
    per_rank = [json.load(open(os.path.join(out, f"rank_{r}.json"))) for r in range(ranks)]
    return {key: max(r[key] for r in per_rank) if isinstance(per_rank[0][key], (int, float))
            else per_rank[0][key] for key in per_rank[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--steps", type=int, default=3,
                        help="training steps timed before the async save")
    parser.add_argument("--max-steps", type=int, default=20,
                        help="training steps at most while the async save completes")
    parser.add_argument("--keep", help="work in this directory and keep it")
    args = parser.parse_args()
    if not os.path.isdir(MODEL):
        sys.exit(f"{MODEL} is missing: run 'make setup' first")
    work = args.keep or tempfile.mkdtemp(prefix="bench-checkpoint-")
    os.makedirs(work, exist_ok=True)
    try:
        shards, preprocess = write_dataset(work)
        results = {ranks: run(ranks, work, shards, preprocess, args.steps, args.max_steps)
                   for ranks in args.ranks}
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"checkpoint of SmolLM2-135M + Adam: {results[args.ranks[0]]['bytes'] / 1e9:.2f} GB"
          f" ({os.getloadavg()[0]:.2f} load)")
    print(f"{'ranks':>5} {'plain save':>10} {'sync save':>9} {'async stall':>11} "
          f"{'(call':>6} {'+ polls)':>8} {'complete':>8} {'steps':>5} {'step':>6} "
          f"{'during':>6} {'plain verify':>12} {'verify':>6}  (seconds, max over ranks)")
    for ranks, r in results.items():
        print(f"{ranks:>5} {r['plain_save_s']:>10.2f} {r['sync_save_s']:>9.2f} "
              f"{r['async_stall_s']:>11.2f} {r['async_call_s']:>6.2f} {r['async_poll_s']:>8.2f} "
              f"{r['async_complete_s']:>8.2f} {r['async_steps']:>5} {r['step_s']:>6.2f} "
              f"{r['step_during_save_s']:>6.2f} {r['plain_verify_s']:>12.2f} "
              f"{r['verify_s']:>6.2f}")
    for ranks, r in results.items():
        print(f"{ranks} rank(s): sync save / plain save {r['sync_save_s'] / r['plain_save_s']:.2f}"
              f"; async stall / sync save {r['async_stall_s'] / r['sync_save_s']:.2f} "
              f"(target <= 0.3); verify / plain verify "
              f"{r['verify_s'] / r['plain_verify_s']:.2f}; step slowdown during the async "
              f"save {r['step_during_save_s'] / r['step_s']:.2f}x")
    if len(results) > 1:
        low, high = min(results), max(results)
        print(f"verify seconds, {high} ranks / {low}: "
              f"{results[high]['verify_s'] / results[low]['verify_s']:.2f} (mimo), "
              f"{results[high]['plain_verify_s'] / results[low]['plain_verify_s']:.2f} "
              "(megatron-core's)")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        out, work, shards, preprocess, steps, max_steps = sys.argv[2:8]
        worker(out, work, shards, preprocess, int(steps), int(max_steps))
    else:
        main()
