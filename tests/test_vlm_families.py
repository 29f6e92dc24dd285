"""Whole Qwen2.5-VL and LLaVA checkpoints as the model (``model.pretrained``,
``mimo_train/families/``), checked as tests/test_vlm.py checks Qwen2-VL.

``assets/models/tiny-qwen2.5-vl`` (its windowed-attention tower: windows of 4 x 4 merged
patches in two blocks of three, RMSNorm, SwiGLU; M-RoPE) and ``assets/models/tiny-llava`` (a
CLIP tower read at its second-to-last layer without the CLS row, a GELU MLP projector, a Llama
language model; 56 px images, short side resized then centre-cropped) are seeded, scaled down
and stored in bf16 (tools/make_models.py). For each:

- the preprocessing config derived from the checkpoint's files (``mimo-train
  --preprocessing-for``; a smaller pixel budget for Qwen) gives, for a two-image multi-turn
  conversation, transformers' ``input_ids`` (the checkpoint's chat template, each image as the
  family's processor writes it) and the family's image processor's pixels;
- the logits of the model mimo builds equal transformers' own class (fp32, 1e-4) on images of
  different sizes over a multi-turn conversation, a text-only sample and single-image
  samples, rows padded or packed into one;
- image dp2 fan-in (variable counts) into language tp2 with packing, and language pp2, give
  the colocated step's loss and gradients;
- ``mimo-export`` of the imported model gives back every weight under its name exactly, and
  transformers' greedy ``generate`` on it for an image prompt gives ``mimo-generate``'s tokens.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from mimo_data.modalities.image import normalize_pixels
from mimo_data.preprocess.config import PreprocessConfig
from mimo_train.errors import TrainConfigError

from conftest import REPO, build_dataset
from support.runs import compare, copy_checkpoint, train_records, write_meta
from support.vlm_runs import (SAMPLES, TOLERANCE, assert_packed_logits, colocated as run_colocated,
                      finetune, layout_step, turns, weights)

MODELS = REPO / "assets" / "models"
MAX_PIXELS = 37632                  # a smaller budget than the processor's, for speed
# family -> (checkpoint, transformers class)
FAMILIES = {"qwen2.5-vl": (MODELS / "tiny-qwen2.5-vl", "Qwen2_5_VLForConditionalGeneration"),
            "llava": (MODELS / "tiny-llava", "LlavaForConditionalGeneration")}
NAMES = ("chelsea.jpg", "rocket.jpg")


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, corpus, tmp_path_factory) -> dict:
    return _family_data(request.param, corpus, tmp_path_factory.mktemp(request.param))


def _family_data(name: str, corpus: Path, tmp: Path) -> dict:
    """The family's shards of image + text conversations and preprocessing config (the
    checkpoint's tokenizer, positions, image token and geometry), and the overrides of a run
    on them."""
    import yaml

    from mimo_train.families.registry import preprocessing_for
    checkpoint, architecture = FAMILIES[name]
    images = corpus / "images"
    marker = "<image>"
    records = [
        {"id": "multi-turn", "image": [str(images / n) for n in NAMES],
         "conversations": turns(f"{marker}What animal is this?", "A cat, lying down.",
                                f"And here? {marker}", "A rocket on its launch pad.")},
        {"id": "text-only", "conversations": turns("What is a tar file?",
                                                    "An archive of files.")},
        {"id": "page", "image": str(images / "page.png"),
         "conversations": turns(f"{marker}Read the page.", "A page of printed text.")},
        {"id": "hopper", "image": str(images / "grace_hopper.jpg"),
         "conversations": turns(f"Who is this? {marker}", "Grace Hopper, in uniform.")},
    ]
    (tmp / "records.json").write_text(json.dumps(records))
    build_dataset([tmp / "records.json"], tmp / "shards")
    preprocess = tmp / "preprocess.yaml"
    config = preprocessing_for(str(checkpoint))      # derived from the checkpoint's files
    config["modalities"].pop("video", None)          # images only (tests/test_vlm_video.py)
    if "max_pixels" in config["modalities"]["image"]:
        config["modalities"]["image"]["max_pixels"] = MAX_PIXELS
    preprocess.write_text(yaml.safe_dump({**config, "seq_length": 512}))
    common = [f"data.datasets=[{tmp / 'shards'}]", f"data.preprocess={preprocess}",
              f"model.pretrained={checkpoint}", f"train.global_batch_size={SAMPLES}",
              "train.steps=1", "train.device=cpu", "optimizer.warmup_steps=0", "train.seed=3"]
    return dict(name=name, checkpoint=checkpoint, architecture=architecture, tmp=tmp,
                preprocess=preprocess, common=common)


def _model(family: dict, directory: Path):
    import transformers
    cls = getattr(transformers, family["architecture"])
    return cls.from_pretrained(directory, dtype=torch.float32).eval()


def _processor(family: dict):
    """The family's image processor, as saved with the checkpoint, Pillow backend."""
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil)
    if family["name"] == "llava":
        return CLIPImageProcessorPil.from_pretrained(family["checkpoint"])
    return Qwen2VLImageProcessorPil.from_pretrained(family["checkpoint"], max_pixels=MAX_PIXELS)


