"""What the tests of the published Qwen3-VL and Qwen3.5 checkpoints share
(tests/test_qwen3_vl.py, tests/test_qwen3_5.py, tests/test_qwen3_5_lora.py; no test module
imports another): the conversations of their runs (``conversations``) and their shards
(``build_shards``), the published checkpoint's preprocessing config for them
(``preprocessing``), a run's settings at lr 0 (``run_setup``), transformers' loss on one of the
micro-batches a parity step trained on (``transformers_loss``), and transformers' processor and
greedy ``generate`` on an export against ``mimo-generate`` (``assert_generate_matches``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mimo_data.modalities.image import normalize_pixels
from mimo_data.modalities.video import normalize_video_pixels

IMAGE_PIXELS = {"min_pixels": 65536, "max_pixels": 131072}     # 64 to 128 tokens an image
VIDEO_PIXELS = {"max_pixels": 4 * 65536}                       # the clip's whole budget


def conversations(corpus: Path, clips: dict) -> list[dict]:
    """A system turn and two images over two turns, text only, a video, an image and a
    video (``clips``: the ``corpus_videos`` fixture)."""
    images = corpus / "images"
    return [
        {"id": "multi-turn", "image": [str(images / "chelsea.jpg"), str(images / "rocket.jpg")],
         "conversations": [
             {"from": "system", "value": "You describe pictures in a few words."},
             {"from": "human", "value": "<image>What animal is this?"},
             {"from": "gpt", "value": "A cat, lying down."},
             {"from": "human", "value": "<image>And here?"},
             {"from": "gpt", "value": "A rocket on its launch pad."}]},
        {"id": "text-only", "conversations": [
            {"from": "human", "value": "What is a tar file?"},
            {"from": "gpt", "value": "An archive of files."}]},
        {"id": "video", "videos": [str(corpus / clips["pan_h264_24"].path)], "conversations": [
            {"from": "human", "value": "<video>\nWhat moves?"},
            {"from": "gpt", "value": "The camera pans across a person."}]},
        {"id": "mixed", "image": [str(images / "chelsea.jpg")],
         "videos": [str(corpus / clips["zoom_mpeg4_10"].path)], "conversations": [
             {"from": "human", "value": "<image> A cat. Now <video> what is shown?"},
             {"from": "gpt", "value": "A cat, closer."}]},
    ]


def build_shards(tmp: Path, corpus: Path, clips: dict, ids: tuple[str, ...] = ()) -> Path:
    """Shards of ``conversations`` (those of ``ids``; all by default) in ``tmp/shards``."""
    from conftest import build_dataset
    records = [c for c in conversations(corpus, clips) if not ids or c["id"] in ids]
    (tmp / "records.json").write_text(json.dumps(records))
    build_dataset([tmp / "records.json"], tmp / "shards")
    return tmp / "shards"


def run_setup(checkpoint: Path, shards: Path, tmp: Path, samples: int, *overrides: str
              ) -> dict:
    """A one-step run of ``checkpoint`` at lr 0 on ``shards``, ``samples`` a step, its
    preprocessing config written in ``tmp``: ``checkpoint``, ``tmp``, ``preprocess`` (its
    path), ``config`` (the ``PreprocessConfig``) and ``common`` (the overrides every layout's
    step takes, ``overrides`` last)."""
    import yaml

    from mimo_data.preprocess.config import PreprocessConfig
    if not (checkpoint / ".complete").is_file():
        pytest.fail(f"{checkpoint} is not built: run tools/setup.sh")
    preprocess = tmp / "preprocess.yaml"
    preprocess.write_text(yaml.safe_dump(preprocessing(checkpoint)))
    common = [f"data.datasets=[{shards}]", f"data.preprocess={preprocess}",
              f"model.pretrained={checkpoint}", f"train.global_batch_size={samples}",
              "train.steps=1", "train.device=cpu", "optimizer.warmup_steps=0",
              "optimizer.lr=0.0", "optimizer.min_lr=0.0", "train.seed=3", *overrides]
    return dict(checkpoint=checkpoint, tmp=tmp, preprocess=preprocess, common=common,
                config=PreprocessConfig.from_yaml(str(preprocess)))


def preprocessing(checkpoint: Path) -> dict:
    """The checkpoint's preprocessing config (``mimo-train --preprocessing-for``), smaller
    images and clips for a fast tower."""
    from mimo_train.families.registry import preprocessing_for
    config = preprocessing_for(str(checkpoint))
    config["modalities"]["image"].update(IMAGE_PIXELS)
    config["modalities"]["video"].update(VIDEO_PIXELS)
    return {**config, "seq_length": 2048}


def transformers_loss(model, batch: dict, config: dict, dtype: torch.dtype
                      ) -> tuple[torch.Tensor, int, tuple[str, ...]]:
    """``model``'s (transformers' Qwen3-VL or Qwen3.5 VLM, or PEFT's around one) mean loss per
    trained token on one padded micro-batch of mimo's loader, that count, and the micro-batch's
    modalities; pixels normalized as ``config`` (the preprocessing config's modalities) says,
    in ``dtype``. Where mimo's ``loss_mask`` is set at t, its label is token t + 1 (checked),
    transformers' label at t + 1 (its loss shifts back)."""
    inputs, labels, modalities = _transformers_inputs(model, batch, config, dtype)
    loss = model(**inputs, labels=labels).loss
    return loss, int((labels[:, 1:] != -100).sum()), modalities


def transformers_balance(model, batches: list[dict], config: dict) -> float:
    """transformers' load-balancing loss (its ``load_balancing_loss_func``, without the
    coefficient) of ``model`` (a mixture of experts) on ``batches`` together: every layer's
    router logits of every micro-batch, their padding left out (fp32)."""
    import importlib
    module = importlib.import_module(type(model).__module__)
    logits: list[list[torch.Tensor]] = []
    masks = []
    for batch in batches:
        inputs, _, _ = _transformers_inputs(model, batch, config, torch.float32)
        with torch.no_grad():
            layers = model(**inputs, output_router_logits=True).router_logits
        logits.append(list(layers))
        masks.append(inputs["attention_mask"].reshape(-1))
    text = model.config.text_config
    by_layer = tuple(torch.cat(rows) for rows in zip(*logits))
    return float(module.load_balancing_loss_func(by_layer, text.num_experts,
                                                 text.num_experts_per_tok, torch.cat(masks)))


def _transformers_inputs(model, batch: dict, config: dict, dtype: torch.dtype
                         ) -> tuple[dict, torch.Tensor, tuple[str, ...]]:
    """``transformers_loss``'s model inputs of ``batch``, its labels and its modalities."""
    image_id, video_id = model.config.image_token_id, model.config.video_token_id
    length = int(batch["attention_mask"].sum(1).max())
    ids = batch["input_ids"][:, :length]
    trained = batch["loss_mask"][:, :length].bool()
    assert torch.equal(batch["labels"][:, :length - 1][trained[:, :-1]],
                       ids[:, 1:][trained[:, :-1]])
    labels = torch.full_like(ids, -100)
    labels[:, 1:][trained[:, :-1]] = ids[:, 1:][trained[:, :-1]]
    inputs = {modality: by_encoder[modality]
              for modality, by_encoder in batch["modality_inputs"].items()}
    extra = {}
    if "image" in inputs:
        extra.update(pixel_values=normalize_pixels(inputs["image"]["pixel_values"],
                                                   config["image"]).to(dtype),
                     image_grid_thw=inputs["image"]["image_grid_thw"])
    if "video" in inputs:
        extra.update(pixel_values_videos=normalize_video_pixels(
            inputs["video"]["pixel_values_videos"], config["video"]).to(dtype),
            video_grid_thw=inputs["video"]["video_grid_thw"])
    return (dict(input_ids=ids, attention_mask=batch["attention_mask"][:, :length].long(),
                 mm_token_type_ids=(ids == image_id).int() + 2 * (ids == video_id).int(),
                 **extra), labels, tuple(sorted(inputs)))


def _processor(checkpoint: Path, config: dict):
    """The published processor, its image and video budgets set as ``config`` (the
    preprocessing config's modalities) says."""
    from transformers import AutoProcessor
    processor = AutoProcessor.from_pretrained(checkpoint)
    image, video = config["image"], config["video"]
    processor.image_processor.size = {"shortest_edge": image.min_pixels,
                                      "longest_edge": image.max_pixels}
    processor.video_processor.size = {"shortest_edge": video.min_pixels,
                                      "longest_edge": video.max_pixels}
    processor.video_processor.fps = video.fps
    return processor


def assert_export_as_published(checkpoint: Path, exported: Path, config: dict) -> None:
    """The import's export: ``config.json`` the published one, key for key and value for value
    (its dtype only in ``text_config``), every weight in its published dtype, and the
    processor transformers loads from it has the run's image and video budgets and frame rate
    (``config``: the preprocessing config's modalities)."""
    import json

    from safetensors.torch import load_file
    from transformers import AutoProcessor
    assert (json.loads((exported / "config.json").read_text())
            == json.loads((checkpoint / "config.json").read_text()))
    published = {k: v.dtype for path in checkpoint.glob("*.safetensors")
                 for k, v in load_file(path).items()}
    ours = {k: v.dtype for path in exported.glob("*.safetensors")
            for k, v in load_file(path).items()}
    assert ours == published
    processor = AutoProcessor.from_pretrained(exported)
    for kind, budget in ((processor.image_processor, config["image"]),
                         (processor.video_processor, config["video"])):
        assert (kind.size["shortest_edge"], kind.size["longest_edge"]) == (
            budget.min_pixels, budget.max_pixels)
    assert processor.video_processor.fps == config["video"].fps


def assert_generate_matches(checkpoint: Path, config: dict, exported: Path, corpus: Path,
                            clips: dict, kind: str) -> None:
    """transformers' processor of ``checkpoint`` (the published chat template, its image or
    video processor: frames sampled over the clip, ``<t seconds>`` before each temporal patch)
    and greedy ``generate`` on ``exported`` give ``mimo-generate``'s prompt and 8 tokens, on an
    image or a video (``kind``) prompt."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText
    from transformers.video_utils import load_video

    from mimo_train.hf.generate import Generator
    processor = _processor(checkpoint, config)
    question = "What is shown?"
    messages = [{"role": "user", "content": [{"type": kind}, {"type": "text",
                                                             "text": question}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if kind == "image":
        path = corpus / "images" / "chelsea.jpg"
        inputs = processor(text=[text], images=[Image.open(path).convert("RGB")],
                           return_tensors="pt")
    else:
        path = corpus / clips["zoom_mpeg4_10"].path
        frames, metadata = load_video(str(path), backend="pyav")
        inputs = processor(text=[text], videos=[frames], video_metadata=[metadata],
                           do_sample_frames=True, return_tensors="pt")
        assert "seconds>" in processor.decode(inputs["input_ids"][0])
    model = AutoModelForImageTextToText.from_pretrained(exported, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = model.generate(**inputs, do_sample=False, max_new_tokens=8)
    generator = Generator(str(exported))
    ours = generator.generate(f"<{kind}>{question}", **{f"{kind}s": [str(path)]},
                              max_new_tokens=8)
    assert ours.prompt_ids == inputs["input_ids"][0].tolist()
    assert ours.token_ids == theirs[0, inputs["input_ids"].size(1):].tolist()
    assert len(ours.token_ids) == 8
    thinks = "enable_thinking" in (processor.chat_template or "")
    assert thinks or "Qwen3.5" not in checkpoint.name         # Qwen3.5's template reads it
    if kind == "image" and thinks:
        # --no-thinking: the template's enable_thinking false (the empty think block an answer
        # without reasoning trains after), as transformers renders it
        text = processor.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=False, enable_thinking=False)
        assert text.endswith("<think>\n\n</think>\n\n"), text[-40:]
        inputs = processor(text=[text], images=[Image.open(path).convert("RGB")],
                           return_tensors="pt")
        with torch.no_grad():
            theirs = model.generate(**inputs, do_sample=False, max_new_tokens=8)
        ours = generator.generate(f"<{kind}>{question}", images=[str(path)], max_new_tokens=8,
                                  thinking=False)
        assert ours.prompt_ids == inputs["input_ids"][0].tolist()
        assert ours.token_ids == theirs[0, inputs["input_ids"].size(1):].tolist()
