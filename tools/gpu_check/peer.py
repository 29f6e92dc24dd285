"""The GPU check's peer: transformers' own model class, trained on mimo's batches the way a
transformers-based fine-tuning framework trains it.

    python tools/gpu_check/peer.py --config CASE.yaml --records PEER.jsonl [--profile-dir D]

``CASE.yaml`` is the mimo training config of the same case (``model.pretrained``, data,
batch sizes, seed, precision, recompute): the peer loads the same checkpoint with
``AutoModelForImageTextToText`` and takes every micro-batch from mimo's own loader for
rank 0 of the same colocated layout, so both train the same samples in the same order on the
same weights. What it does is what such frameworks do with a transformers model:

- a frozen tower (``model.freeze: [image]``) frozen; ``model.lora.language``: PEFT's LoRA
  with the same rank and alpha on the language model's linear layers (``with_lora``);
- weights in the run's dtype (bf16 on a GPU: no fp32 master copy, which favours the peer),
  ``torch.optim.AdamW(fused=True)`` with the config's betas, weight decay and learning rate,
  gradients clipped to ``optimizer.clip_grad`` with ``clip_grad_norm_``; the learning rate on
  transformers' ``get_cosine_with_min_lr_schedule_with_warmup`` (the Trainer's
  ``cosine_with_min_lr``), which is mimo's schedule: a linear warmup from 0 over
  ``optimizer.warmup_steps`` (at most ``train.steps - 1``, as mimo clamps it), then a cosine to
  ``optimizer.min_lr`` at ``train.steps``, so the two sides' losses compare step by step;
- the strongest attention transformers takes here: ``flash_attention_2`` where flash-attn is
  installed; else, for a packed row on a GPU, torch's own varlen flash kernels registered
  with transformers' ``AttentionInterface`` (``PACKED_VARLEN``: the samples' boundaries read
  from their text positions, as transformers' flash-attn path reads them; the kernels mimo's
  ``varlen`` attention runs, so the speedup is not a kernel's); else ``sdpa``; a packed
  micro-batch goes as one row with per-sample text positions (under ``sdpa`` transformers
  then masks each sample to itself) and mimo's per-sample M-RoPE
  positions, a padded one with its attention mask and mimo's M-RoPE positions (the text after
  a clip as the checkpoint was trained: transformers 5.3+'s own rule starts it earlier,
  ``families.qwen2_vl``); images and clips as transformers'
  processor makes them (``pixel_values``, ``pixel_values_videos``, their grids);
- no key-value cache (``use_cache=False``, as training frameworks set it): with one, which
  transformers makes by default even in training, it drops the per-sample mask of a packed
  row without a word and every sample attends to the ones before it in the row;
- the loss as transformers computes it from ``labels=`` (its shift, fp32 logits), each
  micro-batch's token sum divided by the step's trained tokens (``num_items_in_batch``, as
  the transformers Trainer accumulates), activation checkpointing
  (``gradient_checkpointing_enable``) where the case recomputes.

Each step's wall time ends with the device synchronized (reading the loss, as every
framework's logging does). Records: one JSON line per step with ``step, loss, tokens,
seconds, tokens_per_s, samples_per_s, images, clips, memory_mib``; ``--profile-dir``: the same
``mimo_train.runtime.profile`` summary mimo writes.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import itertools
import json
import time
from pathlib import Path

import torch
import yaml

from mimo_data.loading.loader import build_loader
from mimo_data.modalities.image import normalize_pixels
from mimo_data.modalities.video import normalize_video_pixels
from mimo_data.preprocess.config import PreprocessConfig
from mimo_train.config import ProfileConfig, TrainConfig
from mimo_train.runtime.profile import Profile, mark_phase
from mimo_train.training.step import kept_length


# torch's own varlen flash kernels under transformers' attention interface: what the
# flash-attn package (which the GPU image lacks) gives a packing framework; "flash" in the
# name: transformers then hands the towers' boundaries over, and makes no mask for the rows
PACKED_VARLEN = "peer_flash_varlen"


def attention_choice(device: torch.device, packed: bool) -> str:
    """The strongest attention transformers takes on this machine: flash-attn's varlen
    kernels where installed (what packing frameworks ask for), else, for a packed row on a
    GPU, the same kind of kernel from torch (``PACKED_VARLEN``: what mimo's varlen
    attention runs too), else SDPA (a packed row: under a block-diagonal mask)."""
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    if device.type == "cuda" and packed and \
            importlib.util.find_spec("torch.nn.attention.varlen") is not None:
        return PACKED_VARLEN
    return "sdpa"


# the text positions last seen and their samples' boundaries: every layer of a forward gets
# the same positions, so the boundaries are read from the device once a forward
_bounds: dict = {}


def packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask: torch.Tensor | None,
                     position_ids: torch.Tensor | None = None, sliding_window=None, **kwargs):
    """``PACKED_VARLEN``: transformers' attention-function contract, all of a packed row's
    samples in one varlen call. A tower's call gives its items' boundaries; the language
    model's gives its text positions, each sample's from 0, which are read into boundaries
    as transformers' flash-attn path reads them (``prepare_fa_kwargs_from_position_ids``),
    causal as the module says."""
    from mimo_train.model.tower_attention import varlen_attention
    if kwargs.get("cu_seq_lens_q") is None:
        if attention_mask is not None or position_ids is None or sliding_window is not None:
            raise ValueError(f"{PACKED_VARLEN} takes a packed row by its text positions, "
                             "with no mask nor sliding window")
        if _bounds.get("positions") is not position_ids:
            from transformers.modeling_flash_attention_utils import (
                prepare_fa_kwargs_from_position_ids)
            (bounds, _), (longest, _) = prepare_fa_kwargs_from_position_ids(position_ids)
            _bounds.update(positions=position_ids, bounds=bounds, longest=int(longest))
        kwargs.update(cu_seq_lens_q=_bounds["bounds"], cu_seq_lens_k=_bounds["bounds"],
                      max_length_q=_bounds["longest"], max_length_k=_bounds["longest"],
                      is_causal=module.is_causal)
    return varlen_attention(module, query, key, value, None, **kwargs)


def hf_inputs(batch: dict, preprocess: PreprocessConfig, token_ids: dict[str, int], total: int,
              device: torch.device, token_types: bool = True) -> dict:
    """One of mimo's micro-batches as transformers' model takes it (``labels=`` shifted by
    the model itself, so mimo's target at t is transformers' label at t + 1); ``token_ids``:
    the model's image and video placeholder ids."""
    packing = batch.get("packing_kwargs")
    length = kept_length(batch)
    ids = batch["input_ids"][:, :length]
    trained = batch["loss_mask"][:, :length].bool()
    labels = torch.full_like(ids, -100)
    labels[:, 1:][trained[:, :-1]] = batch["labels"][:, :length][:, :-1][trained[:, :-1]]
    inputs = {"input_ids": ids, "labels": labels}
    if token_types:             # the transformers versions that take them (5.2x): 1 image, 2 video
        inputs["mm_token_type_ids"] = (ids == token_ids["image"]).int() + \
            2 * (ids == token_ids["video"]).int()
    if packing is None:     # mimo's positions too: the published rule after a clip, which
        # transformers 5.3+'s own get_rope_index does not follow (families.qwen2_vl)
        inputs["attention_mask"] = batch["attention_mask"][:, :length].long()
        inputs["position_ids"] = batch["position_ids"][:, :, :length]
    else:           # per-sample text positions first: transformers masks each sample alone
        bounds = packing["cu_seqlens_q"].tolist()
        text = torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:])])
        inputs["position_ids"] = torch.cat([text.view(1, 1, -1),
                                            batch["position_ids"][:, :, :length]])
    media = batch.get("modality_inputs") or {}
    images = media.get("image", {}).get("image")
    if images is not None:
        inputs["pixel_values"] = normalize_pixels(images["pixel_values"].to(device),
                                                  preprocess.modalities["image"])
        inputs["image_grid_thw"] = images["image_grid_thw"]
    clips = media.get("video", {}).get("video")
    if clips is not None:
        inputs["pixel_values_videos"] = normalize_video_pixels(
            clips["pixel_values_videos"].to(device), preprocess.modalities["video"])
        inputs["video_grid_thw"] = clips["video_grid_thw"]
    moved = {k: v.to(device, non_blocking=True) for k, v in inputs.items()}
    moved["num_items_in_batch"] = torch.tensor(total, device=device)
    return moved


