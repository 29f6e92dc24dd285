"""What the tests of whole vision-language checkpoints share (tests/test_vlm.py,
tests/test_vlm_families.py, tests/test_vlm_video.py, tests/test_video_modality.py); no test
module imports another:

- ``logits``: the model mimo builds, forward on its loader's first micro-batch
  (``tests/jobs/vlm_logits.py`` on one forked rank), and ``assert_packed_logits``: packed rows
  against transformers' padded ones;
- ``colocated``: in one job, those logits and the colocated step on the same micro-batch (its
  loss and gradients, as ``runs.step`` gives them), the imported model saved first (the
  weights every other layout starts from);
- ``colocated_step`` / ``layout_step``: one step of ``tests/jobs/train_parity.py`` colocated
  (the imported model saved first) and under another layout (``runs.step``), compared with
  ``runs.compare``;
- ``finetune``: a shipped fine-tune config on the test shards (``runs.train``);
- ``transformers_logits``: a transformers model's logits on a padded image micro-batch of
  mimo's loader;
- ``weights``: an export's tensors; ``turns``: ShareGPT turns; ``video_processor``:
  transformers' Qwen2-VL video processor for a ``VideoConfig``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from support.launch import TESTS, Ranks
from support.runs import merged, step, train

LOGITS_RUNNER = TESTS / "jobs" / "vlm_logits.py"
TOLERANCE = 1e-4                # fp32 logits of mimo's model against transformers' class
SAMPLES = 4                     # the samples of the image shards (one micro-batch)


def turns(*texts: str) -> list[dict]:
    """ShareGPT turns, the human's first."""
    return [{"from": "human" if i % 2 == 0 else "gpt", "value": text}
            for i, text in enumerate(texts)]


def logits(ranks: Ranks, tmp: Path, name: str, common: list[str], *overrides: str,
           layout: str = "language=dp1;image=dp1,off0", micro_batch: int = SAMPLES) -> dict:
    """``tests/jobs/vlm_logits.py`` on one rank, colocated: its ``logits.pt`` (logits, batch,
    keys)."""
    out = tmp / name
    ranks.run(1, [LOGITS_RUNNER, out, f"layout={layout}",
                  f"train.micro_batch_size={micro_batch}", f"checkpoint.dir={tmp / name}-ckpt",
                  *common, *overrides], tmp / f"{name}-logs").check()
    return torch.load(out / "logits.pt", weights_only=False)


def assert_packed_logits(ranks: Ranks, tmp: Path, common: list[str], batch: dict,
                         expected: torch.Tensor, mask: torch.Tensor) -> None:
    """Packed (attention sdpa): the samples of the padded ``batch`` back to back in one row, in
    the packed order; each sample's logits are transformers' ``expected`` row."""
    packed = logits(ranks, tmp, "packed", common, "data.packing=true", "model.attention=sdpa")
    bounds = packed["batch"]["packing_kwargs"]["cu_seqlens_q"].tolist()
    lengths = mask.sum(1).tolist()
    vocab = expected.size(-1)
    assert len(bounds) == SAMPLES + 1
    for start, end in zip(bounds, bounds[1:]):
        ids = packed["batch"]["input_ids"][0, start:end]
        (row,) = [r for r in range(SAMPLES) if lengths[r] == end - start
                  and torch.equal(batch["input_ids"][r, :end - start], ids)]
        difference = packed["logits"][0, start:end, :vocab] - expected[row, :end - start]
        assert difference.abs().max() <= TOLERANCE, row


def colocated(ranks: Ranks, tmp: Path, layout: str, common: list[str],
              micro_batch: int = SAMPLES) -> tuple[dict, dict, str]:
    """``logits``' output (colocated, ``layout``), the colocated step's loss and gradients on
    that micro-batch (``tmp/colocated``, as ``colocated_step``'s) and the imported model's
    checkpoint (step 0: ``tmp/init``), from one job: the one-rank Trainer is built once."""
    out = tmp / "colocated"
    ranks.run(1, [LOGITS_RUNNER, out, "--save-init", tmp / "init", "--step", f"layout={layout}",
                  f"train.micro_batch_size={micro_batch}", *common], out / "logs").check()
    return (torch.load(out / "logits.pt", weights_only=False), merged(out),
            str(tmp / "init" / "step_0000000"))


