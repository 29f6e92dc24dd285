"""What ``checkpoint_fit.check`` refuses before a tensor is read, in process on the tensors' names
(the multi-rank checks of a resumed run are in tests/test_train_run.py)."""

from __future__ import annotations

import pytest

from mimo_train.errors import CheckpointError


def test_a_checkpoint_with_a_projection_the_model_lacks_is_refused():
    """Saved with a linear projection after the image tower (a config of before per-module
    projections: model.projection linear beside a whole VLM), resumed with the VLM's own
    (none): its trained projection would be dropped without a word."""
    from mimo_train.components.checkpoint_fit import _check_projections
    image = "modality_submodules.image.module."
    wanted = {f"{image}encoders.image.encoder.model.merger.mlp.0.weight": (8, 8),
              "language_model.module.embedding.word_embeddings.weight": (32, 8)}
    saved = {**wanted, f"{image}input_projections.0.0.weight": None,
             f"{image}input_projections.0.0.bias": None,
             f"optimizer.state.exp_avg.{image}input_projections.0.0.weight": None}
    meta = {"config": {"model": {"projection": "linear", "encoders": {}}}}
    with pytest.raises(CheckpointError, match=r"holds projection weights of module 'image' "
                       r"that this run's model lacks, e.g. \['modality_submodules.image.module."
                       r"input_projections.0.0.bias', .*its config: \{'model.projection': "
                       r"'linear', 'model.encoders.image.projection': None\}"):
        _check_projections("ckpt", wanted, saved, meta)
    # the same kind as the model's: nothing to say; another module's: not this rank's to check
    _check_projections("ckpt", {**wanted, f"{image}input_projections.0.0.weight": (8, 8),
                                f"{image}input_projections.0.0.bias": (8,)}, saved, meta)
    _check_projections("ckpt", {"language_model.module.embedding.word_embeddings.weight":
                                (32, 8)}, saved, meta)


def test_a_resumed_lora_runs_other_alpha_is_refused():
    """The adapters' weights have the same shapes under another ``alpha``, which scales them:
    resumed so, they would give another model without a word. The checkpoint's part without
    this run's adapters, or the same alpha, passes."""
    from mimo_train.components.checkpoint_fit import check_lora_scale
    from mimo_train.config import LoraConfig
    meta = {"config": {"model": {"lora": {"language": {"rank": 4, "alpha": 8.0}}}}}
    with pytest.raises(CheckpointError, match=r"checkpoint ck's adapters of language trained "
                       r"with model.lora.language.alpha 8, this run's model.lora.language.alpha "
                       r"is 64: the same weights would give another model .* resume with "
                       r"alpha 8"):
        check_lora_scale("ck", meta, {"language": LoraConfig(rank=4, alpha=64)})
    check_lora_scale("ck", meta, {"language": LoraConfig(rank=4, alpha=8),
                                  "image.encoder": LoraConfig(alpha=2)})
    # a part named otherwise holding the same layers (the module, or its tower)
    tower = {"config": {"model": {"lora": {"image": {"alpha": 8}}}}}
    with pytest.raises(CheckpointError, match=r"adapters of image trained with "
                       r"model.lora.image.alpha 8, this run's model.lora.image.encoder.alpha "
                       r"is 64"):
        check_lora_scale("ck", tower, {"image.encoder": LoraConfig(alpha=64)})
    check_lora_scale("ck", tower, {"image.encoder": LoraConfig(alpha=8),
                                   "imagery": LoraConfig(alpha=2)})


