"""Checkpoints in the formats their repositories publish (``assets/models/published``, built by
tools/make_published.py: each file as the repository has it, dims shrunk; flat Qwen2-VL /
Qwen2.5-VL configs as transformers 4.41 wrote them, llava-hf's nested ones, weights under the
published names, sharded where the repository is) as ``model.pretrained``:

- the preprocessing config ``mimo-train --preprocessing-for`` derives from the repository's
  files gives transformers' ``input_ids`` (the published chat template, each image as the
  published processor writes it) for a conversation with a system turn, two images over two
  turns, and a text-only one;
- step 1's loss is transformers' own loss on the same micro-batches (its ``labels=`` path,
  fp32) within 1e-5, on the same trained-token count, for every repository colocated and, for
  one repository per family (Qwen2-VL, Qwen2.5-VL, LLaVA), packed and under a non-colocated
  layout with fan-in (image dp2 into language tp2): no padded vocabulary row enters the softmax;
- the export (one repository per family, and the SigLIP llava) writes ``config.json`` back as
  published, key for key, in the published dtype (``--dtype float32``: only the dtype values
  change), the weights in their published dtypes, the processor's budgets the run's and its
  chat template files the published ones; transformers loads it, its ``AutoProcessor`` makes
  the run's image tokens and its greedy tokens are mimo-generate's; with a chat template of
  the run's own, every template file of the export holds it.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from mimo_data.modalities.image import normalize_pixels
from mimo_data.preprocess.config import PreprocessConfig

from conftest import MODELS, build_dataset
from support.runs import step, write_meta

PUBLISHED = MODELS / "published"
# repository -> its transformers class
REPOSITORIES = {
    "Qwen/Qwen2-VL-2B-Instruct": "Qwen2VLForConditionalGeneration",
    "Qwen/Qwen2-VL-7B-Instruct": "Qwen2VLForConditionalGeneration",
    "Qwen/Qwen2.5-VL-3B-Instruct": "Qwen2_5_VLForConditionalGeneration",
    "Qwen/Qwen2.5-VL-7B-Instruct": "Qwen2_5_VLForConditionalGeneration",
    "llava-hf/llava-1.5-7b-hf": "LlavaForConditionalGeneration",
    "llava-hf/llava-interleave-qwen-0.5b-hf": "LlavaForConditionalGeneration",
}
# one repository per family (qwen2_vl, qwen2_5_vl, llava) also runs packed and under the
# fan-in layout; the export runs on those and on the SigLIP llava, whose chat template only
# its processor keeps
PER_FAMILY = ("Qwen/Qwen2-VL-2B-Instruct", "Qwen/Qwen2.5-VL-7B-Instruct",
              "llava-hf/llava-1.5-7b-hf")
EXPORTED = (*PER_FAMILY, "llava-hf/llava-interleave-qwen-0.5b-hf")
MAX_PIXELS = 37632                  # a smaller budget than Qwen's published one, for speed
TOLERANCE = 1e-5                    # on the mean loss per trained token
SAMPLES = 4
NAMES = ("chelsea.jpg", "rocket.jpg")


def _directory(repo: str) -> Path:
    return PUBLISHED / repo.replace("/", "--")


def _conversations(images: Path, marker: str) -> list[dict]:
    """A system turn and two images over two turns; text only; one image each. Each image
    starts its message, as in LLaVA's data: llava-hf's templates write a message's images
    before its text wherever the marker is."""
    return [
        {"id": "multi-turn", "image": [str(images / n) for n in NAMES], "conversations": [
            {"from": "system", "value": "You describe pictures in a few words."},
            {"from": "human", "value": f"{marker}What animal is this?"},
            {"from": "gpt", "value": "A cat, lying down."},
            {"from": "human", "value": f"{marker}And here?"},
            {"from": "gpt", "value": "A rocket on its launch pad."}]},
        {"id": "text-only", "conversations": [
            {"from": "human", "value": "What is a tar file?"},
            {"from": "gpt", "value": "An archive of files."}]},
        {"id": "page", "image": str(images / "page.png"), "conversations": [
            {"from": "human", "value": f"{marker}Read the page."},
            {"from": "gpt", "value": "A page of printed text."}]},
        {"id": "hopper", "image": str(images / "grace_hopper.jpg"), "conversations": [
            {"from": "human", "value": f"{marker}Who is this?"},
            {"from": "gpt", "value": "Grace Hopper, in uniform."}]},
    ]


@pytest.fixture(scope="module", params=sorted(REPOSITORIES))
def published(request, corpus, tmp_path_factory) -> dict:
    """The repository's shards of the conversations, the preprocessing config derived from
    its files, and the overrides of a step on them."""
    import yaml

    from mimo_train.families.registry import preprocessing_for
    repo = request.param
    checkpoint = _directory(repo)
    if not (checkpoint / ".complete").is_file():
        pytest.fail(f"{checkpoint} is not built: run tools/setup.sh")
    tmp = tmp_path_factory.mktemp(repo.replace("/", "--"))
    records = _conversations(corpus / "images", "<image>")
    (tmp / "records.json").write_text(json.dumps(records))
    build_dataset([tmp / "records.json"], tmp / "shards")
    config = preprocessing_for(str(checkpoint))
    config["modalities"].pop("video", None)
    if "max_pixels" in config["modalities"]["image"]:
        config["modalities"]["image"]["max_pixels"] = MAX_PIXELS
    preprocess = tmp / "preprocess.yaml"
    preprocess.write_text(yaml.safe_dump({**config, "seq_length": 2048}))
    common = [f"data.datasets=[{tmp / 'shards'}]", f"data.preprocess={preprocess}",
              f"model.pretrained={checkpoint}", f"train.global_batch_size={SAMPLES}",
              "train.steps=1", "train.device=cpu", "optimizer.warmup_steps=0",
              "optimizer.lr=0.0", "optimizer.min_lr=0.0", "train.seed=3"]
    return dict(repo=repo, checkpoint=checkpoint, architecture=REPOSITORIES[repo], tmp=tmp,
                preprocess=preprocess, common=common, records=records)


def _model(published: dict):
    import transformers
    cls = getattr(transformers, published["architecture"])
    return cls.from_pretrained(published["checkpoint"], dtype=torch.float32).eval()


def transformers_loss(model, preprocess: Path, batches: list[dict]) -> tuple[float, int]:
    """transformers' loss on mimo's micro-batches: the mean over their trained tokens of its
    own ``labels=`` loss (each micro-batch's mean times its token count), and that count.
    Where mimo's ``loss_mask`` is set at position t, its label is token t + 1 (checked); the
    same target is transformers' label at t + 1, which its loss shifts back."""
    image_config = PreprocessConfig.from_yaml(str(preprocess)).modalities["image"]
    total, count = 0.0, 0
    for batch in batches:
        length = int(batch["attention_mask"].sum(1).max())
        ids = batch["input_ids"][:, :length]
        mask = batch["attention_mask"][:, :length]
        trained = batch["loss_mask"][:, :length].bool()
        assert torch.equal(batch["labels"][:, :length - 1][trained[:, :-1]],
                           ids[:, 1:][trained[:, :-1]])
        assert not trained[:, -1].any()
        labels = torch.full_like(ids, -100)
        labels[:, 1:][trained[:, :-1]] = ids[:, 1:][trained[:, :-1]]
        extra = {}
        images = batch["modality_inputs"].get("image", {}).get("image")
        if images is not None:
            extra["pixel_values"] = normalize_pixels(images["pixel_values"], image_config)
            if "image_grid_thw" in images:
                extra.update(image_grid_thw=images["image_grid_thw"],
                             mm_token_type_ids=(ids == model.config.image_token_id).int())
        with torch.no_grad():
            loss = model(input_ids=ids, attention_mask=mask.long(), labels=labels,
                         **extra).loss
        tokens = int((labels[:, 1:] != -100).sum())
        total += float(loss) * tokens
        count += tokens
    return total / count, count


@pytest.fixture(scope="module")
def colocated(ranks, published) -> dict:
    """Step 1 colocated, one sample per micro-batch, the micro-batches it trained on, and, for
    the exported repositories, the imported model saved first (``init/step_0000000``)."""
    tmp = published["tmp"]
    return step(ranks, tmp / "colocated", 1, "layout=language=dp1;image=dp1,off0",
                "train.micro_batch_size=1", *published["common"], save_batches=True,
                save_init=tmp / "init" if published["repo"] in EXPORTED else None)


@pytest.fixture(scope="module")
def reference(published, colocated) -> tuple[float, int]:
    """transformers' loss and trained tokens on the colocated step's micro-batches."""
    return transformers_loss(_model(published), published["preprocess"],
                             colocated["ranks"][0]["batches"])


def _assert_loss(result: dict, reference: tuple[float, int], what: str) -> None:
    loss, tokens = reference
    assert result["tokens"] == tokens, what
    assert math.isclose(result["loss_sum"] / result["tokens"], loss, rel_tol=0,
                        abs_tol=TOLERANCE), (what, result["loss_sum"] / result["tokens"], loss)


def test_step_one_loss_is_transformers_loss(published, colocated, reference):
    assert len(colocated["ranks"][0]["batches"]) == SAMPLES
    _assert_loss(colocated, reference, "colocated")


@pytest.mark.parametrize("published", PER_FAMILY, indirect=True)
def test_packed_and_fan_in_give_transformers_loss(ranks, published, reference):
    tmp, common = published["tmp"], published["common"]
    packed = step(ranks, tmp / "packed", 1, "layout=language=dp1;image=dp1,off0",
                  f"train.micro_batch_size={SAMPLES}", "data.packing=true",
                  "model.attention=sdpa", *common)
    _assert_loss(packed, reference, "packed")
    fan_in = step(ranks, tmp / "fan-in", 4, "layout=image=dp2;language=tp2",
                  f"train.micro_batch_size={SAMPLES}", "data.packing=true", *common)
    _assert_loss(fan_in, reference, "image dp2 -> language tp2, packed")


def test_input_ids_are_the_published_processor_and_template(published, corpus):
    """The multi-turn record with its system turn and two images, and the text-only one: the
    published template rendered from typed contents, encoded by the published processor as its
    documentation does (LLaVA-1.5's tokenizer adds its <s>), each image expanded by it; the
    trained tokens are each answer and the end-of-turn token the template writes after it.
    LLaVA-1.5's template writes none: its EOS follows each answer, as in LLaVA's own training
    (its ``v1`` conversation's ``sep2="</s>"``), through ``append_eos: auto``."""
    from PIL import Image, ImageOps
    from transformers import AutoProcessor

    from mimo_data.preprocess.preprocessor import Preprocessor, media_item
    checkpoint = published["checkpoint"]
    config = PreprocessConfig.from_yaml(str(published["preprocess"]))
    preprocessor = Preprocessor(config)
    processor = AutoProcessor.from_pretrained(checkpoint, **_pixels(published))
    roles = {"system": "system", "human": "user", "gpt": "assistant"}
    for record in published["records"][:2]:
        names = [Path(p).name for p in record.get("image", [])]
        data = [(corpus / "images" / n).read_bytes() for n in names]
        turns = [(roles[t["from"]], t["value"]) for t in record["conversations"]]
        sample = preprocessor.text_batch([{
            "key": "k", "messages": [{"role": r, "content": c} for r, c in turns],
            "media": [media_item("image", d, i) for i, d in enumerate(data)]}])[0]
        ours = sample.ids
        # the trained targets: each answer and the end-of-turn token the template writes
        # after it (Qwen's and llava-interleave's <|im_end|>), or llava-1.5's appended </s>
        targets, trained = sample.ids[1:], sample.loss_mask
        runs = np.split(np.arange(len(trained)), np.flatnonzero(np.diff(trained.astype(int))) + 1)
        answers = [processor.tokenizer.decode(targets[run]).strip() for run in runs
                   if trained[run[0]]]
        llava_1_5 = "llava-1.5" in published["repo"]
        end = "</s>" if llava_1_5 else "<|im_end|>"
        assert answers == [c + end for r, c in turns if r == "assistant"], record["id"]
        # the processor's template: llava-hf repositories keep theirs beside the processor
        text = processor.apply_chat_template(
            [{"role": r, "content": _content(c)} for r, c in turns], tokenize=False)
        if llava_1_5:           # LLaVA's recipe: the answer, then </s>
            text = _after_each(text, [c for r, c in turns if r == "assistant"], "</s>")
        pictures = [ImageOps.exif_transpose(Image.open(corpus / "images" / n)).convert("RGB")
                    for n in names]
        expected = processor(text=[text], images=pictures or None)["input_ids"][0]
        assert ours.tolist() == list(expected), record["id"]
    # typed contents as a dataset gives them (the build's normalization): two adjacent text
    # parts get what the template writes between them (nothing in Qwen's, a space after each
    # in LLaVA-1.5's, a newline before each in llava-interleave's), not a separator of mimo's
    from mimo_data.shards.records import normalize_messages
    typed = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Look."},
                                          {"type": "text", "text": "What is it?"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "A cat."},
                                               {"type": "text", "text": "It sleeps."}]}]
    photo = corpus / "images" / "chelsea.jpg"
    sample = preprocessor.text_batch([{"key": "k", "messages": normalize_messages(typed),
                                       "media": [media_item("image", photo.read_bytes(), 0)]}])[0]
    text = processor.apply_chat_template(typed, tokenize=False)
    if llava_1_5:
        text = _after_each(text, ["It sleeps."], "</s>")
    picture = ImageOps.exif_transpose(Image.open(photo)).convert("RGB")
    assert sample.ids.tolist() == list(processor(text=[text], images=[picture])["input_ids"][0])


