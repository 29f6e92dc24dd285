"""LoRA (``model.lora``) and per-module optimizer settings on a published checkpoint's replica
(Qwen2-VL-2B's files, dims shrunk): adapters on every linear layer of the language model
(megatron-core's fused ``linear_qkv`` / ``linear_fc1`` included) and on two kinds of the vision
tower's layers (with random B, so that they change the model), the tower's optimizer at lr 0.

- a LoRA run started (``model.init_from``) from a full checkpoint has step 1's loss of the model
  without adapters (B zero) and trains only its adapters: every other weight is fixed;
- a short LoRA fine-tune's loss falls, the records give each module's learning rate, the
  checkpoint's fixed weights (base and the lr-0 tower's adapters) are bitwise those it started
  from, and it resumes under another layout (tower on its own rank, language tp2) with the
  uninterrupted losses;
- the adapters' gradients of a colocated step equal those under language tp2 and under
  language pp2, each with the tower on its own rank, and under the tower's fan-in (image dp2
  into language dp1) (fp32, 1e-5);
- the export with the adapters merged gives mimo's logits (1e-4); the adapters alone, in
  PEFT's format, loaded by ``peft.PeftModel.from_pretrained`` on the published base give the
  same logits; ``mimo-generate`` gives the same tokens from either.

Its jobs are its own (no existing run builds adapters): one fine-tune, whose checkpoints every
later job starts from (``model.init_from``), and one-step jobs at lr 0 (``runs.step``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch


from conftest import MODELS, build_dataset
from support.runs import assert_continues, compare, copy_checkpoint, step, train, write_meta
from support.vlm_runs import logits, transformers_logits

BASE = MODELS / "published" / "Qwen--Qwen2-VL-2B-Instruct"
SAMPLES = 4
LAYOUT = "layout=language=dp1;image=dp1,off0"
# the language model's second MLP adapted in its last layer only (a layer's own adapter,
# saved apart from the layers' stacked tensors)
LORA = ("model.lora={language: {rank: 4, alpha: 8, targets: [linear_qkv, linear_proj, "
        "linear_fc1, decoder.layers.1.mlp.linear_fc2]}, image: {rank: 2, alpha: 4, "
        "targets: [attn.qkv, mlp.fc2], init_lora_weights: false}}")
TRAIN_STEPS = 6
LOGITS_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def setup(corpus, tmp_path_factory) -> dict:
    """Shards of four conversations (two images over two turns, text only, one image each)
    and the overrides every run shares."""
    import yaml

    from mimo_train.families.registry import preprocessing_for
    tmp = tmp_path_factory.mktemp("lora")
    images = corpus / "images"
    records = [
        {"id": "two", "image": [str(images / "chelsea.jpg"), str(images / "rocket.jpg")],
         "conversations": [
             {"from": "human", "value": "<image>What animal is this?"},
             {"from": "gpt", "value": "A cat, lying down."},
             {"from": "human", "value": "<image>And here?"},
             {"from": "gpt", "value": "A rocket on its launch pad."}]},
        {"id": "text", "conversations": [
            {"from": "human", "value": "What is a tar file?"},
            {"from": "gpt", "value": "An archive of files."}]},
        {"id": "page", "image": str(images / "page.png"), "conversations": [
            {"from": "human", "value": "<image>Read the page."},
            {"from": "gpt", "value": "A page of printed text."}]},
        {"id": "hopper", "image": str(images / "grace_hopper.jpg"), "conversations": [
            {"from": "human", "value": "<image>Who is this?"},
            {"from": "gpt", "value": "Grace Hopper, in uniform."}]}]
    (tmp / "records.json").write_text(json.dumps(records))
    build_dataset([tmp / "records.json"], tmp / "shards")
    config = preprocessing_for(str(BASE))
    config["modalities"].pop("video", None)
    config["modalities"]["image"]["max_pixels"] = 37632
    preprocess = tmp / "preprocess.yaml"
    preprocess.write_text(yaml.safe_dump({**config, "seq_length": 2048}))
    common = [f"data.datasets=[{tmp / 'shards'}]", f"data.preprocess={preprocess}",
              f"model.pretrained={BASE}", "model.freeze=[]",
              f"train.global_batch_size={SAMPLES}", "train.device=cpu",
              "optimizer.warmup_steps=0", "train.seed=3"]
    return dict(tmp=tmp, preprocess=preprocess, common=common)


def _step(ranks, setup, name: str, *overrides, nproc: int = 1, layout: str = LAYOUT,
          **flags) -> dict:
    """One step at lr 0 (``runs.step``), one sample per micro-batch."""
    return step(ranks, setup["tmp"] / name, nproc, layout, "train.micro_batch_size=1",
                *setup["common"], "train.steps=1", "optimizer.lr=0", "optimizer.min_lr=0",
                *overrides, **flags)


@pytest.fixture(scope="module")
def full_init(ranks, setup) -> tuple[dict, str]:
    """The imported model's step without adapters, and its checkpoint (step 0, no adapters)."""
    result = _step(ranks, setup, "full", save_init=setup["tmp"] / "full-init")
    return result, str(setup["tmp"] / "full-init" / "step_0000000")