def test_lora_on_a_part_and_on_one_inside_it_share_the_checkpoints_alpha():
    """A checkpoint trained with LoRA on a part inside a module (``model.lora`` key
    ``image.encoder``, alpha 8) resumed with the scale set on the module (``image``, alpha 16)
    holds the same layers' adapters under another scale: refused naming the checkpoint's alpha;
    so is the reverse nesting, and a ``model.init_from`` start says to start from it with that
    alpha."""
    from mimo_train.components.checkpoint_fit import check_lora_scale
    from mimo_train.config import LoraConfig
    inner = {"config": {"model": {"lora": {"image.encoder": {"rank": 4, "alpha": 8}}}}}
    with pytest.raises(CheckpointError, match=r"^checkpoint ck's adapters of image.encoder "
                       r"trained with model.lora.image.encoder.alpha 8, this run's "
                       r"model.lora.image.alpha is 16: the same weights would give another "
                       r"model \(the adapters scaled by alpha / rank\); resume with alpha 8,"):
        check_lora_scale("ck", inner, {"image": LoraConfig(rank=4, alpha=16)})
    with pytest.raises(CheckpointError, match=r"model.lora.image.alpha is 16: .*; start from it "
                       r"with alpha 8, or, for new adapters with another alpha, from its merged "
                       r"export \(mimo-export\) as model.pretrained$"):
        check_lora_scale("ck", inner, {"image": LoraConfig(rank=4, alpha=16)}, resume=False)
    check_lora_scale("ck", inner, {"image": LoraConfig(rank=4, alpha=8)})
    outer = {"config": {"model": {"lora": {"image": {"rank": 4, "alpha": 8}}}}}
    with pytest.raises(CheckpointError, match=r"^checkpoint ck's adapters of image trained "
                       r"with model.lora.image.alpha 8, this run's model.lora.image.encoder."
                       r"alpha is 16: .* resume with alpha 8,"):
        check_lora_scale("ck", outer, {"image.encoder": LoraConfig(rank=4, alpha=16)})


def test_a_checkpoint_of_another_model_names_the_settings_that_differ(tmp_path, monkeypatch):
    """Resumed (or started) with another model.pretrained or dims, a checkpoint's tensors have
    other shapes or are missing: the refusal names the model settings that differ from the
    checkpoint's and what to do, not only the first tensor; a module the run adds, by name."""
    import json
    import types

    import torch
    from megatron.core.dist_checkpointing import ShardedTensor

    from mimo_train.components import checkpoint_fit
    tower = "modality_submodules.image.module.encoders.image.encoder.model.patch_embed.proj.weight"
    saved_model = {"pretrained": "/models/Qwen2-VL-7B", "freeze": ["image"],
                   "language": {"hidden_size": 64, "num_layers": 2}}
    (tmp_path / "meta.json").write_text(json.dumps({
        "global_batch_size": 8, "config": {"model": saved_model, "train": {"precision": "fp32"}}}))
    (tmp_path / "integrity.json").write_text(json.dumps({"files": {}}))
    shapes = {tower: (64, 3, 2, 14, 14), "language_model.module.decoder.final_norm.weight": (64,)}
    monkeypatch.setattr(checkpoint_fit.dist_checkpointing, "load_tensors_metadata", lambda _: {
        key: types.SimpleNamespace(global_shape=shape) for key, shape in shapes.items()})

    def model(tensors):
        return types.SimpleNamespace(sharded_state_dict=lambda: {
            key: ShardedTensor.from_rank_offsets(key, torch.zeros(shape))
            for key, shape in tensors.items()})
    # what makes no tensor is not named (init_from, attention, recompute), nor a key one side
    # lacks (another mimo's config)
    ours = {**saved_model, "pretrained": "/models/Qwen2-VL-2B", "init_from": "/runs/a",
            "attention": "sdpa", "language": {**saved_model["language"], "recompute": "full",
                                              "new_setting": 1}}
    with pytest.raises(CheckpointError) as refused:
        checkpoint_fit.check(str(tmp_path), model({**shapes, tower: (32, 3, 2, 14, 14)}), 8,
                         ["image"], ours)
    assert str(refused.value).endswith(
        "it was saved for another model configuration. The model settings that differ from "
        "the checkpoint's: model.pretrained '/models/Qwen2-VL-7B' there, '/models/Qwen2-VL-2B' "
        "here: resume with the settings it was saved with, or train this model in another "
        "checkpoint.dir"), refused.value
    # a weight the checkpoint lacks (more layers), under model.init_from
    deeper = {**saved_model, "language": {"hidden_size": 64, "num_layers": 3}}
    with pytest.raises(CheckpointError) as refused:
        checkpoint_fit.check(str(tmp_path), model({**shapes, "language_model.module.decoder.layers."
                                               "2.mlp.linear_fc1.weight": (8, 64)}), None,
                         settings=deeper)
    assert "lacks 1 weight(s) of this rank's modules" in str(refused.value)
    assert str(refused.value).endswith(
        "The model settings that differ from the checkpoint's: model.language.num_layers 2 "
        "there, 3 here: model.init_from takes a checkpoint of the same model: start with the "
        "settings it was saved with, or from another checkpoint"), refused.value
    # the same settings: the files they name changed
    with pytest.raises(CheckpointError) as refused:
        checkpoint_fit.check(str(tmp_path), model({**shapes, tower: (32, 3, 2, 14, 14)}), 8,
                         ["image"], saved_model)
    assert str(refused.value).endswith(
        "another model configuration. Its model settings are this run's: the files they name "
        "(a model folder's config.json, the tokenizer) changed since it was saved"), \
        refused.value
    # resumed in another precision: said as that, before any tensor (the optimizer's state
    # differs: megatron-core's own error, or "lacks fp32_param", on some ranks otherwise)
    with pytest.raises(CheckpointError) as refused:
        checkpoint_fit.check(str(tmp_path), model(shapes), 8, ["image"], saved_model, "bf16")
    assert str(refused.value) == (
        f"checkpoint {tmp_path} was saved by a train.precision fp32 run, this run's is bf16: "
        "its optimizer state is kept for fp32 (bf16 keeps fp32 main weights beside the "
        "model's); resume with train.precision fp32, or start a new run from its weights "
        f"(model.init_from={tmp_path}) in another checkpoint.dir")
    checkpoint_fit.check(str(tmp_path), model(shapes), 8, ["image"], saved_model, "fp32")
    checkpoint_fit.check(str(tmp_path), model(shapes), None, settings=saved_model,
                         precision="bf16")                  # model.init_from: weights only
    # a module this run adds (an audio encoder): named, no changed files blamed
    audio = "modality_submodules.audio.module.encoders.audio.encoder.conv1.weight"
    with pytest.raises(CheckpointError) as refused:
        checkpoint_fit.check(str(tmp_path), model({**shapes, audio: (8, 80, 3)}), 8, ["image"],
                         {**saved_model, "encoders": {"audio": {"kind": "whisper"}}})
    assert str(refused.value).endswith(
        "holds no weight of module(s) audio of this run's model (the checkpoint's modules: "
        "image, language): it was saved by a run without them. Resume with the checkpoint's "
        "model.encoders and layout, or train this model in another checkpoint.dir"), \
        refused.value