def _after_each(text: str, answers: list[str], token: str) -> str:
    """``text`` with ``token`` right after each of ``answers``, found in order."""
    cursor = 0
    for answer in answers:
        cursor = text.index(answer, cursor) + len(answer)
        text = text[:cursor] + token + text[cursor:]
        cursor += len(token)
    return text


def _content(text: str) -> list[dict]:
    """A message's content as the published templates take it: its images, then its text."""
    parts = text.split("<image>")
    return [*({"type": "image"} for _ in parts[1:]),
            {"type": "text", "text": "".join(parts)}]


def _pixels(published: dict) -> dict:
    return {"max_pixels": MAX_PIXELS} if "Qwen" in published["repo"] else {}


@pytest.mark.parametrize("published", EXPORTED, indirect=True)
def test_export_keeps_the_published_layout(published, colocated, corpus, tmp_path, capsys):
    """The imported model exported: ``config.json`` has the published keys where the published
    file has them (flat stays flat), every weight under its published name with its value;
    transformers loads it, and its greedy tokens for an image prompt are mimo-generate's. The
    run trained in float32: the line saying the dtype says how to keep it."""
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    from mimo_train.hf.export import main
    out = tmp_path / "out"
    capsys.readouterr()
    assert main(["--checkpoint", str(published["tmp"] / "init" / "step_0000000"),
                 "--output", str(out)]) == 0
    original = json.loads((published["checkpoint"] / "config.json").read_text())
    stored = original.get("torch_dtype", original.get("dtype")) or \
        original.get("text_config", {}).get("dtype")
    if stored in ("bfloat16", "float16"):
        assert f"weights in {stored} (the base checkpoint's; trained in float32: --dtype " \
            "float32 keeps it)" in capsys.readouterr().out
    # the published file, key for key and value for value (the run trained in fp32; the
    # export is in the published dtype)
    assert json.loads((out / "config.json").read_text()) == original
    # the published template and tokenizer files (the run's tokens are the checkpoint's)
    for name in ("chat_template.json", "chat_template.jinja", "tokenizer.json",
                 "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json"):
        if (published["checkpoint"] / name).is_file():
            assert (out / name).read_bytes() == (published["checkpoint"] / name).read_bytes(), \
                name
    # and no template file the checkpoint has not (a save's chat_template.jinja, say)
    assert {path.name for path in out.glob("chat_template.*")} == \
        {path.name for path in published["checkpoint"].glob("chat_template.*")}
    theirs = {}
    for path in published["checkpoint"].glob("*.safetensors"):
        theirs.update(load_file(path))
    ours = {}
    for path in out.glob("*.safetensors"):
        ours.update(load_file(path))
    assert set(ours) == set(theirs)
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and torch.equal(ours[name], tensor), name
    model = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32).eval()
    assert type(model).__name__ == published["architecture"]

    # transformers' greedy tokens on mimo-generate's prompt, the image as the published
    # processor gives it
    from PIL import Image, ImageOps
    from transformers import AutoProcessor

    from mimo_train.hf.generate import Generator
    path = corpus / "images" / "grace_hopper.jpg"
    ours = Generator(str(out)).generate("Who is this?", images=[str(path)], max_new_tokens=8)
    image = ImageOps.exif_transpose(Image.open(path)).convert("RGB")
    # the export's own processor, as transformers loads it: the run's pixel budget
    pixels = AutoProcessor.from_pretrained(out).image_processor(images=[image],
                                                                return_tensors="pt")
    if "image_grid_thw" in pixels:
        assert int(pixels["image_grid_thw"].prod()) // 4 == ours.spliced["image"]
    ids = torch.tensor([ours.prompt_ids])
    extra = {"pixel_values": pixels["pixel_values"]}
    if "image_grid_thw" in pixels:
        extra.update(image_grid_thw=pixels["image_grid_thw"],
                     mm_token_type_ids=(ids == model.config.image_token_id).int())
    with torch.no_grad():
        theirs = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                do_sample=False, max_new_tokens=8, **extra)
    assert theirs[0, ids.size(1):].tolist() == ours.token_ids
    assert len(ours.token_ids) == 8