# the language model's linear layers, as mimo's all-linear takes them (not the output layer)
LANGUAGE_LINEAR = (r".*language_model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|"
                   r"mlp\.(gate|up|down)_proj)")


def with_lora(model, lora: dict):
    """PEFT's LoRA on the language model's linear layers with mimo's rank and alpha (PEFT
    adapts q, k and v apart where mimo adapts their fused projection: the same matmuls' shapes
    but three adapters); every other weight frozen, as PEFT does."""
    from peft import LoraConfig, get_peft_model
    targets = lora.get("targets", ["all-linear"])
    if targets != ["all-linear"]:
        raise ValueError(f"the peer takes LoRA targets [all-linear] only, not {targets}")
    return get_peft_model(model, LoraConfig(
        r=lora.get("rank", 8), lora_alpha=lora.get("alpha", 16),
        lora_dropout=lora.get("dropout", 0.0), target_modules=LANGUAGE_LINEAR))


def optimizer_and_schedule(parameters, cfg: TrainConfig, fused: bool):
    """torch's AdamW with mimo's settings of ``cfg`` (the case's config, read as mimo reads
    it) and transformers' cosine-with-min-lr schedule, which is megatron-core's warmup from 0
    and cosine to ``min_lr``: mimo's learning rate every step."""
    from transformers import get_cosine_with_min_lr_schedule_with_warmup
    opt = cfg.optimizer
    optimizer = torch.optim.AdamW(parameters, lr=opt.lr, betas=(opt.adam_beta1, opt.adam_beta2),
                                  weight_decay=opt.weight_decay, fused=fused)
    return optimizer, get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, cfg.warmup_steps()[0], cfg.train.steps, min_lr=opt.min_lr)