def test_a_resume_says_a_pretrained_model_it_does_not_read_and_parts_frozen_from_now():
    """A resume that fits its checkpoint but whose config names another pretrained model (the
    checkpoint's weights continue: the folder gives only the config and files), or freezes a
    part that trained until then (its optimizer state dropped, for good), says so; the
    checkpoint's own settings, or a part frozen inside one frozen then, say nothing."""
    from mimo_train.components.checkpoint_fit import resume_notes
    saved = {"config": {"model": {"pretrained": "/models/a", "freeze": ["image.encoder"],
                                  "encoders": {"audio": {"pretrained": "/models/w"}}}}}
    assert resume_notes(saved, saved["config"]["model"], ["image.encoder"]) == []
    assert resume_notes(saved, saved["config"]["model"], ["image.encoder.x"]) == []
    assert resume_notes(saved, {**saved["config"]["model"], "pretrained": "/models/a/"},
                        ["image.encoder"]) == []
    assert resume_notes({}, {"pretrained": "/models/b"}, []) == []
    now = {"pretrained": "/models/b", "freeze": ["image.encoder", "audio"],
           "encoders": {"audio": {"pretrained": "/models/w"}}}
    assert resume_notes(saved, now, now["freeze"]) == [
        "model.pretrained is /models/b here, /models/a when the checkpoint was saved: the "
        "checkpoint's weights continue the run (the folder gives the model's config and files, "
        "of the same shapes)",
        "model.freeze now holds audio, which trained until this checkpoint: frozen from here, "
        "their optimizer state dropped (a later resume cannot train them again: "
        "model.init_from can)"]
    # another LoRA dropout (the same adapters): said; the same one is not
    lora = {"config": {"model": {"lora": {"language": {"rank": 8, "dropout": 0.0}}}}}
    assert resume_notes(lora, lora["config"]["model"], []) == []
    assert resume_notes(lora, {"lora": {"language": {"rank": 8, "dropout": 0.1}}}, []) == [
        "model.lora.language.dropout is 0.1 here, 0.0 when the checkpoint was saved: its "
        "adapters train with this dropout from here"]


