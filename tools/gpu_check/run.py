"""The project's GPU check: one command, no network, one JSON file of figures.

On the GPU machine, from a copy of the project's root that holds ``.whl/`` (made here by
``bash tools/gpu_check/prepare.sh``), ``assets/tokenizer`` and ``assets/corpus``::

    python3 tools/gpu_check/run.py --out DIR          # about 7 minutes, bounded by --budget-s

Here, on the CPU, the same steps with tiny dims (``tests/test_gpu_check.py`` runs them)::

    .venv/bin/python tools/gpu_check/run.py --out DIR --tiny

Steps, each bounded in time; a failed one is recorded with its first error line, never fatal:

1. ``packages``: megatron-core, webdataset, soundfile, flash-linear-attention (fla) and their
   needs installed from ``.whl`` when missing (the GPU image has torch and transformers only,
   triton with torch); PyAV, when missing, replaced by
   a stub that fails on use (only video needs it; its wheel is half the carry limit).
2. ``env`` and ``kernels`` (one child process, ``probes.py``): versions, the GPU, a bf16
   matmul's TFLOP/s (the practical peak); a one-rank NCCL all-reduce, mimo's step timer on CUDA
   events, ``varlen_attn`` against per-sample SDPA, the gated delta-net's kernels (fla's) on a
   packed row of Qwen3.5-4B's shapes against each sample alone.
3. ``shards``: ``mimo-shard build`` of the sample corpus's image and text conversations.
4. ``parity``: a tiny model's two fp32 steps on the device against the same steps on the CPU
   (TF32 off): losses and gradient norms.
5. ``cases``: a Qwen2-VL-2B-shaped model with random weights (language 28 x 1536, ffn 8960;
   tower 32 x 1280, about 0.6B), bf16, colocated on one rank, for each attention backend,
   unpacked and packed: median step seconds, trained tokens/s, TFLOP/s and MFU
   (from the records), peak GPU memory (sampled with nvidia-smi) against ``mimo-inspect
   plan``'s prediction for the same run.

The trainings run as ``torchrun --nproc-per-node 1 -m mimo_train``; the suite passes its own
launcher (forked ranks) so that the CPU run costs no new interpreter per training.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
STUB = Path(__file__).resolve().parent / "stub"
PROBES = Path(__file__).resolve().parent / "probes.py"
PREPROCESS = ROOT / "configs" / "preprocess_images.yaml"
SOURCES = ["llava.json", "llava.jsonl", "conversations.parquet"]
LAYOUT = "language=dp1;image=dp1,off0"          # colocated on one rank
Dims = dict[str, dict[str, Any]]                 # the model section's language and encoders
TINY: Dims = {
    "language": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4},
    "encoders": {"image": {"kind": "qwen2_vl", "hidden_size": 32, "num_layers": 1,
                           "num_attention_heads": 2}}}
# Qwen2-VL-2B's shapes (its published config.json), random weights, no GQA
BIG: Dims = {
    "language": {"num_layers": 28, "hidden_size": 1536, "num_attention_heads": 12,
                 "ffn_hidden_size": 8960},
    "encoders": {"image": {"kind": "qwen2_vl", "hidden_size": 1280, "num_layers": 32,
                           "num_attention_heads": 16}}}
# (attention backend, packed, recompute), run in this order while time is left: the fast
# kernels first, then sdpa packed again with every layer recomputed (language and tower: what
# full recomputation saves and costs), then megatron-core's local attention
CASES = [("sdpa", False, "none"), ("varlen", True, "none"), ("sdpa", True, "none"),
         ("sdpa", True, "full"), ("local", False, "none"), ("local", True, "none")]


def case_name(attention: str, packed: bool, recompute: str) -> str:
    return f"{attention}_{'packed' if packed else 'unpacked'}" + \
        (f"_recompute_{recompute}" if recompute != "none" else "")


# A launcher runs ``python -m mimo_train ARGS`` as one rank: (args, env, timeout_s, log) -> rc
Launcher = Callable[[list[str], dict[str, str], float, Path], int]


def torchrun_launcher(args: list[str], env: dict[str, str], timeout: float, log: Path) -> int:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "1", "-m", "mimo_train", *args]
    with open(log, "w") as out:
        try:
            return subprocess.run(command, cwd=ROOT, env={**os.environ, **env}, stdout=out,
                                  stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            out.write(f"\ngpu-check: stopped after {timeout:.0f} s\n")
            return 124


class Check:
    """The run's state: where it writes, its deadline, what it found."""

    def __init__(self, out: Path, tiny: bool, budget_s: float, launch: Launcher,
                 shards: Path | None):
        self.out, self.tiny, self.launch = out, tiny, launch
        self.deadline = time.monotonic() + budget_s
        self.work = out / "work"
        self.shards = shards or self.work / "shards"
        self.summary: dict = {"tiny": tiny}
        self.log = open(out / "run.log", "a")

    def say(self, text: str) -> None:
        line = f"gpu-check: {text}"
        print(line, flush=True)
        self.log.write(line + "\n")
        self.log.flush()

    def left(self, most: float) -> float:
        return max(0.0, min(most, self.deadline - time.monotonic()))

    def step(self, name: str, work: Callable[[], object]) -> None:
        """Run one step; its result (or its error's first line) goes in the summary."""
        started = time.monotonic()
        try:
            result = work()
        except Exception as error:          # recorded, the next step still runs
            result = {"error": f"{type(error).__name__}: {str(error).strip()[:400]}"}
        self.summary[name] = result
        self.say(f"{name} ({time.monotonic() - started:.0f} s): {json.dumps(result)[:600]}")


