"""Pretrained checkpoints in any stored dtype, and bf16 training (mimo_train/precision.py).

The tiny checkpoints of ``assets/models`` (Qwen2 language model, Qwen2-VL and SigLIP vision
towers, Whisper) are rounded to values that bf16 and fp16 both hold exactly, then saved three
times: fp32, bf16 and fp16 (weights and ``config.json`` dtype, as real checkpoints are stored).
One process trains from each copy (tests/jobs/train_runs.py):

- under fp32, the step-1 loss is the same to the last bit whatever the stored dtype: every copy
  loads as the same fp32 weights (Qwen2-VL + Whisper + Qwen2, and SigLIP + Qwen2);
- under bf16, the bf16- and fp32-stored copies train to the same losses, close to fp32's;
- ``model.init_from`` a bf16 run's checkpoint into an fp32 run starts from its weights exactly;
- ``mimo-export`` of the bf16 run writes bf16 weights equal to the checkpoint's, and
  ``mimo-generate`` gives the same tokens from that export and from an fp32 copy of it.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import REPO, model_dir, preprocess_config_file
from jobs.train_runs import digest

MODELS = ("tiny-qwen2", "tiny-qwen2-vl-vision", "tiny-siglip-vision", "tiny-whisper")
STORED = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SIGLIP = {"policy": "fixed", "image_size": 224, "patch_size": 14, "mean": [0.5] * 3,
          "std": [0.5] * 3}
BF16_LOSS = 1e-2                       # bf16 against fp32, relative


def _representable(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` rounded to bf16, its values below fp16's smallest normal set to 0: a value
    that bf16 and fp16 both hold exactly (8 significant bits, inside fp16's normal range)."""
    rounded = tensor.to(torch.bfloat16).float()
    rounded[rounded.abs() < 2.0 ** -14] = 0.0
    return rounded


