"""Trained tokens/s with sequence packing against padding, and DP token balance, in one run;
prints the trained tokens/s of each and their ratio, then the tokens per DP rank, max/mean.

Corpus: built at bench time from the sample corpus's real text (the question/answer turns of
``llava.json``, ``llava.jsonl``, ``conversations.parquet`` and ``speech.parquet``, media
markers removed): ``--samples`` ShareGPT-style conversations (a JSON array of
``conversations``), each grown turn by turn (an answer is one to three corpus answers) until it
reaches a target length drawn from a log-normal (median ``--median-tokens``, sigma ``--sigma``)
clipped to 50 .. ``--seq-length`` - 24 tokens: many short samples, a few long ones, as in SFT
data. ``mimo-shard build`` writes it into a temporary directory; the tokens per sample (chat
template included, from the token table) are printed.

1. Throughput: ``python -m mimo_train`` in a fresh process per run, the demo-size language
   model (2 layers, hidden 64, 4 heads; the SmolLM2 tokenizer's vocabulary), the same seed,
   samples, global and micro batch and ``--steps`` steps, ``data.packing=false`` (each
   micro-batch padded to its longest sample rounded up to 64) against ``=true`` (THD, no
   padding), ``--repeat`` times interleaved. Layout ``language=dp1``, text only
   (``modalities: {}``). Trained tokens
   (``loss_mask`` ones, the same in both) per second over steps ``--warmup-steps + 1 ..
   --steps`` of the train records (the first steps pay for allocations), medians over the
   repeats; and, since both runs train the same samples at each step, the median over steps of
   padded step seconds / packed step seconds (robust to a burst of load from other processes).
   Target: packed / padded >= 1.5. Printed beside it: the padding factor of the same
   micro-batches (tokens computed padded / real tokens), what packing can win at most when the
   cost is linear in tokens.
2. Balance: tokens per language DP rank per step, max / mean over the ranks, from the loaders'
   metadata (``build_loader(..., decode_media=False)`` for every rank of ``language=dpN``;
   ``metadata["tokens"]`` summed over the
   step's micro-batches), ``data.balance`` none against tokens, for each of ``--dp`` and
   ``--micro-batch-sizes``, over ``--balance-steps`` steps of ``--balance-global-batch``:
   mean over the steps and the worst step. Target with balancing: max/mean <= 1.05 (the
   mean; the worst step is reported). Beside it the same figure for the tokens a rank computes
   without packing (each micro-batch padded as the trainer pads it), which the token balance
   does not aim at, and the padding factor (those tokens / real tokens) without and with
   balancing (the balance hands out each step's samples largest first, round by round, and
   round r goes to micro-batch r // micro batch size: lengths end up bucketed by micro-batch).
3. Optional (``--balance-train-steps N``; 0, the default, skips it): ``torchrun
   --nproc-per-node 2``, layout ``language=dp2``, packing, balance none
   against tokens: median step seconds (the DP ranks wait for each other in the gradient
   all-reduce, so a step lasts as long as its slowest rank), the median over steps of the
   per-step ratio, and the language forward seconds per step, max over the ranks.

Every process runs with ``OMP_NUM_THREADS`` (and torch's threads) set to ``--threads``
(default 1: one core per process, the same for every figure; on a 2-core machine the
two-process run of 3 takes both). The machine's load average is printed with the figures. No
timing is asserted: the figures are ratios against a baseline measured in the same run. About
3.5 minutes on 2 cores with the defaults (3 adds about 1.5 minutes with 8 steps).

    python tools/bench_throughput.py [--samples 2000] [--steps 10] [--repeat 2] \\
        [--micro-batch-size 4] [--dp 2 4] [--balance-train-steps 0] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import pyarrow.parquet as pq
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4}
MIN_TOKENS = 50
MARKER = re.compile(r"(Image \d+: )?<(image|audio)>\n?")


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"load {one:.2f}/{five:.2f}"


# ---------------------------------------------------------------------------------- corpus

def corpus_pairs(corpus: str) -> list[tuple[str, str]]:
    """(question, answer) of every user turn followed by an assistant turn in the corpus's
    LLaVA/ShareGPT files and Parquet exports, media markers removed."""
    conversations = []
    with open(os.path.join(corpus, "llava.json")) as handle:
        conversations += [r.get("conversations") or r.get("messages") for r in json.load(handle)]
    with open(os.path.join(corpus, "llava.jsonl")) as handle:
        for line in handle:
            if line.strip():
                record = json.loads(line)
                conversations.append(record.get("conversations") or record.get("messages"))
    for name, column in (("conversations.parquet", "messages"),
                         ("speech.parquet", "conversations")):
        for value in pq.read_table(os.path.join(corpus, name),
                                   columns=[column]).column(column).to_pylist():
            conversations.append(json.loads(value) if isinstance(value, str) else value)
    pairs = []
    for turns in conversations:
        turns = [(t.get("from") or t.get("role"), t.get("value") or t.get("content") or "")
                 for t in turns or ()]
        for (role, text), (next_role, answer) in zip(turns, turns[1:]):
            if role in ("human", "user") and next_role in ("gpt", "assistant"):
                question = MARKER.sub("", text).strip() or "Go on."
                pairs.append((question, answer.strip()))
    return sorted(set(pairs))


def long_tail_conversations(pairs, encoder, samples: int, seq_length: int, median: float,
                            sigma: float, seed: int) -> list[list[dict]]:
    """``samples`` conversations of log-normal token lengths (chat template included)."""
    rng = random.Random(seed)
    ceiling = seq_length - 24

    def count(conversations) -> list[int]:
        return [len(e.ids) for e in encoder.encode_batch([(c, []) for c in conversations])]

    def turn() -> list[dict]:
        question, answer = rng.choice(pairs)
        extra = [rng.choice(pairs)[1] for _ in range(rng.choice((0, 0, 1, 2)))]
        return [{"role": "user", "content": question},
                {"role": "assistant", "content": " ".join([answer, *extra])}]

    # tokens of the template around a conversation, and of each turn alone
    a, b = turn(), turn()
    single_a, single_b, both = count([a, b, a + b])
    overhead = single_a + single_b - both
    targets = np.clip(np.random.default_rng(seed).lognormal(math.log(median), sigma, samples),
                      MIN_TOKENS, ceiling)
    conversations = []
    for target in targets:
        messages: list[dict] = []
        tokens = overhead
        while tokens < target:
            added = turn()
            (alone,) = count([added])
            if messages and tokens + alone - overhead > ceiling:
                break
            messages += added
            tokens += alone - overhead
        conversations.append(messages)
    for _ in range(8):                           # trim the few that the estimate let through
        long = [i for i, n in enumerate(count(conversations)) if n > ceiling]
        for i in long:
            conversations[i] = conversations[i][:-2]
        if not long:
            break
    return conversations


def build_dataset(args, work: str) -> tuple[str, str]:
    """(dataset directory, preprocessing YAML) of the long-tail corpus."""
    from mimo_data.preprocess.chat_tokens import TextEncoder
    from mimo_data.preprocess.config import PreprocessConfig

    with open(os.path.join(ROOT, args.config)) as handle:
        settings = yaml.safe_load(handle)
    settings["tokenizer"] = os.path.abspath(os.path.join(ROOT, os.path.dirname(args.config),
                                                         settings["tokenizer"]))
    settings["seq_length"] = args.seq_length
    settings["modalities"] = {}                # text only
    preprocess = os.path.join(work, "preprocess.yaml")
    with open(preprocess, "w") as handle:
        yaml.safe_dump(settings, handle)
    encoder = TextEncoder(PreprocessConfig.from_yaml(preprocess))
    conversations = long_tail_conversations(
        corpus_pairs(os.path.join(ROOT, args.corpus)), encoder, args.samples, args.seq_length,
        args.median_tokens, args.sigma, args.seed)
    source = os.path.join(work, "long_tail.json")
    with open(source, "w") as handle:
        json.dump([{"id": f"lt{i}", "conversations": [
            {"from": "human" if m["role"] == "user" else "gpt", "value": m["content"]}
            for m in messages]} for i, messages in enumerate(conversations)], handle)
    dataset = os.path.join(work, "shards")
    shard = os.path.join(os.path.dirname(sys.executable), "mimo-shard")
    subprocess.run([shard, "build", source, "--output", dataset, "--workers", "0",
                    "--no-progress"], check=True, capture_output=True, text=True)
    return dataset, preprocess


def length_line(dataset: str, preprocess: str) -> str:
    from mimo_data.loading.loader import DataSource

    source = DataSource(dataset, preprocess)
    table = source.tables[0]
    tokens = table.tokens[table.kept].astype(np.int64)
    p = np.percentile(tokens, [10, 50, 90, 99])
    return (f"{len(tokens)} samples kept of {len(table.tokens)}; tokens per sample: min "
            f"{tokens.min()}, p10 {p[0]:.0f}, median {p[1]:.0f}, mean {tokens.mean():.0f}, p90 "
            f"{p[2]:.0f}, p99 {p[3]:.0f}, max {tokens.max()}")


# ------------------------------------------------------------------------------ throughput

def layout(dp: int) -> str:
    """The trainer's layout: the language model on ``dp`` ranks (text-only data)."""
    return f"language=dp{dp}"