def test_a_resume_is_refused_for_another_global_batch_and_for_adapters_the_checkpoint_lacks(
        tmp_path, monkeypatch):
    """Resumed (a global batch size given), a checkpoint saved with another
    train.global_batch_size is refused naming both, and one without this run's LoRA adapters
    is refused as lacking them (the weights it has would train under new, unsaved adapters);
    started from (``model.init_from``: no global batch size) either is taken. A checkpoint
    whose meta names no train.precision (an older mimo's) is resumed in any."""
    import json
    import types

    import torch
    from megatron.core.dist_checkpointing import ShardedTensor

    from mimo_train.components import checkpoint_fit
    weight = "language_model.module.decoder.layers.0.mlp.linear_fc1.weight"
    adapter = "language_model.module.decoder.layers.0.mlp.linear_fc1.lora.a.weight"
    (tmp_path / "meta.json").write_text(json.dumps({"global_batch_size": 8, "config": {
        "model": {"language": {"hidden_size": 8}}}}))
    (tmp_path / "integrity.json").write_text(json.dumps({"files": {}}))
    monkeypatch.setattr(checkpoint_fit.dist_checkpointing, "load_tensors_metadata", lambda _: {
        weight: types.SimpleNamespace(global_shape=(16, 8))})

    def model(*keys):
        return types.SimpleNamespace(sharded_state_dict=lambda: {
            key: ShardedTensor.from_rank_offsets(key, torch.zeros(16, 8)) for key in keys})
    with pytest.raises(CheckpointError, match=rf"^checkpoint {tmp_path} was saved with "
                       r"train.global_batch_size 8, this run has 16: resuming the sample "
                       r"stream needs the same global batch size"):
        checkpoint_fit.check(str(tmp_path), model(weight), 16)
    with pytest.raises(CheckpointError, match=r"lacks 1 LoRA adapter weight\(s\) of this run"
                       r".*it was saved without LoRA adapters"):
        checkpoint_fit.check(str(tmp_path), model(weight, adapter), 8)
    checkpoint_fit.check(str(tmp_path), model(weight, adapter), None)
    checkpoint_fit.check(str(tmp_path), model(weight), 8, precision="bf16")


def test_what_a_refusal_names_of_the_settings_and_the_weights_missing():
    """Settings that make no tensor (attention, recompute, a LoRA alpha or dropout,
    init_from) are not named as what differs even where both configs hold them, nor a value
    said as empty one way and absent the other; weights missing beyond adapters are another
    model, not adapters."""
    from mimo_train.components.checkpoint_fit import _lacks, _model_changes
    saved = {"attention": "flash", "init_from": None, "encoders": {},
             "language": {"hidden_size": 64, "recompute": "none"},
             "lora": {"language": {"rank": 4, "alpha": 8, "dropout": 0.0}}}
    ours = {"attention": "sdpa", "init_from": "/runs/a", "encoders": None,
            "language": {"hidden_size": 32, "recompute": "full"},
            "lora": {"language": {"rank": 4, "alpha": 16, "dropout": 0.1}}}
    assert _model_changes({"config": {"model": saved}}, ours, True) == (
        ". The model settings that differ from the checkpoint's: model.language.hidden_size "
        "64 there, 32 here: resume with the settings it was saved with, or train this model "
        "in another checkpoint.dir")
    refusal = str(_lacks("ck", ["language_model.module.decoder.layers.2.mlp.lora.a.weight",
                                "language_model.module.decoder.layers.2.mlp.weight"],
                         {"config": {"model": saved}}, ["language"], ours))
    assert refusal.startswith("checkpoint ck lacks 2 weight(s) of this rank's modules"), refusal
    from mimo_train.components.checkpoint_fit import resume_notes
    then = {"config": {"model": {"encoders": {"audio": {"pretrained": "/models/w"}}}}}
    assert resume_notes(then, {"encoders": {"audio": {"pretrained": "/models/w2"}}}, []) == [
        "model.encoders.audio.pretrained is /models/w2 here, /models/w when the checkpoint was "
        "saved: the checkpoint's weights continue the run (the folder gives the model's config "
        "and files, of the same shapes)"]
    # a checkpoint whose config names no model.freeze (null, or an older meta): frozen now
    assert resume_notes({"config": {"model": {"freeze": None}}}, {}, ["image"]) == [
        "model.freeze now holds image, which trained until this checkpoint: frozen from here, "
        "their optimizer state dropped (a later resume cannot train them again: "
        "model.init_from can)"]