def _as_run(init: Path, target: Path, preprocess: Path) -> Path:
    """The checkpoint ``init`` (linked) as if its run had ``preprocess`` as its config."""
    target.mkdir()
    for path in init.iterdir():
        if path.name not in ("meta.json", "integrity.json"):
            (target / path.name).symlink_to(path)
    shutil.copy(init / "integrity.json", target / "integrity.json")
    from mimo_data.preprocess.config import PreprocessConfig
    meta = json.loads((init / "meta.json").read_text())
    meta["config"]["data"]["preprocess"] = str(preprocess)
    meta["preprocess"] = PreprocessConfig.from_yaml(str(preprocess)).to_dict()   # as trained
    write_meta(target, meta)
    return target


@pytest.mark.parametrize("published", EXPORTED, indirect=True)
def test_export_in_another_dtype_and_with_the_runs_own_chat_template(published, colocated,
                                                                     tmp_path, capsys):
    """``--dtype fp32`` (float32 by its short name): config.json as published but its dtype
    values, every weight in float32. The run's own ``chat_template:`` is in every file
    transformers reads a template from: AutoTokenizer's and AutoProcessor's, and
    mimo-generate's prompt."""
    import yaml
    from safetensors.torch import load_file
    from transformers import AutoProcessor, AutoTokenizer

    from mimo_train.hf.export import main
    from mimo_train.hf.generate import Generator
    init = published["tmp"] / "init" / "step_0000000"
    template = ("{% for m in messages %}MimoBot {{ m['role'] }}: {{ m['content'] if m['content'] "
                "is string else m['content'][-1]['text'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}MimoBot assistant:{% endif %}")
    (tmp_path / "custom.jinja").write_text(template)
    config = yaml.safe_load(published["preprocess"].read_text())
    (tmp_path / "custom.yaml").write_text(yaml.safe_dump(
        {**config, "chat_template": str(tmp_path / "custom.jinja")}))
    run = _as_run(init, tmp_path / "run", tmp_path / "custom.yaml")
    out = tmp_path / "out"
    capsys.readouterr()
    assert main(["--checkpoint", str(run), "--output", str(out), "--dtype", "fp32"]) == 0
    assert "weights in float32 (--dtype)" in capsys.readouterr().out

    original = json.loads((published["checkpoint"] / "config.json").read_text())
    # every section's dtype (the tower's too: its weights are in float32 as well)
    for section in (original, *(value for key, value in original.items()
                                if key.endswith("_config") and isinstance(value, dict))):
        for key in ("dtype", "torch_dtype"):
            if key in section:
                section[key] = "float32"
    assert json.loads((out / "config.json").read_text()) == original
    weights = {}
    for path in out.glob("*.safetensors"):
        weights.update(load_file(path))
    assert {t.dtype for t in weights.values() if t.is_floating_point()} == {torch.float32}

    assert (out / "chat_template.jinja").read_text() == template
    if (published["checkpoint"] / "chat_template.json").is_file():
        assert json.loads((out / "chat_template.json").read_text())["chat_template"] == template
    assert AutoTokenizer.from_pretrained(out).chat_template == template
    assert AutoProcessor.from_pretrained(out).chat_template == template
    assert yaml.safe_load((out / "preprocess.yaml").read_text())["chat_template"] is None
    generator = Generator(str(out))
    prompt = generator.tokenizer.decode(generator.generate("Hi", max_new_tokens=1).prompt_ids)
    assert prompt.endswith("MimoBot user: Hi\nMimoBot assistant:"), prompt


