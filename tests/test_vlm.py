"""A whole Qwen2-VL checkpoint as the model (``model.pretrained``, mimo_train/families/).

``assets/models/tiny-qwen2-vl`` is a seeded Qwen2-VL scaled down and stored in bf16
(tools/make_models.py). mimo takes its vision tower (merger included) as the image encoder,
no projection, and its language model with the checkpoint's M-RoPE section:

- the logits of the model mimo builds equal transformers' ``Qwen2VLForConditionalGeneration``
  (fp32, 1e-4) on a batch of images of different sizes over a multi-turn conversation, a
  text-only sample and single-image samples, rows padded or packed into one;
- a step under language tp2 with image dp2 fan-in of variable counts, packing and the loss in
  chunks (``model.language.loss_chunk_tokens``: the checkpoint's vocabulary padded to 128 rows,
  the rows past it masked on the second TP rank), and under language pp2, gives the colocated
  step's loss and gradients;
- the shipped fine-tune config trains (the loss falls) and resumes under another layout with
  the same losses;
- ``mimo-export`` writes the same class back: untrained, every weight exactly, and
  transformers' greedy ``generate`` on it for an image prompt gives ``mimo-generate``'s
  tokens; fine-tuned, it loads with the frozen tower unchanged;
- what cannot be taken is refused: another family (with the reason), a tokenizer whose image
  token is not the checkpoint's, an image processor config that normalizes differently, a TP
  size the heads cannot split into.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from mimo_data.preprocess.config import PreprocessConfig
from mimo_train.config import TrainConfig
from mimo_train.plan import resolve
from mimo_train.errors import TrainConfigError

from conftest import REPO, build_dataset
from support.runs import (assert_continues, compare, copy_checkpoint, read_records,
                          train_job, train_records, write_meta)
from support.vlm_runs import (SAMPLES, TOLERANCE, assert_packed_logits, colocated as run_colocated,
                      finetune as run_finetune, layout_step, transformers_logits, turns,
                      weights)

VLM = REPO / "assets" / "models" / "tiny-qwen2-vl"
MIN_PIXELS, MAX_PIXELS = 3136, 37632


@pytest.fixture(scope="module")
def vlm_data(corpus, tmp_path_factory) -> tuple[Path, Path, list[str]]:
    """Shards of image + text conversations, and the preprocessing config for the checkpoint:
    its tokenizer, M-RoPE positions, each image between <|vision_start|> and <|vision_end|>,
    its image geometry (a smaller pixel budget)."""
    tmp = tmp_path_factory.mktemp("vlm")
    images = corpus / "images"
    image = "<image>"
    records = [
        {"id": "multi-turn", "image": [str(images / "chelsea.jpg"), str(images / "rocket.jpg")],
         "conversations": turns(f"{image}What animal is this?", "A cat, lying down.",
                                f"And here? {image}", "A rocket on its launch pad.")},
        {"id": "text-only", "conversations": turns("What is a tar file?",
                                                    "An archive of files.")},
        {"id": "page", "image": str(images / "page.png"),
         "conversations": turns(f"{image}Read the page.", "A page of printed text.")},
        {"id": "hopper", "image": str(images / "grace_hopper.jpg"),
         "conversations": turns(f"Who is this? {image}", "Grace Hopper, in uniform.")},
    ]
    (tmp / "records.json").write_text(json.dumps(records))
    build_dataset([tmp / "records.json"], tmp / "shards")
    preprocess = tmp / "preprocess.yaml"
    preprocess.write_text(f"""tokenizer: {VLM}
seq_length: 512
positions: mrope
modalities:
  image: {{token: "<|image_pad|>", wrap: ["<|vision_start|>", "<|vision_end|>"],
          policy: dynamic, patch_size: 14, merge_size: 2, temporal_patch_size: 2,
          min_pixels: {MIN_PIXELS}, max_pixels: {MAX_PIXELS}}}
""")
    common = [f"data.datasets=[{tmp / 'shards'}]", f"data.preprocess={preprocess}",
              f"model.pretrained={VLM}", f"train.global_batch_size={SAMPLES}", "train.steps=1",
              "train.device=cpu", "optimizer.warmup_steps=0", "train.seed=3"]
    return tmp, preprocess, common


def _reference(batch: dict, preprocess: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' logits for a padded batch, and its real-token mask."""
    from transformers import Qwen2VLForConditionalGeneration
    model = Qwen2VLForConditionalGeneration.from_pretrained(VLM, dtype=torch.float32).eval()
    return transformers_logits(model, batch, preprocess)