def _image_text(family: dict, pixels: dict) -> list[str]:
    """Each image's text as the family's processor writes it."""
    if family["name"] == "llava":             # LlavaProcessor: one <image> per patch
        return ["<image>" * 16] * len(pixels["pixel_values"])
    return ["<|vision_start|>" + "<|image_pad|>" * (int(grid.prod()) // 4) + "<|vision_end|>"
            for grid in pixels["image_grid_thw"]]


def _inputs(family: dict, model, ids: torch.Tensor, pixel_values: torch.Tensor,
            image: dict) -> dict:
    """transformers' forward / generate inputs besides the tokens."""
    extra = {"pixel_values": pixel_values}
    if "image_grid_thw" in image:
        extra.update(image_grid_thw=image["image_grid_thw"],
                     mm_token_type_ids=(ids == model.config.image_token_id).int())
    return extra


def test_input_ids_and_pixels_are_the_processors(family, corpus):
    """With the preprocessing config derived from the checkpoint (``preprocessing_for``)."""
    from PIL import Image, ImageOps
    from transformers import AutoTokenizer

    from mimo_data.preprocess.preprocessor import Preprocessor, media_item
    data = [(corpus / "images" / name).read_bytes() for name in NAMES]
    turns = [("user", "<image>What animal is this?"), ("assistant", "A cat, lying down."),
             ("user", "And here? <image>"), ("assistant", "A rocket on its launch pad.")]
    record = {"key": "k", "messages": [{"role": r, "content": c} for r, c in turns],
              "media": [media_item("image", d, i) for i, d in enumerate(data)]}
    config = PreprocessConfig.from_yaml(str(family["preprocess"]))
    preprocessor = Preprocessor(config)
    ours = preprocessor.text_batch([record])[0].ids
    pictures = [ImageOps.exif_transpose(Image.open(corpus / "images" / n)).convert("RGB")
                for n in NAMES]
    theirs = _processor(family)(images=pictures, return_tensors="pt")
    written = iter(_image_text(family, theirs))
    messages = [{"role": r, "content": c.replace("<image>", next(written)) if "<image>" in c
                 else c} for r, c in turns]
    tokenizer = AutoTokenizer.from_pretrained(family["checkpoint"])
    expected = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert ours.tolist() == list(expected)
    from mimo_data.modalities.image import decode_image, image_encoder_inputs
    image = config.modalities["image"]
    inputs = image_encoder_inputs([decode_image(d, item["orientation"], image)
                                   for d, item in zip(data, record["media"])], image)
    assert torch.equal(normalize_pixels(inputs["pixel_values"], image), theirs["pixel_values"])


@pytest.fixture(scope="module")
def colocated(ranks, family) -> tuple[dict, dict, str]:
    """One colocated job: the model's logits on its first micro-batch, padded, the step's
    loss and gradients on it, and the imported model's checkpoint (step 0)."""
    return run_colocated(ranks, family["tmp"], "language=dp1;image=dp1,off0", family["common"])


def test_logits_match_transformers_padded_or_packed(ranks, family, colocated):
    tmp, common = family["tmp"], family["common"]
    padded = colocated[0]
    batch = padded["batch"]
    image = batch["modality_inputs"]["image"]["image"]
    model = _model(family, family["checkpoint"])
    length = int(batch["attention_mask"].sum(1).max())
    ids, mask = batch["input_ids"][:, :length], batch["attention_mask"][:, :length]
    pixels = normalize_pixels(image["pixel_values"], PreprocessConfig.from_yaml(
        str(family["preprocess"])).modalities["image"])
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask.long(),
                         **_inputs(family, model, ids, pixels, image)).logits
    vocab = expected.size(-1)
    ours = padded["logits"][:, :length, :vocab]
    assert (ours - expected)[mask].abs().max() <= TOLERANCE
    assert_packed_logits(ranks, tmp, common, batch, expected, mask)


@pytest.fixture(scope="module")
def colocated_step(colocated) -> tuple[dict, str]:
    return colocated[1], colocated[2]


def test_layouts_match_the_colocated_step(ranks, family, colocated_step):
    tmp, common = family["tmp"], family["common"]
    reference, init = colocated_step
    fan_in = layout_step(ranks, tmp, "fan-in-tp2-packed", 4, "image=dp2;language=tp2",
                         SAMPLES, [*common, "data.packing=true"], init)
    compare(reference, fan_in, "image dp2 -> language tp2, packed")
    staged = layout_step(ranks, tmp, "pp2", 3, "image=dp1;language=pp2", 2, common, init)
    compare(reference, staged, "image dp1 -> language pp2")