def train_config(args, work: str, dataset: str, preprocess: str, dp: int,
                 global_batch: int, micro_batch: int, steps: int) -> str:
    path = os.path.join(work, f"dp{dp}.yaml")
    with open(path, "w") as handle:
        yaml.safe_dump({"data": {"datasets": [dataset], "preprocess": preprocess},
                        "layout": layout(dp),
                        "model": {"language": MODEL},
                        "optimizer": {"lr": 3.0e-3, "min_lr": 3.0e-4, "warmup_steps": 3},
                        "train": {"global_batch_size": global_batch,
                                  "micro_batch_size": micro_batch, "steps": steps,
                                  "log_interval": 1, "seed": args.seed}}, handle)
    return path


def child_env(threads: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               CUDA_VISIBLE_DEVICES="")
    env.pop("RANK", None)
    return env


def train(args, config: str, overrides: list[str], records: str, nproc: int = 1) -> dict:
    """One training run in fresh process(es); its train records and the load before it."""
    before = load()
    launcher = [sys.executable, "-m", "mimo_train"] if nproc == 1 else [
        os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone",
        f"--nproc-per-node={nproc}", "-m", "mimo_train"]
    start = time.perf_counter()
    result = subprocess.run([*launcher, "--config", config, "--records", records, *overrides],
                            capture_output=True, text=True, env=child_env(args.threads),
                            cwd=ROOT, check=False)
    if result.returncode:
        raise RuntimeError(f"training {' '.join(overrides)} failed ({result.returncode}):\n"
                           f"{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    with open(records) as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    return {"records": [r for r in rows if "loss" in r], "load": before,
            "wall": time.perf_counter() - start}