def test_input_ids_are_the_checkpoint_tokenizers_with_the_processors_image_tokens(vlm_data,
                                                                                   corpus):
    """mimo's tokens for a two-image multi-turn conversation equal the checkpoint tokenizer's
    chat template over the text with each image written as Qwen2-VL's processor writes it
    (``<|vision_start|>``, one ``<|image_pad|>`` per merged patch of the grid transformers'
    image processor cuts, ``<|vision_end|>``)."""
    from PIL import Image, ImageOps
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil)

    from mimo_data.preprocess.preprocessor import Preprocessor, media_item
    _, preprocess, _ = vlm_data
    names = ("chelsea.jpg", "rocket.jpg")
    data = [(corpus / "images" / name).read_bytes() for name in names]
    items = [media_item("image", d, i) for i, d in enumerate(data)]
    turns = [("user", "<image>What animal is this?"), ("assistant", "A cat, lying down."),
             ("user", "And here? <image>"), ("assistant", "A rocket on its launch pad.")]
    record = {"key": "k", "messages": [{"role": r, "content": c} for r, c in turns],
              "media": items}
    ours = Preprocessor(PreprocessConfig.from_yaml(str(preprocess))).text_batch([record])[0].ids

    processor = Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS,
                                         patch_size=14, merge_size=2, temporal_patch_size=2)
    pictures = [ImageOps.exif_transpose(Image.open(corpus / "images" / n)) for n in names]
    grids = processor(images=pictures, return_tensors="pt")["image_grid_thw"]
    written = iter("<|vision_start|>" + "<|image_pad|>" * (int(g.prod()) // 4) +
                   "<|vision_end|>" for g in grids)
    messages = [{"role": r, "content": c.replace("<image>", next(written)) if "<image>" in c
                 else c} for r, c in turns]
    tokenizer = AutoTokenizer.from_pretrained(VLM)
    expected = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert ours.tolist() == list(expected)
    assert ours.tolist().count(tokenizer.convert_tokens_to_ids("<|vision_start|>")) == 2


@pytest.fixture(scope="module")
def colocated(ranks, vlm_data) -> tuple[dict, dict, str]:
    """One colocated job: the model's logits on its first micro-batch, padded (``logits``), the
    step's loss and gradients on it, and the imported model's checkpoint (step 0, before any
    training) every other layout starts from."""
    tmp, _, common = vlm_data
    return run_colocated(ranks, tmp, "language=dp1;image=dp1,off0", common)


def test_logits_match_transformers_padded_or_packed(ranks, vlm_data, colocated):
    tmp, preprocess, common = vlm_data
    padded = colocated[0]
    batch = padded["batch"]
    grids = batch["modality_inputs"]["image"]["image"]["image_grid_thw"]
    assert len(grids) == 4 and len({tuple(g) for g in grids.tolist()}) >= 3   # image sizes
    expected, mask = _reference(batch, preprocess)
    vocab = expected.size(-1)
    ours = padded["logits"][:, :mask.size(1), :vocab]
    assert (ours - expected)[mask].abs().max() <= TOLERANCE
    assert_packed_logits(ranks, tmp, common, batch, expected, mask)


@pytest.fixture(scope="module")
def colocated_step(colocated) -> tuple[dict, str]:
    """The colocated job's step (loss and gradients), and the imported model's checkpoint."""
    return colocated[1], colocated[2]


def test_layouts_match_the_colocated_step(ranks, vlm_data, colocated_step):
    """Image dp2 fan-in (variable counts: two, none, one, one image) into language tp2 with
    packing and the loss in chunks of 97 tokens (the last one shorter), and language pp2,
    from the same weights: the colocated step's loss and gradients (the colocated model's
    logits are transformers' above)."""
    tmp, _, common = vlm_data
    reference, init = colocated_step
    fan_in = layout_step(ranks, tmp, "fan-in-tp2-packed", 4, "image=dp2;language=tp2",
                         SAMPLES, [*common, "data.packing=true",
                                   "model.language.loss_chunk_tokens=97"], init)
    compare(reference, fan_in, "image dp2 -> language tp2, packed, chunked loss")
    staged = layout_step(ranks, tmp, "pp2", 3, "image=dp1;language=pp2", 2, common, init)
    compare(reference, staged, "image dp1 -> language pp2")


@pytest.fixture(scope="module")
def untrained_export(colocated_step, tmp_path_factory) -> Path:
    """mimo-export of the imported model before any training."""
    from mimo_train.hf.export import main
    out = tmp_path_factory.mktemp("untrained-export") / "out"
    assert main(["--checkpoint", colocated_step[1], "--output", str(out)]) == 0
    return out


def test_import_then_export_gives_back_every_weight_exactly(untrained_export):
    """The same class, every tensor of the checkpoint under its name with its value (in its
    dtype, bf16), its tokenizer and processor config beside them."""
    from safetensors.torch import load_file
    config = json.loads((untrained_export / "config.json").read_text())
    assert config["architectures"] == ["Qwen2VLForConditionalGeneration"]
    original, exported = load_file(VLM / "model.safetensors"), weights(untrained_export)
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    for name in ("preprocessor_config.json", "tokenizer.json", "chat_template.jinja"):
        assert (untrained_export / name).is_file(), name


def test_an_export_of_a_base_without_processor_files_says_so(colocated_step, tmp_path, capsys):
    """A base saved without its processor files (a model saved alone, not its processor):
    the run trains on its preprocessing config, and the export, which has no processor file
    to copy, says so and what to do (transformers' ``AutoProcessor`` fails on it), rather
    than nothing."""
    import shutil

    from transformers import AutoProcessor

    from mimo_train.hf.export import main
    base = tmp_path / "base"
    base.mkdir()
    for each in VLM.iterdir():
        if "processor" not in each.name:
            (base / each.name).symlink_to(each)
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(colocated_step[1], checkpoint)
    for meta in checkpoint.rglob("meta.json"):        # as if the run had named that base
        data = json.loads(meta.read_text())
        data["config"]["model"]["pretrained"] = str(base)
        write_meta(meta.parent, data)
    out = tmp_path / "out"
    assert main(["--checkpoint", str(checkpoint), "--output", str(out)]) == 0
    said = capsys.readouterr().out
    assert f"note: the base {base} has no processor file (preprocessor_config.json or " \
           f"processor_config.json), so neither has {out}" in said, said
    assert not (out / "preprocessor_config.json").exists()
    with pytest.raises(OSError, match="Can't load image processor"):
        AutoProcessor.from_pretrained(out)


def test_an_export_in_another_dtype_says_it_in_every_config_section(colocated_step, tmp_path):
    """``--dtype float16`` of a base transformers saved (its vision_config holds a dtype of
    its own): every section of config.json that holds a dtype says float16, as every tensor
    is, not only the top and text sections."""
    from safetensors import safe_open

    from mimo_train.hf.export import main
    base = json.loads((VLM / "config.json").read_text())
    assert "dtype" in base["vision_config"] or "torch_dtype" in base["vision_config"]
    out = tmp_path / "out"
    assert main(["--checkpoint", str(colocated_step[1]), "--output", str(out), "--dtype",
                 "float16"]) == 0
    config = json.loads((out / "config.json").read_text())
    said = [section[key] for section in (config, *(v for k, v in config.items()
                                                    if k.endswith("_config")))
            for key in ("dtype", "torch_dtype") if key in section]
    assert len(said) >= 2 and set(said) == {"float16"}, config
    with safe_open(out / "model.safetensors", framework="pt") as weights:
        assert {str(weights.get_slice(name).get_dtype()) for name in weights.keys()} == {"F16"}


def test_transformers_generate_on_the_export_equals_mimo_generate(untrained_export, corpus):
    """The export loads as ``AutoModelForImageTextToText``; its greedy ``generate`` on an
    image prompt built by transformers (image processor, the tokenizer's chat template) gives
    ``mimo-generate``'s tokens (its own preprocessing) and prompt."""
    from PIL import Image, ImageOps
    from transformers import AutoModelForImageTextToText, AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil)

    from mimo_train.hf.generate import Generator
    image = corpus / "images" / "grace_hopper.jpg"
    ours = Generator(str(untrained_export)).generate("Who is this?", images=[str(image)],
                                                     max_new_tokens=8)
    model = AutoModelForImageTextToText.from_pretrained(untrained_export,
                                                        dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(untrained_export)
    processor = Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS,
                                         patch_size=14, merge_size=2, temporal_patch_size=2)
    pixels = processor(images=[ImageOps.exif_transpose(Image.open(image))], return_tensors="pt")
    tokens = int(pixels["image_grid_thw"][0].prod()) // 4
    text = "<|vision_start|>" + "<|image_pad|>" * tokens + "<|vision_end|>\nWho is this?"
    ids = torch.tensor([tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
        return_dict=False)])
    assert ids[0].tolist() == ours.prompt_ids and ours.spliced == {"image": tokens}
    with torch.no_grad():
        theirs = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
            max_new_tokens=8, pixel_values=pixels["pixel_values"],
            image_grid_thw=pixels["image_grid_thw"],
            mm_token_type_ids=(ids == model.config.image_token_id).int())
    assert theirs[0, ids.size(1):].tolist() == ours.token_ids
    assert len(ours.token_ids) == 8 and tokenizer.eos_token_id not in ours.token_ids


