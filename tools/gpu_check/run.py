"""The project's GPU check: one command, no network, one JSON file of figures.

On the GPU machine, from a copy of the project's root that holds ``.whl/`` (made here by
``bash tools/gpu_check/prepare.sh``: wheels, and the Qwen2-VL replica's tokenizer and
processor files), ``assets/tokenizer`` and ``assets/corpus``::

    python3 tools/gpu_check/run.py --out DIR          # about 8 minutes, bounded by --budget-s
    python3 tools/gpu_check/run.py --out DIR --cases none      # the machine's probes, parity

Here, on the CPU, the same steps with tiny dims (``tests/test_gpu_check.py`` runs them)::

    .venv/bin/python tools/gpu_check/run.py --out DIR --tiny

Steps, each bounded in time; a failed one is recorded with its first error line, never fatal:

1. ``packages``: megatron-core, webdataset, soundfile, flash-linear-attention (fla) and their
   needs installed from ``.whl`` when missing (the GPU image has torch and transformers only,
   triton with torch), PyAV (the clips; the GPU image has none). Without its wheel, a stub
   that fails on use stands in for it and the shards hold no clips.
2. ``env`` and ``kernels`` (one child process, ``probes.py``): versions, the GPU, a bf16
   matmul's TFLOP/s (the practical peak); a one-rank NCCL all-reduce, mimo's step timer on CUDA
   events, ``varlen_attn`` against per-sample SDPA, Qwen2-VL-2B's tower under mimo's varlen
   attention against transformers' SDPA, the fused formulas compiled against as written, the
   gated delta-net's kernels (fla's) on a packed row of Qwen3.5-4B's shapes against each
   sample alone, grouped experts, the fused AdamW against foreach and the weight gradient
   made into its fp32 buffer against megatron-core's unfused path. They run
   after the first ``PROBE_AFTER`` (1) case, the goal's, or before parity where no case is
   chosen (``--cases none``: packages, shards, probes and parity alone, what a short GPU
   lease wants), never with
   ``--skip-probes``; with under ``PROBES_S`` (150 s, their limit) of the budget left both
   are ``{"skipped": "out of time"}``, not started (no error).
3. ``shards``: the sample corpus's image, video and text conversations, images and clips in
   turn, replicated (``tools/replicate_corpus.py``) and built with ``mimo-shard build``.
4. ``checkpoint``: Qwen2-VL-2B as published (``tools/published``' config.json, the replica's
   tokenizer, template and processor files at their published ids and vocabulary), random
   bf16 weights, saved as transformers saves it; tiny: the replica itself. Skipped with no
   cases (``--cases none``).
5. ``cases``: fine-tuning workloads (``WORKLOADS``) of that checkpoint, images and clips at
   its default pixel budgets (the clips through the same tower): packed to 8k and 32k tokens
   a micro-batch and the unpacked short conversations (the floor), with full recompute, with
   other attention kernels. Each trains
   with mimo (``torchrun -m mimo_train``, one rank, colocated) and, where the workload says
   so, with the peer (``peer.py``: transformers' own model class on the same checkpoint and the
   same micro-batches); each reports median step seconds, trained tokens/s, TFLOP/s and MFU
   (mimo's records), the first losses of both, mimo's tokens/s over the peer's, peak GPU
   memory (nvidia-smi and the allocator) against ``mimo-inspect plan``'s prediction, and a
   profile of two steps each (``mimo_train.runtime.profile``: the share of GPU time in
   matmuls, attention, elementwise/norm, communication, copies and idle, the top kernels,
   host syncs per step).
6. ``parity``: a tiny model's two fp32 steps on the device against the same steps on the CPU
   (TF32 off): losses and gradient norms.

How to read ``summary.json``: ``cases.NAME.mimo`` and ``cases.NAME.peer`` hold each side's
figures (``median_*`` over the steps before the profiled ones), ``cases.NAME.speedup`` is
mimo's trained tokens/s over the peer's, each the same steps' tokens over their seconds
(``timed_tokens_per_s``; the issue's goal: >= 1.3 on ``packed_8k``), and
``mimo.profile`` / ``peer.profile`` say where the time went (``shares``; ``idle`` is GPU time
with no kernel running: the host is behind), and ``busy_over_timed`` what of an unprofiled
step the GPU's kernels take (near 1 the GPU bounds the step, well under 1 the host).
``memory_error`` is mimo's allocator peak against
the advisor's prediction (goal: within 10%).

The trainings run as ``torchrun --nproc-per-node 1 -m mimo_train`` and ``python peer.py``; the
suite passes its own launchers (forked ranks; the peer in its process) so that the CPU run
costs no new interpreter per training.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
STUB = Path(__file__).resolve().parent / "stub"
PROBES = Path(__file__).resolve().parent / "probes.py"
PEER = Path(__file__).resolve().parent / "peer.py"
PREPROCESS = ROOT / "configs" / "preprocess_images.yaml"      # the parity step's
# the cases' models by size: the published config.json (tools/published), and the replica
# (set-up's) whose tokenizer, template and processor files go beside it (Qwen2-VL-2B's and
# -7B's are the same files: the 2B replica's serve both, one carried folder); tiny: the replica
PUBLISHED = {size: ROOT / "tools" / "published" / f"Qwen--Qwen2-VL-{size}-Instruct"
             for size in ("2B", "7B")}
REPLICAS = {size: ROOT / "assets" / "models" / "published" / f"Qwen--Qwen2-VL-{size}-Instruct"
            for size in ("2B", "7B")}
REPLICA = REPLICAS["2B"]
# the replica's files but its weights, as prepare.sh carries them in .whl/ (with PyAV's
# wheel, the replica's 20 MB of weights would not fit the 64 MiB the GPU machine is sent)
PROCESSOR_FILES = ROOT / ".whl" / REPLICA.name
# colocated on one rank; the tower serves the clips too where the shards hold them
LAYOUTS = {False: "language=dp1;image=dp1,off0",
           True: "language=dp1;image=dp1,off0,video"}
Dims = dict[str, dict[str, Any]]                 # the model section's language and encoders
TINY: Dims = {
    "language": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4},
    "encoders": {"image": {"kind": "qwen2_vl", "hidden_size": 32, "num_layers": 1,
                           "num_attention_heads": 2}}}


@dataclass(frozen=True)
class Workload:
    """One case: how its micro-batches are made and trained; ``micro`` samples a
    micro-batch (about ``seq_length`` tokens when packed: the corpus's samples hold ~330),
    two micro-batches a step; ``peer``: the peer trains it too."""
    name: str
    packed: bool
    seq_length: int
    micro: int
    attention: str = "auto"         # mimo's model.attention: varlen on a GPU in bf16
    recompute: str = "none"         # the language model's and the tower's
    tower_recompute: str = "none"   # the tower's alone (``recompute`` none); auto: ``tower_kept``
    peer: bool = True
    size: str = "2B"                # Qwen2-VL-2B (full fine-tune) or -7B (LoRA)
    lora: bool = False              # LoRA rank 16 on the language model, the tower frozen
    loss_chunk: int = 0             # model.language.loss_chunk_tokens (0: the loss at once)


# run in this order while time is left: the goal's case and the floor first
# (an 8k micro-batch holds ~40 images at their default budget: ~52k patches through the tower,
# four times the language model's tokens; its activations were recomputed to fit one GPU: out
# of memory at 121 GiB on an H200 before the varlen tower, the trained-tokens loss and the
# fused tower regions; the advisor now predicts ~95 GiB kept, so the goal's case keeps them
# where that fits)
WORKLOADS = [Workload("packed_8k", True, 8192, 24, tower_recompute="auto"),
             Workload("unpacked", False, 2048, 8, attention="sdpa"),
             Workload("lora_7b_packed_8k", True, 8192, 24, size="7B", lora=True),
             # the loss makes the trained tokens' logits alone: ~2,900 of a 32k micro-batch
             # (1.8 GB in fp32 at once); chunks of 1,024 make it take three, the chunked path
             Workload("packed_32k", True, 32768, 96, tower_recompute="full", loss_chunk=1024),
             Workload("packed_8k_recompute_full", True, 8192, 24, recompute="full"),
             # packed_8k with the language model and the tower on transformers' SDPA: the
             # varlen kernels' gain
             Workload("packed_8k_sdpa", True, 8192, 24, attention="sdpa",
                      tower_recompute="full", peer=False),
             Workload("packed_8k_local", True, 8192, 24, attention="local",
                      tower_recompute="full", peer=False)]
# on the CPU (tiny) these are packed_8k's run again: the same micro-batches, SDPA
TINY_SAME = {"packed_32k": "packed_8k", "packed_8k_sdpa": "packed_8k"}
# the machine's probes run after this many cases: the goal's case, then the probes (never
# run in the 2026-11-30 lease: its 450 s went to the goal's case and the floor), then the rest
PROBE_AFTER = 1
PROBES_S = 150                          # their limit; they start only with all of it left
# parity's two runs on a GPU machine (2026-12-04: started with ~80 s left, the device's took
# ~54 s and the CPU's was stopped at the budget 23 s in, an error); it starts only with this
# much left, and says each side's seconds (``device_s``, ``cpu_s``) for setting it
PARITY_S = 150
# the peer starts only with this much left (its model's load and 8 steps: one started with
# 65 s left on a busy machine was stopped before its first step, an error)
PEER_S = 150
AUTO_SHARE = 0.85                       # auto: the tower kept when predicted under this share
TINY_MICRO = {True: 2, False: 2}        # tiny: samples a micro-batch (packed: one row of two)
# steps of a case: the profiled ones last, after the profiler's lead-in step (profiled, not
# summarized: ``mimo_train.runtime.profile.Profile``); the median over those between the
# warm-up and the lead-in
STEPS, PROFILED, WARM = 8, 2, 2
# tiny: a first step (the optimizer's moments made, the fused regions compiled) and a profiled
# one
TINY_STEPS, TINY_PROFILED = 2, 1
# tiny: images and clips' frames of 112 x 112 pixels at most (16 tokens each; the checkpoint's
# default up to 16,384): a step's tokens, hence the peer's logits, a third (its steps 2.5 s
# each with one thread, 9 s at the default)
TINY_MAX_PIXELS = 112 * 112

# A launcher runs ``python ARGV`` (``-m mimo_train ...`` as one torchrun rank, or the peer's
# script) and returns its exit code: (argv, env, timeout_s, log) -> rc
Launcher = Callable[[list[str], dict[str, str], float, Path], int]


def torchrun_launcher(argv: list[str], env: dict[str, str], timeout: float, log: Path) -> int:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "1", *argv] if argv[0] == "-m" else [sys.executable, *argv]
    with open(log, "w") as out:
        process = subprocess.Popen(command, cwd=ROOT, env={**os.environ, **env}, stdout=out,
                                   stderr=subprocess.STDOUT)
        try:
            return process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            # SIGTERM first: torchrun stops its worker, which runs in a session of its own
            # (a SIGKILL of torchrun alone leaves it holding the GPU for the next run)
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            out.write(f"\ngpu-check: stopped after {timeout:.0f} s\n")
            return 124


class Check:
    """The run's state: where it writes, its deadline, what it found."""

    def __init__(self, out: Path, tiny: bool, budget_s: float, launch: Launcher,
                 shards: Path | None, work: Path | None = None):
        self.out, self.tiny, self.launch = out, tiny, launch
        self.deadline = time.monotonic() + budget_s
        self.work = work or out / "work"           # shards, checkpoint: not brought back
        self.shards = shards or self.work / "shards"
        self.checkpoints: dict[str, Path] = {}       # by size (``make_checkpoint``)
        # mimo's runs' environment once a compile failed (``compile_failure``)
        self.compile_env: dict[str, str] = {}
        self.summary: dict = {"tiny": tiny}
        self.log = open(out / "run.log", "a")

    def save(self) -> None:
        """``summary.json`` rewritten (a run stopped from outside keeps what it measured)."""
        (self.out / "summary.json").write_text(json.dumps(self.summary, indent=1))

    def bring_back(self, *paths: Path) -> None:
        """Copies of ``paths`` (the runs' logs, records, configs) come back with the summary
        where ``work`` is not under ``out``: in one archive, ``out/logs.tar.gz``, rewritten
        (a GPU lease brings back at most 8 files: the summary, run.log and this)."""
        if self.work == self.out / "work":
            return
        kept = self.work / "brought_back"
        kept.mkdir(exist_ok=True)
        for path in paths:
            if path.exists():
                shutil.copy(path, kept / path.name)
        partial = self.out / "logs.tar.gz.partial"
        with tarfile.open(partial, "w:gz") as archive:
            archive.add(kept, arcname="logs")
        os.replace(partial, self.out / "logs.tar.gz")

    @property
    def media(self) -> dict[str, int]:
        """The shards' images and clips (items; none before they are built)."""
        index = self.shards / "index.json"
        found = json.loads(index.read_text())["modalities"] if index.exists() else {}
        return {kind: found.get(kind, {}).get("items", 0) for kind in ("image", "video")}

    @property
    def video(self) -> bool:
        """Whether the shards hold clips: the tower serves them too."""
        return self.media["video"] > 0

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
    path = [str(ROOT)] + ([str(STUB)] if _missing("av") else [])
    env = {"PYTHONPATH": os.pathsep.join(path + [os.environ.get("PYTHONPATH", "")]).rstrip(
        os.pathsep), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "4")}
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    else:       # both sides: the allocator's segments grow in place, not fragment (an H200
        #         run held 94 GB for an allocator peak of 70.5)
        env["PYTORCH_CUDA_ALLOC_CONF"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF",
                                                        "expandable_segments:True")
    return env