def child_env(device: str) -> dict[str, str]:
    path = [str(ROOT)] + ([str(STUB)] if AV_MISSING else [])
    env = {"PYTHONPATH": os.pathsep.join(path + [os.environ.get("PYTHONPATH", "")]).rstrip(
        os.pathsep), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "4")}
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _missing(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except ModuleNotFoundError:         # its parent package is missing
        return True


# read before this process puts the stub on its own path (the shard build)
AV_MISSING = _missing("av")


def install_packages(gpu: bool) -> dict:
    """pip-install the carried wheels whose packages are missing (no index, no dependencies);
    the GPU kernels (fla) only on the GPU machine (``gpu``)."""
    wheels = sorted((ROOT / ".whl").glob("*.whl"))
    wanted = ("megatron.core", "webdataset", "soundfile") + (("fla", "einops") if gpu else ())
    missing = [m for m in wanted if _missing(m)]
    result: dict = {"missing": missing, "av": "stub" if AV_MISSING else "installed"}
    if missing:
        if not wheels:
            raise RuntimeError(f"{missing} missing and no wheels in .whl/: run "
                               "bash tools/gpu_check/prepare.sh on the development machine")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                        "--no-compile", "--no-cache-dir", *map(str, wheels)], check=True,
                       capture_output=True, text=True, timeout=180)
        result["installed"] = [w.name for w in wheels]
    return result


def probe(check: Check, env: dict[str, str], limit: float) -> dict:
    """``probes.py`` in a child process; its last stdout line is JSON."""
    done = subprocess.run([sys.executable, str(PROBES)], cwd=ROOT,
                          env={**os.environ, **env},
                          capture_output=True, text=True, timeout=check.left(limit))
    if done.returncode:
        lines = [x for x in done.stderr.splitlines() if x.strip()]
        raise RuntimeError(lines[-1] if lines else f"exit {done.returncode}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def probe_here() -> dict:
    """``probes.py``'s figures from this process (the CPU run: no CUDA context to keep out)."""
    spec = importlib.util.spec_from_file_location("gpu_check_probes", PROBES)
    assert spec and spec.loader
    probes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probes)
    return {"env": probes.env(), "kernels": probes.kernels()}


def build_shards(check: Check) -> dict:
    """``mimo-shard build`` of the corpus's image and text conversations, in this process."""
    if (check.shards / "index.json").exists():
        return {"reused": str(check.shards)}
    sys.path[:0] = [str(ROOT)] + ([str(STUB)] if AV_MISSING else [])
    from mimo_data.shards.cli import main as shard
    corpus = ROOT / "assets" / "corpus"
    rc = shard(["build", *[str(corpus / s) for s in SOURCES], "--output", str(check.shards),
                "--workers", "0" if check.tiny else "4", "--max-samples-per-shard", "64"])
    if rc:
        raise RuntimeError(f"mimo-shard build exited {rc} (its message is in the output above)")
    return {"built": str(check.shards)}