def train(config_path: Path, records: Path, profile_dir: Path | None = None) -> list[dict]:
    """Train the case of ``config_path`` as the peer; returns (and writes) its records."""
    from transformers import AutoModelForImageTextToText

    config = yaml.safe_load(config_path.read_text())
    cfg = TrainConfig.load(str(config_path))
    data, run, model_cfg = config["data"], config["train"], config["model"]
    device = torch.device("cuda" if run.get("device") != "cpu" and torch.cuda.is_available()
                          else "cpu")
    dtype = torch.bfloat16 if run.get("precision") == "bf16" else torch.float32
    torch.manual_seed(run.get("seed", 1))
    attention = attention_choice(device, data.get("packing", False))
    model = AutoModelForImageTextToText.from_pretrained(
        model_cfg["pretrained"], dtype=dtype,
        attn_implementation="sdpa" if attention == PACKED_VARLEN else attention).to(device)
    if attention == PACKED_VARLEN:
        from mimo_train.model.tower_attention import serve_attention
        serve_attention(model, PACKED_VARLEN, packed_attention)
    if "image" in model_cfg.get("freeze", []):
        model.model.visual.requires_grad_(False)
    lora = (model_cfg.get("lora") or {}).get("language")
    if lora:
        model = with_lora(model, lora)
    model.train()
    if model_cfg.get("language", {}).get("recompute", "none") != "none":
        model.gradient_checkpointing_enable()
    elif model_cfg.get("encoders", {}).get("image", {}).get("recompute", "none") != "none":
        tower = model.get_base_model().model.visual if lora else model.model.visual
        tower.gradient_checkpointing_enable()                       # the tower alone
    optimizer, schedule = optimizer_and_schedule(
        [p for p in model.parameters() if p.requires_grad], cfg, fused=device.type == "cuda")
    preprocess = PreprocessConfig.from_yaml(str(data["preprocess"]))
    gbs, mbs = run["global_batch_size"], run["micro_batch_size"]
    # mimo's case's layout: one rank, all data
    loader = build_loader(data["datasets"], preprocess, config["layout"], 0, 1, gbs, mbs,
                          run.get("seed", 1), num_workers=data.get("num_workers", 0),
                          packing=data.get("packing", False))
    assert loader is not None
    stream = (batch for _ in itertools.count() for batch, _ in loader)     # across epochs
    window = run.get("profile") or {}          # the steps mimo's run profiles, if it does
    profile = Profile(ProfileConfig(str(profile_dir), window.get("start", 3),
                                    window.get("steps", 2)) if profile_dir else None, 0, device)
    token_ids = {"image": model.config.image_token_id, "video": model.config.video_token_id}
    base = model.get_base_model() if lora else model
    token_types = "mm_token_type_ids" in inspect.signature(base.forward).parameters
    found: list[dict] = []
    records.parent.mkdir(parents=True, exist_ok=True)
    with open(records, "w") as out, profile:
        for step in range(1, run["steps"] + 1):
            profile.before(step)
            started = time.perf_counter()
            with mark_phase("data"):
                batches = [next(stream) for _ in range(gbs // mbs)]
                total = int(sum(int(b["loss_mask"].sum()) for b in batches))
            loss = torch.zeros((), device=device)
            media = {"images": 0, "clips": 0}
            for batch in batches:
                with mark_phase("data"):
                    inputs = hf_inputs(batch, preprocess, token_ids, total, device,
                                       token_types)
                for kind, grids in (("images", "image_grid_thw"), ("clips", "video_grid_thw")):
                    media[kind] += len(inputs.get(grids, ()))
                with mark_phase("forward"):
                    part = model(**inputs, use_cache=False).loss
                with mark_phase("backward"):
                    part.backward()
                loss += part.detach()
            with mark_phase("optimizer"):
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optimizer.clip_grad)
                optimizer.step()
                schedule.step()
            optimizer.zero_grad(set_to_none=True)
            value = float(loss)                          # the host waits for the step here
            seconds = time.perf_counter() - started
            profile.after(step)
            record = {"step": step, "loss": value, "tokens": total, "seconds": seconds,
                      "tokens_per_s": total / seconds, "samples_per_s": gbs / seconds,
                      "attention": attention, **media,
                      "memory_mib": (torch.cuda.max_memory_allocated(device) / 2**20
                                     if device.type == "cuda" else None)}
            out.write(json.dumps(record) + "\n")
            out.flush()
            found.append(record)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--records", type=Path, required=True)
    parser.add_argument("--profile-dir", type=Path)
    args = parser.parse_args(argv)
    train(args.config, args.records, args.profile_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