def test_import_export_and_generate(family, colocated_step, corpus, tmp_path, capsys):
    """Untrained, the export is the checkpoint: its class, every weight under its name with
    its (bf16) value; transformers' greedy generate on it equals mimo-generate's. Its
    model.pretrained holding another model since: refused, nothing written; moved since:
    exported from where --base says it is now."""
    from PIL import Image, ImageOps
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from mimo_train.hf.export import main
    from mimo_train.hf.generate import Generator
    out = tmp_path / "out"
    assert main(["--checkpoint", colocated_step[1], "--output", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [family["architecture"]]
    original, exported = load_file(family["checkpoint"] / "model.safetensors"), weights(out)
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor.float()), name

    path = corpus / "images" / "grace_hopper.jpg"
    ours = Generator(str(out)).generate("Who is this?", images=[str(path)], max_new_tokens=8)
    model = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    pixels = _processor(family)(images=[ImageOps.exif_transpose(Image.open(path))
                                        .convert("RGB")], return_tensors="pt")
    (text,) = _image_text(family, pixels)
    ids = torch.tensor([tokenizer.apply_chat_template(
        [{"role": "user", "content": text + "\nWho is this?"}], add_generation_prompt=True,
        tokenize=True, return_dict=False)])
    assert ids[0].tolist() == ours.prompt_ids
    with torch.no_grad():
        theirs = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                do_sample=False, max_new_tokens=8,
                                **_inputs(family, model, ids, pixels["pixel_values"],
                                          dict(pixels)))
    assert theirs[0, ids.size(1):].tolist() == ours.token_ids
    assert len(ours.token_ids) == 8
    # model.pretrained replaced since the run by another model of its tokenizer (Qwen2-VL's
    # tower for Qwen2.5-VL's): refused, not mixed into it
    if family["name"] == "llava":         # no other model here takes its tokenizer
        return
    step = Path(colocated_step[1])
    replaced = copy_checkpoint(step, tmp_path / "replaced") / step.name
    meta = json.loads((replaced / "meta.json").read_text())
    other = MODELS / "tiny-qwen2-vl"
    meta["config"]["model"]["pretrained"] = str(other)
    write_meta(replaced, meta)
    capsys.readouterr()
    assert main(["--checkpoint", str(replaced), "--output", str(tmp_path / "mixed")]) == 1
    err = capsys.readouterr().err
    assert f"model.pretrained {other} holds another model than the run trained (" in err and \
        err.rstrip().endswith("would mix the two: put the model the run started from back "
                              "at that path, or give where it is now with --base DIR") and \
        not (tmp_path / "mixed").exists(), err
    # the base (and the tokenizer read from it) moved since the run: --base says where
    import shutil
    moved = copy_checkpoint(step, tmp_path / "moved") / step.name
    meta = json.loads((moved / "meta.json").read_text())
    assert meta["preprocess"]["tokenizer"] == meta["config"]["model"]["pretrained"]
    meta["preprocess"]["tokenizer"] = meta["config"]["model"]["pretrained"] = \
        str(tmp_path / "gone")
    write_meta(moved, meta)
    assert main(["--checkpoint", str(moved), "--output", str(tmp_path / "m1")]) == 2
    assert "give where it is now with --base DIR" in capsys.readouterr().err
    shutil.copytree(family["checkpoint"], tmp_path / "now-here")
    assert main(["--checkpoint", str(moved), "--output", str(tmp_path / "m2"), "--base",
                 str(tmp_path / "now-here")]) == 0
    assert weights(tmp_path / "m2").keys() == exported.keys()
    assert main(["--checkpoint", str(moved), "--output", str(tmp_path / "m3"), "--base",
                 str(other)]) == 1                         # checked as the recorded one
    err = capsys.readouterr().err          # named as given; the advice not --base again
    assert f"--base {other} holds another model than the run trained (" in err and \
        err.rstrip().endswith("would mix the two: give --base the model the run started "
                              "from"), err
    # a base of the family whose config names a larger vocabulary (a bigger sibling): said
    # as another model, not as an embedding short of rows
    bigger = shutil.copytree(family["checkpoint"], tmp_path / "bigger")
    config = json.loads((bigger / "config.json").read_text())
    for section in (config, config.get("text_config") or {}):
        if "vocab_size" in section:
            section["vocab_size"] += 128
    (bigger / "config.json").write_text(json.dumps(config))
    assert main(["--checkpoint", str(moved), "--output", str(tmp_path / "m5"), "--base",
                 str(bigger)]) == 1
    err = capsys.readouterr().err
    assert f"--base {bigger} holds another model than the run trained (its config's " \
        "vocab_size " in err and err.rstrip().endswith(
            "the export takes its config from there: give --base the model the run started "
            "from"), err
    # another family's model as --base: said to be no move of the run's (its own paths are)
    alien = MODELS / "tiny-llava"
    code = main(["--checkpoint", str(moved), "--output", str(tmp_path / "m4"), "--base",
                 str(alien)])
    err = capsys.readouterr().err
    assert "make the paths it names exist again" not in err and not (tmp_path / "m4").exists()
    assert code == 1 or code == 2 and f"--base {alien} is not the run's model.pretrained, " \
        "moved: give the folder it is now" in err, err


def test_llava_finetune_trains_the_projector_with_the_tower_frozen(ranks, corpus, tmp_path):
    """The shipped LLaVA config (``model.freeze: [image.encoder]``), non-colocated on 2 ranks
    for 2 steps: its export loads in transformers with the tower exactly the checkpoint's and
    the projector and language model trained."""
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    from mimo_train.hf.export import main
    data = _family_data("llava", corpus, tmp_path)
    common = [*(c for c in data["common"] if not c.startswith("train.")),
              "train.global_batch_size=4", "train.micro_batch_size=2", "train.steps=2",
              "train.device=cpu", "optimizer.lr=3e-3"]
    records = finetune(ranks, tmp_path, "llava", tmp_path / "ckpt", common, nproc=2,
                       config="llava_finetune.yaml")
    losses = [r["loss"] for r in train_records(records)]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    out = tmp_path / "out"
    assert main(["--checkpoint", str(tmp_path / "ckpt"), "--output", str(out)]) == 0
    model = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32)
    # its processor as transformers' documentation calls it: each image its tokens
    from PIL import Image
    from transformers import AutoProcessor
    image = Image.open(corpus / "images" / "grace_hopper.jpg").convert("RGB")
    ids = AutoProcessor.from_pretrained(out)(images=[image], text="<image>\nWho?",
                                             return_tensors="pt")["input_ids"]
    assert int((ids == model.config.image_token_id).sum()) == model.config.image_seq_length
    original, exported = load_file(data["checkpoint"] / "model.safetensors"), weights(out)
    assert set(exported) == set(original)
    tower = [n for n in original if n.startswith("vision_tower.")]
    assert tower and all(torch.equal(exported[n], original[n].float()) for n in tower)
    for moved in ("multi_modal_projector.linear_1.weight", "language_model.lm_head.weight"):
        assert not torch.equal(exported[moved], original[moved].float()), moved