@pytest.fixture(scope="module")
def finetune(ranks, vlm_data) -> tuple[list[dict], list[str], Path]:
    """The shipped fine-tune config (tower frozen) for 4 steps on 2 ranks, checkpoints at 2
    and 4: its records, overrides and checkpoint dir."""
    tmp, _, common = vlm_data
    common = [*(c for c in common if not c.startswith("train.global_batch_size")),
              "train.global_batch_size=4", "train.micro_batch_size=2", "train.steps=4",
              "checkpoint.interval=2", "optimizer.lr=3e-3"]
    records = run_finetune(ranks, tmp, "finetune", tmp / "finetune-ckpt", common, nproc=2)
    return records, common, tmp / "finetune-ckpt"


def test_finetune_non_colocated_then_resume_colocated(ranks, vlm_data, finetune):
    """The loss falls; resumed from the step-2 checkpoint on one colocated rank, steps 3 and 4
    are the same within 1e-5."""
    tmp = vlm_data[0]
    full, common, checkpoints = finetune
    losses = [r["loss"] for r in train_records(full)]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.1, losses
    resume = copy_checkpoint(checkpoints / "step_0000002", tmp / "resume-ckpt")
    resumed = run_finetune(ranks, tmp, "resumed", resume, common,
                           "layout=language=dp1;image=dp1,off0", nproc=1)
    assert_continues(resumed, full, [3, 4], loss=1e-5, grad_norm_rel=1e-4)


def test_a_non_finite_step_is_skipped_with_the_tower_frozen_on_ranks_of_its_own(ranks,
                                                                                vlm_data):
    """The fine-tune's layout (the frozen tower on a rank of its own): a learning rate of 1e30
    makes the language rank's gradient norm NaN from step 2 while the tower's rank has none
    to give; the ranks' MAX of their norms (0 and NaN) is 0 under gloo, which stepped NaN into
    every weight. Every step from 2 is skipped, and the third skip stops the run (exit 1)."""
    tmp, _, common = vlm_data
    job = train_job(ranks, tmp, "nan", "qwen2_vl_finetune.yaml", *common, "checkpoint.dir=null",
                    "optimizer.lr=1e30", "optimizer.min_lr=0", "optimizer.warmup_steps=0",
                    "train.steps=6", "train.max_skipped_steps=2", nproc=2)
    records = train_records(read_records(tmp / "nan.jsonl"))
    assert not job.ok and 0 not in job.codes, job.explain()
    assert [r["skipped"] for r in records] == [False, True, True, True], records
    assert "steps were skipped for a non-finite gradient norm" in job.stdout + job.stderr, \
        job.explain()


