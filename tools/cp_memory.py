"""One long clip's peak memory on a language rank: the language model's sequence whole (cp1)
against cut over four context-parallel ranks (cp4), on the CPU, in the same run. Prints, per
model and attention, each layout's tokens, a language rank's RSS before the step and its peaks
above it (MB), the step's seconds and loss, then the ratios cp1 / cp4.

Builds in a temporary folder one long clip (PyAV, a slow pan across a corpus photo: ``--frames``
frames of ``--size`` x ``--size`` at ``--fps``), a one-sample dataset of a LLaVA-style record
with a ``videos`` field (``mimo-shard build``) and the tiny Qwen2.5-VL's preprocessing config
(``preprocessing_for``) sampling every frame (``fps`` the clip's) at its own size, with a
``seq_length`` that holds the whole clip (the micro-batch is padded to it). Then one training
step (fp32, ``train.device=cpu``, nothing frozen) under torchrun twice:
``image=dp1,video;language=cp1`` (2 ranks) and ``image=dp1,video;language=cp4`` (5 ranks), the
tower on its own rank feeding the language ranks, the same weights and batch in both. Each rank
runs this file with ``--rank``: it builds the ``Trainer``, reads the step's micro-batches,
frees what the allocator holds (``malloc_trim``), resets its resident high-water mark
(``/proc/self/clear_refs``: VmHWM back to VmRSS) and runs ``Trainer.train_step``; its
forward-backward peak is VmHWM when the forward and backward passes return minus VmRSS before
the step, its step peak the same after the optimizer's step (the first step allocates Adam's
moments: 2x the weights, which cp does not divide). Large tensors are mapped and unmapped whole
by the allocator, so VmHWM follows them.

The models (``--widths``): ``0``, the tiny Qwen2.5-VL as it is (``assets/models/tiny-qwen2.5-vl``:
language 2 layers x 64, 4 heads), whose activations are tens of MB, about as much as what cp
does not divide (its ratio moves between runs); and a width (default 512: ``widened``, the tiny
checkpoint with a random ``--layers`` x width language model of ``--heads`` heads, its tower's
merger writing that width), whose layers' activations set its peak. Only the trained tokens
(the answer's ~16) go through the output layer (``mcore.language_loss``).

Printed: per model, backend and layout the micro-batch's tokens (real ones, video ones), a
language rank's RSS before the step (weights, start-up) and its peaks above it (the largest over
the layout's language ranks), the step's seconds and the loss of each run (they agree to
~1e-6); then the ratios cp1 / cp4 of the forward-backward peak and of the step's, and the part
of a cp4 rank's peak that did not divide (cp4 - cp1 / 4: weight-sized gradients, the whole
sequence's embeddings and the tower's rows before the cut). ``--attention``: ``sdpa`` (causal,
no score matrix kept) and/or ``local`` (megatron-core's, ``[b, heads, s, s]`` scores: under cp
each rank holds its heads' share of them, over the whole sequence). ``--loss-chunk`` sets
``model.language.loss_chunk_tokens`` (default 0: the trained tokens' logits at once). Nothing is
asserted.

    python tools/cp_memory.py [--frames 128] [--size 224] [--fps 8] [--widths 0 512] \\
        [--layers 4] [--heads 8] [--attention sdpa local] [--loss-chunk 0] [--cp 4]

Defaults: 128 frames of 224 x 224 are 64 temporal patches of 8 x 8 merged patches: 4,096 video
tokens; about 3 minutes on 2 cores. Needs the assets of ``make test``'s set-up (tools/setup.sh).
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mimo_data.process_memory import status_bytes

REPO = Path(__file__).resolve().parents[1]
CHECKPOINT = REPO / "assets" / "models" / "tiny-qwen2.5-vl"
PHOTO = REPO / "assets" / "corpus" / "images" / "astronaut.jpg"
MB = 2 ** 20


# ----------------------------------------------------------------------------- one rank


def rank_main(out: str, overrides: list[str]) -> None:
    """One rank of a run (under torchrun): one training step, measured (module docstring);
    writes ``out/rank_R.json``."""
    import torch
    import torch.distributed as dist

    from mimo_train.config import TrainConfig
    from mimo_train.plan import resolve
    from mimo_train.training.trainer import Trainer

    trainer = Trainer(resolve(TrainConfig.load(None, overrides)))
    iterator = trainer.batches(trainer.loader)
    batches = None
    if iterator is not None:                    # the step's micro-batches, read before it
        batches = list(itertools.islice(iterator, trainer.micro_batches))
        iterator = iter(batches)
    language = "language" in trainer.modules
    video_id = json.loads((CHECKPOINT / "config.json").read_text())["video_token_id"]
    tokens = video = real = None
    if language and batches:
        ids = batches[0]["input_ids"]
        tokens, video = int(ids.numel()), int((ids == video_id).sum())
        real = int(batches[0]["attention_mask"].sum())
    marks: dict[str, int] = {}
    forward_backward = trainer.forward_backward

    def measured(*args, **kwargs):
        result = forward_backward(*args, **kwargs)
        marks["forward_backward"] = status_bytes("VmHWM")["VmHWM"]
        return result
    trainer.forward_backward = measured        # type: ignore[method-assign]
    dist.barrier()
    import gc
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:      # VmHWM := VmRSS
        f.write("5")
    before = status_bytes("VmRSS")["VmRSS"]
    started = time.perf_counter()
    values, _, _ = trainer.train_step(iterator)
    assert values is not None                # the first step: no step skipped before it
    seconds = time.perf_counter() - started
    peak = status_bytes("VmHWM")["VmHWM"]
    sums = values.readings.read()["sums"]
    result = {"rank": dist.get_rank(), "modules": sorted(trainer.modules),
              "language": language, "tokens": tokens, "video_tokens": video,
              "real_tokens": real,
              "rss_before": before, "forward_backward": marks["forward_backward"] - before,
              "step": peak - before, "seconds": seconds, "sums": sums,
              "torch_threads": torch.get_num_threads()}
    os.makedirs(out, exist_ok=True)
    Path(out, f"rank_{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- the inputs


def make_clip(path: Path, frames: int, size: int, fps: int) -> None:
    """A slow pan across ``PHOTO`` (enlarged so the pan has room): ``frames`` frames of
    ``size`` x ``size``, mpeg4 in mp4, one encoder thread."""
    import av
    import numpy as np
    from PIL import Image

    with Image.open(PHOTO) as opened:
        photo = opened.convert("RGB")
    scale = max(1.0, 3 * size / photo.width, 1.5 * size / photo.height)
    photo = photo.resize((int(photo.width * scale), int(photo.height * scale)),
                         Image.Resampling.BILINEAR)
    span = photo.width - size
    with av.open(str(path), "w", format="mp4", options={"fflags": "+bitexact"}) as container:
        stream = container.add_stream("mpeg4", rate=fps)
        assert isinstance(stream, av.VideoStream)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        stream.codec_context.thread_count = 1
        for i in range(frames):
            x = int(i * span / max(1, frames - 1))
            picture = np.asarray(photo.crop((x, 0, x + size, size)))
            container.mux(stream.encode(av.VideoFrame.from_ndarray(picture, format="rgb24")))
        container.mux(stream.encode())


def widened(out: Path, width: int, layers: int, heads: int) -> Path:
    """The tiny Qwen2.5-VL with a wider, deeper language model (``width``, ``layers``,
    ``heads`` query heads, half as many key-value groups, an FFN of 3 x ``width``, M-RoPE
    sections in Qwen2.5-VL's proportions 2 : 3 : 3), its tower's merger writing ``width``;
    random weights (seeded), saved in bf16 as the tiny one, its tokenizer and processor files
    copied."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(CHECKPOINT)
    text = config.text_config
    pairs = width // heads // 2
    text.hidden_size, text.num_hidden_layers = width, layers
    text.num_attention_heads, text.num_key_value_heads = heads, max(1, heads // 2)
    text.intermediate_size = 3 * width
    text.layer_types = ["full_attention"] * layers
    text.rope_parameters["mrope_section"] = [pairs - 2 * (3 * pairs // 8), 3 * pairs // 8,
                                             3 * pairs // 8]
    config.vision_config.out_hidden_size = width
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    model.to(torch.bfloat16).save_pretrained(out)
    for name in ("chat_template.jinja", "tokenizer.json", "tokenizer_config.json",
                 "preprocessor_config.json", "generation_config.json"):
        shutil.copy(CHECKPOINT / name, out / name)
    return out


def make_inputs(tmp: Path, frames: int, size: int, fps: int) -> tuple[Path, Path]:
    """The clip, its one-sample dataset and the preprocessing config; returns (shards,
    preprocess YAML)."""
    import yaml

    from mimo_train.families.registry import preprocessing_for

    clip = tmp / "long.mp4"
    make_clip(clip, frames, size, fps)
    record = {"id": "long-clip", "videos": [str(clip)], "conversations": [
        {"from": "human", "value": "<video>\nWhat does the camera show as it moves?"},
        {"from": "gpt", "value": "It pans slowly across a photo of an astronaut, from left "
                                 "to right."}]}
    (tmp / "records.json").write_text(json.dumps([record]))
    shard = Path(sys.executable).with_name("mimo-shard")
    subprocess.run([str(shard), "build", str(tmp / "records.json"), "--output",
                    str(tmp / "shards"), "--workers", "0", "--no-progress"], check=True,
                   capture_output=True)
    data = preprocessing_for(str(CHECKPOINT))
    pixels = size * size
    data["modalities"]["video"].update(fps=float(fps), max_frames=max(768, frames),
                                       min_pixels=min(3136, pixels),
                                       max_pixels=max(pixels, 3136))
    tokens = (frames // 2) * (size // 28) ** 2
    data["seq_length"] = (tokens + 64 + 63) // 64 * 64      # the whole clip and its text
    preprocess = tmp / "preprocess.yaml"
    preprocess.write_text(yaml.safe_dump(data))
    return tmp / "shards", preprocess


# ----------------------------------------------------------------------------- the runs


def run(tmp: Path, name: str, cp: int, common: list[str]) -> list[dict]:
    """One step under ``image=dp1,video;language=cp<cp>`` (1 + cp ranks) with torchrun; the
    ranks' results."""
    out = tmp / name
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                       os.environ.get("PYTHONPATH")]))}
    command = [str(torchrun), "--standalone", f"--nproc-per-node={1 + cp}",
               os.path.abspath(__file__), "--rank", str(out),
               f"layout=image=dp1,video;language=cp{cp}", *common,
               f"checkpoint.dir={tmp / name}-checkpoints"]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{name} failed ({done.returncode}):\n{done.stdout[-3000:]}"
                 f"{done.stderr[-6000:]}")
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank_*.json"))]