# repository -> its language model as published (layers, hidden, heads, key/value heads,
# vocabulary, tied, M-RoPE section): llava-1.5's text config leaves the dims to LlamaConfig's
# defaults (Vicuna-7B's); Qwen's flat configs hold them at the top level
def test_export_writes_the_video_sampling_where_transformers_cannot_say_its_default(
        tmp_path, monkeypatch):
    """Without torchvision, transformers' video processor classes are placeholders that raise
    ImportError (mimo needs no torchvision): the export still writes Qwen3-VL's video
    processor file, with the run's frame sampling written out (its class default unknown);
    with the class readable, a run at the class defaults leaves the published file as it is
    but for cap_pixels_per_frame, whose class default of None transformers says will change
    meaning: the run's written, as the run sampled."""
    import shutil
    import sys

    from mimo_train.families.registry import preprocessing_for
    from mimo_train.hf.processor_files import processor_budgets
    repo = PUBLISHED / "Qwen--Qwen3-VL-2B-Instruct"
    preprocess = PreprocessConfig.from_dict(preprocessing_for(str(repo)))
    name = "video_preprocessor_config.json"
    published = json.loads((repo / name).read_text())
    shutil.copy(repo / name, tmp_path / name)
    processor_budgets(str(tmp_path), preprocess)
    assert json.loads((tmp_path / name).read_text()) == {**published,
                                                        "cap_pixels_per_frame": False}
    # a run that capped each frame's pixels (Qwen3-VL's 768 tokens a frame, its class
    # default, unless given): the cap written, so that transformers' processor makes the
    # grids the run trained on
    import dataclasses
    video = preprocess.modalities["video"]
    assert video.max_video_tokens == 768
    capped = dataclasses.replace(preprocess, modalities={
        **preprocess.modalities, "video": dataclasses.replace(video, cap_pixels_per_frame=True)})
    (tmp_path / "capped").mkdir()
    shutil.copy(repo / name, tmp_path / "capped" / name)
    processor_budgets(str(tmp_path / "capped"), capped)
    assert json.loads((tmp_path / "capped" / name).read_text()) == {
        **published, "cap_pixels_per_frame": True}
    # ... and read back as such: that export as model.pretrained preprocesses as it trained
    for each in repo.iterdir():
        if each.name != name:
            (tmp_path / "capped" / each.name).symlink_to(each)
    assert preprocessing_for(str(tmp_path / "capped"))["modalities"]["video"][
        "cap_pixels_per_frame"] is True

    class Placeholder:                   # what transformers gives without torchvision
        def __getattr__(self, key):
            raise ImportError("Qwen3VLVideoProcessor requires the Torchvision library")
    # the module transformers' own imports see (the name bound here may be another object)
    monkeypatch.setattr(sys.modules["transformers"], "Qwen3VLVideoProcessor", Placeholder(),
                        raising=False)
    shutil.copy(repo / name, tmp_path / name)                    # the published file again
    processor_budgets(str(tmp_path), preprocess)
    video = preprocess.modalities["video"]
    assert json.loads((tmp_path / name).read_text()) == {
        **published, "fps": video.fps, "min_frames": video.min_frames,
        "max_frames": video.max_frames, "cap_pixels_per_frame": False, "max_video_tokens": 768}