def test_the_fine_tuned_export_loads_with_the_tower_kept_and_the_rest_trained(finetune,
                                                                              tmp_path,
                                                                              vlm_data, capsys):
    """mimo-export of the fine-tuned step 4 loads as ``AutoModelForImageTextToText``: the
    frozen tower (merger included) is the checkpoint's exactly, the language model moved.
    The preprocessing YAML edited after the run (its pixel budget doubled): the export keeps
    the budget the run trained with, and says so."""
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    from mimo_train.hf.export import main
    out, preprocess = tmp_path / "out", vlm_data[1]
    text = preprocess.read_text()
    try:
        preprocess.write_text(text.replace(f"max_pixels: {MAX_PIXELS}",
                                           f"max_pixels: {MAX_PIXELS * 2}"))
        assert main(["--checkpoint", str(finetune[2] / "step_0000004"), "--output",
                     str(out)]) == 0
    finally:
        preprocess.write_text(text)
    assert f"{preprocess} is not as the run trained with it" in capsys.readouterr().err
    assert json.loads((out / "preprocessor_config.json").read_text())["size"][
        "longest_edge"] == MAX_PIXELS
    AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32)
    original, exported = load_file(VLM / "model.safetensors"), weights(out)
    tower = [name for name in original if name.startswith("visual.")]
    assert tower and all(torch.equal(exported[n], original[n].float()) for n in tower)
    assert not torch.equal(exported["lm_head.weight"], original["lm_head.weight"].float())


# ------------------------------------------------------------------------------- refusals

def test_another_models_preprocessing_is_named_before_its_positions():
    """LLaVA-1.5 as published with Qwen2-VL's preprocessing (M-RoPE positions, Qwen's
    tokenizer): the plan says the tokenizer is another model's and how to make this one's,
    not that the language model lacks an mrope_section."""
    llava = REPO / "assets" / "models" / "published" / "llava-hf--llava-1.5-7b-hf"
    with pytest.raises(TrainConfigError) as refused:
        resolve(TrainConfig.load(None, [
            "data.datasets=[unused]", f"model.pretrained={llava}",
            f"data.preprocess={REPO / 'configs' / 'preprocess_qwen2_vl.yaml'}"]))
    message = str(refused.value)
    assert "the preprocessing config's tokenizer" in message and \
        f"is not model.pretrained's ({llava})" in message, message
    assert f"mimo-train --preprocessing-for {llava}" in message and "mrope" not in message


def test_another_image_token_with_the_checkpoints_tokenizer_names_the_token(vlm_data,
                                                                           tmp_path):
    """The checkpoint's tokenizer with LLaVA's ``<image>`` as the image token: the token to
    give is named, not the tokenizer the config already uses."""
    preprocess = tmp_path / "preprocess.yaml"
    preprocess.write_text(vlm_data[1].read_text().replace('token: "<|image_pad|>"',
                                                          'token: "<image>"'))
    from mimo_data.preprocess.chat_tokens import load_tokenizer
    from mimo_train.families.preprocessing_fit import check_preprocessing
    plan = resolve(TrainConfig.load(None, ["data.datasets=[unused]", f"model.pretrained={VLM}",
                                           f"data.preprocess={preprocess}"]))
    with pytest.raises(TrainConfigError) as refused:     # as training's start-up checks it
        check_preprocessing(plan.vlm, plan.preprocess, load_tokenizer(plan.preprocess),
                            plan.vlm_tower_serves)
    assert str(refused.value).endswith(
        "set modalities.image.token: '<|image_pad|>' (the token of that id)"), refused.value