def _missing(module: str) -> bool:
    """Whether ``module`` is not installed (PyAV's stub, on this process's path once the
    shards are built without it, is not PyAV)."""
    importlib.invalidate_caches()       # the packages step may have installed it
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:         # its parent package is missing
        return True
    return spec is None or (spec.origin is not None and Path(spec.origin).is_relative_to(STUB))


def install_packages(gpu: bool) -> dict:
    """pip-install the carried wheels whose packages are missing (no index, no dependencies);
    the GPU kernels (fla) only on the GPU machine (``gpu``)."""
    wheels = sorted((ROOT / ".whl").glob("*.whl"))
    wanted = ("megatron.core", "webdataset", "soundfile", "peft", "accelerate", "psutil",
              "av") + (("fla", "einops") if gpu else ())
    missing = [m for m in wanted if _missing(m)]
    result: dict = {"missing": missing}
    if missing:
        if not wheels and missing != ["av"]:          # without PyAV: no clips (the stub)
            raise RuntimeError(f"{missing} missing and no wheels in .whl/: run "
                               "bash tools/gpu_check/prepare.sh on the development machine")
    if missing and wheels:
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index",
                               "--no-deps", "--no-compile", "--no-cache-dir",
                               *map(str, wheels)], capture_output=True, text=True, timeout=180)
        if done.returncode:             # pip's own words, not its command line
            said = [x for x in (done.stderr + done.stdout).splitlines() if x.strip()]
            raise RuntimeError(f"pip install of .whl/ (exit {done.returncode}): "
                               + " | ".join(said[-3:]))
        result["installed"] = [w.name for w in wheels]
    # without PyAV (no wheel carried) the shards hold no clips and a stub stands in for it
    result["av"] = "stub" if _missing("av") else "installed"
    result["unmet"] = unmet()
    if result["unmet"]:                 # the cases would fail further on, less clearly
        result["error"] = f"installed at versions pyproject.toml does not allow: {result['unmet']}"
    return result