def train(check: Check, name: str, device: str, limit: float, config: dict,
          env: dict[str, str] | None = None) -> tuple[int, list[dict], Path]:
    """One one-rank training of ``config`` (written to ``work/NAME.yaml``); its train
    records."""
    records, log = check.work / f"{name}.jsonl", check.work / f"{name}.log"
    records.unlink(missing_ok=True)
    args = ["--config", str(write_config(check, name, device, config)), "--records", str(records)]
    rc = check.launch(args, {**child_env(device), **(env or {})}, check.left(limit), log)
    found = [json.loads(x) for x in records.read_text().splitlines()] if records.exists() else []
    return rc, [r for r in found if "loss" in r], log


def write_config(check: Check, name: str, device: str, config: dict) -> Path:
    """The whole training config of one run, self-contained (absolute paths; no checkpoint:
    a 2B model's is 40 GB of writing); also what the memory prediction reads."""
    import yaml
    data = {"datasets": [str(check.shards)], "preprocess": str(PREPROCESS),
            "num_workers": 0 if check.tiny else 2, "packing": False}
    whole: dict[str, Any] = {
        "data": data, "layout": LAYOUT,
        "optimizer": {"lr": 3.0e-3, "min_lr": 3.0e-4, "warmup_steps": 1, "clip_grad": 1.0},
        "train": {"seed": 3, "log_interval": 1, "device": device}}
    for section, values in config.items():       # the sections' keys, replaced one by one
        whole[section] = {**whole.get(section, {}), **values}
    path = check.work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(whole, sort_keys=False))
    return path


def failure(rc: int, log: Path) -> str:
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    wanted = [x for x in lines if "rror" in x or "refuse" in x or "stopped after" in x]
    return f"rc {rc}: " + (wanted[-1] if wanted else (lines[-1] if lines else "no output"))[:400]


def parity(check: Check, device: str) -> dict:
    runs = {}
    for name, where in (("parity_device", device), ("parity_cpu", "cpu")):
        config = {"model": TINY, "train": {"steps": 2, "precision": "fp32",
                                           "global_batch_size": 4, "micro_batch_size": 2}}
        rc, records, log = train(check, name, where, 240, config,
                                 env={"NVIDIA_TF32_OVERRIDE": "0"})
        if rc or len(records) != 2:
            return {"error": f"{where}: {failure(rc, log)}"}
        runs[where] = records
    a, b = runs[device], runs["cpu"]
    return {"device": device, "device_losses": [r["loss"] for r in a],
            "cpu_losses": [r["loss"] for r in b],
            "device_grad_norms": [r["grad_norm"] for r in a],
            "cpu_grad_norms": [r["grad_norm"] for r in b],
            "max_abs_loss_diff": max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b))}


class GpuMemory:
    """Peak used GPU memory over a training (nvidia-smi, twice a second): the child's own
    allocator figures are not visible from here."""

    def __init__(self) -> None:
        self.peak: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> GpuMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._stop.wait(0.5):
            try:
                text = subprocess.run(["nvidia-smi", "--query-gpu=memory.used",
                                       "--format=csv,noheader,nounits"], capture_output=True,
                                      text=True, timeout=5).stdout.split()
            except (OSError, subprocess.TimeoutExpired):
                return
            if text and text[0].isdigit():
                self.peak = max(self.peak or 0, int(text[0]))


def _median(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if isinstance(r.get(key), (int, float))]
    return statistics.median(values) if values else None


def case(check: Check, device: str, attention: str, packed: bool, recompute: str,
         steps: int) -> dict:
    name = case_name(attention, packed, recompute)
    # bf16 is what GPUs train in; on the CPU it is slow and no one's choice: fp32 there
    train_section = {"steps": steps, "precision": "bf16" if device == "cuda" else "fp32",
                     "global_batch_size": 4 if check.tiny else 16,
                     "micro_batch_size": 2 if check.tiny else 8}
    dims = TINY if check.tiny else BIG
    model = {"language": {**dims["language"], "recompute": recompute},
             "encoders": {"image": {**dims["encoders"]["image"], "recompute": recompute}},
             "attention": attention}
    config = {"model": model,
              "data": {"packing": packed}, "train": train_section}
    memory = GpuMemory() if device == "cuda" else None
    if memory:
        with memory:
            rc, records, log = train(check, name, device, 240, config)
    else:
        rc, records, log = train(check, name, device, 240, config)
    result: dict = {"steps": len(records), "losses": [round(r["loss"], 4) for r in records]}
    if rc or not records:
        result["error"] = failure(rc, log)
    late = records[2:] or records        # the first steps warm kernels and the allocator
    for key in ("seconds", "tokens_per_s", "samples_per_s",
                "tflops_per_gpu", "mfu", "memory_mib"):
        if (value := _median(late, key)) is not None:
            result[f"median_{key}"] = value
    result["peak_gpu_mib"] = memory.peak if memory else None
    try:
        result["predicted_mib"] = predicted_mib(check, name, train_section, packed)
    except Exception as error:          # the figures above stand without it
        result["predicted_mib"] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
    return result