def test_the_derived_video_config_writes_the_frame_sampling_it_takes():
    """``--preprocessing-for`` writes the frames a clip is sampled to (transformers' class
    defaults where the checkpoint saves none; fps 2, qwen-vl-utils', where the class has none
    either, as Qwen2-VL's) rather than leave them to unwritten defaults, and no null."""
    import transformers

    from mimo_train.families.registry import preprocessing_for
    for repo, kind in (("Qwen--Qwen2.5-VL-3B-Instruct", "Qwen2VLVideoProcessor"),
                       ("Qwen--Qwen3-VL-2B-Instruct", "Qwen3VLVideoProcessor")):
        video = preprocessing_for(str(PUBLISHED / repo))["modalities"]["video"]
        assert None not in video.values(), video
        processor = getattr(transformers, kind)
        assert (video["fps"], video["min_frames"], video["max_frames"]) == (
            getattr(processor, "fps", None) or 2.0, processor.min_frames,
            processor.max_frames), video


PUBLISHED_LANGUAGE = {
    "Qwen/Qwen2-VL-2B-Instruct": (28, 1536, 12, 2, 151936, True, (16, 24, 24)),
    "Qwen/Qwen2-VL-7B-Instruct": (28, 3584, 28, 4, 152064, False, (16, 24, 24)),
    "Qwen/Qwen2.5-VL-3B-Instruct": (36, 2048, 16, 2, 151936, True, (16, 24, 24)),
    "Qwen/Qwen2.5-VL-7B-Instruct": (28, 3584, 28, 4, 152064, False, (16, 24, 24)),
    "llava-hf/llava-1.5-7b-hf": (32, 4096, 32, 32, 32064, False, None),
    "llava-hf/llava-interleave-qwen-0.5b-hf": (24, 1024, 16, 16, 152000, True, None),
}