@pytest.fixture(scope="module")
def finetune(ranks, setup) -> tuple[list[dict], Path]:
    """The LoRA fine-tune (colocated, one rank): its records and checkpoint.dir (steps 3, 6)."""
    checkpoints = setup["tmp"] / "checkpoints"
    records = train(ranks, setup["tmp"], "finetune", "qwen2_vl_finetune.yaml", LAYOUT,
                    f"checkpoint.dir={checkpoints}", "checkpoint.interval=3",
                    *setup["common"], LORA, f"train.steps={TRAIN_STEPS}",
                    "train.micro_batch_size=4", "optimizer.lr=1e-2", "optimizer.min_lr=1e-3",
                    "optimizer.modules={image: {lr: 0}}", nproc=1)
    return records, checkpoints


def test_a_lora_run_from_a_full_checkpoint_starts_at_its_loss(ranks, setup, full_init):
    """B is zero at the start: the adapted model is the model; only adapters train."""
    full, init = full_init
    lora = _step(ranks, setup, "lora-start", LORA, "model.lora.image.init_lora_weights=true",
                 f"model.init_from={init}")
    assert lora["tokens"] == full["tokens"] > 0
    assert lora["loss_sum"] / lora["tokens"] == pytest.approx(
        full["loss_sum"] / full["tokens"], abs=1e-6)
    for module, grads in lora["grads"].items():
        assert grads and all(".lora." in name for name in grads), module
    fixed = lora["ranks"][0]["fixed"]
    assert len(fixed["language"]) == len(full["grads"]["language"])   # every weight of its own
    assert all(".lora." not in name for names in fixed.values() for name in names)
    # B zero: A's gradients are zero, B's are not
    language = lora["grads"]["language"]
    assert all(g.abs().sum() == 0 for n, g in language.items() if n.endswith("lora.a.weight"))
    assert all(g.abs().sum() > 0 for n, g in language.items() if n.endswith("lora.b.weight"))


def test_lora_finetune_loss_falls_with_each_modules_learning_rate(finetune):
    records, _ = finetune
    steps = [r for r in records if "loss" in r]
    assert len(steps) == TRAIN_STEPS
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.5, [r["loss"] for r in steps]
    for record in steps:
        assert set(record["lrs"]) == {"language", "image"}
        assert record["lrs"]["image"] == 0.0
        assert record["lrs"]["language"] == record["lr"] > 0