def predicted_mib(check: Check, name: str, train_section: dict, packed: bool) -> float:
    """What ``mimo-inspect plan``'s memory model predicts for the run's rank (weights,
    gradients, optimizer state, activations of its micro-batches, temporaries): the layout
    advisor's evaluation of this one layout and settings, on the loader's dry run of the
    run's own seed."""
    from mimo_data.inspect.workload import workload
    from mimo_data.loading.layout import Layout
    from mimo_data.loading.loader import DataSource
    from mimo_data.preprocess.config import PreprocessConfig
    from mimo_train.planning.advisor import GPU, Advisor, Candidate, read_model, read_work
    from mimo_train.planning.memory import Settings
    preprocess = PreprocessConfig.from_yaml(str(PREPROCESS))
    work = workload(DataSource([str(check.shards)], preprocess), preprocess,
                    train_section["global_batch_size"], train_section["micro_batch_size"],
                    seed=3, steps=train_section["steps"], packing=packed)
    model = read_model(str(check.work / f"{name}.yaml"), str(PREPROCESS), preprocess,
                       {"image": "image"})
    advisor = Advisor(model, read_work(model, work), GPU("any", 1e6, 1.0, 1.0, 1.0))
    settings = Settings(model.precision, attention_scores=model.attention_scores)
    result = advisor.evaluate(Candidate(Layout.parse(LAYOUT), settings))
    return round(result.peak_bytes / 2**20, 1)


def run(out: Path, tiny: bool, budget_s: float, launch: Launcher = torchrun_launcher,
        shards: Path | None = None) -> dict:
    """Every step in order; returns the summary, also written to ``out/summary.json``."""
    out.mkdir(parents=True, exist_ok=True)
    check = Check(out, tiny, budget_s, launch, shards)
    check.work.mkdir(exist_ok=True)
    check.step("packages", lambda: install_packages(gpu=not tiny))
    # a child process on a GPU machine: the parent holds no CUDA context while the cases run
    check.step("machine", lambda: probe_here() if tiny else probe(check, child_env("auto"), 180))
    machine = check.summary.pop("machine")           # an error: both say it
    check.summary.update(env=machine.get("env", machine), kernels=machine.get("kernels", machine))
    cuda = bool(check.summary["env"].get("cuda"))
    device = "cuda" if cuda and not tiny else "cpu"
    check.step("shards", lambda: build_shards(check))
    check.step("parity", lambda: parity(check, device))
    cases: dict[str, dict] = {}
    for attention, packed, recompute in CASES:
        name = case_name(attention, packed, recompute)
        if check.left(60) < 60:
            cases[name] = {"skipped": "out of time"}
            continue
        check.step(name, functools.partial(case, check, device, attention, packed, recompute,
                                           2 if tiny else 6))
        cases[name] = check.summary.pop(name)
    check.summary["cases"] = cases
    (out / "summary.json").write_text(json.dumps(check.summary, indent=1))
    check.say(f"summary in {out / 'summary.json'}")
    return check.summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_check")))
    parser.add_argument("--tiny", action="store_true",
                        help="tiny dims on the CPU (what the suite runs)")
    parser.add_argument("--budget-s", type=float, default=420,
                        help="stop starting steps after this many seconds (default 420)")
    parser.add_argument("--shards", type=Path, help="use these shards instead of building")
    args = parser.parse_args(argv)
    summary = run(args.out, args.tiny, args.budget_s, shards=args.shards)
    failed = [k for k, v in summary.items() if isinstance(v, dict) and "error" in v]
    failed += [k for k, v in summary["cases"].items() if "error" in v]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
