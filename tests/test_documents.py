"""Caption pairs and interleaved documents: built from JSONL and Parquet (OBELICS columns),
bad ones counted, preprocessed against references built here by hand from the tokenizer (and
Qwen2-VL's own processor), token counts from metadata equal to full preprocessing's, M-RoPE
against transformers, what ``mimo-inspect report`` says of them (all in process), and one
training step on them (one forked rank of the session's ``ranks`` parent: no existing job
trains on documents)."""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import math
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, AutoTokenizer

from mimo_data.errors import ConfigError
from mimo_data.inspect.checks import Thresholds
from mimo_data.inspect.report import build_report, format_report
from mimo_data.inspect.stats import SampleInspector
from mimo_data.loading import token_table
from mimo_data.preprocess.chat_tokens import TextEncoder
from mimo_data.preprocess.collate import Collator
from mimo_data.preprocess.config import CaptionConfig, DocumentConfig, PreprocessConfig
from mimo_data.preprocess.preprocessor import (Preprocessor, SampleDropped, media_item,
                                              preprocess_dataset)
from mimo_data.shards.reader import ShardReader
from mimo_data.tally import Tally

from support import runs

from conftest import REPO, build_dataset, model_dir, read_json, sample_records, write_jsonl

SMOLLM2 = str(REPO / "assets" / "tokenizer" / "smollm2")
IGNORE = -100


def _smol(**changes) -> PreprocessConfig:
    return dataclasses.replace(PreprocessConfig.from_yaml(str(REPO / "configs" /
                                                              "preprocess.yaml")), **changes)


# The caption prompt of the chat-format tests (the default's marker first; this one's not).
PROMPT = "Look: <image>\nWhat is it?"


@pytest.fixture(scope="module")
def encoders() -> dict[str, TextEncoder]:
    """The SmolLM2 text encoders of captions in plain and in chat format, shared (building
    one analyses the tokenizer and template: seconds)."""
    return {"plain": TextEncoder(_smol()),
            "chat": TextEncoder(_smol(captions=CaptionConfig("chat", {"image": PROMPT})))}


def _preprocessor(encoders, encoder: str = "plain", with_media=False, **changes
                  ) -> Preprocessor:
    text = encoders[encoder]
    return Preprocessor(dataclasses.replace(text.config, **changes), with_media=with_media,
                        text=text)


def _image(width: int, height: int, index: int = 0) -> dict:
    """An image item's metadata as the shards hold it (the bytes are not read here)."""
    return {"modality": "image", "member": f"img{index}.jpg", "format": "jpeg", "bytes": 1,
            "width": width, "height": height, "mode": "RGB", "orientation": 1}


# The sample corpus's config: dynamic images, patch 14 merged 2x2, min 3136 / max 200704
# pixels. 56x112 is 4x8 patches, 2x4 merged: 8 tokens; 56x56: 4 tokens.
DOCUMENT = {"key": "d", "id": None, "source": {}, "kind": "document",
            "text": "An essay on cats.\n<image>\nThe cat sleeps.\n<image>\nThe end.",
            "media": [_image(56, 112, 0), _image(56, 56, 1)]}
CAPTION = {"key": "c", "id": None, "source": {}, "kind": "caption", "text": "A red car.",
           "media": [_image(56, 56)]}


@pytest.fixture(scope="module")
def smol_tokenizer():
    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2)
    # the config's modality tokens, which SmolLM2 lacks, added as the preprocessing adds them
    tokenizer.add_tokens(["<|image_pad|>", "<|audio_pad|>"], special_tokens=True)
    # the references below assume no BOS is added to a text (SmolLM2's tokenizer adds none)
    assert tokenizer("a")["input_ids"] == tokenizer("a", add_special_tokens=False)["input_ids"]
    return tokenizer


def _pieces(tokenizer, *pieces) -> list[int]:
    """Token ids of text pieces (str) and token runs (list of ids), each text tokenized alone:
    the markers are atomic tokens, which split the text as any added token does."""
    ids: list[int] = []
    for piece in pieces:
        ids += piece if isinstance(piece, list) else tokenizer(
            piece, add_special_tokens=False)["input_ids"]
    return ids