def test_a_speech_tower_beside_the_vlms_gets_a_projection_of_its_own(vlm_data):
    """A Whisper module beside the whole VLM's tower: the tower keeps the VLM's projector
    (none: Qwen2-VL's merger emits the language width, and its weights are the checkpoint's),
    the speech tower gets linear, else model.projection, else its own entry; the model built
    has those layers, as the dims and export count them."""
    from mimo_data.modalities.audio import AudioConfig
    from mimo_train.planning.dims import from_plan
    preprocess = PreprocessConfig.from_yaml(vlm_data[1])
    preprocess = dataclasses.replace(preprocess, modalities={
        **preprocess.modalities, "audio": AudioConfig(token="<audio>")})
    common = ["data.datasets=[unused]", f"model.pretrained={VLM}",
              "layout=language=dp1;image=dp1;audio=dp1"]

    def projections(*overrides: str) -> dict[str, str]:
        plan = resolve(TrainConfig.load(None, [*common, *overrides]), preprocess)
        dims = from_plan(plan)
        assert dims.encoders["image"].projection == ()
        assert len(dims.encoders["audio"].projection) == \
            {"linear": 1, "mlp": 2}[plan.encoders["audio"].projection]
        return {name: setting.projection for name, setting in plan.encoders.items()}
    assert projections() == {"image": "none", "audio": "linear"}
    assert projections("model.projection=mlp") == {"image": "none", "audio": "mlp"}
    assert projections("model.projection=mlp", "model.encoders={audio: {projection: linear}}"
                       ) == {"image": "none", "audio": "linear"}
    with pytest.raises(TrainConfigError, match="encoder module 'audio' has projection none "
                       r"\(model.encoders.audio.projection, else model.projection\), but its "
                       "tower emits 32 features for a language width of 64: use linear or mlp"):
        projections("model.encoders={audio: {projection: none}}")
    # a random tower's dims checked as resolved, not at step 1's reshape: heads dividing the
    # width; the whole VLM's tower's dims are its checkpoint's, a dim set beside it refused
    with pytest.raises(TrainConfigError, match=r"model.encoders.audio: num_attention_heads 4 "
                       r"over hidden_size 30 makes heads of 7.5 channels, and a whisper tower's "
                       r"head size is a whole number: give heads of 1, 2, 3, 5, 6, 10"):
        projections("model.encoders={audio: {hidden_size: 30, num_attention_heads: 4}}")
    with pytest.raises(TrainConfigError, match=r"model.encoders.image.num_layers is 7, but the "
                       f"tower is model.pretrained {VLM}'s, whose config gives its dims: drop "
                       "the key"):
        projections("model.encoders={image: {num_layers: 7}}")
    # ... but a checkpoint's config saved by an earlier mimo, which wrote every encoder's
    # dims as its defaults (and a profile past its steps), still rebuilds: mimo-export's read
    saved = TrainConfig.load(None, [*common, "model.encoders={image: {recompute: full}}"]
                             ).to_dict()
    saved["model"]["encoders"]["image"].update(hidden_size=32, num_layers=1,
                                               num_attention_heads=2)
    saved["train"]["profile"] = {"dir": "p", "start": 50, "steps": 2, "trace": False,
                                 "waits": False}
    plan = resolve(TrainConfig.from_dict(saved), preprocess)
    assert plan.encoders["image"].spec.pretrained == str(VLM)
    # Qwen2-VL's rotary takes heads of a multiple of 4 channels (14 failed in its forward)
    plain = ["data.datasets=[unused]", "layout=language=dp1;image=dp1",
             "model.language.mrope_section=[2, 3, 3]"]
    dynamic = PreprocessConfig.from_yaml(vlm_data[1])
    with pytest.raises(TrainConfigError, match=r"heads of 14 channels, and a qwen2_vl tower's "
                       r"head size is a multiple of 4 \(its rotary positions\): give heads of "
                       r"1, 7$"):
        resolve(TrainConfig.load(None, [*plain, "model.encoders.image.hidden_size=28"]), dynamic)
    assert resolve(TrainConfig.load(None, [*plain, "model.encoders.image.hidden_size=24"]),
                   dynamic).encoders["image"].dims == (24, 1, 2)
    with pytest.raises(TrainConfigError, match=r"\(its rotary positions\): give a hidden_size "
                       r"that is a multiple of 4$"):      # no head count fits 30 (it said none)
        resolve(TrainConfig.load(None, [*plain, "model.encoders.image.hidden_size=30"]), dynamic)
    # and the language model's: its rotary turns channel pairs (15 failed at step 1)
    with pytest.raises(TrainConfigError, match=r"model.language: num_attention_heads 4 over "
                       r"hidden_size 60 makes heads of 15 channels, an odd number, .* give "
                       r"heads that make it even \(e.g. 2, 3, 5, 6\)"):
        resolve(TrainConfig.load(None, [*plain, "model.language.hidden_size=60"]), dynamic)
    # a module misspelt: the one meant said, as a misspelt key's is
    for override, said in (("model.freeze=[imag]", "model.freeze names 'imag' (did you mean "
                            "image?), not a module"),
                           ("model.encoders.imag.hidden_size=24", "model.encoders has imag "
                            "(did you mean image?), which the layout")):
        with pytest.raises(TrainConfigError, match=re.escape(said)):
            resolve(TrainConfig.load(None, [*plain, override]), dynamic)


def test_the_checkpoint_gives_the_language_model_m_rope_and_no_projection(vlm_data):
    _, preprocess, _ = vlm_data
    plan = resolve(TrainConfig.load(None, ["data.datasets=[unused]", f"model.pretrained={VLM}",
                                           f"data.preprocess={preprocess}",
                                           "layout=language=dp1;image=dp1"]))
    assert plan.language.pretrained == str(VLM)
    assert plan.language.mrope_section == (2, 3, 3)
    assert (plan.language.num_layers, plan.language.hidden_size) == (2, 64)
    assert plan.encoders["image"].projection == "none"
    # another projection than the checkpoint's own: a random layer export cannot write back
    with pytest.raises(TrainConfigError, match=f"model.projection is mlp, but model.pretrained "
                       f"{VLM} is a whole qwen2_vl model, whose own projector mimo runs as "
                       "projection none"):
        resolve(TrainConfig.load(None, ["data.datasets=[unused]", f"model.pretrained={VLM}",
                                        "model.projection=mlp", f"data.preprocess={preprocess}"]))
    with pytest.raises(TrainConfigError, match="model.encoders.image.projection is mlp, but "
                       "its tower is model.pretrained .*'s, a whole qwen2_vl model"):
        resolve(TrainConfig.load(None, ["data.datasets=[unused]", f"model.pretrained={VLM}",
                                        "model.encoders={image: {projection: mlp}}",
                                        "layout=language=dp1;image=dp1",
                                        f"data.preprocess={preprocess}"]))
    # named by the key the user set: model.pretrained, whose language model it is
    with pytest.raises(TrainConfigError, match="mrope_section is \\[4, 2, 2\\], but "
                       "model.pretrained's language model .* has \\[2, 3, 3\\]"):
        resolve(TrainConfig.load(None, ["data.datasets=[unused]", f"model.pretrained={VLM}",
                                        "model.language.mrope_section=[4,2,2]",
                                        f"data.preprocess={preprocess}"]))
    with pytest.raises(TrainConfigError, match="hidden_size is 128, but model.pretrained's "
                       f"language model {VLM} has hidden_size 64"):
        resolve(TrainConfig.load(None, ["data.datasets=[unused]", f"model.pretrained={VLM}",
                                        "model.language.hidden_size=128",
                                        f"data.preprocess={preprocess}"]))