def test_freeze_names_a_module_or_an_encoder_modules_part():
    from mimo_data.loading.layout import Layout
    from mimo_train.plan.parts import parse_parts
    layout = Layout.parse("image=dp1;language=dp1")

    def prefixes(entries):
        return {p.module: p.prefix for p in parse_parts(entries, layout, "model.freeze", True)}
    assert prefixes(["image.encoder", "language"]) == {"image": "encoders.", "language": ""}
    assert prefixes(["image.projection"]) == {"image": "input_projections."}
    for wrong, message in ((["language.encoder"], "nor an encoder module's part"),
                           (["image.tower"], "<module>.encoder / <module>.projection"),
                           (["audio"], "not a module of the layout"),
                           (["image.encoder", "image.projection"], "name the module \\(image\\) "
                            "or one of its parts")):
        with pytest.raises(TrainConfigError, match=message):
            prefixes(wrong)
    # model.lora's entries, a mapping: how an override removes the one the YAML gives
    with pytest.raises(TrainConfigError) as refused:
        parse_parts({"image": {}, "image.projection": {}}, layout, "model.lora")
    assert str(refused.value) == "model.lora names 'image' and 'image.projection': name the " \
        "module (image) or its parts, not both (an override removes an entry the YAML gives: " \
        "~model.lora.image)"


def test_the_start_up_line_says_what_trains():
    """Frozen parts, each part's LoRA (rank, alpha, targets), the rest in full."""
    from types import SimpleNamespace

    from mimo_train.config import LoraConfig
    from mimo_train.plan.parts import Part
    from mimo_train.plan.run_plan import RunPlan
    lora = SimpleNamespace(part=Part("language"),
                           spec=LoraConfig(rank=4, alpha=8, targets=["linear_qkv", "linear_fc1"]))
    modules = {"image": None, "language": None}
    encoders = {"image": SimpleNamespace(projection="mlp")}
    plan: Any = SimpleNamespace(frozen=(Part("image", "encoder"),), adapted=(lora,),
                                modules=modules, encoders=encoders,
                                language=SimpleNamespace(experts=0, num_layers=2))
    plan.parts_in_full = lambda: RunPlan.parts_in_full(plan)
    plan._experts_left = lambda adapted: RunPlan._experts_left(plan, adapted)
    assert RunPlan.training_summary(plan) == (
        "image.encoder frozen; language LoRA rank 4 alpha 8 on linear_qkv, linear_fc1 (its "
        "weights fixed); image.projection in full")
    plan.frozen = ()            # a whole VLM's tower (its merger its own): no projection named
    plan.encoders = {"image": SimpleNamespace(projection="none")}
    assert RunPlan.training_summary(plan).endswith("(its weights fixed); image.encoder in full")
    plan.frozen = (Part("image"),)                  # nothing left to train in full
    assert RunPlan.training_summary(plan).endswith("linear_fc1 (its weights fixed)")
    assert RunPlan.training_summary(SimpleNamespace(frozen=(), adapted=(), modules=modules)) \
        == "every module in full"
    # a mixture of experts: targets that leave its routed experts out say so (all-linear as
    # PEFT's), targets that take them in say nothing more
    plan.language.experts = 8
    assert RunPlan.training_summary(plan).endswith("linear_fc1 (its weights fixed)")
    lora.spec = LoraConfig(rank=4, alpha=8, targets=["all-linear"])
    assert RunPlan.training_summary(plan).endswith(
        "on all-linear (its weights fixed; its routed experts not adapted, as PEFT's "
        "all-linear leaves them: name linear_fc1 / linear_fc2 to adapt them too)")
    lora.spec = LoraConfig(rank=4, alpha=8, targets=["linear_qkv"])
    assert RunPlan.training_summary(plan).endswith(
        "on linear_qkv (its weights fixed; its routed experts not adapted: name linear_fc1 / "
        "linear_fc2 to adapt them too)")
    plan.frozen, plan.adapted = (), ()    # what an adapters-only export refuses: all of it
    assert plan.parts_in_full() == ["image.encoder", "language"]


# ------------------------------------------------------------------------------- refusals

def test_llava_takes_its_projector_and_sequential_positions():
    from mimo_train.config import TrainConfig
    from mimo_train.plan import resolve
    checkpoint = FAMILIES["llava"][0]
    from mimo_data.preprocess.config import PreprocessConfig
    plan = resolve(TrainConfig.load(None, ["data.datasets=[unused]",
                                           f"model.pretrained={checkpoint}"]),
                   PreprocessConfig(tokenizer=str(checkpoint), modalities={}))
    assert plan.vlm.projection == "mlp" and plan.language.mrope_section is None
    from mimo_train.families.registry import read_vlm
    projector = read_vlm(str(checkpoint)).projector()
    assert sorted(projector) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert projector["0.weight"].shape == (64, 32)


def test_a_video_modality_for_llava_s_tower_says_the_model_takes_none():
    """LLaVA-1.5's tower encodes images only: a layout serving video from it is refused
    naming the model, and that the modality goes (its samples dropped), not only that the
    encoder module cannot take it."""
    from mimo_data.preprocess.config import PreprocessConfig
    from mimo_train.config import TrainConfig
    from mimo_train.families.registry import preprocessing_for
    from mimo_train.plan import resolve
    checkpoint = FAMILIES["llava"][0]
    config = preprocessing_for(str(checkpoint))
    video = {"token": "<video>", "fps": 1.0, "patch_size": 14}
    preprocess = PreprocessConfig.from_dict(
        {**config, "modalities": {**config["modalities"], "video": video}})
    with pytest.raises(TrainConfigError) as refused:
        resolve(TrainConfig.load(None, ["data.datasets=[unused]",
                                        f"model.pretrained={checkpoint}",
                                        "layout=image=dp1,video;language=dp1"]), preprocess)
    assert f"model.pretrained {checkpoint}'s tower encodes ['image'] only (the model takes no " \
        "video): drop modalities.video from the preprocessing config and video from module " \
        "'image' of the layout (those samples are then dropped as unconfigured_modality)" \
        in str(refused.value), refused.value
    # done so: planned
    resolve(TrainConfig.load(None, ["data.datasets=[unused]", f"model.pretrained={checkpoint}",
                                    "layout=image=dp1;language=dp1"]),
            PreprocessConfig.from_dict(config))