def unmet(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """The project's dependencies installed here at a version ``pyproject`` does not allow
    (the GPU image's own torch and transformers: no carried wheel replaces them)."""
    import importlib.metadata
    import tomllib

    from packaging.requirements import Requirement
    found = []
    for line in tomllib.loads(pyproject.read_text())["project"]["dependencies"]:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        try:
            version = importlib.metadata.version(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            continue                    # missing: the carried wheels' part
        if not requirement.specifier.contains(version, prereleases=True):
            found.append(f"{requirement.name} {version} (needs {requirement.specifier})")
    return found


def probe(check: Check, env: dict[str, str], limit: float) -> dict:
    """``probes.py`` in a child process: ``{"env": ..., "kernels": ...}`` from its JSON lines.
    Stopped at ``limit`` or dead (a kernel's crash can take the process), it keeps what the
    probes before reported, and the probe it was in gets the reason as its error."""
    try:
        done = subprocess.run([sys.executable, str(PROBES)], cwd=ROOT,
                              env={**os.environ, **env},
                              capture_output=True, text=True, timeout=check.left(limit))
        stdout, reason = done.stdout, None
        if done.returncode:
            lines = [x for x in done.stderr.splitlines() if x.strip()]
            reason = f"the probes' process ended (exit {done.returncode}): " + (
                lines[-1] if lines else "no message")
    except subprocess.TimeoutExpired as error:
        output = error.stdout or b""     # bytes even in text mode (Python's own quirk)
        stdout = output.decode(errors="replace") if isinstance(output, bytes) else output
        reason = f"stopped at the probes' limit of {limit:.0f} s"
    found: dict = {"kernels": {}}
    running = None
    for text in stdout.splitlines():
        try:
            line = json.loads(text)
        except json.JSONDecodeError:
            continue                     # a line a library printed, or a cut-off last one
        if not isinstance(line, dict):
            continue                     # a library's line that is JSON too (a number)
        if "env" in line:
            found["env"] = line["env"]
        elif "starting" in line:
            running = line["starting"]
        elif "kernel" in line:
            found["kernels"][line["kernel"]], running = line["found"], None
    if reason is not None:
        if "env" not in found:
            raise RuntimeError(reason)
        # the probe it was in, else (between probes, at exit) the process's own entry
        found["kernels"][running or "probes_process"] = {"ok": False, "error": reason}
    return found


def probe_here() -> dict:
    """``probes.py``'s figures from this process (the CPU run: no CUDA context to keep out)."""
    spec = importlib.util.spec_from_file_location("gpu_check_probes", PROBES)
    assert spec and spec.loader
    probes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probes)
    return {"env": probes.env(), "kernels": probes.kernels()}


def build_shards(check: Check) -> dict:
    """The corpus's image, video and text conversations (no audio: the cases' model has no
    audio tower), images and clips in turn, replicated to enough samples for two 32k
    micro-batches a step over several steps, built by ``mimo-shard build``'s builder, in
    this process; without PyAV, no clips."""
    if not (check.shards / "index.json").exists():
        video = not _missing("av")
        sys.path[:0] = [str(ROOT), str(ROOT / "tools")] + ([] if video else [str(STUB)])
        from replicate_corpus import CORPUS_INPUTS, replicated_dataset
        kinds = ("image", "video") if video else ("image",)
        built = replicated_dataset(
            str(ROOT / "assets" / "corpus"), 64 if check.tiny else 1200, str(check.work),
            inputs=CORPUS_INPUTS + (("video.jsonl",) if video else ()),
            keep=lambda r: all(m["modality"] in kinds for m in r["media"]),
            kind=lambda r: "video" if any(m["modality"] == "video" for m in r["media"])
            else "image")
        Path(built).rename(check.shards)
    media = check.media
    samples = json.loads((check.shards / "index.json").read_text())["totals"]["samples"]
    if not media["image"]:      # the cases would train text alone, their figures not a VLM's
        raise RuntimeError(f"the shards in {check.shards} hold no image: their build skipped "
                           "every media record (see its report.json)")
    return {"dir": str(check.shards), "samples": samples, "images": media["image"],
            "clips": media["video"],
            **({} if media["video"] or not _missing("av") else {"video": "no PyAV: no clips"})}


def make_checkpoint(check: Check, size: str = "2B") -> dict:
    """Qwen2-VL-SIZE's published config.json with the replica's tokenizer, template and
    processor files, random bf16 weights (seeded) saved by transformers, in a child process
    (this one holds no CUDA memory while the cases run); tiny: the replica."""
    if check.tiny:
        check.checkpoints[size] = REPLICAS[size]
        return {"checkpoint": str(REPLICAS[size])}
    out = check.work / f"qwen2-vl-{size.lower()}"
    if not (out / ".complete").exists():
        out.mkdir(parents=True, exist_ok=True)
        for path in (REPLICA if REPLICA.is_dir() else PROCESSOR_FILES).iterdir():
            if path.is_file() and path.suffix != ".safetensors" and path.name != "config.json" \
                    and not path.name.startswith("."):
                shutil.copy(path, out / path.name)
        subprocess.run([sys.executable, "-c", SAVE_RANDOM, str(PUBLISHED[size]), str(out)],
                       check=True, capture_output=True, text=True, timeout=check.left(240))
        (out / ".complete").touch()
    check.checkpoints[size] = out
    return {"checkpoint": str(out)}


# argv: the published config's folder, the output folder
SAVE_RANDOM = """
import sys, torch, transformers
config = transformers.AutoConfig.from_pretrained(sys.argv[1])
torch.manual_seed(3)
with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
    model = transformers.Qwen2VLForConditionalGeneration._from_config(config, dtype=torch.bfloat16)
model.save_pretrained(sys.argv[2])
"""


def preprocessing(check: Check, seq_length: int) -> Path:
    """The checkpoint's own preprocessing (``preprocessing_for``: its tokenizer, tokens,
    geometry and default pixel budget; tiny: ``TINY_MAX_PIXELS``) with ``seq_length``."""
    import yaml

    from mimo_train.families.registry import preprocessing_for
    path = check.work / f"preprocess_{seq_length}.yaml"
    if not path.exists():           # the same for every size: the same processor files
        config = preprocessing_for(str(check.checkpoints["2B"]))
        if not check.video:
            config["modalities"].pop("video", None)
        if check.tiny:
            for modality in config["modalities"].values():
                modality["max_pixels"] = TINY_MAX_PIXELS
        path.write_text(yaml.safe_dump({**config, "seq_length": seq_length}, sort_keys=False))
    return path


def train(check: Check, name: str, device: str, limit: float, config: dict,
          env: dict[str, str] | None = None, peer: bool = False) -> tuple[int, list[dict], Path]:
    """One one-rank training of ``config`` (written to ``work/NAME.yaml``), by mimo or by the
    peer; its train records."""
    records, log = check.work / f"{name}.jsonl", check.work / f"{name}.log"
    records.unlink(missing_ok=True)
    args = ["--config", str(write_config(check, name, device, config)), "--records", str(records)]
    if peer:
        argv = [str(PEER), *args, "--profile-dir", str(check.work / f"{name}_profile")]
    else:
        argv = ["-m", "mimo_train", *args]
    rc = check.launch(argv, {**child_env(device), **({} if peer else check.compile_env),
                             **(env or {})}, check.left(limit), log)
    found = [json.loads(x) for x in records.read_text().splitlines()] if records.exists() else []
    for record in found:             # a non-finite value is written as null (JSON has no NaN)
        record.update({key: math.nan for key in ("loss", "grad_norm")
                       if key in record and record[key] is None})
    check.bring_back(log, records, check.work / f"{name}.yaml")
    return rc, [r for r in found if "loss" in r], log


def write_config(check: Check, name: str, device: str, config: dict) -> Path:
    """The whole training config of one run, self-contained (absolute paths; no checkpoint:
    a 2B model's is 40 GB of writing); also what the memory prediction and the peer read."""
    import yaml
    data = {"datasets": [str(check.shards)], "preprocess": str(PREPROCESS),
            "num_workers": 0 if check.tiny else 2, "packing": False}
    whole: dict[str, Any] = {
        "data": data, "layout": LAYOUTS[check.video],
        "optimizer": {"lr": 3.0e-3, "min_lr": 3.0e-4, "warmup_steps": 0, "clip_grad": 1.0},
        "train": {"seed": 3, "log_interval": 1, "device": device}}
    for section, values in config.items():       # the sections' keys, replaced one by one
        whole[section] = {**whole.get(section, {}), **values} if isinstance(values, dict) \
            else values
    path = check.work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(whole, sort_keys=False))
    return path