def test_a_vlm_config_without_its_vision_config_is_refused(tmp_path, vlm_data):
    """A whole VLM's config.json cut of its vision_config (transformers fills the tower's dims
    with its defaults): refused naming what to give, by the trainer and by the advisor; its
    language model alone (model.language.pretrained) is still read."""
    from mimo_train.planning.advisor.inputs import read_model

    config = json.loads((VLM / "config.json").read_text())
    del config["vision_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    said = (f"model.pretrained {tmp_path}: its config.json is a 'qwen2_vl' model's without its "
            "vision_config (the tower's dims, which transformers would fill with its "
            "defaults): give the checkpoint's whole config.json")
    with pytest.raises(TrainConfigError, match=re.escape(said)):
        resolve(TrainConfig.load(None, ["data.datasets=[unused]", f"model.pretrained={tmp_path}"]))
    _, preprocess, _ = vlm_data                     # not "a language model alone"
    with pytest.raises(TrainConfigError, match=re.escape(said)):
        read_model(str(tmp_path), str(preprocess), PreprocessConfig.from_yaml(str(preprocess)),
                   {"image": "image"})
    # its language model alone needs no tower: read as before
    from mimo_train.families.registry import language_arch
    assert language_arch(str(tmp_path), weights=False) == language_arch(str(VLM), weights=False)


@pytest.mark.parametrize("model_type, reason", [
    ("llava_onevision", "any-res"), ("llava_next", "any-res"),
    ("llama", "not a whole vision-language model"),
    # a path that is no directory: said so, not transformers' "Repo id must be in the form"
    (None, "model.pretrained is '{0}': {0} is not a directory \\(give a model directory")])
def test_other_families_are_refused_with_the_reason(tmp_path, model_type, reason):
    from transformers import AutoConfig
    directory = tmp_path / str(model_type)
    if model_type:
        AutoConfig.for_model(model_type).save_pretrained(directory)
    with pytest.raises(TrainConfigError, match=reason.format(directory)):
        resolve(TrainConfig.load(None, ["data.datasets=[unused]", f"model.pretrained={directory}"]))


@pytest.mark.parametrize("change, expected", [
    # the SmolLM2 tokenizer (without Qwen2-VL's tokens) adds <|image_pad|> at another id
    ([(f"tokenizer: {VLM}", f"tokenizer: {REPO / 'assets' / 'tokenizer' / 'smollm2'}"),
      ('wrap: ["<|vision_start|>", "<|vision_end|>"],', "")],
     # another model's tokenizer: said so, not which token to change
     [f"the preprocessing config's tokenizer ({REPO / 'assets' / 'tokenizer' / 'smollm2'}) "
      f"is not model.pretrained's ({VLM}): token id 49154 is ",
      f"in the checkpoint's. Use a preprocessing config made for this model: mimo-train "
      f"--preprocessing-for {VLM} > preprocess.yaml"]),
    ([('wrap: ["<|vision_start|>", "<|vision_end|>"],', "")],
     ["modalities.image.wrap is [], but model.pretrained", "expects each image between the "
      "tokens [49152, 49153]", "set modalities.image.wrap: ['<|vision_start|>', "
      "'<|vision_end|>']"]),
    # two settings another family's config has otherwise: both named, after how to write
    # the model's own config (not one refusal a run)
    ([('wrap: ["<|vision_start|>", "<|vision_end|>"],', ""), ("positions: mrope", "")],
     [f"the preprocessing config is not the one model.pretrained {VLM} takes (2 settings "
      f"differ): write its own with mimo-train --preprocessing-for {VLM} > preprocess.yaml "
      "(then data.preprocess=preprocess.yaml in training, --config preprocess.yaml to "
      "mimo-inspect), or mend each:\n  - the preprocessing config "
      "has positions: sequential, but", "set positions: mrope\n  - modalities.image.wrap is []"]),
    # a patch and merge size another tower has (Qwen3-VL's 16 px patches): every image's
    # token count wrong, said before any weight is read
    ([("patch_size: 14, merge_size: 2", "patch_size: 16, merge_size: 1")],
     [f"modalities.image has patch_size: 16, merge_size: 1, but model.pretrained {VLM}'s "
      "tower takes patch_size: 14, merge_size: 2, so every image's token count would be "
      "wrong: set modalities.image.patch_size: 14, modalities.image.merge_size: 2"]),
], ids=["image-token-id", "no-wrap", "two-settings", "patch-and-merge"])
def test_preprocessing_that_writes_images_otherwise_is_refused(vlm_data, tmp_path, change,
                                                               expected):
    """What the trainer checks in its config phase, before building anything."""
    from mimo_data.preprocess.chat_tokens import load_tokenizer
    from mimo_train.families.registry import read_vlm
    from mimo_train.families.preprocessing_fit import check_preprocessing
    _, preprocess, _ = vlm_data
    text = preprocess.read_text()
    for old, new in change:
        text = text.replace(old, new)
    other = tmp_path / "preprocess.yaml"
    other.write_text(text)
    config = PreprocessConfig.from_yaml(str(other))
    with pytest.raises(TrainConfigError) as error:
        check_preprocessing(read_vlm(str(VLM)), config, load_tokenizer(config), ("image",))
    for fragment in expected:
        assert fragment in str(error.value)