@pytest.mark.parametrize("repo", sorted(PUBLISHED_LANGUAGE))
def test_a_published_config_is_read_where_its_format_keeps_each_value(repo, tmp_path):
    """The full-size published ``config.json`` beside the replica's weights (whose names say
    where the language model sits): its language model as published, tying included (top
    level for Qwen2-VL-2B and llava-1.5, only in text_config for llava-interleave)."""
    import shutil

    from mimo_train.families.registry import language_arch
    directory = tmp_path / "checkpoint"
    shutil.copytree(_directory(repo), directory)
    shutil.copy(Path(__file__).parents[1] / "tools" / "published" / repo.replace("/", "--") /
                "config.json", directory / "config.json")
    arch = language_arch(str(directory), "model.pretrained")
    layers, hidden, heads, groups, vocab, tied, mrope = PUBLISHED_LANGUAGE[repo]
    assert (arch.num_layers, arch.hidden_size, arch.num_attention_heads, arch.num_query_groups,
            arch.vocab_size, arch.tied, arch.mrope_section) == (
                layers, hidden, heads, groups, vocab, tied, mrope)


def test_a_value_missing_from_a_checkpoint_config_names_the_file_and_the_key():
    from transformers import AutoConfig

    from mimo_train.errors import TrainConfigError
    from mimo_train.families.base import checkpoint_value
    path = str(_directory("Qwen/Qwen2-VL-2B-Instruct"))
    config = AutoConfig.from_pretrained(path)
    assert checkpoint_value(config, "tie_word_embeddings", path, "model.pretrained") is True
    with pytest.raises(TrainConfigError, match=r"config\.json has no 'no_such_key'"):
        checkpoint_value(config, "no_such_key", path, "model.pretrained")