def timed(run: dict, warmup: int) -> dict:
    """Figures of a run's steps after ``warmup``."""
    steps = [r for r in run["records"] if r["step"] > warmup]
    seconds = sum(r["seconds"] for r in steps)
    tokens = sum(r["tokens"] for r in steps)
    forward = sum(max(r["forward_s"].values()) for r in steps)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "step_s": statistics.median(r["seconds"] for r in steps),
            "forward_s": forward / len(steps), "per_step": [r["seconds"] for r in steps],
            "load": run["load"], "wall": run["wall"]}


def step_ratios(slow: list[dict], fast: list[dict]) -> list[float]:
    """Per step of each repeat: ``slow`` step seconds / ``fast`` step seconds."""
    return [a / b for s, f in zip(slow, fast) for a, b in zip(s["per_step"], f["per_step"])]


def steps_of(loader, steps: int):
    """``(step, metadata)`` of ``loader``'s micro-batches for its first ``steps`` steps, epoch
    after epoch (``step`` counted from the first)."""
    offset = 0
    while offset < steps:
        for _, metadata in loader:
            if offset + metadata["step"] >= steps:
                break
            yield offset + metadata["step"], metadata
        offset += loader.steps_per_epoch
    loader.close()


def padded_tokens(tokens: list[int], seq_length: int) -> int:
    """Tokens the trainer computes for an unpacked micro-batch (``mimo_train.training.step``)."""
    from mimo_data.preprocess.collate import LENGTH_MULTIPLE

    return len(tokens) * min(seq_length, -(-max(tokens) // LENGTH_MULTIPLE) * LENGTH_MULTIPLE)


def padding_factor(dataset: str, preprocess: str, args) -> tuple[float, float]:
    """(tokens computed padded / real tokens, packed sequences per micro-batch) over the
    timed steps' micro-batches of the throughput runs (the same loader as the trainer's)."""
    from mimo_data.loading.loader import build_loader

    loader = build_loader(dataset, preprocess, layout(1), 0, 1, args.global_batch_size,
                          args.micro_batch_size, seed=args.seed, decode_media=False,
                          packing=True)
    assert loader is not None
    real = padded = sequences = micro = 0
    for step, metadata in steps_of(loader, args.steps):
        if step < args.warmup_steps:
            continue
        real += sum(metadata["tokens"])
        padded += padded_tokens(metadata["tokens"], args.seq_length)
        sequences += len(metadata["sequences"])
        micro += 1
    return padded / real, sequences / micro


def throughput(args, work: str, dataset: str, preprocess: str) -> None:
    config = train_config(args, work, dataset, preprocess, 1, args.global_batch_size,
                          args.micro_batch_size, args.steps)
    runs: dict[str, list[dict]] = {"padded": [], "packed": []}
    for repeat in range(args.repeat):
        for name in runs:
            run = train(args, config, [f"data.packing={str(name == 'packed').lower()}"],
                        os.path.join(work, f"{name}-{repeat}.jsonl"))
            runs[name].append(timed(run, args.warmup_steps))
    factor, sequences = padding_factor(dataset, preprocess, args)
    print(f"\n1. throughput: layout {layout(1)}, language model {MODEL}, global batch "
          f"{args.global_batch_size}, micro batch {args.micro_batch_size}, seq_length "
          f"{args.seq_length}, steps {args.warmup_steps + 1}..{args.steps} timed, "
          f"{args.repeat} run(s) each, interleaved")
    print(f"{'':8s} {'trained tok/s':>13s} {'step s':>7s} {'forward s':>9s} {'timed tokens':>12s}"
          "  process wall, load before")
    rates = {}
    for name, results in runs.items():
        rates[name] = statistics.median(r["tokens_per_s"] for r in results)
        step = statistics.median(r["step_s"] for r in results)
        forward = statistics.median(r["forward_s"] for r in results)
        print(f"{name:8s} {rates[name]:13.0f} {step:7.2f} {forward:9.2f} "
              f"{results[0]['tokens']:12d}  "
              + ", ".join(f"{r['wall']:.0f} s {r['load']}" for r in results))
    tokens = {name: {r["tokens"] for r in results} for name, results in runs.items()}
    assert tokens["padded"] == tokens["packed"] and len(tokens["packed"]) == 1, tokens
    print(f"padding factor of these micro-batches (padded tokens / real tokens): {factor:.2f}; "
          f"packed: {sequences:.2f} sequences of <= {args.seq_length} per micro-batch")
    ratios = step_ratios(runs["padded"], runs["packed"])
    print(f"packed / padded trained tokens/s: {rates['packed'] / rates['padded']:.2f}x; per step, "
          f"padded seconds / packed seconds: median {statistics.median(ratios):.2f}x (min "
          f"{min(ratios):.2f}, max {max(ratios):.2f}) (target >= 1.5)  [{load()}]")


# -------------------------------------------------------------------------------- balance

def rank_loads(source, dp: int, micro: int, global_batch: int, balance: str, steps: int,
               seed: int, seq_length: int, layout: str | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
    """``[steps, dp]`` real tokens and padded tokens per language DP rank and step (ranks
    0..dp-1 are the language ranks of ``layout``, default ``language=dpN``)."""
    from mimo_data.loading.loader import build_loader

    real = np.zeros((steps, dp))
    padded = np.zeros((steps, dp))
    for rank in range(dp):
        loader = build_loader(source, None, layout or f"language=dp{dp}", rank, dp,
                              global_batch, micro, seed=seed, decode_media=False,
                              balance=balance)
        assert loader is not None
        for step, metadata in steps_of(loader, steps):
            real[step, rank] += sum(metadata["tokens"])
            padded[step, rank] += padded_tokens(metadata["tokens"], seq_length)
    return real, padded


def max_over_mean(loads: np.ndarray) -> np.ndarray:
    return loads.max(axis=1) / loads.mean(axis=1)


def balance(args, dataset: str, preprocess: str) -> None:
    from mimo_data.loading.loader import DataSource

    source = DataSource(dataset, preprocess)
    start = time.perf_counter()
    print(f"\n2. balance: tokens per language DP rank per step, max/mean over the ranks, layout "
          f"language=dpN, {args.balance_steps} steps of global batch "
          f"{args.balance_global_batch} (the loaders' metadata); mean over the steps (worst "
          "step)")
    print(f"{'dp':>3s} {'micro':>5s} | {'real tokens: none':>19s} {'tokens':>13s} | "
          f"{'padded tokens: none':>21s} {'tokens':>13s} | padding factor none, tokens")
    worst_mean = 0.0
    for dp in args.dp:
        for micro in args.micro_batch_sizes:
            if args.balance_global_batch % (dp * micro):
                print(f"{dp:3d} {micro:5d} | global batch {args.balance_global_batch} does not "
                      f"cut into {dp} x {micro}: skipped")
                continue
            loads = {mode: rank_loads(source, dp, micro, args.balance_global_batch, mode,
                                      args.balance_steps, args.seed, args.seq_length)
                     for mode in ("none", "tokens")}
            ratios = {mode: [max_over_mean(kind) for kind in pair] for mode, pair in loads.items()}
            worst_mean = max(worst_mean, ratios["tokens"][0].mean())
            cells = [f"{r.mean():.3f} ({r.max():.2f})" for kind in (0, 1)
                     for r in (ratios["none"][kind], ratios["tokens"][kind])]
            factors = [loads[mode][1].sum() / loads[mode][0].sum() for mode in ("none", "tokens")]
            print(f"{dp:3d} {micro:5d} | {cells[0]:>19s} {cells[1]:>13s} | {cells[2]:>21s} "
                  f"{cells[3]:>13s} | {factors[0]:.2f}, {factors[1]:.2f}")
    print(f"balanced real tokens, the worst mean max/mean of these cases: {worst_mean:.3f} "
          f"(target <= 1.05)  [{time.perf_counter() - start:.0f} s, {load()}]")


def balance_training(args, work: str, dataset: str, preprocess: str) -> None:
    steps = args.balance_train_steps
    config = train_config(args, work, dataset, preprocess, 2, args.balance_train_global_batch,
                          args.micro_batch_size, steps)
    print(f"\n3. balance in training: torchrun, 2 processes, layout {layout(2)}, packing, "
          f"global batch {args.balance_train_global_batch}, micro batch "
          f"{args.micro_batch_size}, "
          f"steps {args.warmup_steps + 1}..{steps} timed")
    from mimo_data.loading.loader import DataSource

    source = DataSource(dataset, preprocess)
    results = {}
    for mode in ("none", "tokens"):
        run = train(args, config, ["data.packing=true", f"data.balance={mode}"],
                    os.path.join(work, f"dp2-{mode}.jsonl"), nproc=2)
        results[mode] = timed(run, args.warmup_steps)
        real, _ = rank_loads(source, 2, args.micro_batch_size, args.balance_train_global_batch,
                             mode, steps, args.seed, args.seq_length, layout(2))
        imbalance = max_over_mean(real[args.warmup_steps:]).mean()
        print(f"balance {mode:6s}: median step {results[mode]['step_s']:.2f} s, language forward "
              f"(max over ranks) {results[mode]['forward_s']:.2f} s per step, "
              f"{results[mode]['tokens_per_s']:.0f} trained tok/s; tokens per rank max/mean "
              f"{imbalance:.3f}  [{run['load']} before]")
    ratios = step_ratios([results["tokens"]], [results["none"]])
    overall = results["tokens"]["step_s"] / results["none"]["step_s"]
    print(f"step time balanced / not: medians {overall:.2f}x; per step, median "
          f"{statistics.median(ratios):.2f}x (min {min(ratios):.2f}, max {max(ratios):.2f})"
          f"  [{load()}]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", default="assets/corpus")
    parser.add_argument("--config", default="configs/preprocess.yaml",
                        help="preprocessing YAML (its seq_length is replaced)")
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--median-tokens", type=float, default=180)
    parser.add_argument("--sigma", type=float, default=0.75)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--micro-batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--balance-global-batch", type=int, default=64)
    parser.add_argument("--balance-steps", type=int, default=100)
    parser.add_argument("--balance-train-steps", type=int, default=0)
    parser.add_argument("--balance-train-global-batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1,
                        help="OMP_NUM_THREADS and torch threads of every process")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(args.threads)
    import torch
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    work = tempfile.mkdtemp(prefix="bench_throughput_")
    try:
        dataset, preprocess = build_dataset(args, work)
        line = length_line(dataset, preprocess)
        print(f"corpus: {line} (seq_length {args.seq_length}); OMP_NUM_THREADS={args.threads}, "
              f"{os.cpu_count()} CPUs  [{time.perf_counter() - start:.0f} s, {load()}]")
        throughput(args, work, dataset, preprocess)
        balance(args, dataset, preprocess)
        if args.balance_train_steps:
            balance_training(args, work, dataset, preprocess)
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work)
    print(f"\ntotal {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