def test_a_checkpoint_without_tokenizer_files_takes_the_preprocessings(vlm_data, tmp_path,
                                                                       capsys):
    """Weights and processor saved without the tokenizer's files (a trainer's checkpoint; the
    tokenizer kept elsewhere): the preprocessing config's tokenizer is the run's; a setting
    that differs is named, not the tokenizer blamed as another model's (transformers makes an
    empty tokenizer from such a folder, which knows none of the ids); ``--preprocessing-for``
    on it is refused naming the files, not written with its tokens null (and not advised
    where the preprocessing has several settings wrong, before the files are there)."""
    import shutil

    from mimo_data.preprocess.chat_tokens import load_tokenizer
    from mimo_train.cli import main
    from mimo_train.families.preprocessing_fit import check_preprocessing
    from mimo_train.families.registry import read_vlm
    for name in ("config.json", "preprocessor_config.json"):
        shutil.copy(VLM / name, tmp_path / name)
    _, preprocess, _ = vlm_data
    config = PreprocessConfig.from_yaml(str(preprocess))
    check_preprocessing(read_vlm(str(tmp_path)), config, load_tokenizer(config), ("image",))
    other = tmp_path / "preprocess.yaml"
    other.write_text(preprocess.read_text().replace("patch_size: 14, merge_size: 2",
                                                    "patch_size: 16, merge_size: 1"))
    config = PreprocessConfig.from_yaml(str(other))
    with pytest.raises(TrainConfigError, match="modalities.image has patch_size: 16, "
                       "merge_size: 1, but model.pretrained"):
        check_preprocessing(read_vlm(str(tmp_path)), config, load_tokenizer(config), ("image",))
    # several settings: the advice to write the model's own config says what it needs first
    other.write_text(other.read_text().replace("positions: mrope", ""))
    config = PreprocessConfig.from_yaml(str(other))
    with pytest.raises(TrainConfigError, match=re.escape(
            f"write its own with mimo-train --preprocessing-for {tmp_path} > preprocess.yaml "
            "(then data.preprocess=preprocess.yaml in training, --config preprocess.yaml to "
            "mimo-inspect), once the checkpoint's tokenizer files (tokenizer.json, "
            "tokenizer_config.json) are beside its config.json (the folder has none), or mend "
            "each:")):
        check_preprocessing(read_vlm(str(tmp_path)), config, load_tokenizer(config), ("image",))
    # wrap ids the preprocessing tokenizer has no tokens for (another model's ids): its
    # tokenizer is what to change, not a wrap of [None, None]
    other_ids = tmp_path / "other-ids"
    shutil.copytree(tmp_path, other_ids, ignore=shutil.ignore_patterns("*.yaml"))
    (other_ids / "config.json").write_text(json.dumps(
        {**json.loads((tmp_path / "config.json").read_text()), "vision_start_token_id": 151652,
         "vision_end_token_id": 151653}))
    config = PreprocessConfig.from_yaml(str(preprocess))
    with pytest.raises(TrainConfigError) as refused:
        check_preprocessing(read_vlm(str(other_ids)), config, load_tokenizer(config),
                            ("image",))
    assert "expects each image between the tokens [151652, 151653], which the preprocessing " \
        f"tokenizer has no tokens for: use the checkpoint's tokenizer (tokenizer: " \
        f"{other_ids})" in str(refused.value) and "None" not in str(refused.value), refused.value
    assert main(["--preprocessing-for", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert not captured.out, captured.out
    assert f"{tmp_path}'s tokenizer has no token " in captured.err, captured.err
    assert "tokenizer files (tokenizer.json, tokenizer_config.json) are missing" in captured.err


def test_an_image_tower_given_in_place_of_the_checkpoints_takes_its_own_geometry(vlm_data,
                                                                                 tmp_path):
    """A whole VLM's language model with another image tower (``model.encoders.image
    .pretrained``, SigLIP's fixed 224 px images): the token counts are that tower's, so the
    checkpoint's own tower's geometry is not asked of them (its image token and wrap still
    are); the same config against the VLM's own tower is refused."""
    from mimo_data.preprocess.chat_tokens import load_tokenizer
    from mimo_train.families.preprocessing_fit import check_preprocessing
    _, preprocess, _ = vlm_data
    fixed = tmp_path / "fixed.yaml"
    fixed.write_text(preprocess.read_text().replace(
        "policy: dynamic, patch_size: 14, merge_size: 2, temporal_patch_size: 2,",
        "policy: fixed, image_size: 224, patch_size: 14,").replace(
        f"min_pixels: {MIN_PIXELS}, max_pixels: {MAX_PIXELS}", "crop: false"))
    siglip = REPO / "assets" / "models" / "tiny-siglip-vision"
    common = ["data.datasets=[unused]", "layout=language=dp1;image=dp1", f"model.pretrained={VLM}",
              f"data.preprocess={fixed}"]
    plan = resolve(TrainConfig.load(None, [*common, f"model.encoders.image.pretrained={siglip}",
                                           "model.encoders.image.projection=linear"]))
    assert plan.vlm_tower_serves == ()
    check_preprocessing(plan.vlm, plan.preprocess, load_tokenizer(plan.preprocess),
                        plan.vlm_tower_serves)
    with pytest.raises(TrainConfigError, match="modalities.image has policy: fixed, but "
                       f"model.pretrained {VLM}'s tower takes policy: dynamic"):
        check_preprocessing(plan.vlm, plan.preprocess, load_tokenizer(plan.preprocess),
                            ("image",))     # the VLM's own tower, as without the SigLIP one


def test_wrap_tokens_must_be_two_the_tokenizer_has(vlm_data):
    from mimo_data.errors import ConfigError
    from mimo_data.preprocess.chat_tokens import TextEncoder
    _, preprocess, _ = vlm_data
    config = PreprocessConfig.from_yaml(str(preprocess))
    image = config.modalities["image"]
    with pytest.raises(ConfigError, match="modalities.image.wrap is \\['<\\|vision_start"
                       "\\|>'\\]: give two tokens"):
        dataclasses.replace(config, modalities={"image": dataclasses.replace(
            image, wrap=("<|vision_start|>",))})
    unknown = dataclasses.replace(config, modalities={"image": dataclasses.replace(
        image, wrap=("<|box_start|>", "<|box_end|>"))})
    with pytest.raises(ConfigError, match="wrap names \\['<\\|box_start\\|>', "
                       "'<\\|box_end\\|>'\\], which the tokenizer"):
        TextEncoder(unknown)


def test_an_image_processor_that_normalizes_differently_is_refused(vlm_data, tmp_path):
    from mimo_train.errors import EncoderBuildError
    from mimo_train.families.qwen2_vl import Qwen2VLVision
    _, preprocess, _ = vlm_data
    image = PreprocessConfig.from_yaml(str(preprocess)).modalities["image"]
    other = dataclasses.replace(image, mean=(0.5, 0.5, 0.5))
    with pytest.raises(EncoderBuildError,
                       match="the image processor saved in .* preprocesses differently: "
                             "image_mean"):
        Qwen2VLVision(other, 0, 0, 0, pretrained=str(VLM))
    # refused before any tower is built: by the run's plan, as mimo-train's start-up and
    # mimo-inspect plan --model check it; a Whisper encoder's sampling rate likewise
    import yaml

    from mimo_train.families.registry import ENCODERS
    from mimo_train.plan.encoders import check_processors
    config = PreprocessConfig.from_yaml(str(preprocess))
    written = tmp_path / "other.yaml"
    written.write_text(yaml.safe_dump(dataclasses.replace(
        config, modalities={**config.modalities, "image": other}).to_dict()))
    plans = [resolve(TrainConfig.load(None, ["data.datasets=[unused]", f"model.pretrained={VLM}",
                                             f"data.preprocess={given}",
                                             "layout=image=dp1;language=dp1"]))
             for given in (preprocess, written)]
    check_processors(plans[0].encoders)
    with pytest.raises(TrainConfigError, match=r"^encoder module 'image': the image processor "
                       r"saved in .* preprocesses differently: image_mean \[0\.48"):
        check_processors(plans[1].encoders)
    audio = PreprocessConfig.from_yaml(str(REPO / "configs" / "preprocess_audio.yaml")
                                       ).modalities["audio"]
    whisper = str(REPO / "assets" / "models" / "tiny-whisper")
    ENCODERS["whisper"].check_processor(whisper, audio)
    with pytest.raises(EncoderBuildError, match=r"preprocesses differently: sampling_rate 16000 "
                       r"\(ours: modalities.audio.sample_rate 8000\): .*align the "
                       r"preprocessing config: set modalities.audio.sample_rate: 16000$"):
        ENCODERS["whisper"].check_processor(whisper, dataclasses.replace(audio,
                                                                         sample_rate=8000))
    with pytest.raises(EncoderBuildError, match=r"preprocesses differently: hop_length 160 "
                       r"\(ours: modalities.audio.hop_length 320\)"):
        ENCODERS["whisper"].check_processor(whisper, dataclasses.replace(audio, hop_length=320))


def test_a_tp_size_the_heads_cannot_split_into_is_refused(vlm_data):
    from mimo_train.families.registry import language_arch
    _, preprocess, _ = vlm_data
    arch = language_arch(str(VLM))
    assert (arch.num_attention_heads, arch.num_query_groups) == (4, 2)
    with pytest.raises(TrainConfigError, match="2 query groups .* do not split into language "
                       "tp4"):
        resolve(TrainConfig.load(None, ["data.datasets=[unused]", f"model.pretrained={VLM}",
                                        f"data.preprocess={preprocess}",
                                        "layout=image=dp1;language=tp4"]))