@pytest.mark.parametrize("change, reason", [
    ({"projector_hidden_act": "relu"}, "a 'relu' projector \\(GELU is mapped\\)"),
    ({"vision_feature_select_strategy": "full"}, "full on a tower with a CLS row"),
    ({"multimodal_projector_bias": False}, "a projector without biases"),
    # a SigLIP tower (no CLS row) whose first patch default would drop
    ({"vision_config": "siglip", "vision_feature_select_strategy": "default"},
     "default on a tower without a CLS row \\(it drops each image's first patch"),
    # past the embeddings and 3 layers, either way (transformers fails on either too)
    ({"vision_feature_layer": -5}, "vision_feature_layer -5, past its tower's hidden states "
                                   "\\(-4 to 3: the embeddings, then 3 layers"),
    ({"vision_feature_layer": [-2, 4]}, "vision_feature_layer 4, past"),
    # a language model mimo cannot build: said of the key the user set, not of
    # model.language.pretrained
    ({"text_config": "gemma"}, "^model.pretrained's language model: .* is a 'gemma' model; the "
                               "language model can be built from llama, qwen2"),
])
def test_llava_variants_mimo_cannot_take_are_refused(tmp_path, change, reason):
    from transformers import AutoConfig, GemmaConfig, SiglipVisionConfig
    config = AutoConfig.from_pretrained(FAMILIES["llava"][0])
    made = {"siglip": lambda: SiglipVisionConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
        image_size=56, patch_size=14), "gemma": lambda: GemmaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=4, head_dim=16, vocab_size=config.text_config.vocab_size)}
    for key, value in change.items():
        setattr(config, key, made[value]() if isinstance(value, str) and value in made
                else value)
    config.save_pretrained(tmp_path)
    with pytest.raises(TrainConfigError, match=reason):
        from mimo_train.config import TrainConfig
        from mimo_train.plan import resolve
        resolve(TrainConfig.load(None, ["data.datasets=[unused]", f"model.pretrained={tmp_path}"]))
    if "text_config" in change:         # mimo-train --preprocessing-for refuses it too
        from mimo_train.families.registry import preprocessing_for
        with pytest.raises(TrainConfigError, match="^--preprocessing-for's language model: "):
            preprocessing_for(str(tmp_path), "--preprocessing-for")