def test_fixed_weights_stay_bitwise_in_the_checkpoint(ranks, setup, full_init, finetune,
                                                     capsys):
    """Against the run's starting weights (the same config's step 0, saved): the base and the
    lr-0 tower (its adapters included) unchanged, the language adapters moved; the
    checkpoint names its base by path and digest."""
    from mimo_train.components.checkpoint import load_weights
    from mimo_train.components.digests import weights_digest
    from mimo_train.inspect_cli import main as inspect_main
    _, checkpoints = finetune
    _step(ranks, setup, "lora-init", LORA, save_init=setup["tmp"] / "lora-init")
    start = load_weights(str(setup["tmp"] / "lora-init" / "step_0000000"))
    end = load_weights(str(checkpoints / f"step_{TRAIN_STEPS:07d}"))
    moved = []
    for module, tensors in start.items():
        assert set(end[module]) == set(tensors)
        for key, tensor in tensors.items():
            if torch.equal(end[module][key], tensor):
                continue
            assert module == "language" and ".lora." in key, f"{module}.{key} changed"
            moved.append(key)
    assert sorted(moved) == sorted(k for k in start["language"] if ".lora." in k)
    assert {k for k in start["language"] if k.startswith("decoder.layers.") and
            ".linear_fc2.lora." in k} == {"decoder.layers.1.mlp.linear_fc2.lora.a.weight",
                                          "decoder.layers.1.mlp.linear_fc2.lora.b.weight"}
    assert any(".lora." in k for k in start["image"])
    meta = json.loads((checkpoints / f"step_{TRAIN_STEPS:07d}" / "meta.json").read_text())
    assert meta["lora_base"] == [{"key": "model.pretrained", "path": str(BASE),
                                  "sha256": weights_digest(str(BASE))}]
    # mimo-inspect checkpoint names the base the adapters alone are exported onto
    assert inspect_main(["checkpoint", str(checkpoints)]) == 0
    said = capsys.readouterr().out
    assert f"LoRA over model.pretrained {BASE} (weights' sha256 " \
        f"{weights_digest(str(BASE))[:12]}…); `mimo-export --adapters` needs" in said, said


def _with_meta(step: Path, root: Path, edit) -> Path:
    """A checkpoint.dir whose latest is a copy of ``step`` with its meta.json changed by
    ``edit`` (its integrity manifest updated, as if the run had saved it so)."""
    copy = copy_checkpoint(step, root)
    meta = json.loads((copy / step.name / "meta.json").read_text())
    edit(meta)
    write_meta(copy / step.name, meta)
    return copy


def test_lora_resumes_under_another_layout(ranks, setup, finetune):
    """Also: the base's digest the checkpoint records is carried to the resumed run's
    checkpoints (its fixed weights come from the checkpoint, not from model.pretrained as it
    is now); a marker digest stands for a base replaced since."""
    records, checkpoints = finetune
    marker = "0" * 64
    resumed_dir = _with_meta(checkpoints / "step_0000003", setup["tmp"] / "resumed",
                             lambda meta: meta["lora_base"][0].update(sha256=marker))
    resumed = train(ranks, setup["tmp"], "resumed", "qwen2_vl_finetune.yaml",
                    "layout=image=dp1;language=tp2", f"checkpoint.dir={resumed_dir}",
                    *setup["common"], LORA, f"train.steps={TRAIN_STEPS}",
                    "train.micro_batch_size=4", "optimizer.lr=1e-2", "optimizer.min_lr=1e-3",
                    "optimizer.modules={image: {lr: 0}}", nproc=3)
    assert_continues(resumed, records, [4, 5, 6], loss=1e-4, grad_norm_rel=1e-3)
    meta = json.loads((resumed_dir / f"step_{TRAIN_STEPS:07d}" / "meta.json").read_text())
    assert meta["lora_base"][0]["sha256"] == marker


@pytest.fixture(scope="module")
def trained_step(ranks, setup, finetune) -> tuple[dict, str]:
    """A colocated step from the fine-tune's step 3 (adapters A and B both non-zero)."""
    _, checkpoints = finetune
    init = str(checkpoints / "step_0000003")
    return _step(ranks, setup, "trained-colocated", LORA, f"model.init_from={init}"), init


@pytest.mark.parametrize("layout", ["image=dp1;language=tp2", "image=dp1;language=pp2",
                                    "image=dp2;language=dp1"])
def test_lora_gradients_match_under_other_layouts(ranks, setup, trained_step, layout):
    """Language tp2 and pp2 with the tower on its own rank; the tower's fan-in (dp2). Under
    tp2 the loss is taken in chunks (``model.language.loss_chunk_tokens``): the output layer,
    tied to the embedding and fixed under LoRA, gets no gradient made."""
    reference, init = trained_step
    other = _step(ranks, setup, layout.replace(";", "-"), LORA, f"model.init_from={init}",
                  "train.micro_batch_size=2" if "image=dp2" in layout else
                  "train.micro_batch_size=1", *(["model.language.loss_chunk_tokens=97"]
                                                if "tp2" in layout else []),
                  nproc=3, layout=f"layout={layout}")
    compare(reference, other, layout)