def test_an_adapters_export_names_its_processor(tmp_path):
    """An adapters folder has no config.json: with a base whose image processor's file does
    not name the processor (the set-up's tiny Qwen2-VL, saved as an image processor alone),
    ``AutoProcessor`` on it gave the tokenizer alone. The export names the class from the
    base's model type; a base that names it (the hub's) is copied as it is."""
    import shutil

    from transformers import AutoProcessor

    from mimo_train.hf.processor_files import name_processor
    tiny = MODELS / "tiny-qwen2-vl"
    assert "processor_class" not in json.loads((tiny / "preprocessor_config.json").read_text())
    out = tmp_path / "adapters"
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "preprocessor_config.json"):
        shutil.copyfile(tiny / name, out / name)
    name_processor(str(out), str(tiny))
    assert type(AutoProcessor.from_pretrained(out)).__name__ == "Qwen2VLProcessor"
    published = PUBLISHED / "Qwen--Qwen2.5-VL-3B-Instruct"
    shutil.copyfile(published / "preprocessor_config.json", out / "preprocessor_config.json")
    name_processor(str(out), str(tiny))        # named already: left as it is
    assert (out / "preprocessor_config.json").read_bytes() == \
        (published / "preprocessor_config.json").read_bytes()


@pytest.mark.parametrize("repository", ["Qwen/Qwen2-VL-2B-Instruct",
                                        "llava-hf/llava-interleave-qwen-0.5b-hf"])