def test_llava_configs_transformers_misreads_or_cannot_read_are_refused(tmp_path):
    """A LLaVA config.json without its text_config (transformers would fill in a 7B Llama's
    dims), a value transformers' strict validation refuses, the original LLaVA repository's
    format: each one message naming what to do, never a traceback or "upgrade transformers"."""
    from mimo_train.families.registry import read_vlm
    given = json.loads((FAMILIES["llava"][0] / "config.json").read_text())
    for name, config, said in (
            ("flat", {k: v for k, v in given.items() if k != "text_config"},
             "its config.json is a 'llava' model's without its text_config (the language "
             "model's dims, which transformers would fill with its defaults)"),
            ("strict", {**given, "vision_feature_select_strategy": "cls_patch"},
             "from which transformers cannot read a model config ("),
            ("original", {**given, "model_type": "llava_llama"},
             "is in the original LLaVA repository's format (liuhaotian/llava-v1.5-7b's "
             "model_type 'llava_llama'), which transformers does not read: give its llava-hf "
             "conversion")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        with pytest.raises(TrainConfigError, match=re.escape(said)):
            read_vlm(str(tmp_path / name))
    # a feature layer at either end of the tower's hidden states (the embeddings, its last
    # layer: -4 and 3 of the tiny 3-layer tower) is taken
    assert given["vision_config"]["num_hidden_layers"] == 3
    for name, layer in (("first", -4), ("last", 3), ("both", [-4, 3])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(
            {**given, "vision_feature_layer": layer}))
        assert read_vlm(str(tmp_path / name)).family == "llava"


def test_a_modality_token_may_be_its_own_marker_only():
    """LLaVA's image token is ``<image>``, mimo's image marker: allowed. ``<audio>`` as the
    image token would read every audio marker as an image: refused."""
    from mimo_data.errors import ConfigError
    from mimo_data.modalities.image import ImageConfig
    tokenizer = str(FAMILIES["llava"][0])
    config = PreprocessConfig(tokenizer=tokenizer, modalities={
        "image": ImageConfig(token="<image>", policy="fixed", image_size=56, patch_size=14)})
    assert config.modalities["image"].token == "<image>"
    with pytest.raises(ConfigError, match="modalities.image.token '<audio>' is another "
                       "modality's text marker"):
        PreprocessConfig(tokenizer=tokenizer, modalities={"image": ImageConfig(token="<audio>")})


def test_a_processor_that_resizes_otherwise_is_refused():
    """LLaVA's CLIP processor crops; squashing (crop: false) would feed the tower other
    pixels than it was trained on."""
    from mimo_data.modalities.image import ImageConfig
    from mimo_train.errors import EncoderBuildError
    from mimo_train.families.llava import LlavaVision
    from mimo_train.families.registry import read_vlm
    squashed = ImageConfig(token="<image>", policy="fixed", image_size=56, patch_size=14)
    with pytest.raises(EncoderBuildError, match="do_center_crop True.*crop False"):
        LlavaVision(squashed, 0, 0, 0, pretrained=read_vlm(str(FAMILIES["llava"][0])))


def test_a_processor_that_pads_to_a_square_is_followed(tmp_path, corpus):
    """``LlavaImageProcessor`` with ``do_pad`` (LLaVA's ``image_aspect_ratio: pad``): each
    image centred on a square of the mean colour before its resize and crop. The config derived
    from the checkpoint pads; its pixels are the processor's; a config that does not pad is
    refused."""
    import dataclasses

    from PIL import Image, ImageOps
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    from mimo_data.modalities.image import decode_image, image_encoder_inputs
    from mimo_data.preprocess.preprocessor import media_item
    from mimo_train.errors import EncoderBuildError
    from mimo_train.families.llava import LlavaVision
    from mimo_train.families.registry import preprocessing_for, read_vlm
    checkpoint = FAMILIES["llava"][0]
    for each in checkpoint.iterdir():
        if each.name != "preprocessor_config.json":
            (tmp_path / each.name).symlink_to(each)
    processor = json.loads((checkpoint / "preprocessor_config.json").read_text())
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {**processor, "image_processor_type": "LlavaImageProcessor", "do_pad": True}))
    derived = preprocessing_for(str(tmp_path))["modalities"]["image"]
    assert derived["pad"] is True and derived["crop"] is True
    # CLIP's processor reads no do_pad (transformers' pads nothing there): neither does mimo
    from mimo_train.families.llava import pads
    assert not pads({**processor, "image_processor_type": "CLIPImageProcessor", "do_pad": True})
    image = PreprocessConfig.from_dict(preprocessing_for(str(tmp_path))).modalities["image"]
    data = [(corpus / "images" / name).read_bytes() for name in NAMES]
    pictures = [ImageOps.exif_transpose(Image.open(corpus / "images" / n)).convert("RGB")
                for n in NAMES]
    assert all(p.width != p.height for p in pictures)
    theirs = LlavaImageProcessorPil.from_pretrained(tmp_path)(images=pictures,
                                                             return_tensors="pt")
    inputs = image_encoder_inputs([decode_image(d, media_item("image", d, i)["orientation"],
                                                image) for i, d in enumerate(data)], image)
    assert torch.equal(normalize_pixels(inputs["pixel_values"], image), theirs["pixel_values"])
    unpadded = image_encoder_inputs([decode_image(d, media_item("image", d, i)["orientation"],
                                                  image) for i, d in enumerate(data)],
                                    dataclasses.replace(image, pad=False))
    assert not torch.equal(unpadded["pixel_values"], inputs["pixel_values"])
    with pytest.raises(EncoderBuildError, match=r"pads each image to a square of its image_mean "
                       r"colour first \(do_pad: true.*set modalities.image.pad: true"):
        LlavaVision(dataclasses.replace(image, pad=False), 0, 0, 0,
                    pretrained=read_vlm(str(tmp_path)))
    # the other way: a config that pads where the checkpoint's processor does not
    with pytest.raises(EncoderBuildError, match=r"pads no image \(no do_pad\); the "
                       r"preprocessing config gives pad True: set modalities.image.pad: false"):
        LlavaVision(image, 0, 0, 0, pretrained=read_vlm(str(checkpoint)))