def test_merged_and_peft_exports_give_mimos_logits(ranks, setup, finetune, corpus, capsys):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from mimo_train.hf.export import main
    from mimo_train.hf.generate import Generator
    _, checkpoints = finetune
    final = checkpoints / f"step_{TRAIN_STEPS:07d}"
    merged, adapters = setup["tmp"] / "merged", setup["tmp"] / "adapters"
    # in the trained dtype (the base's, bf16, by default): mimo's fp32 logits to 1e-4
    assert main(["--checkpoint", str(final), "--output", str(merged), "--dtype", "float32"]) == 0
    capsys.readouterr()
    assert main(["--checkpoint", str(final), "--output", str(adapters), "--adapters"]) == 0
    assert "weights in float32 (the trained weights'): the adapters alone" in \
        capsys.readouterr().out
    ours = logits(ranks, setup["tmp"], "lora-logits", setup["common"], LORA,
                  f"model.init_from={final}")
    batch = ours["batch"]
    model = AutoModelForImageTextToText.from_pretrained(merged, dtype=torch.float32).eval()
    expected, mask = transformers_logits(model, batch, setup["preprocess"])
    length, vocab = expected.shape[1:]
    assert (ours["logits"][:, :length, :vocab] - expected)[mask].abs().max() <= LOGITS_TOLERANCE
    base = AutoModelForImageTextToText.from_pretrained(BASE, dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, adapters).eval()
    assert (transformers_logits(peft, batch, setup["preprocess"])[0] - expected)[mask].abs(
        ).max() <= LOGITS_TOLERANCE
    plain = AutoModelForImageTextToText.from_pretrained(BASE, dtype=torch.float32).eval()
    assert (transformers_logits(plain, batch, setup["preprocess"])[0] - expected)[mask].abs(
        ).max() > 100 * LOGITS_TOLERANCE                  # the adapters change the model
    config = json.loads((adapters / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and (config["r"], config["lora_alpha"]) == (4, 8)
    assert set(config["rank_pattern"].values()) == {2}

    image = str(corpus / "images" / "grace_hopper.jpg")
    tokens = [Generator(str(path)).generate("Who is this?", images=[image],
                                            max_new_tokens=6).token_ids
              for path in (merged, adapters)]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 6
    # the adapters' base moved away since the export: one error naming it, no traceback
    from mimo_train.errors import GenerateError
    manifest = json.loads((adapters / "manifest.json").read_text())
    manifest["adapters"]["base"] = str(setup["tmp"] / "moved-base")
    (adapters / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(GenerateError, match=f"their base {setup['tmp'] / 'moved-base'} "
                       r"\(manifest.json's adapters.base\) cannot be loaded \(no such directory\): "
                       "restore it there, or give where it is now with --base DIR"):
        Generator(str(adapters))
    shutil.copytree(BASE, setup["tmp"] / "base-copy")          # --base: where it is now
    assert Generator(str(adapters), base=str(setup["tmp"] / "base-copy")).generate(
        "Who is this?", images=[image], max_new_tokens=6).token_ids == tokens[1]
    with pytest.raises(GenerateError, match="--base goes with an export of LoRA adapters alone"):
        Generator(str(merged), base=str(BASE))


def test_the_adapters_alone_go_only_onto_the_base_they_trained_on(setup, finetune, capsys):
    """A base changed since the run (one weight moved): ``--adapters`` refuses it (exit 1),
    and generation refuses an export whose base changed since; a run whose fixed weights came
    from ``model.init_from`` is refused (exit 2); a checkpoint saved before runs recorded the
    base's digest is exported with a note, its manifest recording the digest from then on."""

    from safetensors.torch import load_file, save_file

    from mimo_train.errors import GenerateError
    from mimo_train.hf.export import main
    from mimo_train.hf.generate import Generator
    _, checkpoints = finetune
    tmp = setup["tmp"]
    changed = tmp / "changed-base"
    shutil.copytree(BASE, changed)
    weights = load_file(changed / "model.safetensors")
    name = next(iter(weights))
    weights[name] = weights[name] + 1e-3
    save_file(weights, changed / "model.safetensors", metadata={"format": "pt"})

    def rewritten(label: str, edit) -> Path:
        return _with_meta(checkpoints / f"step_{TRAIN_STEPS:07d}", tmp / label, edit)

    moved = rewritten("on-changed", lambda m: m["config"]["model"].update(pretrained=str(changed)))
    capsys.readouterr()
    assert main(["--checkpoint", str(moved), "--output", str(tmp / "x1"), "--adapters"]) == 1
    assert f"the base model.pretrained {changed} is not the one the run trained on" in \
        capsys.readouterr().err and not (tmp / "x1").exists()
    # given as --base: named so, and the advice is another --base (or the merged export,
    # whose base is checked by names and shapes: another revision of the model would do)
    assert main(["--checkpoint", str(checkpoints / f"step_{TRAIN_STEPS:07d}"), "--output",
                 str(tmp / "x1"), "--adapters", "--base", str(changed)]) == 1
    err = capsys.readouterr().err
    assert f"--adapters: --base {changed} is not the one the run trained on" in err and \
        "model. Give --base the model the run started from. A merged export (without " \
        "--adapters) takes the trained weights from the checkpoint and only the config from " \
        "the base: another revision of the base (the same weights' names and shapes) does " \
        "for it" in err and "Restore" not in err, err
    init = rewritten("from-init", lambda m: m["config"]["model"].update(
        init_from=str(checkpoints / "step_0000003")))
    assert main(["--checkpoint", str(init), "--output", str(tmp / "x2"), "--adapters"]) == 2
    assert "the run's fixed weights came from model.init_from" in capsys.readouterr().err

    older = rewritten("unrecorded", lambda m: m.pop("lora_base"))
    out = tmp / "unrecorded-adapters"
    assert main(["--checkpoint", str(older), "--output", str(out), "--adapters"]) == 0
    assert "records no digest of the base" in capsys.readouterr().out
    manifest = json.loads((out / "manifest.json").read_text())
    meta = json.loads((checkpoints / f"step_{TRAIN_STEPS:07d}" / "meta.json").read_text())
    assert manifest["adapters"] == {"base": str(BASE), "sha256": meta["lora_base"][0]["sha256"]}
    manifest["adapters"]["base"] = str(changed)       # the base replaced after the export
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(GenerateError, match=f"trained on other weights than those of their "
                       f"base {changed} now") as refused:
        Generator(str(out))
    assert refused.value.exit_code == 1          # as mimo-export --adapters refuses it
    with pytest.raises(GenerateError, match=f"base {changed} now .*give the one they trained "
                       "on with --base DIR"):                   # --base checked the same
        Generator(str(out), base=str(changed))


def test_a_lora_checkpoint_is_refused_by_a_run_without_its_adapters(tmp_path):
    """Its weights without the adapters are not the model it saved."""
    from mimo_train.components.checkpoint_fit import _check_adapters
    from mimo_train.errors import CheckpointError
    layer = "language_model.module.decoder.layers.self_attention.linear_qkv."
    saved = {layer + "weight", layer + "lora.a.weight", layer + "lora.b.weight"}
    meta = {"config": {"model": {"lora": {"language": {"rank": 4}}}}}
    _check_adapters(str(tmp_path), set(saved), saved, meta, {})          # the same adapters
    with pytest.raises(CheckpointError, match="holds LoRA adapters .* on layers this run does "
                       "not adapt, e.g. .*linear_qkv.lora.a.weight: give this run the same "
                       "model.lora"):
        _check_adapters(str(tmp_path), {layer + "weight"}, saved, meta, {})
    # an adapter of one layer only (1 of 2), saved as that layer's tensor beside the stacked
    # weights: refused by the rank that holds layer 1, not by a pipeline stage of layer 0
    from megatron.core.dist_checkpointing import ShardedTensor

    from mimo_train.components.checkpoint_fit import _numbered_layers
    one = "language_model.module.decoder.layers.1.self_attention.linear_qkv."
    saved = {layer + "weight", one + "lora.a.weight"}

    def held(*layers):
        tensors = [ShardedTensor.from_rank_offsets(layer + "weight", torch.zeros(2, 2),
                                                   (0, i, 2), prepend_axis_num=1)
                   for i in layers]
        return {layer + "weight"} | _numbered_layers(tensors)
    for layers in ((0, 1), (1,)):
        with pytest.raises(CheckpointError, match="e.g. .*layers.1.self_attention.linear_qkv"):
            _check_adapters(str(tmp_path), held(*layers), saved, meta, {})
    _check_adapters(str(tmp_path), held(0), saved, meta, {})
    _check_adapters(str(tmp_path), held(0, 1) | {one + "lora.a.weight"}, saved, meta, {})
    # the refusal names what this run's model.lora changed, and for a frozen part the lr-0 way
    tower = "modality_submodules.image.module.encoders.image.encoder.model.blocks.0.attn.proj."
    saved = {tower + "weight", tower + "lora.a.weight"}
    meta = {"config": {"model": {"lora": {"image": {"targets": ["attn.qkv", "attn.proj"]}}}}}
    with pytest.raises(CheckpointError, match=r"model.lora.image.targets \['attn.qkv', "
                       r"'attn.proj'\] in the checkpoint, \['attn.qkv'\] in this run"):
        _check_adapters(str(tmp_path), {tower + "weight"}, saved, meta,
                        {"lora": {"image": {"targets": ["attn.qkv"]}}, "freeze": []})
    with pytest.raises(CheckpointError, match=r"model.lora.image is set in the checkpoint, not "
                       r"in this run \(model.freeze holds image: .* drop image from model."
                       r"freeze, .* optimizer.modules.image.lr=0 and optimizer.modules.image."
                       r"min_lr=0\)"):
        _check_adapters(str(tmp_path), {tower + "weight"}, saved, meta,
                        {"lora": {}, "freeze": ["image"]})
    # a part's tower adapted, the whole module frozen now: the module's lr, said as all of it
    meta = {"config": {"model": {"lora": {"image.encoder": {"targets": ["attn.proj"]}}}}}
    with pytest.raises(CheckpointError, match=r"model.freeze holds image: .* keep model.lora."
                       r"image.encoder and set optimizer.modules.image.lr=0 and optimizer."
                       r"modules.image.min_lr=0, which stops all of image\)"):
        _check_adapters(str(tmp_path), {tower + "weight"}, saved, meta,
                        {"lora": {}, "freeze": ["image"]})
    # the same targets in another order are none changed (no clause for them)
    meta = {"config": {"model": {"lora": {"image": {"targets": ["attn.proj", "attn.qkv"]}}}}}
    with pytest.raises(CheckpointError) as refused:
        _check_adapters(str(tmp_path), {tower + "weight"}, saved, meta,
                        {"lora": {"image": {"targets": ["attn.qkv", "attn.proj"]}}, "freeze": []})
    assert "targets" not in str(refused.value).partition("merged export")[2]


def test_module_settings_inherit_and_scale_min_lr(tmp_path):
    from mimo_train.config import TrainConfig
    from mimo_train.errors import TrainConfigError
    cfg = TrainConfig.load(None, ["data.datasets=[x]", "optimizer.lr=1e-3",
                                  "optimizer.min_lr=1e-4", "optimizer.warmup_steps=2",
                                  "optimizer.modules={image: {lr: 1e-4}, audio: {lr: 0}, "
                                  "language: {weight_decay: 0.1, min_lr: 0}}"])
    image, audio, language = (cfg.optimizer.of(m) for m in ("image", "audio", "language"))
    assert (image.lr, image.min_lr, image.warmup_steps) == (1e-4, pytest.approx(1e-5), 2)
    assert (audio.lr, audio.min_lr) == (0, 0)
    assert (language.lr, language.min_lr, language.weight_decay) == (1e-3, 0, 0.1)
    assert cfg.optimizer.of("other") == cfg.optimizer.of("")
    with pytest.raises(TrainConfigError, match="optimizer.modules.image.min_lr 0.1 must be in"):
        TrainConfig.load(None, ["data.datasets=[x]", "optimizer.modules.image.min_lr=0.1"])


def test_another_lora_rank_or_targets_on_resume_is_named_as_such():
    """A checkpoint's adapters of rank 4 resumed by a run of rank 8: the refusal says the
    ranks, not only 'another model configuration', for a tower's adapters and the language
    model's, saved stacked over its layers ((layers, rank, in), as a real checkpoint's
    metadata gives them). Started from it (model.init_from, which needs its shapes), the
    advice is its rank or its merged export, not model.init_from again."""
    from mimo_train.components.checkpoint_fit import _why_shapes_differ
    layer = "language_model.module.decoder.layers.self_attention.linear_qkv."
    saved = {"config": {"model": {"lora": {"language": {"rank": 4}, "image": {"rank": 8}}}}}
    said = "it was saved with model.lora.language.rank 4, this run's is 8: "
    assert _why_shapes_differ(layer + "lora.a.weight", (4, 64), (8, 64), saved, True) == \
        said + "resume with the checkpoint's rank, or, for new adapters of another rank, " \
        "start a new run in another checkpoint.dir from its merged export (mimo-export) as " \
        "model.pretrained (model.init_from takes its rank only)"     # not init_from alone
    assert _why_shapes_differ(layer + "lora.a.weight", (2, 4, 64), (2, 8, 64),
                              saved, True).startswith(said)
    assert _why_shapes_differ(layer + "lora.b.weight", (2, 64, 4), (2, 64, 8),
                              saved, True).startswith(said)
    assert _why_shapes_differ(layer + "lora.b.weight.query", (64, 4), (64, 8),
                              saved, True).startswith(said)
    started = _why_shapes_differ(layer + "lora.a.weight", (4, 64), (8, 64), saved, False)
    assert started == said + "start from it with rank 4, or, for new adapters of another " \
        "rank, from its merged export (mimo-export) as model.pretrained, without " \
        "model.init_from"
    # another alpha (the same shapes): refused alike, pointing at the merged export
    from mimo_train.components.checkpoint_fit import check_lora_scale
    from mimo_train.errors import CheckpointError
    from mimo_train.config import LoraConfig
    with pytest.raises(CheckpointError, match=r"resume with alpha 16, or, for new adapters "
                       r"with another alpha, start a new run in another checkpoint.dir from "
                       r"its merged export \(mimo-export\) as model.pretrained"):
        check_lora_scale("/ck", {"config": {"model": {"lora": {"language": {"alpha": 16}}}}},
                         {"language": LoraConfig(alpha=8)})
    # a tower's adapters: its part named; a meta that does not say: the module
    tower = "modality_submodules.image.module.encoder.blocks.attn.qkv."
    assert _why_shapes_differ(tower + "lora.a.weight", (8, 64), (2, 64), saved,
                              True).startswith("it was saved with model.lora.image.rank 8, "
                                               "this run's is 2: ")
    assert _why_shapes_differ(tower + "lora.a.weight", (8, 64), (2, 64), {}, True).startswith(
        "it was saved with image's adapters at model.lora rank 8, this run's is 2: ")
    assert _why_shapes_differ(layer + "weight", (192, 64), (96, 64), saved, True) == \
        "it was saved for another model configuration"
    # other targets: the checkpoint lacks this run's adapters, said as model.lora, not as
    # another model.pretrained
    from mimo_train.components.checkpoint_fit import _lacks
    meta = {"config": {"model": {"pretrained": "/m", "lora": {"language": {"rank": 4}}}}}
    lacked = str(_lacks("/ck", [layer.replace("qkv", "fc1") + "lora.a.weight"], meta, ["l"]))
    assert "lacks 1 LoRA adapter weight(s) of this run" in lacked and "saved with model.lora " \
        "{'language': {'rank': 4}}, which adapts other parts or targets" in lacked
    meta_t = {"config": {"model": {"lora": {"language": {"targets": ["linear_qkv"]}}}}}
    assert str(_lacks("/ck", [layer.replace("qkv", "fc1") + "lora.a.weight"], meta_t, ["l"],
                      {"lora": {"language": {"targets": ["linear_qkv", "linear_fc1"]}}})
               ).endswith("; model.lora.language.targets ['linear_qkv'] in the checkpoint, "
                          "['linear_qkv', 'linear_fc1'] in this run")
    assert "model.pretrained /m" in str(_lacks("/ck", [layer + "weight"], meta, ["language"]))
    plain = {"config": {"model": {"pretrained": "/m", "lora": {}}}}
    assert "it was saved without LoRA adapters: to add them, start a new run from its " \
        "weights (model.init_from)" in str(_lacks("/ck", [layer + "lora.a.weight"], plain, []))