def summary(ranks: list[dict]) -> dict:
    """The layout's language ranks: the largest peaks, the sequence, the loss."""
    language = [r for r in ranks if r["language"]]
    loss_sum, trained = language[0]["sums"][:2]
    return {"tokens": language[0]["tokens"], "video": language[0]["video_tokens"],
            "real": language[0]["real_tokens"],
            "ranks": len(language),
            "rss": max(r["rss_before"] for r in language),
            "fb": max(r["forward_backward"] for r in language),
            "step": max(r["step"] for r in language),
            "each": [r["forward_backward"] for r in language],
            "seconds": max(r["seconds"] for r in ranks),
            "loss": loss_sum / trained}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", help=argparse.SUPPRESS)
    parser.add_argument("--frames", type=int, default=128)
    parser.add_argument("--size", type=int, default=224, help="frame side, a multiple of 28")
    parser.add_argument("--fps", type=int, default=8)
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--attention", nargs="+", default=["sdpa"],
                        choices=("sdpa", "local"))
    parser.add_argument("--loss-chunk", type=int, default=0)
    parser.add_argument("--widths", type=int, nargs="+", default=[0, 512],
                        help="language widths to run; 0: the tiny checkpoint as it is")
    parser.add_argument("--layers", type=int, default=4, help="of a widened language model")
    parser.add_argument("--heads", type=int, default=8, help="of a widened language model")
    args, rest = parser.parse_known_args()
    if args.rank:
        rank_main(args.rank, rest)
        return
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="cp-memory-") as folder:
        tmp = Path(folder)
        shards, preprocess = make_inputs(tmp, args.frames, args.size, args.fps)
        common = [f"data.datasets=[{shards}]", f"data.preprocess={preprocess}",
                  "train.global_batch_size=1", "train.micro_batch_size=1", "train.steps=1",
                  "train.device=cpu", "optimizer.warmup_steps=0", "train.seed=3",
                  "model.freeze=[]", "data.packing=false",
                  f"model.language.loss_chunk_tokens={args.loss_chunk}"]
        print(f"one clip: {args.frames} frames of {args.size} x {args.size} at {args.fps} fps; "
              f"fp32; loss chunk {args.loss_chunk or 'none (the trained tokens at once)'}; "
              "peaks above the rank's RSS before the step, the largest over the layout's "
              "language ranks",
              flush=True)
        print(f"{'language':<22} {'attention':<9} {'layout':<31} {'tokens':>6} {'real':>6} "
              f"{'video':>6} {'RSS MB':>7} {'fwd+bwd MB':>10} {'step MB':>8} {'s':>5} {'loss':>12}")
        for width in args.widths:
            if width:
                checkpoint = widened(tmp / f"wide-{width}", width, args.layers, args.heads)
                label = f"{args.layers} x {width}, {args.heads} heads"
            else:
                checkpoint, label = CHECKPOINT, "tiny: 2 x 64, 4 heads"
            for attention in args.attention:
                rows = {}
                for cp in (1, args.cp):
                    name = f"{width}-{attention}-cp{cp}"
                    rows[cp] = summary(run(tmp, name, cp, [
                        *common, f"model.pretrained={checkpoint}",
                        f"model.attention={attention}"]))
                    r = rows[cp]
                    print(f"{label:<22} {attention:<9} "
                          f"{f'image=dp1,video;language=cp{cp}':<31} {r['tokens']:>6} "
                          f"{r['real']:>6} {r['video']:>6} {r['rss'] / MB:>7.0f} "
                          f"{r['fb'] / MB:>10.1f} {r['step'] / MB:>8.1f} "
                          f"{r['seconds']:>5.1f} {r['loss']:>12.8f}",
                          flush=True)
                one, many = rows[1], rows[args.cp]
                print(f"{label:<22} {attention:<9} cp1 / cp{args.cp}: fwd+bwd "
                      f"{one['fb'] / many['fb']:.2f}x, step {one['step'] / many['step']:.2f}x; "
                      f"undivided (cp{args.cp} - cp1 / {args.cp}) "
                      f"{(many['fb'] - one['fb'] / args.cp) / MB:.1f} MB; cp{args.cp} ranks' "
                      f"fwd+bwd MB {', '.join(f'{x / MB:.1f}' for x in many['each'])}; loss "
                      f"difference {abs(one['loss'] - many['loss']):.1e}", flush=True)
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