def test_a_processor_saved_by_transformers_5_is_read_checked_and_exported(repository, tmp_path):
    """A checkpoint whose processor this transformers saved (one nested processor_config.json,
    no preprocessor_config.json: a user's own save, a second fine-tune round) is read as the
    published files are (``--preprocessing-for``), checked against the run's preprocessing,
    and exported with the run's pixel budget and frame sampling in the section transformers
    reads first."""
    import dataclasses
    import os

    from transformers import AutoImageProcessor, AutoProcessor

    from mimo_train.errors import EncoderBuildError
    from mimo_train.families.base import check_preprocessor, normalization
    from mimo_train.families.registry import preprocessing_for
    from mimo_train.hf.processor_files import copy_processor
    repo = PUBLISHED / repository.replace("/", "--")
    saved = tmp_path / "saved"
    AutoProcessor.from_pretrained(repo).save_pretrained(saved)
    assert (saved / "processor_config.json").is_file()
    assert not (saved / "preprocessor_config.json").exists()
    for each in repo.iterdir():                 # the weights and config beside it, as published
        if not (saved / each.name).exists() and "processor" not in each.name:
            (saved / each.name).symlink_to(each)
    preprocess = PreprocessConfig.from_dict(preprocessing_for(str(saved)))
    # the same settings (the saved video processor spells out its class defaults)
    assert preprocess.modalities == \
        PreprocessConfig.from_dict(preprocessing_for(str(repo))).modalities
    image = preprocess.modalities["image"]
    check_preprocessor(str(saved), normalization(image))          # agrees: no error
    with pytest.raises(EncoderBuildError, match=r"the image processor saved in .* "
                                                r"preprocesses differently: image_mean"):
        check_preprocessor(str(saved), normalization(dataclasses.replace(image, mean=(0.25,) * 3)))
    if image.policy != "dynamic":
        return
    # exported from a run at another pixel budget (and 1 frame a second): what transformers
    # builds from the export is that budget and sampling, not the checkpoint's
    video = preprocess.modalities["video"]
    run = dataclasses.replace(preprocess, modalities={
        **preprocess.modalities, "image": dataclasses.replace(image, max_pixels=MAX_PIXELS),
        "video": dataclasses.replace(video, max_pixels=MAX_PIXELS, fps=1.0)})
    out = tmp_path / "export"
    out.mkdir()
    copy_processor(str(saved), str(out), run, None)
    assert not os.path.exists(out / "video_preprocessor_config.json")
    assert AutoImageProcessor.from_pretrained(out).size["longest_edge"] == MAX_PIXELS
    section = json.loads((out / "processor_config.json").read_text())["video_processor"]
    assert (section["size"]["longest_edge"], section["fps"], section["do_sample_frames"]) == \
        (MAX_PIXELS, 1.0, True)