# a torch.compile that failed, in a log: dynamo's wrapper of the backend's error, inductor's
COMPILE_FAILURE = re.compile(r"BackendCompilerFailed|InductorError|torch\._inductor\.exc\.")


def compile_failure(log: Path) -> str | None:
    """The line of ``log`` that says a compile failed, if one does."""
    text = log.read_text(errors="replace") if log.exists() else ""
    found = COMPILE_FAILURE.search(text)
    return text[text.rfind("\n", 0, found.start()) + 1:].splitlines()[0][:400] \
        if found else None


# what mimo-train's message of a rank out of GPU memory says (``runtime.console``)
OUT_OF_MEMORY = "out of GPU memory"


def failure(rc: int, log: Path) -> str:
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    wanted = [x for x in lines if OUT_OF_MEMORY in x] or \
        [x for x in lines if "rror" in x or "refuse" in x or "stopped after" in x]
    return f"rc {rc}: " + (wanted[-1] if wanted else (lines[-1] if lines else "no output"))[:400]


def parity(check: Check, device: str) -> dict:
    runs = {}
    # on the CPU (tiny) the device is the CPU: one run, compared with itself
    sides = [("parity_cpu", "cpu")] if device == "cpu" else \
        [("parity_device", device), ("parity_cpu", "cpu")]
    seconds = {}
    for name, where in sides:
        config = {"model": TINY, "layout": LAYOUTS[False],     # its preprocessing: images
                  "train": {"steps": 2, "precision": "fp32", "global_batch_size": 4,
                            "micro_batch_size": 2}}
        started = time.monotonic()
        rc, records, log = train(check, name, where, 240, config,
                                 env={"NVIDIA_TF32_OVERRIDE": "0"})
        seconds[f"{'cpu' if where == 'cpu' else 'device'}_s"] = round(
            time.monotonic() - started, 1)
        if rc or len(records) != 2:
            return {"error": f"{where}: {failure(rc, log)}", **seconds}
        runs[where] = records
    a, b = runs[device], runs["cpu"]
    return {"device": device, **seconds, "device_losses": [r["loss"] for r in a],
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


def _figures(records: list[dict], rc: int, log: Path, steps: int, profiled: int,
             profile: Path) -> dict:
    """One side's figures: its losses, medians over the steps between the warm-up and the
    profiled ones, the profile summary."""
    result: dict = {"steps": len(records), "losses": [round(r["loss"], 6) for r in records]}
    if rc or len(records) < steps:
        result["error"] = failure(rc, log)
    timed = records[WARM:steps - profiled - 1] or records     # not the lead-in
    for key in ("seconds", "tokens_per_s", "samples_per_s", "tflops_per_gpu", "mfu",
                "memory_mib", "data_wait_s"):
        if (value := _median(timed, key)) is not None:
            result[f"median_{key}"] = value
    # the same steps' trained tokens over their seconds: both sides' ``speedup`` term (the
    # two medians may fall on different steps, whose trained tokens differ)
    if timed and all(isinstance(r.get(key), (int, float)) for r in timed
                     for key in ("seconds", "tokens")):
        result["timed_tokens_per_s"] = sum(r["tokens"] for r in timed) / max(
            sum(r["seconds"] for r in timed), 1e-12)
    # the allocator's peak since the model's build, after each step: the run's peak is the
    # last; the jump after the first step is the optimizer's moments (made at its first update)
    result["memory_mib_by_step"] = [r.get("memory_mib") for r in records]
    # the profiled steps' time against the timed ones': the profiler's own cost on the host,
    # which the profile's idle share includes
    result["seconds_by_step"] = [r.get("seconds") for r in records]
    profiled_seconds = _median(records[steps - profiled:], "seconds")
    if profiled_seconds and result.get("median_seconds"):
        result["profiled_over_timed"] = round(profiled_seconds / result["median_seconds"], 3)
    if records and "attention" in records[-1]:
        result["attention"] = records[-1]["attention"]
    found = sorted(profile.glob("profile_rank*.json")) if profile.is_dir() else []
    result["profile"] = json.loads(found[0].read_text()) if found else None
    # the profiled steps' kernel time (the profiler slows the host, not the kernels) against
    # the timed steps' wall time: what of a step the GPU works, on a GPU
    busy = (result["profile"] or {}).get("busy_ms_per_step")
    if busy and result.get("median_seconds"):
        result["busy_over_timed"] = round(busy / (result["median_seconds"] * 1000), 3)
    return result


def case(check: Check, device: str, work: Workload) -> dict:
    steps, profiled = (TINY_STEPS, TINY_PROFILED) if check.tiny else (STEPS, PROFILED)
    micro = TINY_MICRO[work.packed] if check.tiny else work.micro
    # bf16 is what GPUs train in; on the CPU it is slow and no one's choice: fp32 there
    train_section = {"steps": steps, "precision": "bf16" if device == "cuda" else "fp32",
                     "global_batch_size": 2 * micro, "micro_batch_size": micro,
                     "profile": {"dir": str(check.work / f"{work.name}_profile"),
                                 "start": steps - profiled + 1, "steps": profiled,
                                 # the CPU's map of waits: slow, so the first case's alone
                                 "waits": check.tiny and work.name == WORKLOADS[0].name}}
    # varlen is a CUDA kernel: the CPU run takes SDPA where the GPU run takes the default
    attention = "sdpa" if device == "cpu" and work.attention == "auto" else work.attention
    if work.size not in check.checkpoints:
        make_checkpoint(check, work.size)
    model: dict[str, Any] = {
        "pretrained": str(check.checkpoints[work.size]), "attention": attention,
        "language": {"recompute": work.recompute, "loss_chunk_tokens": work.loss_chunk},
        "encoders": {"image": {"recompute": work.recompute if work.recompute != "none"
                               else work.tower_recompute}}}
    if work.lora:                   # the language model's linear layers; the tower frozen
        model.update(lora={"language": {"rank": 16, "alpha": 32, "targets": ["all-linear"]}},
                     freeze=["image"])
    preprocess = preprocessing(check, work.seq_length)
    config = {"model": model, "data": {"packing": work.packed, "preprocess": str(preprocess)},
              "train": train_section}
    result: dict = {"micro_batch_size": micro, "seq_length": work.seq_length,
                    "packed": work.packed}
    if work.tower_recompute == "auto":
        result["tower_kept"] = tower_kept(check, work, device, config, preprocess)
        model["encoders"]["image"]["recompute"] = "none" if result["tower_kept"]["kept"] \
            else "full"
    result["mimo"] = mimo_side(check, work, device, config, steps, profiled)
    check.summary.setdefault("cases", {})[work.name] = result   # kept should the rest fail
    check.save()
    log = check.work / f"{work.name}.log"

    def again(why: str, into: dict) -> None:
        """mimo's run failed for ``why`` (its figures and log kept as ``into[why]``): once
        more, rather than no figures of mimo's."""
        keep_log(check, log, why)
        into[why] = result.pop("mimo")
        result["mimo"] = mimo_side(check, work, device, config, steps, profiled)

    reason = compile_failure(log) if "error" in result["mimo"] else None
    if reason and not check.compile_env and check.left(150) >= 150:
        # the fused regions' and megatron-core's compiled kernels (inductor, Triton) failed
        # on this machine: this case and the later ones with torch.compile off (the same
        # formulas run as written)
        check.compile_env = {"TORCH_COMPILE_DISABLE": "1"}
        check.summary["compile_failed"] = reason
        again("compile_failed", result)
    if result.get("tower_kept", {}).get("kept") and \
            OUT_OF_MEMORY in result["mimo"].get("error", "") and check.left(150) >= 150:
        # the advisor's prediction was short: the tower recomputed, the peer's run too (the
        # same config)
        model["encoders"]["image"]["recompute"] = "full"
        again("out_of_memory", result["tower_kept"])
    # what mimo's figures ran with
    result["tower_recompute"] = model["encoders"]["image"]["recompute"]
    result["compiled"] = not check.compile_env
    tower = model["encoders"]["image"]["recompute"]
    try:
        result["mimo"]["predicted_mib"], result["mimo"]["predicted_gib"] = predicted_mib(
            check, work.name, train_section, work.packed, preprocess, work.recompute,
            tower if work.recompute == "none" else None)
        # against the whole run's peak: the advisor takes the fullest micro-batch of the
        # same steps (the loader's dry run of the run's seed)
        peak = max((m for m in result["mimo"]["memory_mib_by_step"] if m), default=None)
        if peak:
            result["mimo"]["memory_error"] = round(
                result["mimo"]["predicted_mib"] / peak - 1, 4)
    except Exception as error:          # the figures above stand without it
        result["mimo"]["predicted_mib"] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
    if work.peer and check.left(PEER_S) >= PEER_S:
        rc, records, log = train(check, f"{work.name}_peer", device, 240, config, peer=True)
        result["peer"] = _figures(records, rc, log, steps, profiled,
                                  check.work / f"{work.name}_peer_profile")
        ours, theirs = (result[side].get("timed_tokens_per_s") for side in ("mimo", "peer"))
        if ours and theirs and result["mimo"]["steps"] == result["peer"]["steps"]:
            result["speedup"] = round(ours / theirs, 3)
        if records and result["mimo"]["losses"]:
            result["first_loss_diff"] = round(abs(records[0]["loss"] -
                                                  result["mimo"]["losses"][0]), 6)
    elif work.peer:
        result["peer"] = {"skipped": "out of time"}
    return result


def mimo_side(check: Check, work: Workload, device: str, config: dict, steps: int,
              profiled: int) -> dict:
    """mimo's run of the case: its figures, with nvidia-smi's peak."""
    memory = GpuMemory() if device == "cuda" else None
    with memory or contextlib.nullcontext():
        rc, records, log = train(check, work.name, device, 300, config)
    figures = _figures(records, rc, log, steps, profiled, check.work / f"{work.name}_profile")
    figures["peak_gpu_mib"] = memory.peak if memory else None
    return figures


def keep_log(check: Check, log: Path, why: str) -> None:
    """A copy of a failed run's ``log`` (NAME_WHY.log, beside it and in the logs brought
    back) before the run again overwrites it."""
    if log.exists():
        kept = check.work / f"{log.stem}_{why}.log"
        shutil.copy(log, kept)
        check.bring_back(kept)


def gpu_total_mib() -> int | None:
    """The GPU's memory (nvidia-smi; this process holds no CUDA context)."""
    try:
        text = subprocess.run(["nvidia-smi", "--query-gpu=memory.total",
                               "--format=csv,noheader,nounits"], capture_output=True,
                              text=True, timeout=10).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return int(text[0]) if text and text[0].isdigit() else None


def tower_kept(check: Check, work: Workload, device: str, config: dict,
               preprocess: Path) -> dict:
    """A workload's ``auto`` tower recompute: the tower's activations kept where the layout
    advisor's prediction of the run with them kept is under ``AUTO_SHARE`` of the GPU's
    memory, else recomputed; on the CPU recomputed (no GPU to size against)."""
    capacity = gpu_total_mib() if device == "cuda" else None
    if capacity is None:
        return {"kept": False, "capacity_mib": None}
    kept = {**config, "model": {**config["model"], "encoders": {"image": {"recompute": "none"}}}}
    write_config(check, work.name, device, kept)
    try:
        predicted, _ = predicted_mib(check, work.name, config["train"], work.packed, preprocess,
                                     work.recompute, "none")
    except Exception as error:          # no prediction: recomputed, as before
        return {"kept": False, "capacity_mib": capacity,
                "error": f"{type(error).__name__}: {str(error)[:300]}"}
    return {"kept": predicted <= AUTO_SHARE * capacity, "capacity_mib": capacity,
            "predicted_kept_mib": predicted}


def predicted_mib(check: Check, name: str, train_section: dict, packed: bool,
                  preprocess_path: Path, recompute: str = "none",
                  tower_recompute: str | None = None) -> tuple[float, dict[str, float]]:
    """What ``mimo-inspect plan``'s memory model predicts for the run's rank, in MiB, and its
    parts in GiB (weights, gradients, optimizer state, activations of its fullest
    micro-batch, temporaries): the layout advisor's evaluation of this one layout and
    settings, on the loader's dry run of the run's own seed."""
    from mimo_data.inspect.workload import workload
    from mimo_data.loading.layout import Layout
    from mimo_data.loading.loader import DataSource
    from mimo_data.preprocess.config import PreprocessConfig
    from mimo_train.planning.advisor import GPU, Advisor, Candidate, read_model, read_work
    from mimo_train.planning.memory import Settings
    preprocess = PreprocessConfig.from_yaml(str(preprocess_path))
    work = workload(DataSource([str(check.shards)], preprocess), preprocess,
                    train_section["global_batch_size"], train_section["micro_batch_size"],
                    seed=3, steps=train_section["steps"], packing=packed)
    model = read_model(str(check.work / f"{name}.yaml"), str(preprocess_path), preprocess,
                       {"image": "image", **({"video": "image"} if check.video else {})})
    advisor = Advisor(model, read_work(model, work), GPU("any", 1e6, 1.0, 1.0, 1.0))
    settings = Settings(model.precision, recompute=recompute, tower_recompute=tower_recompute,
                        attention_scores=model.attention_scores,
                        loss_chunk_tokens=model.loss_chunk_tokens,
                        **model.kernel_settings(packed))
    result = advisor.evaluate(Candidate(Layout.parse(LAYOUTS[check.video]), settings))
    (memory,) = result.memory.values()            # one rank: the colocated modules
    return round(result.peak_bytes / 2**20, 1), {
        part: round(gib, 3) for part, gib in memory.gib().items()}


def probes_before(chosen: int) -> int:
    """The index of the chosen case the machine's probes run before, of ``chosen`` cases
    (``chosen``: after the last one): after the first ``PROBE_AFTER`` (the goal's case comes
    first), or after them all when fewer are chosen (none: before parity)."""
    return min(PROBE_AFTER, chosen)


def machine(check: Check, tiny: bool) -> None:
    """The ``env`` and ``kernels`` probes, where ``PROBES_S`` are left; else both skipped (no
    error: started with less, they would stop at the limit and say only that)."""
    if check.left(PROBES_S) < PROBES_S:
        check.summary.update(env={"skipped": "out of time"}, kernels={"skipped": "out of time"})
        check.say("env, kernels: skipped, out of time")
        return
    # a child process on a GPU machine: the parent holds no CUDA context
    check.step("machine", lambda: probe_here() if tiny else probe(
        check, child_env("auto"), PROBES_S))
    found = check.summary.pop("machine")           # an error: both say it
    check.summary.update(env=found.get("env", found), kernels=found.get("kernels", found))


def run(out: Path, tiny: bool, budget_s: float, launch: Launcher = torchrun_launcher,
        shards: Path | None = None, work: Path | None = None,
        names: list[str] | None = None, probes: bool = True) -> dict:
    """Every step in order; returns the summary, also written to ``out/summary.json`` after
    each step (a run stopped from outside keeps what it measured)."""
    out.mkdir(parents=True, exist_ok=True)
    check = Check(out, tiny, budget_s, launch, shards, work)
    check.work.mkdir(parents=True, exist_ok=True)
    save = check.save
    check.step("packages", lambda: install_packages(gpu=not tiny))
    import torch                        # the driver's device count: no CUDA context
    device = "cuda" if torch.cuda.is_available() and not tiny else "cpu"
    check.step("shards", lambda: build_shards(check))         # parity trains on them too
    chosen = [w for w in WORKLOADS if names is None or w.name in names]
    if chosen:
        check.step("checkpoint", lambda: make_checkpoint(check))
    else:                               # only the cases train it (parity: a tiny model)
        check.summary["checkpoint"] = {"skipped": "no cases"}
    save()
    cases: dict[str, dict] = {}
    check.summary["cases"] = cases
    for index in range(len(chosen) + 1):
        if probes and index == probes_before(len(chosen)):
            machine(check, tiny)
            save()
        if index == len(chosen):
            break
        workload = chosen[index]
        if check.left(90) < 90:
            cases[workload.name] = {"skipped": "out of time"}
            continue
        if tiny and workload.name in TINY_SAME:
            same = TINY_SAME[workload.name]
            cases[workload.name] = {"skipped": f"on the CPU the same run as {same}"}
            continue
        check.step(workload.name, functools.partial(case, check, device, workload))
        # a case that failed keeps what it measured before (``case`` saves mimo's side)
        cases[workload.name] = {**cases.get(workload.name, {}),
                                **check.summary.pop(workload.name)}
        save()
    if check.left(PARITY_S) >= PARITY_S:
        check.step("parity", lambda: parity(check, device))
    else:
        check.summary["parity"] = {"skipped": "out of time"}
    save()
    check.say(f"summary in {out / 'summary.json'}")
    return check.summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_check")),
                        help="where summary.json and the logs go (default $OUT, else "
                        "./gpu_check)")
    parser.add_argument("--tiny", action="store_true",
                        help="tiny dims on the CPU (what the suite runs)")
    parser.add_argument("--budget-s", type=float,
                        help="stop starting steps after this many seconds (default 450; "
                        "--tiny: none, a CPU's pace is not a GPU lease's)")
    parser.add_argument("--shards", type=Path, help="use these shards instead of building")
    parser.add_argument("--work", type=Path, help="where the shards, the checkpoint and the "
                        "runs' files go (default OUT/work; elsewhere, the logs are copied "
                        "into OUT/logs)")
    parser.add_argument("--cases", help="only these workloads, comma-separated, or none "
                        "(packages, shards, probes and parity: a short GPU lease's check) "
                        "(default: all, in this order: "
                        f"{', '.join(w.name for w in WORKLOADS)})")
    parser.add_argument("--skip-probes", action="store_true", help="no machine probes")
    args = parser.parse_args(argv)
    names = None if not args.cases else [] if args.cases == "none" else args.cases.split(",")
    unknown = [name for name in names or () if name not in {w.name for w in WORKLOADS}]
    if unknown:
        parser.error(f"--cases: no workload {', '.join(unknown)} (the workloads: "
                     f"{', '.join(w.name for w in WORKLOADS)}; or none)")
    budget = args.budget_s if args.budget_s is not None else math.inf if args.tiny else 450
    summary = run(args.out, args.tiny, budget, shards=args.shards, work=args.work,
                  names=names, probes=not args.skip_probes)
    return 1 if failures(summary) else 0


def failures(summary: dict) -> list[str]:
    """The steps, the cases and the cases' sides that failed (an ``error``; ``skipped`` is
    none)."""
    failed = [k for k, v in summary.items() if isinstance(v, dict) and "error" in v]
    cases = summary.get("cases", {})
    return failed + [k for k, v in cases.items() if "error" in v] + [
        f"{k}.{side}" for k, v in cases.items() for side in ("mimo", "peer")
        if "error" in v.get(side, {})]


if __name__ == "__main__":
    sys.exit(main())