def _check(sample, ids: list[int], trained_targets: list[bool]) -> None:
    """``sample`` is the sequence ``ids`` whose target k (ids[k + 1]) is trained when
    ``trained_targets[k]``."""
    assert sample.input_ids.tolist() == ids[:-1]
    labels = [t if on else IGNORE for t, on in zip(ids[1:], trained_targets)]
    assert sample.labels.tolist() == labels
    assert sample.loss_mask.tolist() == [float(on) for on in trained_targets]


def test_a_document_trains_its_text_and_eos_around_its_images(smol_tokenizer, encoders):
    tok = smol_tokenizer
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    ids = _pieces(tok, "An essay on cats.\n", [pad] * 8, "\nThe cat sleeps.\n", [pad] * 4,
                  "\nThe end.", [tok.eos_token_id])
    sample = _preprocessor(encoders)(DOCUMENT)
    _check(sample, ids, [t != pad for t in ids[1:]])
    assert sample.token_counts["image"] == [8, 4]
    assert int(sample.loss_mask.sum()) == len(ids) - 1 - 12


def test_a_plain_caption_trains_the_caption_and_eos_after_its_image(smol_tokenizer, encoders):
    tok = smol_tokenizer
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    ids = _pieces(tok, [pad] * 4, "A red car.", [tok.eos_token_id])
    sample = _preprocessor(encoders)(CAPTION)
    _check(sample, ids, [False] * 3 + [True] * (len(ids) - 4))


def test_a_chat_caption_is_its_prompt_and_the_caption_through_the_template(smol_tokenizer,
                                                                           encoders):
    tok = smol_tokenizer
    sample = _preprocessor(encoders, "chat")(CAPTION)
    user = {"role": "user", "content": "Look: " + "<|image_pad|>" * 4 + "\nWhat is it?"}
    answer = {"role": "assistant", "content": "A red car."}
    ids = _pieces(tok, tok.apply_chat_template([user, answer], tokenize=False))
    prompt = _pieces(tok, tok.apply_chat_template([user], tokenize=False,
                                                  add_generation_prompt=True))
    assert ids[:len(prompt)] == prompt
    answer_ids = _pieces(tok, "A red car.", [tok.convert_tokens_to_ids("<|im_end|>")])
    assert ids[len(prompt):len(prompt) + len(answer_ids)] == answer_ids
    trained = [len(prompt) <= k + 1 < len(prompt) + len(answer_ids) for k in range(len(ids) - 1)]
    _check(sample, ids, trained)


@pytest.fixture(scope="module")
def qwen():
    """The tiny Qwen2-VL's preprocessing (its text encoder), its processor and a transformers
    Qwen2-VL model whose get_rope_index is the positions' reference."""
    from transformers import Qwen2VLConfig, Qwen2VLModel

    from mimo_train.families.registry import preprocessing_for
    path = model_dir("tiny-qwen2-vl")
    model = Qwen2VLModel(Qwen2VLConfig(
        text_config=dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=32, vocab_size=64),
        vision_config=dict(depth=1, embed_dim=16, num_heads=2, hidden_size=16,
                           spatial_merge_size=2)))
    text = TextEncoder(PreprocessConfig.from_dict(preprocessing_for(str(path))))
    return text, AutoProcessor.from_pretrained(path), model


@pytest.mark.parametrize("kind, text", [("caption", "end"), ("document", "A page:\n<image>\nend")])
def test_inspect_finds_a_text_after_its_image_not_in_the_images_wrap_tokens(qwen, kind, text):
    """``mimo-inspect report``'s loss_mask_coverage finds a caption's or a document's text
    after its image's tokens: a trained "end" after <|vision_end|> passes (it was found in
    the untrained wrap token, and failed)."""
    encoder, _, _ = qwen
    record = {"key": "e", "id": None, "source": {}, "kind": kind, "text": text,
              "media": [_image(56, 56)]}
    stats, sample = SampleInspector(encoder.config, text=encoder)(0, record)
    assert sample is not None and sample.loss_mask.sum() > 0
    assert stats.coverage_problems == [] and stats.assistant_chars_not_trained == 0