def colocated_step(ranks: Ranks, tmp: Path, layout: str, common: list[str],
                   micro_batch: int = SAMPLES) -> tuple[dict, str]:
    """One colocated step's loss and gradients (``tmp/colocated``), and the imported model's
    checkpoint (step 0, before any training: ``tmp/init``) every other layout starts from."""
    reference = step(ranks, tmp / "colocated", 1, f"layout={layout}",
                     f"train.micro_batch_size={micro_batch}", *common, save_init=tmp / "init")
    return reference, str(tmp / "init" / "step_0000000")


def layout_step(ranks: Ranks, tmp: Path, name: str, nproc: int, layout: str, micro_batch: int,
                common: list[str], init: str) -> dict:
    """One step under ``layout`` on ``nproc`` ranks (``tmp/name``) from the weights ``init``."""
    return step(ranks, tmp / name, nproc, f"layout={layout}",
                f"train.micro_batch_size={micro_batch}", f"model.init_from={init}", *common)


def transformers_logits(model, batch: dict, preprocess: Path
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``model``'s (a transformers VLM's, or PEFT's around one) logits on a padded image
    micro-batch of mimo's loader, cut to its longest sample, and its real-token mask; pixels
    normalized as the preprocessing config says, Qwen's grids and token types where given."""
    from mimo_data.modalities.image import normalize_pixels
    from mimo_data.preprocess.config import PreprocessConfig
    length = int(batch["attention_mask"].sum(1).max())
    ids, mask = batch["input_ids"][:, :length], batch["attention_mask"][:, :length]
    image = batch["modality_inputs"]["image"]["image"]
    extra = {"pixel_values": normalize_pixels(
        image["pixel_values"], PreprocessConfig.from_yaml(str(preprocess)).modalities["image"])}
    if "image_grid_thw" in image:
        extra.update(image_grid_thw=image["image_grid_thw"],
                     mm_token_type_ids=(ids == model.config.image_token_id).int())
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask.long(), **extra).logits, mask.bool()


def weights(directory: Path) -> dict:
    """Every tensor of the ``*.safetensors`` files of a directory, by name."""
    from safetensors.torch import load_file
    found: dict = {}
    for path in sorted(directory.glob("*.safetensors")):
        found.update(load_file(path))
    return found


def finetune(ranks: Ranks, tmp: Path, name: str, checkpoints: Path, common: list[str],
             *overrides: str, nproc: int, config: str = "qwen2_vl_finetune.yaml") -> list[dict]:
    """``configs/train/<config>`` on the test shards, checkpoints in ``checkpoints``; its JSONL
    records."""
    return train(ranks, tmp, name, config, f"checkpoint.dir={checkpoints}", *common,
                 *overrides, nproc=nproc)


def video_processor(cfg):
    """transformers' ``Qwen2VLVideoProcessor`` set as the ``VideoConfig`` ``cfg`` (skips where
    torchvision, its only backend, is not installed)."""
    pytest.importorskip("torchvision")
    from transformers import Qwen2VLVideoProcessor
    return Qwen2VLVideoProcessor(
        patch_size=cfg.patch_size, temporal_patch_size=cfg.temporal_patch_size,
        merge_size=cfg.merge_size, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels,
        min_frames=cfg.min_frames, max_frames=cfg.max_frames,
        cap_pixels_per_frame=cfg.cap_pixels_per_frame, max_video_tokens=cfg.max_video_tokens,
        image_mean=list(cfg.mean), image_std=list(cfg.std), fps=cfg.fps, do_sample_frames=True)