def test_preprocessing_for_prints_the_derived_config(capsys, monkeypatch):
    """``mimo-train --preprocessing-for VLM`` prints the checkpoint's tokenizer, positions,
    image token and its processor's geometry and normalization, and says which modalities
    the model takes; a checkpoint that is not a whole VLM is refused (exit 2). The published
    llava-1.5's chat template writes a message's images and text only: audio added to its
    config is refused at the run's start, naming the modality, the model and what to do,
    where every audio sample would have been dropped (``template_mismatch``); the tiny
    model's ChatML writes ``<audio>`` as given: taken (beside an audio module)."""
    import yaml

    from mimo_train.cli import main
    checkpoint = FAMILIES["llava"][0]
    assert main(["--preprocessing-for", str(checkpoint)]) == 0
    out = capsys.readouterr().out
    assert out.endswith("\n") and not out.endswith("\n\n")      # one final newline
    assert "\n# The model takes image (its own tower) and text, no video. Adding audio needs " \
        "an encoder module of its own" in out, out
    printed = yaml.safe_load(out)
    processor = json.loads((checkpoint / "preprocessor_config.json").read_text())
    assert printed["tokenizer"] == str(checkpoint) and printed["positions"] == "sequential"
    assert printed["seq_length"] == 1024 and "seq_length 1024 is mimo's default" in out
    assert printed["modalities"]["image"] == {
        "token": "<image>", "policy": "fixed", "image_size": processor["crop_size"]["height"],
        "patch_size": 14, "crop": True, "mean": processor["image_mean"],
        "std": processor["image_std"]}
    assert "# image: max_pixels" not in out         # a fixed size: its tokens are known
    # a Qwen checkpoint's pixel budget (16384 tokens an image) over the default seq_length:
    # said, with a budget that fits
    assert main(["--preprocessing-for",
                 str(MODELS / "published" / "Qwen--Qwen2.5-VL-7B-Instruct")]) == 0
    assert "\n# image: max_pixels 12845056 is up to 16384 tokens an image, more than " \
        "seq_length 1024: a sample with such an image is dropped as too long; lower " \
        "max_pixels (e.g. 401408, 512 tokens at the most) or raise seq_length.\n" in \
        capsys.readouterr().out
    assert main(["--preprocessing-for", str(MODELS / "tiny-llama")]) == 2
    err = capsys.readouterr().err       # named by the option given, not the training key
    assert "--preprocessing-for " in err and "not a whole vision-language model" in err
    assert "model.pretrained" not in err.split("instead")[0], err
    published = MODELS / "published" / "llava-hf--llava-1.5-7b-hf"
    assert main(["--preprocessing-for", str(published)]) == 0
    out = capsys.readouterr().out
    assert "\n# The model takes image (its own tower) and text, no video. Its chat template " \
        "writes no <audio>: with modalities.audio added, every such sample would be dropped " \
        "(template_mismatch), so mimo-train refuses it unless a chat_template that writes it " \
        "is given (and an encoder module serves it).\n" in out, out
    from mimo_data.modalities.audio import AudioConfig
    from mimo_data.preprocess.tokenizer_loading import load_tokenizer
    from mimo_train.config import TrainConfig
    from mimo_train.families.preprocessing_fit import check_preprocessing
    from mimo_train.plan import resolve
    for model, config, refused in ((published, yaml.safe_load(out), True),
                                   (checkpoint, printed, False)):
        preprocess = PreprocessConfig.from_dict({**config, "modalities": {
            **config["modalities"], "audio": {"token": "<audio>"}}})
        assert isinstance(preprocess.modalities["audio"], AudioConfig)
        plan = resolve(TrainConfig.load(None, ["data.datasets=[unused]",
                                               f"model.pretrained={model}",
                                               "layout=image=dp1;audio=dp1;language=dp1"]),
                       preprocess)
        start = (plan.vlm, preprocess, load_tokenizer(preprocess), plan.vlm_tower_serves)
        if not refused:
            check_preprocessing(*start)         # as training's start-up checks it
            continue
        with pytest.raises(TrainConfigError) as error:      # before any data is read
            check_preprocessing(*start)
        assert str(error.value) == (
            f"model.pretrained {published} (a llava) has no audio tower, and the preprocessing "
            f"config's chat template (the tokenizer's, {published}) writes no <audio> for audio "
            "in a message (it writes image and text only), so every sample with audio would "
            "be dropped as template_mismatch and none trained: drop modalities.audio from the "
            "preprocessing config, or give it a chat_template that writes <audio> for each "
            "audio part (and serve audio from an encoder module of its own: model.encoders, "
            "the layout)")
    # a run of encoder modules around SmolLM2 (no whole VLM): the same check at start-up,
    # its template the one that counts (llava's, typed parts, leaves audio out)
    import dataclasses

    from mimo_data.preprocess.chat_render import ChatRenderer
    from mimo_train.families.preprocessing_fit import check_template
    smol = PreprocessConfig.from_yaml(str(Path(__file__).parents[1] / "configs" /
                                          "preprocess.yaml"))
    assert "audio" in smol.modalities
    check_template(smol, ChatRenderer(smol, load_tokenizer(smol)))    # SmolLM2's: <audio>
    llava = load_tokenizer(PreprocessConfig.from_dict({**config, "tokenizer": str(published)}))
    typed = dataclasses.replace(smol, chat_template=llava.chat_template)
    with pytest.raises(TrainConfigError, match=r"^the preprocessing config's chat template "
                       r"\(its chat_template\) writes no <audio> for audio in a message \(it "
                       r"writes image and text only\), so every sample with audio would be "
                       "dropped"):
        check_template(typed, ChatRenderer(typed, load_tokenizer(typed)))
    # a template mimo cannot render at all (no eos token, say): the config printed, that
    # sentence left to the start-up's refusal
    def unrenderable(*args):
        raise ValueError("the tokenizer has no eos_token")
    monkeypatch.setattr(ChatRenderer, "unwritten_modalities", unrenderable)
    assert main(["--preprocessing-for", str(published)]) == 0
    out = capsys.readouterr().out
    assert "writes no <audio>" not in out and "\nmodalities:\n" in out, out


def _tiny_llava(folder, corpus, vision_class, layer, strategy: str, image):
    """A seeded LLaVA of a 2-layer ``vision_class`` tower (56 px, 14 px patches) and a 1-layer
    Llama, read at ``layer`` with ``strategy``, saved in ``folder`` and loaded back by
    transformers in fp32; and the corpus images ``NAMES`` as ``image`` makes them."""
    from transformers import LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    from mimo_data.modalities.image import decode_image, image_encoder_inputs
    from mimo_data.preprocess.preprocessor import media_item
    torch.manual_seed(0)
    config = LlavaConfig(
        vision_config=vision_class(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=2, image_size=56, patch_size=14),
        text_config=LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                num_attention_heads=4, vocab_size=300),
        image_token_index=299, vision_feature_layer=layer,
        vision_feature_select_strategy=strategy)
    LlavaForConditionalGeneration(config).save_pretrained(folder)
    model = LlavaForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    data = [(corpus / "images" / name).read_bytes() for name in NAMES]
    pixels = image_encoder_inputs([decode_image(d, media_item("image", d, 0)["orientation"],
                                                image) for d in data], image)["pixel_values"]
    return model, pixels