def _save_copy(source: Path, target: Path, dtype: torch.dtype) -> None:
    shutil.copytree(source, target)
    weights = load_file(source / "model.safetensors")
    save_file({k: _representable(v).to(dtype) if v.is_floating_point() else v
               for k, v in weights.items()}, target / "model.safetensors", {"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["dtype"] = str(dtype).removeprefix("torch.")
    (target / "config.json").write_text(json.dumps(config, indent=1))


@pytest.fixture(scope="module")
def stored(tmp_path_factory) -> dict:
    """(model, stored dtype name) -> the copy's directory."""
    tmp = tmp_path_factory.mktemp("stored")
    copies = {}
    for name in MODELS:
        for label, dtype in STORED.items():
            copies[name, label] = tmp / f"{name}-{label}"
            _save_copy(model_dir(name), copies[name, label], dtype)
    return copies


def _overrides(stored: dict, label: str, corpus: Path, preprocess: Path, image: str,
               *extra: str) -> list[str]:
    encoders = {"image": image} if image == "tiny-siglip-vision" else {
        "image": image, "audio": "tiny-whisper"}
    layout = ";".join(["language=dp1", *(f"{name}=dp1,off0" for name in encoders)])
    return [f"data.datasets=[{corpus}]", f"data.preprocess={preprocess}", f"layout={layout}",
            f"model.language.pretrained={stored['tiny-qwen2', label]}",
            *(f"model.encoders.{module}.pretrained={stored[model, label]}"
              for module, model in encoders.items()),
            "optimizer.warmup_steps=0", "train.global_batch_size=2",
            "train.micro_batch_size=2", "train.seed=5", "train.steps=1", *extra]


@pytest.fixture(scope="module")
def runs(ranks, stored, loader_corpus, tmp_path_factory) -> tuple[dict, Path]:
    """Every run's losses and starting checksums, and the bf16 run's checkpoint directory (the
    runs one after another in one forked process)."""
    tmp = tmp_path_factory.mktemp("dtype-runs")
    preprocess = preprocess_config_file(tmp / "preprocess.yaml")
    # at most 16 tokens per image: bf16 matrix products are slow on CPUs without bf16 units
    preprocess.write_text(preprocess.read_text().replace("seq_length: 1024", "seq_length: 512")
                          .replace("max_pixels: 200704", "max_pixels: 12544"))
    siglip = preprocess_config_file(tmp / "siglip.yaml", image=SIGLIP)
    checkpoints = tmp / "bf16-checkpoints"
    qwen = "tiny-qwen2-vl-vision"
    listed = [
        *({"name": f"{label}-stored-fp32",
           "overrides": _overrides(stored, label, loader_corpus, preprocess, qwen)}
          for label in STORED),
        *({"name": f"siglip-{label}-stored-fp32",
           "overrides": _overrides(stored, label, loader_corpus, siglip, "tiny-siglip-vision")}
          for label in ("fp32", "bf16")),
        *({"name": f"{label}-stored-bf16",
           "overrides": _overrides(stored, label, loader_corpus, preprocess, qwen,
                                   "train.precision=bf16", "train.steps=2",
                                   *([f"checkpoint.dir={checkpoints}"] if label == "bf16"
                                     else []))}
          for label in ("bf16", "fp32")),
        # the run's checkpoint.dir: its latest, step 2, as mimo-export takes it
        {"name": "init-from-bf16-run-fp32",
         "overrides": _overrides(stored, "fp32", loader_corpus, preprocess, qwen,
                                 f"model.init_from={checkpoints}")},
    ]
    (tmp / "runs.json").write_text(json.dumps(listed))
    ranks.run(1, [REPO / "tests" / "jobs" / "train_runs.py", tmp / "runs.json", tmp / "out.json"],
              tmp / "logs", timeout=900).check()
    return json.loads((tmp / "out.json").read_text()), checkpoints / "step_0000002"


def test_any_stored_dtype_gives_the_same_fp32_step(runs):
    results, _ = runs
    first = {name: result["losses"][0] for name, result in results.items()}
    assert first["fp32-stored-fp32"] == first["bf16-stored-fp32"] == first["fp16-stored-fp32"]
    assert first["siglip-fp32-stored-fp32"] == first["siglip-bf16-stored-fp32"]
    assert math.isfinite(first["fp32-stored-fp32"]) and math.isfinite(
        first["siglip-fp32-stored-fp32"])
    assert results["fp32-stored-fp32"]["start"] == results["fp16-stored-fp32"]["start"]


def test_bf16_trains_from_either_stored_dtype(runs):
    results, _ = runs
    bf16, fp32 = results["bf16-stored-bf16"]["losses"], results["fp32-stored-bf16"]["losses"]
    assert len(bf16) == 2 and bf16 == fp32
    assert all(math.isfinite(loss) for loss in bf16)
    reference = results["fp32-stored-fp32"]["losses"][0]
    assert abs(bf16[0] - reference) <= BF16_LOSS * reference


def test_init_from_a_bf16_checkpoint_loads_its_weights_exactly(runs):
    """The fp32 run that starts from the bf16 run's checkpoint holds exactly its values."""
    from mimo_train.components.checkpoint import load_weights
    results, checkpoint = runs
    saved = load_weights(str(checkpoint))
    start = results["init-from-bf16-run-fp32"]["start"]
    assert set(start) == set(saved) == {"language", "image", "audio"}
    for module, params in start.items():
        for key, value in params.items():
            tensor = saved[module][key]
            assert tensor.dtype == torch.bfloat16, key
            assert digest(tensor) == value, f"{module}.{key}"


def test_export_keeps_bf16_and_generate_reads_any_dtype(runs, tmp_path, capsys):
    from mimo_train.hf.export import main as export
    from mimo_train.hf.generate import Generator
    _, checkpoint = runs
    out = tmp_path / "export"
    assert export(["--checkpoint", str(checkpoint), "--output", str(out)]) == 0
    from mimo_train.components.checkpoint import load_weights
    saved = load_weights(str(checkpoint))
    for module in ("language", "image", "audio"):
        weights = load_file(out / module / "model.safetensors")
        assert {t.dtype for t in weights.values() if t.is_floating_point()} == {torch.bfloat16}
    image = load_file(out / "image" / "model.safetensors")
    prefix = "encoders.image.encoder.model."
    for key, tensor in saved["image"].items():
        if key.startswith(prefix):
            assert torch.equal(image[key[len(prefix):]], tensor), key
    widened = tmp_path / "export-fp32"
    shutil.copytree(out, widened)
    for path in widened.rglob("*.safetensors"):
        save_file({k: v.float() if v.is_floating_point() else v
                   for k, v in load_file(path).items()}, path, {"format": "pt"})
    answers = [Generator(str(directory)).generate("Describe <image>", images=[str(photo)],
                                                  max_new_tokens=8).token_ids
               for directory in (out, widened) for photo in [_photo()]]
    assert answers[0] == answers[1] and len(answers[0]) > 0
    bf16 = Generator(str(out), dtype="bf16")
    assert bf16.language.dtype == torch.bfloat16
    assert bf16.generate("Describe <image>", images=[str(_photo())], max_new_tokens=4).token_ids


def _photo() -> Path:
    return min((REPO / "assets" / "corpus" / "images").glob("*.jpg"),
               key=lambda p: p.stat().st_size)