@pytest.mark.parametrize("train_wraps", [False, True])
def test_a_qwen2_vl_document_is_the_processors_tokens_and_its_mrope_positions(
        qwen, corpus, train_wraps):
    text, processor, model = qwen
    preprocessor = Preprocessor(dataclasses.replace(text.config,
                                                    documents=DocumentConfig(train_wraps)),
                                text=text)
    tok = processor.tokenizer
    photos = [(corpus / "images" / name).read_bytes() for name in ("chelsea.jpg", "page.png")]
    items = [media_item("image", data, i) for i, data in enumerate(photos)]
    record = {"key": "q", "id": None, "source": {}, "kind": "document", "media": items,
              "text": "Cats.\n<image>\nA page:\n<image>\nDone."}
    media = {item["member"]: data for item, data in zip(items, photos)}
    sample = preprocessor(record, media)
    # the reference: Qwen2-VL's processor expands each image in its own text form
    vision = "<|vision_start|><|image_pad|><|vision_end|>"
    expected = processor(text=[f"Cats.\n{vision}\nA page:\n{vision}\nDone.{tok.eos_token}"],
                         images=[Image.open(io.BytesIO(data)).convert("RGB")
                                 for data in photos], return_tensors="pt")
    ids = expected["input_ids"][0].tolist()
    pad, start, end = (tok.convert_tokens_to_ids(t) for t in
                       ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>"))
    untrained = {pad} if train_wraps else {pad, start, end}
    _check(sample, ids, [t not in untrained for t in ids[1:]])
    grids = expected["image_grid_thw"]
    assert sample.token_counts["image"] == (grids.prod(-1) // 4).tolist()
    # positions: transformers' get_rope_index on the same tokens and grids
    input_ids = sample.input_ids[None]
    positions, _ = model.get_rope_index(input_ids, mm_token_type_ids=(input_ids == pad).int(),
                                        image_grid_thw=grids,
                                        attention_mask=torch.ones_like(input_ids))
    assert torch.equal(sample.position_ids, positions[:, 0])
    batch, _ = Collator(preprocessor)([sample, sample])
    assert torch.equal(batch["position_ids"][:, 1, :input_ids.size(1)], positions[:, 0])
    # a wrap token typed in the text (its template need not write it): refused, not trained
    # as an image's start with no image after it
    typed = {**record, "text": "Typed <|vision_start|> here.\n<image>\nA page:\n<image>\nDone."}
    with pytest.raises(SampleDropped) as dropped:
        preprocessor(typed, media)
    assert dropped.value.reason == "literal_special_token" and \
        "holds '<|vision_start|>'" in str(dropped.value), dropped.value


def test_token_counts_from_metadata_equal_full_preprocessing(corpus, encoders):
    photos = [(corpus / "images" / name).read_bytes() for name in ("astronaut.jpg", "logo.png")]
    items = [media_item("image", data, i) for i, data in enumerate(photos)]
    media = {item["member"]: data for item, data in zip(items, photos)}
    records = [{**DOCUMENT, "media": items}, {**CAPTION, "media": items[1:]}]
    for captions in ("plain", "chat"):
        full = _preprocessor(encoders, captions, with_media=True)
        metadata = _preprocessor(encoders, captions)
        for record in records:
            media_of = {item["member"]: media[item["member"]] for item in record["media"]}
            a, b = full(record, media_of), metadata(record)
            assert a.token_counts == b.token_counts and sum(a.token_counts["image"]) > 8
            assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
            rows = a.encoder_inputs["image"]["image_grid_thw"].prod(-1) // 4
            assert rows.tolist() == a.token_counts["image"]


def test_a_document_longer_than_seq_length_is_dropped_and_counted(encoders):
    for policy in ("drop", "truncate_turns"):
        preprocessor = _preprocessor(encoders, seq_length=20, length_policy=policy)
        [dropped] = preprocessor.text_batch([DOCUMENT])
        assert dropped.reason == "too_long" and "a document is never cut" in dropped.detail


def test_the_caption_and_document_settings_are_checked():
    with pytest.raises(ConfigError, match="captions.format is 'conversation'"):
        _smol(captions=CaptionConfig("conversation"))
    with pytest.raises(ConfigError, match="captions.prompts.image .* marker <image> once"):
        PreprocessConfig.from_dict({"tokenizer": SMOLLM2,
                                    "captions": {"prompts": {"image": "Describe it."}}})
    with pytest.raises(ConfigError, match="no modality has wrap tokens"):
        _smol(documents=DocumentConfig(True))
    # from a file's data, judged by its own modalities (a Qwen config's wraps): taken
    wrapped = {"tokenizer": SMOLLM2, "documents": {"train_media_wraps": True}, "modalities": {
        "image": {"token": "<image>", "wrap": ["<|im_start|>", "<|im_end|>"]}}}
    assert PreprocessConfig.from_dict(wrapped).documents.train_media_wraps
    with pytest.raises(ConfigError, match="no modality has wrap tokens"):
        PreprocessConfig.from_dict({**wrapped, "modalities": {"image": {"token": "<image>"}}})
    config = PreprocessConfig.from_dict({"tokenizer": SMOLLM2, "captions": {"format": "chat"}})
    assert config.captions.prompts["audio"] == "<audio>\nTranscribe the audio."
    assert PreprocessConfig.from_dict(config.to_dict()) == config


# ------------------------------------------------------------------- mimo-shard build


@pytest.fixture(scope="module")
def built(tmp_path_factory, corpus):
    """Documents and captions from JSONL, an OBELICS-shaped Parquet (images as paths and as
    HF {bytes, path} structs) and MMC4's JSONL (images as files and embedded as OpenFlamingo's
    shards hold them), with bad records of each kind, built in process."""
    root = tmp_path_factory.mktemp("documents")
    for name in ("chelsea.jpg", "astronaut.jpg"):
        shutil.copy(corpus / "images" / name, root / name)
    write_jsonl(root / "mixed.jsonl", [
        {"texts": ["A cat:", None, "It sleeps."], "images": [None, "chelsea.jpg", None]},
        {"image": "astronaut.jpg", "caption": "An astronaut."},
        {"texts": [None, None], "images": ["chelsea.jpg", "astronaut.jpg"]},     # no text
        {"texts": ["  "], "images": [None]},                                      # whitespace
        {"texts": ["a", None], "images": [None]},                                 # not parallel
        {"texts": ["a", "b"], "images": [None, "chelsea.jpg"]},                   # both at 1
        {"texts": ["see <image>", None], "images": [None, "chelsea.jpg"]},        # typed marker
        {"texts": ["fine", None], "images": [None, "absent.jpg"]},                # no such file
        {"caption": "", "image": "chelsea.jpg"},                                  # empty caption
        {"caption": "Two.", "images": ["chelsea.jpg", "astronaut.jpg"]},          # two items
        b'{"texts": ["\\ud800"], "images": [null]}',                              # lone surrogate
    ])
    chelsea = (corpus / "images" / "chelsea.jpg").read_bytes()
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    pq.write_table(pa.table({
        "images": pa.array([[None, {"bytes": chelsea, "path": "c.jpg"}, None],
                            [None, {"bytes": None, "path": "astronaut.jpg"}],
                            # positions a cleaning emptied: "" or blank text, a struct of nulls
                            [None, None, None, {"bytes": chelsea, "path": "e.jpg"},
                             {"bytes": None, "path": None}]],
                           pa.list_(image)),
        "texts": pa.array([["Intro.", None, "Outro."], ["Only text then", None],
                           ["Emptied pieces around it:", "", " \n", None, None]]),
        "metadata": pa.array(["{}", "{}", "{}"]),
    }), root / "obelics.parquet")
    # MMC4's records as published: each image before the sentence it is matched to
    write_jsonl(root / "mmc4.jsonl", [
        {"url": "https://example.com/a", "text_list": ["A cat.", "It sleeps.", "The end."],
         "texts": [],                   # a merged export's empty column: not a document
         "image_info": [{"image_name": "chelsea.jpg", "raw_url": "https://example.com/c.jpg",
                         "matched_text_index": 1, "matched_sim": 0.31},
                        {"image_name": "astronaut.jpg", "raw_url": "https://example.com/a.jpg",
                         "matched_text_index": 1, "matched_sim": 0.22},
                        {"image_name": "m.jpg", "matched_text_index": 0, "matched_sim": 0.27,
                         "image_base64": base64.b64encode(chelsea).decode()}],
         "similarity_matrix": [[0.1, 0.31, 0.0], [0.0, 0.22, 0.1], [0.27, 0.0, 0.0]]},
        {"url": "u", "text_list": ["One.", "Two."],                   # no sentence 2
         "image_info": [{"image_name": "chelsea.jpg", "matched_text_index": 2}]},
        {"url": "u", "text_list": ["Unfetched."],                     # its image never fetched
         "image_info": [{"image_name": "gone.jpg", "matched_text_index": 0}]},
    ])
    out = root / "dataset"
    build_dataset([root / "mixed.jsonl", root / "obelics.parquet", root / "mmc4.jsonl"], out)
    return out


def test_build_writes_documents_and_captions_and_counts_the_bad_ones(built):
    records = sample_records(built)
    assert [(r.get("kind"), r["text"]) for r in records] == [
        ("document", "A cat:\n<image>\nIt sleeps."), ("caption", "An astronaut."),
        ("document", "Intro.\n<image>\nOutro."), ("document", "Only text then\n<image>"),
        ("document", "Emptied pieces around it:\n<image>"),
        # MMC4's text_list is sentences: those between two images joined by a space, as
        # OpenFlamingo joins them (not one sentence a line)
        ("document", "<image>\nA cat.\n<image>\n<image>\nIt sleeps. The end.")]
    assert all("messages" not in r for r in records)
    assert [[m["path"] for m in r["media"]] for r in records] == [
        ["chelsea.jpg"], ["astronaut.jpg"], ["c.jpg"], ["astronaut.jpg"], ["e.jpg"],
        ["m.jpg", "chelsea.jpg", "astronaut.jpg"]]
    # MMC4's images as their files' bytes, the embedded one as its base64's
    photos = {name: (built.parent / name).read_bytes() for name in ("chelsea.jpg",
                                                                     "astronaut.jpg")}
    reader = ShardReader(str(built))
    mmc4 = reader.media(5, records[5])
    assert [mmc4[m["member"]] for m in records[5]["media"]] == [
        photos["chelsea.jpg"], photos["chelsea.jpg"], photos["astronaut.jpg"]]
    report = read_json(built / "report.json")
    assert report["records_read"] == 17 and report["samples_written"] == 6
    assert {reason: data["count"] for reason, data in report["skipped_by_reason"].items()} == {
        "empty_document": 2, "malformed_record": 4, "marker_mismatch": 1, "missing_media": 2,
        "empty_caption": 1, "invalid_utf8": 1}
    [malformed] = [skip for skip in report["skipped_by_reason"]["malformed_record"]["first"]
                   if skip["location"].endswith("mmc4.jsonl:2")]
    assert malformed["detail"] == ("MMC4 image 0 (chelsea.jpg) has matched_text_index 2, not "
                                   "the index of one of its 2 sentences"), malformed
    assert report["skipped_by_reason"]["invalid_utf8"]["first"][0]["location"].endswith(
        "mixed.jsonl:11")
    # a document's image it cannot read skips the document: how to keep the rest is said, as
    # the document's form has it
    missing, unfetched = report["skipped_by_reason"]["missing_media"]["first"]
    assert missing["detail"].endswith("absent.jpg: not found (paths are relative to the "
                                      "input file's folder, or to --media-root); the whole "
                                      "document is skipped: to keep the rest, set that image "
                                      "to null in the record's 'images' list"), missing
    assert unfetched["location"].endswith("mmc4.jsonl:3") and unfetched["detail"].endswith(
        "gone.jpg: not found (paths are relative to the input file's folder, or to "
        "--media-root); the whole document is skipped: to keep the rest, remove that image "
        "from the record's 'image_info' (MMC4's images that could not be fetched are left "
        "out so)"), unfetched


def test_built_documents_preprocess_and_inspect_by_kind(built, encoders):
    config = encoders["plain"].config
    reader = ShardReader(str(built))
    tally = Tally()
    full = list(preprocess_dataset(reader, _preprocessor(encoders, with_media=True), tally))
    assert tally.kept == 6
    table = token_table.TokenTable(token_table.compute(reader, _preprocessor(encoders)),
                                   list(config.modalities))
    assert table.tokens.tolist() == [len(s.input_ids) for s in full]
    assert table.trained.tolist() == [int(s.loss_mask.sum()) for s in full]
    assert [table.item_tokens["image"][1].tolist()] == [
        [n for s in full for n in s.token_counts["image"]]]
    inspector = SampleInspector(config, text=encoders["plain"])
    report = build_report(str(built), inspector, Thresholds(), progress=False, reuse=False)
    assert report["kinds"] == {
        "caption": {"trains_as": "caption (plain)", "samples": 1, "kept": 1},
        "document": {"trains_as": "document", "samples": 5, "kept": 5}}
    # the build's skipped records fail the report, which names them by reason, and nothing
    # else does
    assert [c["name"] for c in report["checks"] if not c["passed"]] == ["skipped_records"]
    assert report["checks"][0]["by_reason"] == {
        "empty_caption": 1, "empty_document": 2, "invalid_utf8": 1, "malformed_record": 4,
        "marker_mismatch": 1, "missing_media": 2}
    report = build_report(str(built), inspector, Thresholds(max_skipped_records_fraction=0.7),
                          progress=False, reuse=False)
    assert report["passed"], format_report(report)
    assert "kinds       caption 1 (1 kept) as caption (plain), document 5 (5 kept)" in \
        format_report(report)
    # a few samples a minute read as such, not as 0 samples/s
    assert " 0.31 samples/s overall" in format_report({**report, "samples_per_second": 0.3125})
    assert " 1234 samples/s overall" in format_report({**report, "samples_per_second": 1234.4})
    again = build_report(str(built), inspector, Thresholds(), progress=False)
    assert again["tables"]["reused"] and again["kinds"] == report["kinds"]


def test_the_token_table_key_follows_how_captions_and_documents_train(built, encoders):
    reader = ShardReader(str(built))
    keys = {token_table.table_key(reader, _preprocessor(encoders, captions))
            for captions in ("plain", "chat")}
    keys.add(token_table.table_key(reader, _preprocessor(
        encoders, "chat", captions=CaptionConfig("chat", {"image": "<image> Caption?"}))))
    assert len(keys) == 3


def test_a_record_of_an_unknown_kind_is_a_counted_drop(encoders):
    [dropped] = _preprocessor(encoders).text_batch([{**DOCUMENT, "kind": "x"}])
    assert dropped.reason == "malformed_record" and "kind is 'x'" in dropped.detail
    caption = {**CAPTION, "media": CAPTION["media"] * 2}
    [dropped] = _preprocessor(encoders).text_batch([caption])
    assert dropped.reason == "malformed_record" and "exactly one media item" in dropped.detail



def test_one_training_step_on_documents_and_captions(built, encoders, ranks, tmp_path):
    """The tiny images + language model's first step on the built dataset (a global batch of
    its six samples): a finite loss over exactly their trained tokens."""
    records = runs.train(ranks, tmp_path, "documents", "images_language_colocated.yaml",
                         f"data.datasets=[{built}]", "layout=language=dp1;image=dp1,off0",
                         "train.steps=1", "train.global_batch_size=6",
                         "train.micro_batch_size=6", f"checkpoint.dir={tmp_path / 'ck'}",
                         nproc=1)
    [record] = runs.train_records(records)
    reader = ShardReader(str(built))
    expected = sum(int(s.loss_mask.sum()) for s in preprocess_dataset(
        reader, _preprocessor(encoders), Tally()))
    assert record["tokens"] == expected and math.isfinite(record["loss"])


def test_a_document_without_its_lists_says_which_and_what_it_is():
    """A Parquet row whose ``images`` is null (or a JSON record's a string): said as what it
    is, not as lists of different lengths; parallel lists are the document."""
    from mimo_data.shards.records import RecordError, normalize_document
    for texts, images, said in ((["A.", "B."], None, "a document's 'images' is missing"),
                                (["A.", None], "moon.jpg", "a document's 'images' is a string"),
                                ("A.", [None], "a document's 'texts' is a string")):
        with pytest.raises(RecordError, match=said) as refused:
            normalize_document(texts, images)
        assert refused.value.reason == "malformed_record"
    assert normalize_document(["A.", None], [None, "moon.jpg"]) == ("A.\n<image>", ["moon.jpg"])


def test_an_mmc4_record_not_of_its_form_is_skipped_saying_which_part(tmp_path):
    """MMC4 records whose sentences or images are not of MMC4's form (a string for the
    sentences, a sentence that is no string, the images as one object, an image without its
    file's name, a matched_text_index that is no sentence's: negative, or a boolean) are each
    skipped ``malformed_record`` naming the part, never read as a document of other text or
    with an image before another sentence."""
    image = {"image_name": "chelsea.jpg", "matched_text_index": 0}
    write_jsonl(tmp_path / "mmc4.jsonl", [
        {"text_list": "A cat.", "image_info": [image]},
        {"text_list": ["A cat.", None], "image_info": [image]},
        {"text_list": ["A cat."], "image_info": image},
        {"text_list": ["A cat."], "image_info": [{"matched_text_index": 0}]},
        {"text_list": ["A cat.", "It sleeps."],
         "image_info": [{**image, "matched_text_index": -1}]},
        {"text_list": ["A cat.", "It sleeps."],
         "image_info": [{**image, "matched_text_index": True}]}])
    build_dataset([tmp_path / "mmc4.jsonl"], tmp_path / "out")
    report = read_json(tmp_path / "out" / "report.json")
    assert report["samples_written"] == 0 and list(report["skipped_by_reason"]) == [
        "malformed_record"], report["skipped_by_reason"]
    skipped = [json.loads(line) for line in
               (tmp_path / "out" / "skipped.jsonl").read_text().splitlines()]
    assert {skip["reason"] for skip in skipped} == {"malformed_record"}, skipped
    details = {int(skip["location"].rpartition(":")[2]): skip["detail"] for skip in skipped}
    assert details == {
        1: "MMC4's 'text_list' is a string, not a list of sentences",
        2: "MMC4 sentence 1 is a null, not a string",
        3: "MMC4's 'image_info' is an object, not a list of images",
        4: "MMC4 image 0 has no 'image_name' (its file's name) and no 'image_base64' (its "
           "bytes)",
        5: "MMC4 image 0 (chelsea.jpg) has matched_text_index -1, not the index of one of its "
           "2 sentences",
        6: "MMC4 image 0 (chelsea.jpg) has matched_text_index True, not the index of one of "
           "its 2 sentences"}, details
    # a marker typed in a sentence: named by its index in text_list (the document's pieces
    # hold the images before it too)
    from mimo_data.shards.records import RecordError, mmc4_document
    with pytest.raises(RecordError, match=r"^MMC4 sentence 1 holds the marker\(s\) "
                       r"\['<image>'\]") as refused:
        mmc4_document(["Plain.", "Has <image> typed.", "End."], [image, image])
    assert refused.value.reason == "marker_mismatch"
    # an image embedded with no file's name: its bytes alone are the image
    assert mmc4_document(["A cat."], [{"image_base64": "aGk=", "matched_text_index": 0}]) == (
        [None, "A cat."], [{"bytes": "aGk=", "path": None}, None])
    # MMC4 as a Parquet table (its text_list and image_info columns): said as MMC4, with the
    # way to its JSONL (not a --texts-column that reads no row)
    from mimo_data.shards.sources import SourceError
    pq.write_table(pa.table({"url": ["u"], "text_list": [["A cat."]], "image_info": [[image]]}),
                   tmp_path / "mmc4.parquet")
    with pytest.raises(SourceError, match="mmc4.parquet holds MMC4's columns text_list and "
                       "image_info: MMC4 is read from its JSON / JSONL records"):
        build_dataset([tmp_path / "mmc4.parquet"], tmp_path / "from-parquet")


def test_inspect_finds_an_answer_after_a_user_turn_ending_in_its_image(qwen):
    """A user turn ending with its image ("Describe.\\n<image>"): the next header
    (<|im_end|>\\n<|im_start|>assistant) is found where it is, not at the next turn's; no
    trained answer is said to be missing, no weight-0 answer said trained."""
    encoder, _, _ = qwen
    for weight in (1, 0):
        record = {"key": "t", "id": None, "source": {}, "media": [_image(56, 56)],
                  "messages": [{"role": "user", "content": "Describe.\n<image>"},
                               {"role": "assistant", "content": "Yes.", "weight": weight},
                               {"role": "user", "content": "Is it?"},
                               {"role": "assistant", "content": "Yes. Sure"}]}
        stats, _ = SampleInspector(encoder.config, text=encoder)(0, record)
        assert stats.coverage_problems == [], stats.coverage_problems