def test_a_siglip_llava_tower_and_projector_give_transformers_image_features(tmp_path, corpus):
    """A LLaVA with a SigLIP tower read at its last layer (no CLS row, ``full`` selection,
    squashed 56 px images): mimo's tower and projection give ``get_image_features``'s rows;
    the pooling head is not held."""
    from transformers import SiglipVisionConfig

    from mimo_data.modalities.image import ImageConfig
    from mimo_train.families.base import Projection
    from mimo_train.families.llava import LlavaVision
    from mimo_train.families.registry import read_vlm
    image = ImageConfig(token="<image>", policy="fixed", image_size=56, patch_size=14,
                        mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
    model, pixels = _tiny_llava(tmp_path, corpus, SiglipVisionConfig, -1, "full", image)
    tower = LlavaVision(image, 0, 0, 0, pretrained=read_vlm(str(tmp_path))).eval()
    assert not any("head" in name for name in tower.state_dict())
    projection = Projection(32, 64, "mlp", initial=read_vlm(str(tmp_path)).projector())
    with torch.no_grad():
        ours = projection(tower(pixels))
        theirs = model.model.get_image_features(
            pixel_values=normalize_pixels(pixels, image), vision_feature_layer=-1,
            vision_feature_select_strategy="full").pooler_output
    theirs = torch.cat(list(theirs)) if isinstance(theirs, (list, tuple)) else \
        theirs.reshape(-1, theirs.size(-1))
    assert ours.shape == (2 * 16, 64)
    assert (ours - theirs).abs().max() <= TOLERANCE


def test_a_clip_llava_tower_read_at_its_embeddings_gives_transformers_image_features(
        tmp_path, corpus):
    """``vision_feature_layer`` -(depth + 1) reads the tower's embeddings (transformers takes
    it): the tower mimo builds keeps a layer, as one of no layers returns no hidden states
    (an IndexError in step 1 before)."""
    from transformers import CLIPVisionConfig

    from mimo_data.modalities.image import ImageConfig
    from mimo_train.families.llava import LlavaVision
    from mimo_train.families.registry import read_vlm
    image = ImageConfig(token="<image>", policy="fixed", image_size=56, patch_size=14,
                        crop=True, mean=(0.48145466, 0.4578275, 0.40821073),
                        std=(0.26862954, 0.26130258, 0.27577711))
    model, pixels = _tiny_llava(tmp_path, corpus, CLIPVisionConfig, -3, "default", image)
    tower = LlavaVision(image, 0, 0, 0, pretrained=read_vlm(str(tmp_path))).eval()
    with torch.no_grad():
        ours = tower(pixels)
        theirs = model.model.vision_tower(normalize_pixels(pixels, image),
                                          output_hidden_states=True).hidden_states[-3][:, 1:]
    assert ours.shape == (2 * 16, 32)
    assert (ours - theirs.reshape(-1, 32)).abs().max() <= TOLERANCE


def test_split_media_takes_a_llava_tower():
    """A LLaVA tower encodes each image alone and data.split_media deals whole images: a
    fan-in layout may cut a language rank's images over its ranks (refused before, while the
    LayoutError for such a layout's micro-batch names data.split_media as the way out)."""
    from mimo_train.config import TrainConfig
    from mimo_train.families.registry import preprocessing_for
    from mimo_train.plan import resolve
    checkpoint = FAMILIES["llava"][0]
    resolve(TrainConfig.load(None, ["data.datasets=[unused]", f"model.pretrained={checkpoint}",
                                    "layout=image=dp2;language=dp1", "data.split_media=true",
                                    "train.micro_batch_size=1", "train.global_batch_size=2"]),
            PreprocessConfig.from_dict(preprocessing_for(str(checkpoint))))


def test_a_checkpoint_without_its_image_processor_says_what_to_do(tmp_path):
    """A VLM saved without its processor files (``model.save_pretrained`` alone):
    ``--preprocessing-for`` cannot read the image settings and says where they come from."""
    from mimo_train.errors import TrainConfigError
    from mimo_train.families.registry import preprocessing_for
    replica = REPO / "assets" / "models" / "tiny-qwen2-vl"
    for each in replica.iterdir():
        if each.name != "preprocessor_config.json":
            (tmp_path / each.name).symlink_to(each)
    with pytest.raises(TrainConfigError) as refused:
        preprocessing_for(str(tmp_path))
    assert str(refused.value) == (
        f"{tmp_path} holds no image processor (preprocessor_config.json, or "
        "processor_config.json with an image_processor): its settings cannot be read; copy "
        "the processor files of the model it was made from beside it and run this again, or "
        "write the preprocessing config by hand (the repository's configs/preprocess_*.yaml "
        "show one for each family)")


def test_a_checkpoint_of_pickled_weights_is_refused_before_anything_is_built(tmp_path,
                                                                              monkeypatch):
    """``model.pretrained`` at a folder whose weights are pytorch_model.bin only: refused by
    the checks the trainer's start-up and ``plan --model`` run first (``check_training``),
    not once the model is being built; by a hub name in the local cache too."""
    import torch

    from mimo_train.config import TrainConfig
    from mimo_train.errors import TrainConfigError
    from mimo_train.plan import check_training, resolve
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    for each in (REPO / "assets" / "models" / "tiny-qwen2-vl").iterdir():
        if each.name != "model.safetensors":
            (pickled / each.name).symlink_to(each)
    torch.save({"a": torch.ones(2)}, pickled / "pytorch_model.bin")
    (tmp_path / "data").mkdir()
    cfg = TrainConfig.load(str(REPO / "configs" / "train" / "qwen2_vl_finetune.yaml"),
                           [f"model.pretrained={pickled}", f"data.datasets=[{tmp_path / 'data'}]"])
    with pytest.raises(TrainConfigError, match=rf"^model.pretrained {pickled} holds no "
                       r"model.safetensors .*, only pytorch_model.bin: save it as safetensors"):
        check_training(resolve(cfg))
    # the same folder by hub name, in the local hub cache as huggingface_hub lays it out
    from huggingface_hub import constants
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--org--pickled"
    (repo / "snapshots").mkdir(parents=True)
    pickled.rename(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path / "data")
    cfg = TrainConfig.load(str(REPO / "configs" / "train" / "qwen2_vl_finetune.yaml"),
                           ["model.pretrained=org/pickled", f"data.datasets=[{tmp_path / 'data'}]"])
    with pytest.raises(TrainConfigError, match=r"^model.pretrained org/pickled holds no "
                       r"model.safetensors .*, only pytorch_model.bin: save it as safetensors"):
        check_training(resolve(cfg))
