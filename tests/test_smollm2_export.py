"""SmolLM2 with image and audio encoders, non-colocated (configs/train/smollm2_images_audio.yaml),
exported with ``mimo-export`` and run with ``mimo-generate``.

One run serves every test here: 1 step on 3 ranks (image, audio, SmolLM2) with the language
model frozen, on the sample corpus with small fixed-size images (4 tokens each: a cheap
encoder), then one export.

- the first loss is far below a random model's (ln of the vocabulary): training starts from
  the converted pretrained weights;
- the export gives back SmolLM2's weights bit for bit (frozen: import then export changes
  nothing), the modality-token rows kept at the mean of the pretrained rows, the padding rows
  dropped, the tokenizer extended with the modality tokens; encoders and projections are the
  checkpoint's;
- the exported, untrained model answers "Paris" through ``mimo-generate``; with an image, the
  4 placeholders get 4 encoder rows and greedy decoding is reproducible and differs from the
  text-only answer.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch
import yaml

from conftest import REPO, model_dir, preprocess_config_file, scratch
from support.runs import train, train_records

CONFIG = REPO / "configs" / "train" / "smollm2_images_audio.yaml"
SMOLLM2_VOCAB = 49152                 # SmolLM2-135M-Instruct's vocabulary (config.json)
MODALITY_TOKENS = 2                   # <|image_pad|>, <|audio_pad|> added by the preprocessing
PADDED_VOCAB = 49280                  # 49154 rounded up to a multiple of 128
IMAGE_SIZE, PATCH = 28, 14            # (28 / 14)² = 4 tokens per image
IMAGE_TOKENS = 4


@dataclass
class Run:
    losses: list[float]
    checkpoint: Path                  # the step_* directory
    export: Path


@pytest.fixture(scope="module")
def smollm2(ranks, loader_corpus, tmp_path_factory) -> Iterator[Run]:
    """1 step of the shipped config (language frozen: one optimizer step must leave it as it
    was; the speech tower's projection an MLP of its own, the image's linear) on 3 forked
    ranks, then ``mimo-export`` of the result. (A second step, whose batch
    holds a long audio sample, cost SmolLM2 three times the first.)"""
    with scratch(tmp_path_factory, "smollm2-export") as tmp:
        preprocess = preprocess_config_file(
            tmp / "preprocess.yaml",
            image={"policy": "fixed", "image_size": IMAGE_SIZE, "patch_size": PATCH},
            audio=yaml.safe_load((REPO / "configs" / "preprocess.yaml").read_text())[
                "modalities"]["audio"])
        records = train(ranks, tmp, "records", CONFIG.name, f"data.datasets=[{loader_corpus}]",
                        f"data.preprocess={preprocess}", f"checkpoint.dir={tmp / 'checkpoints'}",
                        "model.freeze=[language]", "model.encoders.audio.projection=mlp",
                        "train.steps=1", "train.global_batch_size=2",
                        "train.micro_batch_size=2", nproc=3)
        from mimo_train.hf.export import main
        out = tmp / "exports" / "export"           # its folder is made
        # the checkpoint as a path relative to the working directory: the manifest's is not
        assert main(["--checkpoint", os.path.relpath(tmp / "checkpoints"),
                     "--output", str(out)]) == 0
        losses = [record["loss"] for record in train_records(records)]
        yield Run(losses, tmp / "checkpoints" / "step_0000001", out)


# ------------------------------------------------------------------------ A: the config

def test_the_config_is_non_colocated_with_the_language_frozen():
    config = yaml.safe_load(CONFIG.read_text())
    assert config["layout"] == "image=dp1;audio=dp1;language=dp1"
    assert config["model"]["freeze"] == ["language"]
    assert Path(CONFIG.parent, config["model"]["language"]["pretrained"]).resolve() == \
        model_dir("smollm2-135m-instruct")


def test_first_loss_is_far_below_a_random_models(smollm2):
    """Training starts from the converted pretrained weights (``model.language.pretrained``,
    tests/test_hf_language.py): a random language model's first loss is ln(vocabulary) =
    ln(49280) ≈ 10.81 (measured 10.82 with the shipped colocated config's tiny model); SmolLM2
    starts near 5 on these samples (measured 5.1 here, 5.2 colocated on batches of 4; its
    text-only assistant turns alone give 3.9 in transformers, captions of images it cannot see
    more), so 4 nats below the random model's leaves a nat of margin either way."""
    print(f"first losses {smollm2.losses}, random {math.log(PADDED_VOCAB):.3f}")
    assert len(smollm2.losses) == 1
    assert smollm2.losses[0] < math.log(PADDED_VOCAB) - 4.0


# ------------------------------------------------------------------------ B: the export

def test_export_gives_back_the_pretrained_weights_exactly(smollm2):
    from safetensors.torch import load_file

    original_dir = model_dir("smollm2-135m-instruct")
    original = load_file(original_dir / "model.safetensors")
    exported = load_file(smollm2.export / "language" / "model.safetensors")
    assert set(exported) == set(original)                    # tied: no lm_head either
    rows = SMOLLM2_VOCAB + MODALITY_TOKENS
    for key, tensor in original.items():
        if key == "model.embed_tokens.weight":
            assert exported[key].shape == (rows, tensor.shape[1])     # padding rows dropped
            assert torch.equal(exported[key][:SMOLLM2_VOCAB], tensor)
            mean = tensor.mean(0, keepdim=True).expand(MODALITY_TOKENS, -1)
            assert torch.allclose(exported[key][SMOLLM2_VOCAB:], mean, atol=1e-7)
        else:
            assert torch.equal(exported[key], tensor), key
    config = json.loads((smollm2.export / "language" / "config.json").read_text())
    expected = json.loads((original_dir / "config.json").read_text())
    assert config["vocab_size"] == rows
    assert {k: v for k, v in config.items() if k not in ("vocab_size", "transformers_version")} \
        == {k: v for k, v in expected.items() if k not in ("vocab_size", "transformers_version")}


def test_export_writes_the_tokenizer_encoders_projections_and_manifest(smollm2):
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, SiglipVisionModel
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    from mimo_train.components.checkpoint import load_weights

    manifest = json.loads((smollm2.export / "manifest.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(smollm2.export / "language")
    assert len(tokenizer) == SMOLLM2_VOCAB + MODALITY_TOKENS
    # no flag of how this run loaded it in a file users push to the hub
    assert not {"local_files_only", "is_local"} & set(json.loads(
        (smollm2.export / "language" / "tokenizer_config.json").read_text()))
    tokens = {m: (t["token"], t["id"]) for m, t in manifest["modality_tokens"].items()}
    assert {t for t, _ in tokens.values()} == {"<|image_pad|>", "<|audio_pad|>"}
    assert {i for _, i in tokens.values()} == {SMOLLM2_VOCAB, SMOLLM2_VOCAB + 1}
    assert all(tokenizer.convert_tokens_to_ids(t) == i for t, i in tokens.values())
    assert manifest["step"] == 1 and manifest["checkpoint"] == str(smollm2.checkpoint)
    assert {n: (m["modality"], m["kind"], m["projection"])
            for n, m in manifest["modules"].items()} == \
        {"image": ("image", "siglip", "linear"), "audio": ("audio", "whisper", "mlp")}
    preprocess = yaml.safe_load((smollm2.export / manifest["preprocess"]).read_text())
    assert preprocess["tokenizer"] == "./language"
    assert preprocess["modalities"]["image"]["image_size"] == IMAGE_SIZE

    weights = load_weights(str(smollm2.checkpoint))
    for name, cls in (("image", SiglipVisionModel), ("audio", WhisperEncoder)):
        model = cls.from_pretrained(smollm2.export / name)
        prefix = f"encoders.{name}.encoder.model."
        saved = {k[len(prefix):]: v for k, v in weights[name].items() if k.startswith(prefix)}
        assert set(model.state_dict()) == set(saved), name
        for key, tensor in model.state_dict().items():
            assert torch.equal(tensor, saved[key]), (name, key)
    assert manifest["files"] == {str(p.relative_to(smollm2.export)): p.stat().st_size
                                 for p in sorted(smollm2.export.rglob("*"))
                                 if p.is_file() and p.name != "manifest.json"}
    projections = load_file(smollm2.export / "projections.safetensors")
    assert set(projections) == {f"{m}.{layer}.{p}" for m, layers in (("image", "0"),
                                                                     ("audio", "02"))
                                for layer in layers for p in ("weight", "bias")}
    for key, tensor in projections.items():
        module, _, rest = key.partition(".")
        assert torch.equal(tensor, weights[module][f"input_projections.0.{rest}"]), key
    # readable by whoever a new file is for: safetensors' own files are private (0600)
    umask = os.umask(0)
    os.umask(umask)
    modes = {str(p.relative_to(smollm2.export)): stat.S_IMODE(p.stat().st_mode)
             for p in [smollm2.export, *smollm2.export.rglob("*")]}
    assert {"language/model.safetensors", "image/config.json", "projections.safetensors",
            "preprocess.yaml", "manifest.json"} <= set(modes)
    assert {n: m for n, m in modes.items()
            if m != (0o777 if Path(smollm2.export, n).is_dir() else 0o666) & ~umask} == {}


def test_export_refuses_an_output_in_the_way_and_a_missing_checkpoint(smollm2, tmp_path,
                                                                      capsys, monkeypatch):
    from mimo_train.hf.export import main

    assert main(["--checkpoint", str(smollm2.checkpoint), "--output",
                 str(smollm2.export)]) == 2
    assert "exists" in capsys.readouterr().err
    # a step's name in a checkpoint.dir: a later save of that step would replace the export
    step_name = smollm2.checkpoint.parent / "step_0000099"
    assert main(["--checkpoint", str(smollm2.checkpoint), "--output", str(step_name)]) == 2
    assert f"--output {step_name} is a step's name in the checkpoint.dir " \
        f"{smollm2.checkpoint.parent}" in capsys.readouterr().err and not step_name.exists()
    # a folder inside a step: checkpoint.keep_last's pruning would remove it with the step
    inside = smollm2.checkpoint / "exports" / "hf"
    assert main(["--checkpoint", str(smollm2.checkpoint), "--output", str(inside)]) == 2
    assert f"--output {inside} is inside {smollm2.checkpoint}, a step of the checkpoint.dir " \
        f"{smollm2.checkpoint.parent}: a run's checkpoint.keep_last removes it with the step; " \
        "export to a folder of its own" in capsys.readouterr().err
    assert not inside.parent.exists()
    # a checkpoint.dir without its latest (a copy of its steps alone): its complete steps say
    # what it is
    (tmp_path / "steps").mkdir()
    (tmp_path / "steps" / smollm2.checkpoint.name).symlink_to(smollm2.checkpoint)
    inside = tmp_path / "steps" / smollm2.checkpoint.name / "hf"
    assert main(["--checkpoint", str(smollm2.checkpoint), "--output", str(inside)]) == 2
    assert f"--output {inside} is inside {inside.parent}, a step of the checkpoint.dir " \
        f"{tmp_path / 'steps'}" in capsys.readouterr().err and not inside.exists()
    # a link to a step folder on the way: the step it leads to
    (tmp_path / "link").symlink_to(smollm2.checkpoint)
    linked = tmp_path / "link" / "hf"
    assert main(["--checkpoint", str(smollm2.checkpoint), "--output", str(linked)]) == 2
    assert f"--output {linked} is inside {smollm2.checkpoint}, a step of the checkpoint.dir " \
        f"{smollm2.checkpoint.parent}" in capsys.readouterr().err
    assert not (smollm2.checkpoint / "hf").exists()
    (tmp_path / "afile").write_text("in the way\n")          # a file where a folder goes
    assert main(["--checkpoint", str(smollm2.checkpoint), "--output",
                 str(tmp_path / "afile" / "export")]) == 2
    assert f"--output {tmp_path / 'afile' / 'export'}: {tmp_path / 'afile'} is a file, not a " \
        "folder; give another path" in capsys.readouterr().err
    # the file itself as --output: said as a file, not "remove it" (it may be the user's data)
    assert main(["--checkpoint", str(smollm2.checkpoint), "--output",
                 str(tmp_path / "afile")]) == 2
    assert f"--output {tmp_path / 'afile'} is a file: give the path of a directory to create" \
        in capsys.readouterr().err
    (tmp_path / "dangling").symlink_to(tmp_path / "moved")     # a link whose target is gone
    assert main(["--checkpoint", str(smollm2.checkpoint), "--output",
                 str(tmp_path / "dangling")]) == 2
    assert f"--output {tmp_path / 'dangling'} is a link to {tmp_path / 'moved'}, which is not " \
        "there" in capsys.readouterr().err and not (tmp_path / "moved").exists()
    assert main(["--checkpoint", str(tmp_path / "nothing"), "--output",
                 str(tmp_path / "out")]) == 2
    assert "step_*" in capsys.readouterr().err
    incomplete = tmp_path / "step_0000001"          # meta.json but no weights
    incomplete.mkdir()
    (incomplete / "meta.json").write_text((smollm2.checkpoint / "meta.json").read_text())
    assert main(["--checkpoint", str(incomplete), "--output", str(tmp_path / "out")]) == 1
    assert not (tmp_path / "out").exists()
    # meta.json written, integrity.json not yet (the save hashing its files): not finished
    assert f"{incomplete} holds no integrity.json: its save did not finish (or is still " \
        "under way" in capsys.readouterr().err
    (incomplete / "integrity.json").write_text(
        (smollm2.checkpoint / "integrity.json").read_text())      # its files gone since
    assert main(["--checkpoint", str(incomplete), "--output", str(tmp_path / "out")]) == 1
    assert "is damaged: " in (err := capsys.readouterr().err) and \
        err.endswith("no earlier checkpoint is beside it to export: restore it from a copy\n")
    # its meta.json cut short: said as the manifest sees it, not as JSON's parse error
    saved = (incomplete / "meta.json").stat().st_size
    with open(incomplete / "meta.json", "r+") as meta:
        meta.truncate(8)
    assert main(["--checkpoint", str(incomplete), "--output", str(tmp_path / "out")]) == 1
    assert f"checkpoint {incomplete} is damaged: meta.json: truncated (8 bytes, {saved:,} " \
        "saved); no earlier checkpoint is beside it to export" in capsys.readouterr().err
    # JSON, but not the object saved (no integrity.json sizes to say more): said, no traceback
    sizes = (incomplete / "integrity.json").read_text()
    (incomplete / "integrity.json").write_text(json.dumps({"files": {}}))
    (incomplete / "meta.json").write_text("[]")
    assert main(["--checkpoint", str(incomplete), "--output", str(tmp_path / "out")]) == 1
    assert f"checkpoint {incomplete} is damaged: {incomplete / 'meta.json'} is unreadable (not " \
        "the JSON object saved, with the run's config)" in capsys.readouterr().err
    (incomplete / "integrity.json").write_text(sizes)
    (incomplete / "meta.json").write_text((smollm2.checkpoint / "meta.json").read_text())
    # an earlier one beside it (its manifest and meta.json are what is looked at): named to
    # export, not training's advice to resume from it
    (tmp_path / "ck").mkdir()
    earlier = tmp_path / "ck" / "step_0000001"
    earlier.mkdir()
    for name in ("meta.json", "integrity.json"):
        (earlier / name).write_text((smollm2.checkpoint / name).read_text())
    later = tmp_path / "ck" / "step_0000002"
    shutil.copytree(earlier, later)
    assert main(["--checkpoint", str(later), "--output", str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err.endswith(
        f"export the newest earlier one instead: mimo-export --checkpoint {earlier}\n")
    best = tmp_path / "ck" / "best"          # a step copied out of the step_* order
    shutil.copytree(later, best)
    assert main(["--checkpoint", str(best), "--output", str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err.endswith(
        f"export the newest one beside it instead: mimo-export --checkpoint {later}\n")
    shutil.rmtree(best)
    (later / "integrity.json").rename(later / "saved")   # its save not finished: the same
    assert main(["--checkpoint", str(later), "--output", str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err.endswith(
        f"export the newest earlier one: mimo-export --checkpoint {earlier}, or this one once "
        "its run has saved it\n")
    (later / "saved").rename(later / "integrity.json")
    # a step caught mid-save (its tensors, meta.json not yet written): the save, not usage
    saving = tmp_path / "ck" / "step_0000003"
    saving.mkdir()
    (saving / "__0_0.distcp").write_bytes(b"")
    assert main(["--checkpoint", str(saving), "--output", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"mimo-export: --checkpoint {saving} holds no meta.json: its save "
                          "did not finish") and "export the newest earlier one: mimo-export " \
        f"--checkpoint {later}, or this one" in err, err
    # a checkpoint.dir copied without its latest: the newest complete step named (the
    # unfinished step_0000003 is not one)
    assert main(["--checkpoint", str(tmp_path / "ck"), "--output", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.endswith(
        f"holds step_0000001, step_0000002 but no 'latest' file, which names the checkpoint a "
        f"checkpoint.dir stands for: export the newest with --checkpoint {later}, or another "
        "step_* directory\n")
    # a step misspelt, and a latest naming a step that is not there: the complete steps named
    newest = f"{tmp_path / 'ck'} holds step_0000001, step_0000002: export the newest with " \
        f"--checkpoint {later}\n"
    assert main(["--checkpoint", str(tmp_path / "ck" / "step_2"), "--output",
                 str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.endswith("step_2 is not there: give a step_* directory or "
                                            "the checkpoint.dir of a mimo_train run; " + newest)
    (tmp_path / "ck" / "latest").write_text("step_0000009")
    assert main(["--checkpoint", str(tmp_path / "ck"), "--output", str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err.endswith(
        "latest file names step_0000009, which is not there (a folder copied without it, or a "
        "step removed); " + newest)
    (tmp_path / "ck" / "latest").write_text("\n")               # an empty latest: said so
    assert main(["--checkpoint", str(tmp_path / "ck"), "--output", str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err.endswith(
        f"latest holds '', no step's folder name: write the step to resume into it (echo "
        f"step_NNNNNNN > {tmp_path / 'ck' / 'latest'}); " + newest)
    # latest's step without its meta.json (removed since): the newest earlier one named,
    # not the damaged step itself
    (tmp_path / "ck" / "latest").write_text("step_0000002")
    (later / "meta.json").rename(later / "gone")
    assert main(["--checkpoint", str(tmp_path / "ck"), "--output", str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err.endswith(
        f"checkpoint {later} is damaged: it holds no meta.json (it is the latest of "
        f"{tmp_path / 'ck'}); export the newest earlier one instead: mimo-export --checkpoint "
        f"{earlier}\n")
    (later / "gone").rename(later / "meta.json")
    (tmp_path / "ck" / "latest").unlink()
    # a run's checkpoint.dir before its first save: said so, not "give a checkpoint.dir"
    from mimo_train.components.checkpoint_owner import OWNER
    (tmp_path / "fresh").mkdir()
    (tmp_path / "fresh" / OWNER).write_text("{}")
    assert main(["--checkpoint", str(tmp_path / "fresh"), "--output",
                 str(tmp_path / "out")]) == 2
    assert "is a run's checkpoint.dir with no checkpoint saved yet" in capsys.readouterr().err
    # removed while it is read (a run still saving there, with checkpoint.keep_last)
    from mimo_train.components import checkpoint
    from mimo_train.errors import CheckpointError
    shutil.rmtree(saving)
    (tmp_path / "ck" / "latest").write_text("step_0000002")

    def removed(directory):
        shutil.rmtree(directory)
        raise CheckpointError(f"checkpoint {directory}: no such directory")
    monkeypatch.setattr(checkpoint, "load_weights", removed)
    assert main(["--checkpoint", str(tmp_path / "ck"), "--output", str(tmp_path / "out")]) == 1
    assert f"{later} was removed while it was exported (a run still saving to its " \
        f"checkpoint.dir, whose checkpoint.keep_last removes older steps?): export again " \
        f"(--checkpoint {tmp_path / 'ck'} takes the latest)" in capsys.readouterr().err
    shutil.copytree(earlier, later)          # given as the step itself: its folder named
    assert main(["--checkpoint", str(later), "--output", str(tmp_path / "out")]) == 1
    assert f"(--checkpoint {tmp_path / 'ck'} takes the latest)" in capsys.readouterr().err
    # removed while its meta.json is read: the same
    from mimo_train.errors import ExportError
    from mimo_train.hf import export

    def plan_gone(directory, base=None):
        shutil.rmtree(directory)
        raise ExportError(f"{directory}/meta.json: no such file")
    monkeypatch.setattr(export, "_run_plan", plan_gone)
    shutil.copytree(earlier, later)
    assert main(["--checkpoint", str(tmp_path / "ck"), "--output", str(tmp_path / "out")]) == 1
    assert f"{later} was removed while it was exported" in capsys.readouterr().err


@pytest.mark.parametrize("language, message", [
    # megatron-core's own layers (LayerNorm, GELU, biases) have no Llama equivalent
    ({"pretrained": None, "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
      "ffn_hidden_size": None}, "model.language.pretrained"),
    # a Llama written back would drop the M-RoPE positions it was trained with
    ({"mrope_section": [8, 12, 12]}, "M-RoPE positions (model.language.mrope_section)"),
], ids=["random-init", "mrope"])
def test_a_language_model_without_a_causal_lm_equivalent_is_not_exported(
        smollm2, tmp_path, monkeypatch, capsys, language, message):
    from mimo_train.components import checkpoint
    from mimo_train.hf.export import main

    meta = json.loads((smollm2.checkpoint / "meta.json").read_text())
    meta["config"]["model"]["language"].update(language)
    if "mrope_section" in language:     # a run trained so had M-RoPE positions (its start-up says)
        preprocess = yaml.safe_load(Path(meta["config"]["data"]["preprocess"]).read_text())
        mrope = tmp_path / "step_0000001" / "preprocess-mrope.yaml"
        mrope.parent.mkdir()
        mrope.write_text(yaml.safe_dump({**preprocess, "positions": "mrope"}))
        meta["config"]["data"]["preprocess"] = str(mrope)
        meta.pop("preprocess")          # the YAML is the run's (a checkpoint of before)
    directory = tmp_path / "step_0000001"
    directory.mkdir(exist_ok=True)
    (directory / "meta.json").write_text(json.dumps(meta))
    (directory / "integrity.json").write_text("{}")     # saved (its weights stood in for)
    monkeypatch.setattr(checkpoint, "load_weights",
                        lambda d: {"language": {}, "image": {}, "audio": {}})
    assert main(["--checkpoint", str(directory), "--output", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_0000001"]


def test_a_language_model_that_is_not_the_runs_is_named_without_base(smollm2, tmp_path,
                                                                     monkeypatch, capsys):
    """A causal-LM run (no model.pretrained) whose model.language.pretrained calls for a weight
    the run did not train (another model there since): refused, exit 1, naming the setting;
    --base is not offered (it moves a whole VLM's folder only)."""
    from mimo_train.components import checkpoint
    from mimo_train.hf.export import main

    weights = checkpoint.load_weights(str(smollm2.checkpoint))
    lost = next(key for key in weights["language"] if key.endswith("mlp.linear_fc1.weight"))
    del weights["language"][lost]
    directory = tmp_path / "step_0000001"
    directory.mkdir()
    (directory / "meta.json").write_text((smollm2.checkpoint / "meta.json").read_text())
    (directory / "integrity.json").write_text("{}")     # saved (its weights stood in for)
    monkeypatch.setattr(checkpoint, "load_weights", lambda d: weights)
    assert main(["--checkpoint", str(directory), "--output", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    pretrained = json.loads((directory / "meta.json").read_text())["config"]["model"][
        "language"]["pretrained"]
    assert f"have no '{lost}', which the config of model.language.pretrained {pretrained} " \
        in err and err.rstrip().endswith("The export takes its config from there: put the "
                                         "model the run started from back at that path"), err
    assert not (tmp_path / "out").exists()


def test_a_preprocessing_config_this_mimo_does_not_read_is_named_to_fix(smollm2, tmp_path,
                                                                         monkeypatch, capsys):
    """The run's preprocessing YAML, there but refused now (a key given twice, which an older
    mimo read as the last): export says to fix it where it is, not to restore it; gone, to
    restore it."""
    from mimo_train.components import checkpoint
    from mimo_train.hf.export import main

    meta = json.loads((smollm2.checkpoint / "meta.json").read_text())
    twice = tmp_path / "preprocess-twice.yaml"
    twice.write_text(Path(meta["config"]["data"]["preprocess"]).read_text()
                     + "seq_length: 64\nseq_length: 128\n")
    meta["config"]["data"]["preprocess"] = str(twice)
    meta.pop("preprocess")      # a checkpoint saved before meta.json kept its own copy
    directory = tmp_path / "step_0000001"
    directory.mkdir()
    (directory / "meta.json").write_text(json.dumps(meta))
    (directory / "integrity.json").write_text("{}")     # saved (its weights stood in for)
    monkeypatch.setattr(checkpoint, "load_weights", lambda d: {})
    assert main(["--checkpoint", str(directory), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"the preprocessing config {twice} of {directory}/meta.json is not one this mimo " \
        "reads" in err and "'seq_length' is given twice" in err and "fix it where it is" in err
    twice.unlink()                                  # gone: to restore, not to fix
    assert main(["--checkpoint", str(directory), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"the preprocessing config {twice} of {directory}/meta.json cannot be read" in err \
        and "restore it" in err and "fix it" not in err, err


def test_an_interrupted_export_leaves_no_output(smollm2, tmp_path, monkeypatch, capsys):
    from mimo_train.components import checkpoint
    from mimo_train.hf import export

    def fail(out, *args):
        Path(out, "language").mkdir()
        raise OSError("No space left on device")
    monkeypatch.setattr(checkpoint, "load_weights", lambda directory: {})
    monkeypatch.setattr(export, "_write", fail)
    with pytest.raises(OSError):
        export.export(str(smollm2.checkpoint), str(tmp_path / "out"))
    assert list(tmp_path.iterdir()) == []           # neither OUT nor the staging directory

    def racing(out, *args):                         # another export to OUT finished first
        Path(out, "language").mkdir()
        (tmp_path / "out" / "language").mkdir(parents=True)
        return "float32"
    monkeypatch.setattr(export, "_write", racing)
    with pytest.raises(export.ExportError, match=f"--output {tmp_path / 'out'} was made while "
                       "this export was written .another mimo-export to the same --output"):
        export.export(str(smollm2.checkpoint), str(tmp_path / "out"))
    assert [p.name for p in tmp_path.iterdir()] == ["out"]    # the staging directory removed
    shutil.rmtree(tmp_path / "out")

    def file_racing(out, *args):                    # a file written to OUT meanwhile
        Path(out, "language").mkdir()
        (tmp_path / "out").write_text("log")
        return "float32"
    monkeypatch.setattr(export, "_write", file_racing)
    with pytest.raises(export.ExportError, match="was made while this export was written"):
        export.export(str(smollm2.checkpoint), str(tmp_path / "out"))
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and \
        (tmp_path / "out").read_text() == "log"
    (tmp_path / "out").unlink()

    sent: list[signal.Signals] = []

    def stopped(out, *args):                         # Ctrl-C, then SIGTERM, while writing
        Path(out, "language").mkdir()
        if sent[-1] == signal.SIGINT:
            raise KeyboardInterrupt
        signal.raise_signal(sent[-1])
    monkeypatch.setattr(export, "_write", stopped)
    handler = signal.getsignal(signal.SIGTERM)
    for stop, code, said in ((signal.SIGINT, 130, "interrupted"),
                             (signal.SIGTERM, 143, "terminated")):
        sent.append(stop)
        assert export.main(["--checkpoint", str(smollm2.checkpoint), "--output",
                            str(tmp_path / "out")]) == code
        assert capsys.readouterr().err == f"mimo-export: {said}: nothing written to " \
            f"{tmp_path / 'out'}; run it again\n"
        assert list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGTERM) == handler            # put back
    # an export killed outright (SIGKILL, out of memory) leaves its hidden staging folder:
    # the next export to the same --output names it
    (tmp_path / ".out.k1ll3d_x" / "language").mkdir(parents=True)
    assert export.main(["--checkpoint", str(smollm2.checkpoint), "--output",
                        str(tmp_path / "out")]) == 143          # stopped by SIGTERM again
    assert f"mimo-export: note: {tmp_path / '.out.k1ll3d_x'} is left by an export to " \
        f"{tmp_path / 'out'} that did not finish (killed, or the machine stopped): remove it " \
        "(rm -r) unless one runs now\n" in capsys.readouterr().out
    shutil.rmtree(tmp_path / ".out.k1ll3d_x")
    # Ctrl-C while the checkpoint is read: torch's reader wraps it in its exception
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    def reading(directory):
        raise CheckpointException("load", {0: (KeyboardInterrupt(), traceback.StackSummary())})
    monkeypatch.undo()                                # the real load_weights and _write
    monkeypatch.setattr(checkpoint, "load_plain_tensors", reading)
    assert export.main(["--checkpoint", str(smollm2.checkpoint), "--output",
                        str(tmp_path / "out")]) == 130
    assert capsys.readouterr().err == f"mimo-export: interrupted: nothing written to " \
        f"{tmp_path / 'out'}; run it again\n"


# ------------------------------------------------------------------------ C: generation

@pytest.fixture(scope="module")
def one_thread():
    """Generation on one thread: decoding step by step on a loaded 2-core machine, torch's
    worker threads spin (measured: 1.5 s for 8 tokens on one thread, 5 to 12 s on two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def generator(smollm2, one_thread):
    from mimo_train.hf.generate import Generator
    return Generator(str(smollm2.export), "cpu")


def test_generate_answers_the_capital_of_france(smollm2, one_thread, capsys, tmp_path):
    from mimo_train.hf.generate import main

    capsys.readouterr()
    assert main(["--model", str(smollm2.export), "--prompt", "What is the capital of France?",
                 "--max-new-tokens", "8", "--device", "cpu",
                 "--dtype", "float32"]) == 0              # fp32 by mimo-export's name
    answer = capsys.readouterr().out
    print(answer)
    assert "Paris" in answer
    # the prompt from a file, as an editor writes it (its last newline not the prompt's)
    capsys.readouterr()
    (tmp_path / "prompt.txt").write_text("What is the capital of France?\n")
    assert main(["--model", str(smollm2.export), "--prompt-file", str(tmp_path / "prompt.txt"),
                 "--max-new-tokens", "8", "--device", "cpu"]) == 0
    assert capsys.readouterr().out == answer
    from mimo_train.hf.generate import _parser, _prompt_of
    (tmp_path / "lines.txt").write_bytes(b"\xef\xbb\xbfLine one.\r\nLine two.\r\n")  # Notepad's
    assert _prompt_of(str(tmp_path / "lines.txt"), _parser()) == "Line one.\nLine two."
    (tmp_path / "blank.txt").write_text(" \n")
    for flags, said in ((["--prompt-file", str(tmp_path / "blank.txt")], "holds no text"),
                        (["--prompt-file", str(tmp_path / "gone.txt")], "cannot be read"),
                        (["--prompt", "Hi", "--prompt-file", str(tmp_path / "prompt.txt")],
                         "not allowed with argument"),
                        (["--prompt", "Hi", "--temperature", "1", "--seed", str(2**64)],
                         f"argument --seed: {2**64} is above 4294967295"),
                        *((["--prompt", "Hi", "--temperature", value], f"--temperature is "
                           f"{value}: it must be a finite number > 0") for value in ("0.0", "nan",
                                                                                   "inf")),
                        (["--prompt", "Hi", "--temperature", "1", "--top-k", "0"],
                         "--top-k is 0: it must be >= 1"),
                        *((["--prompt", "Hi", "--frames-fps", value], f"--frames-fps is {value}: "
                           "frames are taken 0.01 to 1000 a second") for value in ("0", "nan")),
                        # a rate of no folder of frames (a video file's is its own): refused,
                        # not silently unused
                        (["--prompt", "Hi", "--frames-fps", "4"], "--frames-fps is the rate of "
                         "a --video folder of JPEG frames, and no --video given is one")):
        with pytest.raises(SystemExit) as exit_:
            main(["--model", str(smollm2.export), *flags])
        assert exit_.value.code == 2 and said in capsys.readouterr().err, flags


def test_an_image_fills_its_placeholders_and_changes_the_answer(generator, assets):
    image = str(assets["jpeg"])
    with_image = generator.generate("Describe the image.", images=[image], max_new_tokens=6)
    image_id = generator.manifest["modality_tokens"]["image"]["id"]
    assert with_image.prompt_ids.count(image_id) == IMAGE_TOKENS
    assert with_image.spliced == {"image": IMAGE_TOKENS}
    again = generator.generate("Describe the image.", images=[image], max_new_tokens=6)
    assert again.token_ids == with_image.token_ids
    text_only = generator.generate("Describe the image.", max_new_tokens=6)
    assert text_only.spliced == {} and image_id not in text_only.prompt_ids
    print(f"with the image: {with_image.text!r}; without: {text_only.text!r}")
    assert text_only.token_ids != with_image.token_ids


def test_a_system_turn_one_path_and_a_long_prompt_are_taken_as_said(generator, assets,
                                                                      capsys):
    """``system`` (``--system``): the template's system turn before the prompt, as
    transformers renders it (SmolLM2's default one replaced); one path given as a string is
    one file (it was read as a list of its characters); ``top_p`` without ``temperature``
    refused as the command line refuses it; a prompt past the model's positions said so."""
    from mimo_train.errors import GenerateError
    turns = [{"role": "system", "content": "You answer in French."},
             {"role": "user", "content": "Hi"}]
    ids = generator.tokenizer.apply_chat_template(turns, add_generation_prompt=True,
                                                  tokenize=True, return_dict=False)
    said = generator.generate("Hi", system="You answer in French.", max_new_tokens=1)
    assert said.prompt_ids == list(ids)
    assert generator.generate("Hi", max_new_tokens=1).prompt_ids != said.prompt_ids
    one = generator.generate("Describe the image.", images=str(assets["jpeg"]),
                             max_new_tokens=1)
    assert one.spliced == {"image": IMAGE_TOKENS}
    with pytest.raises(GenerateError, match="top_p 0.5 goes with temperature"):
        generator.generate("Hi", top_p=0.5)
    with pytest.raises(GenerateError, match="top_k 5 goes with temperature"):
        generator.generate("Hi", top_k=5)
    with pytest.raises(GenerateError, match="--frames-fps is the rate of a --video folder"):
        generator.generate("Hi", frames_fps=2.0)       # the API's too, not silently unused
    with pytest.raises(GenerateError, match="the system turn holds a <image> marker: it takes "
                       "text alone"):
        generator.generate("Hi", system="You see <image> images.")
    positions = generator.language.config.max_position_embeddings
    capsys.readouterr()
    generator._say_longer(positions - 1, 2)
    assert capsys.readouterr().err.endswith(
        f", and past {positions}, the positions its config.json gives "
        "(max_position_embeddings), outside what its architecture was made for\n")


def test_a_history_goes_before_the_prompt_as_transformers_renders_it(generator, smollm2,
                                                                    assets, tmp_path, capsys):
    """``history`` (``--history``): the turns before the prompt, in ShareGPT's form too (a
    training record given whole), rendered as transformers' template renders the
    conversation; a marker in it takes the first file; refused: a history ending with no
    answer, a second system turn, a file that is no JSON list of turns."""
    from mimo_train.errors import GenerateError
    from mimo_train.hf.generate import main
    turns = [{"role": "user", "content": "What is the capital of France?"},
             {"role": "assistant", "content": "Paris."}]
    ids = generator.tokenizer.apply_chat_template(
        [*turns, {"role": "user", "content": "And of Italy?"}], add_generation_prompt=True,
        tokenize=True, return_dict=False)
    shared = [{"from": "human", "value": turns[0]["content"]},
              {"from": "gpt", "value": turns[1]["content"]}]
    said = generator.generate("And of Italy?", history=shared, max_new_tokens=3)
    assert said.prompt_ids == list(ids)
    # the image marked in the history is its first turn's (the prompt marks none)
    image_id = generator.manifest["modality_tokens"]["image"]["id"]
    seen = generator.generate("And now?", images=[str(assets["jpeg"])], max_new_tokens=1,
                              history=[{"role": "user", "content": "<image>\nWhat is it?"},
                                       {"role": "assistant", "content": "A cat."}])
    first = seen.prompt_ids.index(image_id)
    answer = generator.tokenizer.encode("A cat.", add_special_tokens=False)
    assert seen.spliced == {"image": IMAGE_TOKENS} and first < next(
        i for i in range(len(seen.prompt_ids)) if seen.prompt_ids[i:i + len(answer)] == answer)
    for history, refused in (
            (turns[:1], "the history ends with a user turn"),
            ([{"role": "system", "content": "Be brief."}, *turns], "the history's system turn "
             "and --system both give one")):
        with pytest.raises(GenerateError, match=refused):
            generator.generate("Hi", history=history, system="You answer in French.")
    # the command line: a record as training holds it, its answer then generated
    (tmp_path / "record.json").write_text(json.dumps({"id": "r1", "conversations": shared}))
    capsys.readouterr()
    assert main(["--model", str(smollm2.export), "--prompt", "And of Italy?", "--history",
                 str(tmp_path / "record.json"), "--max-new-tokens", "3", "--device",
                 "cpu"]) == 0
    assert capsys.readouterr().out == said.text + "\n"
    (tmp_path / "none.json").write_text('{"id": "r1"}')
    with pytest.raises(SystemExit) as usage:
        main(["--model", str(smollm2.export), "--prompt", "Hi", "--history",
              str(tmp_path / "none.json")])
    assert usage.value.code == 2 and "holds no turns" in capsys.readouterr().err


def test_audio_fills_its_placeholders(generator, assets):
    audio_id = generator.manifest["modality_tokens"]["audio"]["id"]
    result = generator.generate("Transcribe the audio.", audios=[str(assets["wav"])],
                                max_new_tokens=1)
    placeholders = result.prompt_ids.count(audio_id)
    assert placeholders > 0 and result.spliced == {"audio": placeholders}


def test_a_clip_that_cannot_be_used_is_refused_as_data(generator, tmp_path):
    """A damaged clip, one too short for log-mel features and one longer than the run's
    clips each fail a check of the data (exit status 1), named by the path given, with what
    to do; a missing file is a usage error (2)."""
    from mimo_train.errors import GenerateError
    damaged, short, long = (tmp_path / f"{name}.wav" for name in ("damaged", "short", "long"))
    damaged.write_bytes(b"RIFF\x00\x00\x00\x00WAVEfmt " + bytes(8))
    soundfile.write(short, np.zeros(100, dtype=np.int16), 16000)
    limit = generator.preprocessor.config.modalities["audio"].max_duration
    soundfile.write(long, np.zeros(int(limit * 16000) + 1600, dtype=np.int16), 16000)
    preprocess = generator.preprocess_path
    for path, said in ((damaged, f"--audio {damaged}: "),
                       (short, f"--audio {short} lasts 6.2 ms, 100 samples at 16000 Hz: "
                               "fewer than the 201 one log-mel frame needs (Whisper's window): "
                               "give a longer clip"),
                       (long, f"--audio {long} lasts {limit + 0.1:g} s, above max_duration "
                              f"{limit} s (modalities.audio.long_audio: truncate keeps its "
                              "first max_duration seconds; a pretrained Whisper hears 30 s at "
                              "most): cut the clip to max_duration, or set long_audio: "
                              f"truncate in {preprocess}")):
        with pytest.raises(GenerateError, match=re.escape(said)) as refused:
            generator.generate("Transcribe.", audios=[str(path)], max_new_tokens=1)
        assert refused.value.exit_code == 1
    with pytest.raises(GenerateError, match="No such file") as refused:
        generator.generate("Transcribe.", audios=[str(tmp_path / "none.wav")], max_new_tokens=1)
    assert refused.value.exit_code == 2
    with pytest.raises(GenerateError, match=f"--audio {tmp_path} is a folder: give a file$") \
            as refused:
        generator.generate("Transcribe.", audios=[str(tmp_path)], max_new_tokens=1)
    assert refused.value.exit_code == 2
    # a clip given as an image: the option is wrong (a usage error), said as such
    with pytest.raises(GenerateError, match=re.escape(
            f"--image {long} is a WAV audio file, not an image: give a clip as --video, audio "
            "as --audio")) as refused:
        generator.generate("Describe.", images=[str(long)], max_new_tokens=1)
    assert refused.value.exit_code == 2
    photo = tmp_path / "photo.jpg"                      # and an image given as audio
    photo.write_bytes(b"\xff\xd8\xff\xe0" + bytes(64))
    with pytest.raises(GenerateError, match=re.escape(
            f"--audio {photo} is a JPEG image, not audio: give an image as --image")) as refused:
        generator.generate("Transcribe.", audios=[str(photo)], max_new_tokens=1)
    assert refused.value.exit_code == 2
    # an image over the decoder's pixel limit (its header says 12000 x 12000): to resize,
    # as mimo-generate has no option raising it
    import struct
    import zlib
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I",
                                                                      zlib.crc32(kind + data))
    huge = tmp_path / "huge.png"
    huge.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(
        ">IIBBBBB", 12000, 12000, 8, 2, 0, 0, 0)) + chunk(b"IDAT", b"") + chunk(b"IEND", b""))
    with pytest.raises(GenerateError, match=re.escape(
            f"--image {huge}: 12000x12000 = 144000000 pixels is above the limit of ")) as refused:
        generator.generate("Describe.", images=[str(huge)], max_new_tokens=1)
    assert str(refused.value).endswith(": resize it first") and refused.value.exit_code == 1


def test_a_clip_the_model_hears_only_the_start_of_is_said(generator, assets, monkeypatch,
                                                          capsys):
    """Under ``long_audio: truncate`` a clip longer than ``max_duration`` is cut, as in
    training: generation says so on stderr, naming the file and what it hears."""
    import dataclasses
    from types import SimpleNamespace

    from mimo_data.modalities.audio import AudioConfig
    config = generator.preprocessor.config
    short = dataclasses.replace(AudioConfig(), long_audio="truncate", max_duration=0.5)
    monkeypatch.setattr(generator, "preprocessor", SimpleNamespace(config=dataclasses.replace(
        config, modalities={**config.modalities, "audio": short})))
    capsys.readouterr()
    generator._say_cut("audio", str(assets["wav"]), {"duration": 2.25})
    assert capsys.readouterr().err == (f"mimo-generate: --audio {assets['wav']} is 2.2 s; the "
                                       "model hears its first 0.5 s (modalities.audio."
                                       "max_duration, long_audio: truncate)\n")
    generator._say_cut("audio", str(assets["wav"]), {"duration": 0.4})      # whole: nothing
    assert capsys.readouterr().err == ""


def test_a_prompt_longer_than_the_trained_sequences_is_said(generator, monkeypatch, capsys):
    """A prompt whose answer may run past ``seq_length`` gets a line on stderr giving both
    lengths; one within it none."""
    import dataclasses
    prompt = "Name a colour."
    capsys.readouterr()
    length = len(generator.generate(prompt, max_new_tokens=2).prompt_ids)
    assert capsys.readouterr().err == ""
    config = dataclasses.replace(generator.preprocessor.config, seq_length=length + 1)
    monkeypatch.setattr(generator.preprocessor, "config", config)
    generator.generate(prompt, max_new_tokens=2)
    assert capsys.readouterr().err == (
        f"mimo-generate: the prompt is {length} tokens (media included), up to {length + 2} "
        f"with --max-new-tokens 2; the model trained on sequences of at most {length + 1} "
        "(seq_length in its preprocess.yaml): answers past that length are outside what it "
        "learned\n")


def test_no_thinking_on_a_template_without_it_is_said(generator, smollm2, capsys):
    """SmolLM2's template reads no ``enable_thinking``: --no-thinking is said to change
    nothing, and the prompt is the same."""
    from mimo_train.hf.generate import main
    capsys.readouterr()
    plain = generator.generate("Name a colour.", max_new_tokens=1)
    assert capsys.readouterr().err == ""
    same = generator.generate("Name a colour.", max_new_tokens=1, thinking=False)
    assert same.prompt_ids == plain.prompt_ids
    assert capsys.readouterr().err == ("mimo-generate: --no-thinking: the model's chat "
                                       "template reads no enable_thinking (it has no thinking "
                                       "to turn off): the prompt is the same\n")
    assert main(["--model", str(smollm2.export), "--prompt", "Hi", "--max-new-tokens",
                 "1", "--no-thinking", "--device", "cpu"]) == 0
    assert "--no-thinking: the model's chat template" in capsys.readouterr().err


def test_sampling_is_reproducible_from_its_seed(generator, smollm2, capsys):
    """At temperature 5 the next token is nearly uniform over 49k tokens: 6 of them repeat
    only from the same seed, and never match the greedy answer by chance; ``top_k`` 1 (``--top-k
    1``) leaves the likeliest token alone to draw: the greedy answer at any temperature."""
    from mimo_train.hf.generate import main
    prompt = "Name a colour."
    first, again, other = (generator.generate(prompt, max_new_tokens=6, temperature=5.0,
                                              seed=seed).token_ids for seed in (1, 1, 2))
    greedy = generator.generate(prompt, max_new_tokens=6).token_ids
    assert first == again
    assert first != other and first != greedy
    assert generator.generate(prompt, max_new_tokens=6, temperature=5.0, seed=1,
                              top_k=1).token_ids == greedy
    answers = []
    for flags in ([], ["--temperature", "5", "--top-k", "1", "--seed", "1"]):
        capsys.readouterr()
        assert main(["--model", str(smollm2.export), "--prompt", prompt, "--max-new-tokens",
                     "6", "--device", "cpu", *flags]) == 0
        answers.append(capsys.readouterr().out)
    assert answers[0] == answers[1] == generator.tokenizer.decode(
        greedy, skip_special_tokens=True) + "\n", answers


def test_generate_refuses_bad_inputs(generator, smollm2, tmp_path, capsys, monkeypatch):
    from mimo_train.hf.generate import Generation, Generator, main
    from mimo_train.errors import GenerateError

    # an answer that ends at once (the first token the end of the turn) is said, not an
    # empty line alone
    end = generator.tokenizer.convert_tokens_to_ids("<|im_end|>")
    space = generator.tokenizer.encode(" ", add_special_tokens=False)
    for new, said in (([end], " (a model that ends its answer at once has often barely "
                       "trained; --temperature T samples instead of taking the likeliest "
                       "token)"), ([*space, end], "")):        # blank text, then the end
        with monkeypatch.context() as patch:
            patch.setattr(Generator, "generate",
                          lambda *a, new=new, **k: Generation(" ", new, [], {}))
            assert main(["--model", str(smollm2.export), "--prompt", "Hi", "--device",
                         "cpu"]) == 0
        out = capsys.readouterr()
        shown = generator.tokenizer.decode(new)
        assert out.out == " \n" and out.err == (
            f"mimo-generate: note: the answer is empty: the model generated {len(new)} "
            f"token(s), {shown!r}, and no text{said}\n")

    with pytest.raises(GenerateError, match="no-such.jpg") as error:
        generator.generate("What is this?", images=[str(tmp_path / "no-such.jpg")])
    assert error.value.exit_code == 2
    assert str(error.value).endswith("no-such.jpg: No such file or directory")
    notes = tmp_path / "notes.jpg"                   # text under an image's name
    notes.write_text("root:x:0:0:root:/root:/bin/bash\n")
    with pytest.raises(GenerateError, match=f"--image {notes}: .*not a readable image") as error:
        generator.generate("What is this?", images=[str(notes)])
    assert " at 0x" not in str(error.value)
    with pytest.raises(GenerateError, match="the prompt's <video> marker asks for video input, "
                       r"but the model has no video encoder \(it has audio, image\): remove"):
        generator.generate("<video> What happens?")
    with pytest.raises(GenerateError, match="the prompt has 2 <image> marker"):
        generator.generate("<image><image> Compare them.", images=[str(tmp_path / "a.jpg")])
    with pytest.raises(GenerateError, match=r"the prompt's <image> marker\(s\) ask for image "
                       r"input, and no --image file is given: give it \(--image FILE\)"):
        generator.generate("<image> What is this?")
    # one marker for two files: which one it meant would be a guess
    with pytest.raises(GenerateError, match=r"1 <audio> marker\(s\) for 2 --audio file\(s\): "
                       "mark each"):
        generator.generate("Compare: <audio> then", audios=["a.wav", "b.wav"])
    assert main(["--model", str(tmp_path), "--prompt", "Hi"]) == 2
    assert "manifest.json" in capsys.readouterr().err
    for model, said in ((notes, "is a file"), (tmp_path / "gone", "is not there")):
        assert main(["--model", str(model), "--prompt", "Hi"]) == 2
        assert capsys.readouterr().err == f"mimo-generate: --model {model} {said}: give the " \
            "directory mimo-export wrote (it holds manifest.json)\n"
    for flags in (["--seed", "3"], ["--top-p", "0.9", "--seed", "3"],   # greedy: unused
                  ["--top-k", "5"]):
        with pytest.raises(SystemExit) as exit_:
            main(["--model", str(smollm2.export), "--prompt", "Hi", *flags])
        assert exit_.value.code == 2
        assert "go with --temperature: without it decoding is greedy" in \
            capsys.readouterr().err.replace("goes with", "go with")
    published = REPO / "assets" / "models" / "tiny-qwen2-vl"        # not an export: said
    assert main(["--model", str(published), "--prompt", "Hi"]) == 2
    assert f"--model {published} is a transformers model (config.json, no manifest.json), " \
        "not a mimo-export folder" in capsys.readouterr().err
    for checkpoint in (smollm2.checkpoint, smollm2.checkpoint.parent):   # step, checkpoint.dir
        assert main(["--model", str(checkpoint), "--prompt", "Hi"]) == 2
        assert f"--model {checkpoint} is a mimo-train checkpoint, not an export: mimo-export " \
            f"--checkpoint {checkpoint} --output OUT" in capsys.readouterr().err
    # a copy cut short or missing a file: named from manifest.json's sizes, before any load
    copy = tmp_path / "copy"
    for path in smollm2.export.rglob("*"):          # links to the export's files
        if path.is_file():
            (copy / path.relative_to(smollm2.export)).parent.mkdir(parents=True, exist_ok=True)
            (copy / path.relative_to(smollm2.export)).symlink_to(path)
    weights = copy / "language" / "model.safetensors"
    weights.unlink()
    weights.write_bytes((smollm2.export / "language" / "model.safetensors").read_bytes()[:1000])
    (copy / "image" / "model.safetensors").unlink()
    assert main(["--model", str(copy), "--prompt", "Hi"]) == 1
    size = (smollm2.export / "language" / "model.safetensors").stat().st_size
    assert capsys.readouterr().err == (
        f"mimo-generate: --model {copy} is not as mimo-export wrote it: image/model.safetensors "
        f"is gone; language/model.safetensors is 1,000 bytes, mimo-export wrote {size:,}. Copy "
        "it again from where it was exported, or export the checkpoint again\n")
    weights.unlink()
    weights.symlink_to(smollm2.export / "language" / "model.safetensors")
    # an export made before the sizes were listed: a weights file that is not one said so
    (copy / "image" / "model.safetensors").write_bytes(b"not safetensors")
    manifest = json.loads((copy / "manifest.json").read_text())
    (copy / "manifest.json").unlink()
    (copy / "manifest.json").write_text(json.dumps({key: value for key, value in
                                                    manifest.items() if key != "files"}))
    assert main(["--model", str(copy), "--prompt", "Hi", "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"mimo-generate: --model {copy} cannot be loaded (") and \
        err.endswith("): the export is damaged or incomplete; copy it again from where it was "
                     "exported, or export the checkpoint again\n") and "Traceback" not in err
    # a config edited since (its size is not checked, a weights file's is) that transformers
    # cannot read is not called damaged: exit 2 naming the version
    (copy / "image" / "model.safetensors").unlink()
    (copy / "image" / "model.safetensors").symlink_to(smollm2.export / "image" /
                                                      "model.safetensors")
    (copy / "manifest.json").write_text(json.dumps(manifest))
    config = json.loads((smollm2.export / "language" / "config.json").read_text())
    (copy / "language" / "config.json").unlink()
    (copy / "language" / "config.json").write_text(json.dumps({**config,
                                                               "model_type": "mimo-future"}))
    assert main(["--model", str(copy), "--prompt", "Hi", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mimo-generate: --model {copy} cannot be loaded by transformers ") \
        and "mimo-future" in err and "damaged" not in err and "Traceback" not in err, err
