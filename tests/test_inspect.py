"""`mimo-inspect` on the real corpus, clean and with planted faults.

Expected keys come from the planted records' ids (looked up in samples.parquet), expected
numbers from the records' own metadata and texts, the token counts from ``token_counts`` (tested
against transformers' processors in test_media_inputs) and the aggregate numbers from the plain
metadata-only Preprocessor, never from the report's own code.
"""

from __future__ import annotations

import copy
import html.parser
import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest
import yaml

from mimo_data.preprocess.chat_tokens import TextEncoder
from mimo_data.inspect.cli import main
from mimo_data.preprocess.preprocessor import Preprocessor, SampleDropped
from mimo_data.preprocess.config import PreprocessConfig
from mimo_data.shards.records import marker_order
from mimo_data.preprocess.segment_tokenizer import (SegmentCacheError, SegmentCachedTokenizer,
                                         byte_level_lengths, encode_texts, unsupported_reason)
from mimo_data.shards.reader import ShardReader
from mimo_data.modalities.audio import audio_tokens
from mimo_data.modalities.image import image_tokens

from conftest import REPO, build_dataset, rerecord_member, samples_table, write_jsonl

EOT = "<|im_end|>"
LONG_ANSWER = " ".join(f"Point {i}: the picture shows one more detail." for i in range(200))


def write_config(path: Path, **changes) -> Path:
    data = yaml.safe_load((REPO / "configs" / "preprocess.yaml").read_text())
    data["tokenizer"] = str(REPO / "assets" / "tokenizer" / "smollm2")
    data.update(changes)
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("inspect-configs")
    return {"default": write_config(root / "default.yaml"),
            "truncate": write_config(root / "truncate.yaml", length_policy="truncate_turns"),
            "caption": write_config(root / "caption.yaml", mode="caption"),
            "fixed": write_config(root / "fixed.yaml", modalities={
                "image": {"policy": "fixed", "image_size": 224, "patch_size": 14},
                "audio": {}}),
            # the corpus's clips of 3 to 7 s: the longer ones over max_duration, cut
            "cut": write_config(root / "cut.yaml", modalities={
                **yaml.safe_load((REPO / "configs" / "preprocess.yaml").read_text())[
                    "modalities"], "audio": {"max_duration": 5.0, "long_audio": "truncate"}})}


@pytest.fixture(scope="module")
def clean(corpus_inputs, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("inspect-clean") / "shards"
    build_dataset(corpus_inputs, out)
    return out


def _planted_records(assets) -> list[dict]:
    image, audio = str(assets["jpeg"]), str(assets["flac"])

    def turns(*pairs):
        return [{"role": role, "content": content} for role, content in pairs]
    return [
        # An assistant turn longer than seq_length, after a first question and answer.
        {"id": "fault-long", "images": [image], "messages": turns(
            ("user", "<image>\nWhat is this?"), ("assistant", "A photo."),
            ("user", "Describe every detail."), ("assistant", LONG_ANSWER))},
        # A second answer without text: its end of turn is all it trains.
        {"id": "fault-empty-answer", "messages": turns(
            ("user", "Hi"), ("assistant", "Hello."), ("user", "And then?"), ("assistant", ""))},
        # Patched after the build (a build or an index skips a conversation without an
        # answer, as an older one did not): the answer made a user's turn, so nothing is left
        # to train on.
        {"id": "fault-prompt-only", "images": [image], "messages": turns(
            ("user", "<image>\nDescribe the image."), ("assistant", "A photo."))},
        # An answer starting with newlines: a token straddles the trained span's edge.
        {"id": "fault-template", "messages": turns(("user", "Hi"), ("assistant", "\n\nHello."))},
        # Fine in chat mode; in caption mode its last placeholder is only a target.
        {"id": "fault-trailing-image", "images": [image], "messages": turns(
            ("user", "What is a cat?"), ("assistant", "An animal."), ("user", "<image>"))},
        # Patched after the build (see _patch_member): <image> -> <audio>.
        {"id": "fault-swap", "images": [image],
         "messages": turns(("user", "<image>\nDescribe the image."), ("assistant", "A photo."))},
        # Patched after the build: "picture" -> "<image>" (2 markers, 1 image).
        {"id": "fault-extra-marker", "images": [image], "messages": turns(
            ("user", "<image>\nDescribe the picture."), ("assistant", "A photo."))},
        # Patched after the build: the record's image width no longer matches samples.parquet.
        {"id": "fault-index", "images": [image], "audios": [audio], "messages": turns(
            ("user", "<image>\n<audio>\nWhat do you see and hear?"),
            ("assistant", "A photo and a voice."))},
        # An image that is not there: the build skips the record (no shard holds it).
        {"id": "fault-missing-image", "images": ["no-such-photo.jpg"], "messages": turns(
            ("user", "<image>\nWhat is this?"), ("assistant", "A photo."))},
    ]


def _patch_member(directory: Path, key: str, old: bytes, new: bytes) -> None:
    """Replace ``old`` by ``new`` (same length) in the JSON member of ``key``, in place, as if
    the builder had written that record: the tar stays valid (only member data changes),
    offsets and sizes stay right, and samples.parquet records the new bytes' crc32."""
    assert len(old) == len(new)
    reader = ShardReader(str(directory))
    position = reader.table.position(key)
    offset, size, _ = reader.table.members(position)["json"]
    shard = directory / reader.table.shard(position)
    reader.close()
    data = shard.read_bytes()
    member = data[offset:offset + size]
    assert member.count(old) == 1, (key, old, member)
    shard.write_bytes(data[:offset] + member.replace(old, new) + data[offset + size:])
    rerecord_member(directory, key, "json")


@pytest.fixture(scope="module")
def faulty(corpus_inputs, assets, tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """The corpus plus the planted faults; returns (directory, {fault id: key})."""
    root = tmp_path_factory.mktemp("inspect-faulty")
    faults = write_jsonl(root / "faults.jsonl", _planted_records(assets))
    out = root / "shards"
    build_dataset([*corpus_inputs, faults], out)
    keys = {row["id"]: row["key"] for row in samples_table(out)
            if (row["id"] or "").startswith("fault-")}
    assert len(keys) == 8, keys
    _patch_member(out, keys["fault-swap"], b"<image>\\nDescribe the image.",
                  b"<audio>\\nDescribe the image.")
    _patch_member(out, keys["fault-extra-marker"], b"the picture.", b"the <image>.")
    _patch_member(out, keys["fault-prompt-only"], b'"role": "assistant"',
                  b'"role": "user"     ')
    reader = ShardReader(str(out))
    record = reader.record(reader.table.position(keys["fault-index"]))
    width = record["media"][0]["width"]
    _patch_member(out, keys["fault-index"], f'"width": {width},'.encode(),
                  f'"width": {width + 1 if width % 10 != 9 else width - 1},'.encode())
    return out, keys


def run(capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def report_json(capsys, tmp_path, directory, config, *extra) -> tuple[int, dict, str]:
    out = tmp_path / f"report-{len(list(tmp_path.iterdir()))}.json"
    code, printed, err = run(capsys, "report", directory, "--config", config, "--json", out,
                             "--no-progress", *extra)
    assert printed.endswith(f"JSON report: {out}\n"), printed
    return code, json.loads(out.read_text()), err


def flagged_keys(report: dict, check: str) -> set[str]:
    return {entry["key"] for entry in report["flagged"][check]}


# ------------------------------------------------------------------------------------ report

def test_clean_corpus_passes_every_check(capsys, tmp_path, clean, configs):
    code, report, err = report_json(capsys, tmp_path, clean, configs["default"])
    assert code == 0, err
    assert "FAIL" not in err
    assert report["passed"] and all(check["passed"] for check in report["checks"])
    assert report["samples"] == report["kept"] == len(ShardReader(str(clean)))
    assert not any(report["flagged"].values())
    # long_audio: drop (the default) drops a long clip's sample, counted: none is cut
    assert "cut" not in report["modalities"]["audio"]


def test_report_time_counts_from_the_command_s_start(capsys, tmp_path, clean, configs,
                                                     monkeypatch):
    """The report's ``seconds`` ("in all") count from the command's start, the config's and
    tokenizer's loading included, not from the pass alone: a clock that put the start 1000 s
    back shows in them."""
    import time
    from types import SimpleNamespace

    from mimo_data.inspect import cli
    monkeypatch.setattr(cli, "time", SimpleNamespace(
        perf_counter=lambda: time.perf_counter() - 1000))
    code, report, err = report_json(capsys, tmp_path, clean, configs["default"], "--recompute")
    assert code == 0 and report["seconds"] >= 1000 and not report["tables"]["reused"], err


def test_report_numbers_are_the_preprocessors(capsys, tmp_path, faulty, configs):
    """Totals of the report == a plain loop of the metadata-only Preprocessor (whole-text
    tokenization, no piece cache) over the same dataset."""
    directory, _ = faulty
    code, report, _ = report_json(capsys, tmp_path, directory, configs["default"])
    assert code == 1
    preprocessor = Preprocessor(PreprocessConfig.from_yaml(str(configs["default"])),
                                with_media=False)
    reader = ShardReader(str(directory))
    lengths, trained, drops = [], 0, {}
    placeholders = {m: 0 for m in preprocessor.text.modality_token_ids}
    items = {m: [0, 0] for m in preprocessor.text.modality_token_ids}    # items, samples
    dropped_media = 0
    for position in range(len(reader)):
        try:
            sample = preprocessor(reader.record(position))
        except SampleDropped as exc:
            drops[reader.table.key(position)] = exc.reason
            dropped_media += bool(reader.record(position)["media"])
            continue
        lengths.append(len(sample.input_ids))
        trained += int(sample.loss_mask.sum())
        for modality, token_id in preprocessor.text.modality_token_ids.items():
            placeholders[modality] += int((sample.input_ids == token_id).sum())
            counts = sample.token_counts.get(modality) or []
            items[modality][0] += len(counts)
            items[modality][1] += bool(counts)
    assert report["kept"] == len(lengths)
    assert report["tokens"]["real"] == sum(lengths)
    assert report["tokens"]["trained"] == trained
    assert report["sequence_length"]["stats"]["max"] == max(lengths)
    assert sum(b["count"] for b in report["sequence_length"]["histogram"]) == len(lengths)
    assert {m: d["tokens"] for m, d in report["modalities"].items()} == placeholders
    # the kept samples' items and the kept samples with any (a dropped one's are not counted)
    assert {m: [d["items"], d["samples"]] for m, d in report["modalities"].items()} == items
    assert dropped_media > 0, drops
    assert {e["key"]: e["detail"].split(":")[0] for e in report["flagged"]["dropped"]} == drops


def test_planted_faults_are_reported_by_key(capsys, tmp_path, faulty, configs):
    directory, keys = faulty
    code, report, err = report_json(capsys, tmp_path, directory, configs["default"])
    assert code == 1
    expected = {
        "dropped": {keys[k] for k in ("fault-long", "fault-prompt-only", "fault-swap",
                                      "fault-extra-marker")},
        "zero_trained": {keys["fault-prompt-only"]},
        # An answer starting with blank lines is trained without them, not a failure.
        "template_failures": set(),
        "marker_mismatches": {keys["fault-swap"], keys["fault-extra-marker"]},
        "index_mismatches": {keys["fault-index"]},
        "truncated": set(),
        "empty_answer_turns": {keys["fault-empty-answer"]},
        "reasoning_dropped": set(),          # SmolLM2's template leaves no reasoning out
        "unclosed_think": set(),
        "placeholder_mismatches": set(),
        # The blank lines before that answer are not content: its loss mask covers it.
        "loss_mask_coverage": set(),
    }
    assert {check: flagged_keys(report, check) for check in expected} == expected
    # a user's turn after the last answer: reported (it trains nothing), failing nothing
    assert flagged_keys(report, "trailing_turns") == {keys["fault-trailing-image"]}
    reasons = {e["key"]: e["detail"].split(":")[0] for e in report["flagged"]["dropped"]}
    assert reasons[keys["fault-long"]] == "too_long"
    assert reasons[keys["fault-prompt-only"]] == "no_trained_tokens"
    # One stderr line per failed check, naming its keys; nothing else fails.
    lines = err.strip().splitlines()
    failed = {re.match(r"mimo-inspect report: FAIL (\w+):", line).group(1) for line in lines}
    assert failed == {check for check, found in expected.items() if found} | {"skipped_records"}
    # the record the build skipped: in no shard, so only the build's own count tells of it
    total = report["checks"][0]["of"]
    assert lines[0] == (f"mimo-inspect report: FAIL skipped_records: 1 of {total} records "
                        f"({1 / total:.2%}) skipped by the build or index (missing_media 1), "
                        "above --max-skipped-records-fraction 0; e.g. "
                        f"{directory.parent / 'faults.jsonl'}:{len(keys) + 1} (id "
                        "fault-missing-image) missing_media; "
                        f"{directory / 'skipped.jsonl'} names each"), lines[0]
    # each key beside where the build read it and its id (the user's record, not a shard key)
    ids = {key: fault for fault, key in keys.items()}
    for line in lines[1:]:
        check = re.match(r"mimo-inspect report: FAIL (\w+):", line).group(1)
        for key in sorted(expected[check])[:5]:
            line_number = list(keys).index(ids[key]) + 1
            assert f"{key} (faults.jsonl:{line_number}, id '{ids[key]}': " in \
                line.replace(str(directory.parent) + "/", ""), (key, line)
    assert {c["name"]: c["passed"] for c in report["checks"]} == {
        **{check: not found for check, found in expected.items()},
        "trained_token_fraction": True, "kept_samples": True, "skipped_records": False,
        "trailing_turns": True}
    # the skipped record asked for by its id: no sample, and why, from skipped.jsonl
    code, _, err = run(capsys, "sample", directory, "--config", configs["default"], "--key",
                       "fault-missing-image")
    assert code == 2 and err.rstrip().endswith(
        f": the build skipped the record of id 'fault-missing-image' ("
        f"{directory.parent / 'faults.jsonl'}:{len(keys) + 1}: missing_media: media file "
        f"{directory.parent / 'no-such-photo.jpg'}: not found (paths are relative to the "
        "input file's folder, or to --media-root))"), err


def test_a_record_that_cannot_be_parsed_is_a_counted_drop_named_by_its_key(
        capsys, tmp_path, good_records, configs):
    """A sample whose JSON member does not parse (as a builder could have written it: its
    crc32 recorded): the report counts it, ``unreadable_record``, and names its key; no crash
    where the message would name its source record."""
    out = tmp_path / "shards"
    build_dataset([write_jsonl(tmp_path / "in.jsonl", good_records)], out)
    reader = ShardReader(str(out))
    key = reader.table.key(1)
    offset, size, _ = reader.table.members(1)["json"]
    shard = out / reader.table.shard(1)
    reader.close()
    data = shard.read_bytes()
    shard.write_bytes(data[:offset] + b"{" * size + data[offset + size:])
    rerecord_member(out, key, "json")
    code, report, err = report_json(capsys, tmp_path, out, configs["default"])
    assert code == 1, err
    assert report["drop_reasons"]["unreadable_record"]["count"] == 1
    assert "FAIL dropped: 1 of 3 samples" in err and f"first: {key} (unreadable_record: " \
        in err, err


def test_a_failed_check_line_keeps_its_first_detail_whole():
    """What to do ends a detail: the first sample's of each reason is kept whole, the others'
    cut at a word, marked as cut."""
    from mimo_data.inspect.report import Flagged, _check_message
    advice = "template_mismatch: " + "the rendered text and the tokens disagree " * 5 + \
        "so the assistant span starts with the user: put the system turn first"
    flagged = Flagged([(0, "000000001", advice), (1, "000000002", advice)])
    line = _check_message({"limit_kind": "count", "name": "dropped", "count": 2, "of": 9,
                           "what": "samples dropped", "passed": False, "flag": "--max-dropped",
                           "limit": 0}, flagged, lambda position: f"a.jsonl:{position + 1}")
    first, second = line.split("; first: ")[1].split(", 000000002 ")
    assert first == f"000000001 (a.jsonl:1: {advice})"
    assert second.endswith(" …)") and "put the system turn first" not in second
    assert len(second) < 140 and second[:-3].rsplit(" ", 1)[1] in advice.split()
    # a sample dropped for another reason after it: its detail whole too
    other = "tool_use: " + "the template writes no tool calls " * 5 + "give a template with tools"
    flagged.entries.append((2, "000000003", other))
    line = _check_message({"limit_kind": "count", "name": "dropped", "count": 3, "of": 9,
                           "what": "samples dropped", "passed": False, "flag": "--max-dropped",
                           "limit": 0}, flagged)
    assert line.endswith(f", 000000003 ({other})"), line


def test_truncated_turn_is_reported_under_truncate_turns(capsys, tmp_path, faulty, configs):
    directory, keys = faulty
    code, report, err = report_json(capsys, tmp_path, directory, configs["truncate"])
    assert code == 1
    assert flagged_keys(report, "truncated") == {keys["fault-long"]}
    assert keys["fault-long"] not in flagged_keys(report, "dropped")
    line = next(text for text in err.splitlines() if "FAIL truncated" in text)
    assert keys["fault-long"] in line


def test_an_empty_answer_beside_answers_with_text_is_flagged(capsys, tmp_path, faulty, configs):
    """A conversation whose second answer is empty trains it as its end of turn alone (the
    model learns to answer that turn with nothing): kept, and flagged as such (a conversation
    whose every answer is empty is dropped as empty_answers instead)."""
    directory, keys = faulty
    key = keys["fault-empty-answer"]
    code, report, err = report_json(capsys, tmp_path, directory, configs["default"])
    assert code == 1
    assert flagged_keys(report, "empty_answer_turns") == {key}
    assert key not in flagged_keys(report, "dropped")
    entry = next(e for e in report["flagged"]["empty_answer_turns"] if e["key"] == key)
    assert entry["detail"].startswith("1 empty answer(s)")
    assert key in next(text for text in err.splitlines() if "FAIL empty_answer_turns" in text)
    code, out, _ = run(capsys, "sample", directory, "--config", configs["default"], "--key", key)
    assert "empty answers: 1 answer(s) without text" in out


def test_reasoning_is_judged_apart_from_the_answer_where_the_template_takes_it_apart(
        capsys, tmp_path):
    """Qwen3.5's template (its published text, with mimo's generation blocks) writes an
    answer's reasoning in a think block of its own after the last user query, and leaves it out
    before, as at inference. The loss mask's coverage judges the reasoning and the text apart
    (the think tags, and the generation prompt's ``<think>``, are the template's): reasoning
    datasets pass it, an earlier turn's reasoning repeated later included. Text the template
    keeps in neither part (between two ``</think>``) fails it; an earlier answer that is
    reasoning alone trains an empty answer; answers whose reasoning is left out are listed under
    reasoning_dropped, which fails no run by default. An answer whose ``<think>`` is never
    closed fails unclosed_think (no template takes it apart). A turn's ``reasoning_content``
    is built into its content as a think block."""
    def turns(*contents):
        return [{"role": ("user", "assistant")[k % 2], "content": text}
                for k, text in enumerate(contents)]
    records = [
        {"id": "two-turns", "messages": turns("Hi", "<think>Greet back.</think>Hello.",
                                              "And then?", "<think>Close.</think>Bye.")},
        {"id": "same-reasoning", "messages": turns("Hi", "<think>Okay.</think>Hello.",
                                                   "And then?", "<think>Okay.</think>Bye.")},
        {"id": "as-written", "messages": turns("Hi", "<think>\nPlan it.\n</think>\n\nHello.")},
        {"id": "no-reasoning", "messages": turns("Hi", "Hello.")},
        {"id": "reasoning-only", "messages": turns("Hi", "<think>Just thinking.</think>",
                                                   "And then?", "Bye.")},
        {"id": "lost-middle", "messages": turns(
            "Hi", "<think>A plan.</think>A middle part.</think>Final.")},
        # a think block never closed: written as text, trained as such; a user's is not
        {"id": "unclosed", "messages": turns("Hi", "<think>Plan it, then say hello. Hello.")},
        {"id": "user-asks", "messages": turns("What is <think> for?", "Reasoning.")},
        {"id": "reasoning-field", "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello.", "reasoning_content": " Greet back. "}]},
        # a last user turn after the last answer: context that trains nothing
        {"id": "ends-on-user", "messages": turns("Hi", "Hello.", "Bye.")},
    ]
    twice = {"id": "reasoning-twice", "messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>A.</think>Hello.", "reasoning_content": "B."}]}
    build_dataset([write_jsonl(tmp_path / "reasoning.jsonl", records + [twice])],
                  tmp_path / "shards")
    skipped = json.loads((tmp_path / "shards" / "report.json").read_text())["skipped_by_reason"]
    assert list(skipped) == ["malformed_record"], skipped
    assert "give its reasoning once" in skipped["malformed_record"]["first"][0]["detail"]
    keys = {row["id"]: row["key"] for row in samples_table(tmp_path / "shards")}
    reader = ShardReader(str(tmp_path / "shards"))
    built = reader.record(reader.table.position(keys["reasoning-field"]))
    assert built["messages"][1]["content"] == "<think>\nGreet back.\n</think>\n\nHello."
    config = REPO / "configs" / "preprocess_qwen3_5.yaml"
    code, report, err = report_json(capsys, tmp_path, tmp_path / "shards", config)
    assert code == 1 and report["kept"] == len(records)
    assert flagged_keys(report, "loss_mask_coverage") == {keys["lost-middle"]}
    [entry] = report["flagged"]["loss_mask_coverage"]
    assert "12 characters before its last <think> or between its </think>" in entry["detail"]
    assert flagged_keys(report, "empty_answer_turns") == {keys["reasoning-only"]}
    assert flagged_keys(report, "reasoning_dropped") == {
        keys[k] for k in ("two-turns", "same-reasoning", "reasoning-only")}
    # what the template itself wrote (not the inspector's reading of it): the earlier
    # answer's reasoning is not in the tokens, the last one's is
    preprocessor = Preprocessor(PreprocessConfig.from_yaml(str(config)), with_media=False)
    ids = preprocessor(reader.record(reader.table.position(keys["two-turns"]))).input_ids
    text = preprocessor.text.tokenizer.decode(ids.tolist())
    assert "Greet back." not in text and "Close." in text and "Hello." in text, text
    entry = next(e for e in report["flagged"]["reasoning_dropped"]
                 if e["key"] == keys["two-turns"])
    assert entry["detail"].startswith("1 answer(s) train without their reasoning")
    check = next(c for c in report["checks"] if c["name"] == "reasoning_dropped")
    assert check["passed"] and check["count"] == 3 and check["limit"] == 1.0
    assert "FAIL reasoning_dropped" not in err
    assert flagged_keys(report, "unclosed_think") == {keys["unclosed"]}
    assert "FAIL unclosed_think: 1 of " in err
    # reported, failing no run by default
    [entry] = report["flagged"]["trailing_turns"]
    assert entry["key"] == keys["ends-on-user"] and \
        entry["detail"] == "1 turn(s) after the last answer train nothing"
    assert "FAIL trailing_turns" not in err
    code, _, err = report_json(capsys, tmp_path, tmp_path / "shards", config,
                               "--max-reasoning-dropped-fraction", "0",
                               "--max-trailing-turns-fraction", "0")
    assert code == 1 and "FAIL reasoning_dropped" in err and "FAIL trailing_turns" in err


# SmolLM2's ChatML turns, each answer written by DeepSeek-R1's published rule (its
# tokenizer_config.json: the text after the last </think> alone, in every turn), or as it is with
# a generation prompt that mentions </think> (a thinking switch, as Qwen3's)
_TURNS = ("{%- for message in messages %}{%- if message['role'] == 'assistant' %}"
          "{{- '<|im_start|>assistant\\n' }}{%- generation %}{{- CONTENT + '<|im_end|>' }}"
          "{%- endgeneration %}{{- '\\n' }}{%- else %}"
          "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
          "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}"
          "{{- '<|im_start|>assistant\\n' + PROMPT }}{%- endif %}")
_DEEPSEEK_R1 = _TURNS.replace("{{- CONTENT", "{% set content = message['content'] %}{% if "
                              "'</think>' in content %}{% set content = content.split("
                              "'</think>')[-1] %}{% endif %}{{- content").replace(
                                  "PROMPT", "'<think>\\n'")
_AS_WRITTEN = _TURNS.replace("CONTENT", "message['content']").replace(
    "PROMPT", "('<think>\\n\\n</think>\\n\\n' if enable_thinking is defined and not "
    "enable_thinking else '')")


@pytest.mark.parametrize("template", ["deepseek_r1", "as_written", "qwen3_5"])
def test_what_of_an_answer_the_template_writes_is_read_from_the_template(template):
    """Which parts of an answer with think tags count is read from a render of the template,
    not from Qwen's rule: under DeepSeek-R1's (every answer's text after the last </think>
    alone) the reasoning and the text before <think> are content not in the tokens, each named,
    and an answer that is reasoning alone is empty; a template that writes contents as they
    are, though it mentions </think>, trains them all and flags nothing. A conversation whose
    every trained answer is empty as the template writes it (reasoning it leaves out, then an
    empty answer) is dropped as empty_answers by the preprocessor, not trained as ends of turn
    alone."""
    from dataclasses import replace
    from mimo_data.inspect.stats import SampleInspector
    config = PreprocessConfig.from_yaml(str(REPO / "configs" / (
        "preprocess_qwen3_5.yaml" if template == "qwen3_5" else "preprocess.yaml")))
    if template != "qwen3_5":
        config = replace(config, chat_template=_DEEPSEEK_R1 if template == "deepseek_r1"
                         else _AS_WRITTEN)
    inspector = SampleInspector(config)
    empty = [{"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "<think>Just thinking.</think>"},
             {"role": "user", "content": "And then?"},
             {"role": "assistant", "content": " "}]
    stats, _ = inspector(0, {"key": "e", "media": [], "messages": empty})
    if template == "as_written":        # the reasoning is the first answer's text
        assert stats.dropped is None and stats.empty_answers == 1
    else:
        assert stats.dropped == "empty_answers", stats
        assert stats.detail.startswith("every trained answer (2 of 2) is empty or reasoning "
                                       "the chat template leaves out")
    if template == "qwen3_5":           # the rest: test_reasoning_is_judged_apart_...
        return
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Aside. <think>Plan it.</think>Hello."},
                {"role": "user", "content": "And then?"},
                {"role": "assistant", "content": "<think>Just thinking.</think>"},
                {"role": "user", "content": "Last?"},
                {"role": "assistant", "content": "Bye."}]
    stats, sample = inspector(0, {"key": "k", "media": [], "messages": messages})
    assert stats.dropped is None and sample is not None
    text = Preprocessor(config, with_media=False).text.tokenizer.decode(sample.input_ids)
    assert stats.reasoning_dropped == 0
    if template == "as_written":        # what the template wrote: every content as it is
        assert all(m["content"] in text for m in messages), text
        assert stats.coverage_problems == [] and stats.empty_answers == 0
        return
    assert "Plan it." not in text and "Aside." not in text and "Hello." in text, text
    assert stats.coverage_problems == [
        "turn 1 (assistant): 6 characters before its last <think> or between its </think> "
        "tags are not in the tokens (the chat template writes neither)",
        "turn 1 (assistant): its reasoning (7 characters) is not in the tokens (the chat "
        "template writes no answer's reasoning, only the text after the last </think>: give "
        "a template that writes the reasoning, or data without it)",
        "turn 3 (assistant): its reasoning (13 characters) is not in the tokens (the chat "
        "template writes no answer's reasoning, only the text after the last </think>: give "
        "a template that writes the reasoning, or data without it)"]
    assert stats.assistant_chars_not_trained == 6 + 7 + 13 and stats.empty_answers == 1


@pytest.mark.parametrize("config_name", ["preprocess.yaml", "preprocess_qwen3_5.yaml"])
def test_an_answer_weighted_0_is_judged_as_text_that_must_not_train(config_name, monkeypatch):
    """Answers weighted 0 (a plain one, one with reasoning before the last user query under
    Qwen3.5's template, an empty one) beside trained ones: no coverage problem, the empty one
    not an empty answer. Under a renderer that ignores the weights (broken on purpose), the
    coverage check names each weighted answer as trained."""
    from mimo_data.inspect.stats import SampleInspector
    from mimo_data.preprocess import chat_render
    config = PreprocessConfig.from_yaml(str(REPO / "configs" / config_name))
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "<think>Greet.</think>Alpha one.", "weight": 0},
                {"role": "user", "content": "Next?"},
                {"role": "assistant", "content": "Beta two.", "weight": 0},
                {"role": "user", "content": "More?"},
                {"role": "assistant", "content": "", "weight": 0},
                {"role": "user", "content": "Last?"},
                {"role": "assistant", "content": "Gamma three."}]
    record = {"key": "k", "media": [], "messages": messages}
    stats, _ = SampleInspector(config)(0, record)
    assert stats.dropped is None and not stats.coverage_failure, stats.coverage_problems
    assert stats.empty_answers == 0 and stats.reasoning_dropped == 0
    monkeypatch.setattr(chat_render, "_weighed", lambda messages, spans: spans)
    stats, _ = SampleInspector(config)(0, record)
    named = [problem.split(":")[0] for problem in stats.coverage_problems]
    assert named == ["turn 1 (assistant, weight 0)", "turn 3 (assistant, weight 0)"], \
        stats.coverage_problems


def test_caption_mode_trailing_image_is_reported_as_dropped(capsys, tmp_path, faulty, configs):
    """In caption mode a conversation ending with a marker would lose its last placeholder to
    the next-token shift: the preprocessor drops it (ends_with_media) and the report says so."""
    directory, keys = faulty
    code, report, err = report_json(capsys, tmp_path, directory, configs["caption"])
    assert code == 1
    reasons = {e["key"]: e["detail"].split(":")[0] for e in report["flagged"]["dropped"]}
    assert reasons[keys["fault-trailing-image"]] == "ends_with_media"
    assert flagged_keys(report, "placeholder_mismatches") == set()
    assert "FAIL dropped" in err and keys["fault-trailing-image"] in err


def test_thresholds_are_flags(capsys, tmp_path, faulty, configs):
    directory, keys = faulty
    relaxed = ["--max-dropped-fraction", "0.5", "--max-zero-trained-fraction", "0.5",
               "--max-template-failures", "1", "--max-index-mismatches", "1",
               "--max-empty-answer-turns-fraction", "0.5",
               "--max-skipped-records-fraction", "0.05"]
    code, report, err = report_json(capsys, tmp_path, directory, configs["default"], *relaxed)
    assert code == 1
    assert [line.split(":")[1].split()[-1] for line in err.strip().splitlines()] == \
        ["marker_mismatches"]
    code, report, err = report_json(capsys, tmp_path, directory, configs["default"], *relaxed,
                                    "--max-marker-mismatches", "2")
    assert code == 0 and err == "" and report["passed"]
    code, _, err = report_json(capsys, tmp_path, directory, configs["default"], *relaxed,
                               "--max-marker-mismatches", "2",
                               "--min-trained-token-fraction", "0.9")
    assert code == 1 and "FAIL trained_token_fraction" in err


def test_limit_and_bad_arguments(capsys, tmp_path, clean, configs):
    code, report, _ = report_json(capsys, tmp_path, clean, configs["default"], "--limit", "7")
    assert code == 0 and report["samples"] == 7
    with pytest.raises(SystemExit) as exited:      # no sample to report on: a usage error
        report_json(capsys, tmp_path, clean, configs["default"], "--limit", "0")
    assert exited.value.code == 2 and "--limit: 0 is not > 0" in capsys.readouterr().err
    code, _, err = run(capsys, "report", tmp_path / "missing", "--config", configs["default"])
    assert code == 2 and "error" in err
    code, _, err = run(capsys, "sample", clean, "--config", configs["default"], "--key", "nope")
    assert code == 2 and "nope" in err
    # a key skipped by an index of tars read in place: why, and where several tars skipped
    # one of that key, TAR/KEY asked for; a key given wider than the tars' is not theirs
    listed = tmp_path / "skipped-keys"
    shutil.copytree(clean, listed)
    (listed / "skipped.jsonl").write_text("".join(
        json.dumps({"location": location, "reason": "corrupt_image", "detail": "broken"}) + "\n"
        for location in ("a.tar:90001", "b.tar:90001", "c.tar:90010")))
    for key, said in (("90001", ": the index skipped samples of key '90001' in 2 tars "
                                "(a.tar:90001, b.tar:90001): give TAR/KEY"),
                      ("b.tar/90001", ": the index skipped the sample b.tar/90001 (b.tar:90001: "
                                      "corrupt_image: broken)"),
                      ("90010", ": the index skipped the sample c.tar/90010 (c.tar:90010: "
                                "corrupt_image: broken)"),
                      ("0090010", "")):
        code, _, err = run(capsys, "sample", listed, "--config", configs["default"], "--key", key)
        assert code == 2 and re.search(rf"keys \S+ \.\. \S+\){re.escape(said)}$", err.strip()), \
            (key, err)
    # a value of the wrong type: one line naming it, exit 2
    fractional = write_config(tmp_path / "fractional.yaml",
                              modalities={"image": {"merge_size": 2.5}, "audio": {}})
    code, _, err = run(capsys, "report", clean, "--config", fractional)
    assert code == 2 and err.strip().endswith(
        "modalities.image.merge_size is 2.5 (float): it must be a whole number"), err
    # an output that is a folder: said before the pass, not after it
    code, _, err = run(capsys, "report", clean, "--config", configs["default"], "--html",
                       tmp_path)
    assert code == 2 and f"--html {tmp_path} is a folder: give the file to write (e.g. " \
        f"{tmp_path / 'report.html'})" in err, err
    # its folder under a file
    (tmp_path / "afile").write_text("in the way\n")
    code, _, err = run(capsys, "report", clean, "--config", configs["default"], "--json",
                       tmp_path / "afile" / "sub" / "report.json")
    assert code == 2 and f"{tmp_path / 'afile'} is a file, not a folder; give another path" \
        in err, err
    # a training config given for the preprocessing one: the one it names is said
    training = REPO / "configs" / "train" / "qwen2_vl_finetune.yaml"
    code, _, err = run(capsys, "report", clean, "--config", training)
    assert code == 2 and err.strip().endswith(
        f"{training} is a training config, not a preprocessing config: give the one its "
        f"data.preprocess names, {REPO / 'configs' / 'preprocess_qwen2_vl.yaml'}"), err
    # Ctrl-C: one line, exit 130, not the traceback of wherever it was
    from mimo_data.inspect import cli
    def interrupted(*args):
        raise KeyboardInterrupt
    for command, function in (("report", "_report"), ("sample", "_sample")):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(cli, function, interrupted)
            code, _, err = run(capsys, command, clean, "--config", configs["default"])
        assert code == 130 and err == f"mimo-inspect {command}: interrupted\n", err


def test_clips_cut_by_long_audio_truncate_are_counted(capsys, tmp_path, clean, configs):
    """Clips over max_duration with ``long_audio: truncate`` train cut, with their whole
    transcripts: the report counts them and the seconds cut off (also from saved tables)."""
    reader = ShardReader(str(clean))
    durations = {reader.table.key(p): [item["frames"] / item["sample_rate"]
                                       for item in reader.record(p)["media"]
                                       if item["modality"] == "audio"]
                 for p in range(len(reader))}
    over = {key: [d for d in found if d > 5.0] for key, found in durations.items()}
    over = {key: found for key, found in over.items() if found}
    assert len(over) >= 2 and any(d <= 5.0 for found in durations.values() for d in found)
    for reuse in (False, True):      # the second report is made from the saved tables
        code, out, err = run(capsys, "report", clean, "--config", configs["cut"],
                             "--no-progress", "--json", tmp_path / "cut.json")
        assert code == 0, err
        report = json.loads((tmp_path / "cut.json").read_text())
        assert report["tables"]["reused"] == reuse
        cut = report["modalities"]["audio"]["cut"]
        assert (cut["clips"], cut["samples"]) == (sum(map(len, over.values())), len(over))
        assert cut["seconds_cut"] == pytest.approx(sum(d - 5.0 for found in over.values()
                                                       for d in found), abs=1e-3)
        first = list(over.items())[:5]
        assert [entry["key"] for entry in cut["first"]] == [key for key, _ in first]
        assert [d for entry in cut["first"] for d in entry["durations"]] == pytest.approx(
            [d for _, found in first for d in found], abs=1e-5)
        assert (f"{cut['clips']} clip(s) over max_duration 5 s cut to it (long_audio: "
                f"truncate) in {cut['samples']} sample(s), {cut['seconds_cut']:.1f} s of audio "
                "dropped") in out
        # each first clip beside where the build read its record
        entry = cut["first"][0]
        assert f"{entry['key']} ({entry['source']}: {entry['durations'][0]:.1f} s" in out, out
        assert re.fullmatch(r".+\.(jsonl|json|parquet)[:#]\d+", entry["source"]), entry


def test_a_dataset_built_with_header_checks_is_said_undecoded(capsys, tmp_path, assets,
                                                              configs):
    """``--check header`` decodes no medium: the report says so and names verify (a clip that
    does not decode stops training at its load, which no check here sees); a default build
    is not said so."""
    records = write_jsonl(tmp_path / "one.jsonl", [{
        "id": "one", "image": str(assets["jpeg"]),
        "conversations": [{"from": "human", "value": "<image>\nWhat is it?"},
                          {"from": "gpt", "value": "A photo."}]}])
    for check in ("header", "decode"):
        build_dataset([records], tmp_path / check, check=check)
        code, out, err = run(capsys, "report", tmp_path / check, "--config", configs["default"],
                             "--no-progress")
        assert code == 0, err
        said = (f"media       built with --check header: no image or clip was decoded, and one "
                "that does not decode stops training when it is loaded; `mimo-shard verify "
                f"{tmp_path / check}` decodes every one")
        assert (said in out) == (check == "header"), out


def test_workers_give_the_same_report(capsys, tmp_path, faulty, configs):
    directory, _ = faulty
    _, one, _ = report_json(capsys, tmp_path, directory, configs["default"])
    _, two, _ = report_json(capsys, tmp_path, directory, configs["default"], "--workers", "2")
    volatile = {"seconds", "samples_per_second", "workers", "token_cache"}

    def stable(report: dict) -> dict:    # the first run of the module may make the tables
        return {k: v for k, v in report.items() if k not in volatile} | {
            "tables": {**report["tables"], "reused": None}}
    assert stable(one) == stable(two)


# -------------------------------------------------------------------------------------- html

class _Images(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.body: dict = {}
        self.images: list[tuple[str | None, str]] = []     # (enclosing sample id, alt)
        self.token_classes: dict[str, set] = {}             # sample id -> token span classes
        self._sample = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "body":
            self.body = attrs
        elif tag == "div" and (attrs.get("id") or "").startswith("sample-"):
            self._sample = attrs["id"]
        elif tag == "img":
            self.images.append((self._sample, attrs.get("alt") or ""))
        elif tag == "span" and self._sample and (attrs.get("class") or "").startswith("t-"):
            self.token_classes.setdefault(self._sample, set()).add(attrs["class"])


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def test_media_the_html_gallery_finds_damaged_fail_the_report(capsys, tmp_path, good_records,
                                                             configs):
    """The report's pass reads no media; its HTML gallery does: a member whose bytes changed
    since the build (crc32) is a failed check, named on stderr, not only a note in the page."""
    out = tmp_path / "shards"
    build_dataset([write_jsonl(tmp_path / "in.jsonl", good_records)], out)
    reader = ShardReader(str(out))
    position = next(p for p in range(len(reader)) if "img0.jpg" in reader.table.members(p))
    offset, size, _ = reader.table.members(position)["img0.jpg"]
    shard = out / reader.table.shard(position)
    key = reader.table.key(position)
    reader.close()
    data = bytearray(shard.read_bytes())
    data[offset + size // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    code, _, err = run(capsys, "report", out, "--config", configs["default"], "--html",
                       tmp_path / "page.html", "--no-progress")
    assert code == 1 and f"FAIL damaged_media: {shard}: sample {key} member {key}.img0.jpg: " \
        "its bytes changed since the build" in err, err


def test_html_report_renders_in_headless_chromium(capsys, tmp_path, faulty, configs):
    browser = _chromium()
    if browser is None:
        pytest.skip("chromium is not installed (tools/setup.sh installs the Debian package "
                    "'chromium')")
    directory, keys = faulty
    page = tmp_path / "report.html"
    code, out, _ = run(capsys, "report", directory, "--config", configs["default"], "--html", page,
                       "--no-progress")
    assert code == 1 and out.endswith(f"HTML report: {page}\n"), out     # where it went
    profile = tempfile.mkdtemp(prefix="chromium-")
    try:
        dom = subprocess.run(
            [browser, "--headless", "--no-sandbox", "--disable-gpu",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--no-first-run", f"--user-data-dir={profile}", "--virtual-time-budget=5000",
             "--dump-dom", page.as_uri()],
            capture_output=True, text=True, timeout=120).stdout
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    parsed = _Images()
    parsed.feed(dom)
    total = int(parsed.body["data-images-total"])
    assert total == len(parsed.images) and total >= 8
    assert int(parsed.body["data-images-loaded"]) == total     # every image decoded
    alts = [alt for _, alt in parsed.images]
    for plot in ("Trained-token fraction per sample", "Sequence length", "image tokens per item",
                 "audio tokens per item", "Dropped samples by reason"):
        assert plot in alts
    # Thumbnails and spectrograms of flagged samples, next to their tokens.
    in_sample = {}
    for sample, alt in parsed.images:
        in_sample.setdefault(sample, []).append(alt)
    assert any(a.startswith("img0.") for a in in_sample[f"sample-{keys['fault-swap']}"])
    assert any(a.startswith("aud0.") for a in in_sample[f"sample-{keys['fault-index']}"])
    # Coloured tokens: the too-long sample shown whole, the answer-less one without targets.
    assert {"t-trained", "t-prompt", "t-image"} <= parsed.token_classes[
        f"sample-{keys['fault-long']}"]
    assert "t-trained" not in parsed.token_classes[f"sample-{keys['fault-prompt-only']}"]


# ------------------------------------------------------------------------------------ sample

def _record_with_image_and_audio(directory: Path) -> tuple[int, dict]:
    reader = ShardReader(str(directory))
    for position in range(len(reader)):
        record = reader.record(position)
        modalities = [item["modality"] for item in record["media"]]
        if modalities.count("audio") >= 2 and "image" in modalities:
            return position, record
    raise AssertionError("the corpus has no sample with an image and two audio clips")


def test_sample_shows_counts_from_metadata_and_trained_text(capsys, clean, configs):
    position, record = _record_with_image_and_audio(clean)
    code, out, err = run(capsys, "sample", clean, "--config", configs["default"],
                         "--key", record["key"], "--color", "never")
    assert code == 0, err
    tokens = out.split("-" * 80 + "\n", 1)[1]       # below the header and legend
    config = PreprocessConfig.from_yaml(str(configs["default"]))
    expected = {
        "image": [image_tokens(i["width"], i["height"], config.modalities["image"])
                  for i in record["media"] if i["modality"] == "image"],
        "audio": [audio_tokens(i["frames"], i["sample_rate"], config.modalities["audio"])
                  for i in record["media"] if i["modality"] == "audio"]}
    for modality, counts in expected.items():
        match = re.search(rf"^{modality}\s+(\d+) placeholder tokens in input_ids, expected "
                          rf"(\d+) from metadata \[([\d, ]+)\]\s+OK$", out, re.M)
        assert match, out
        assert int(match.group(1)) == int(match.group(2)) == sum(counts)
        assert [int(n) for n in match.group(3).split(",")] == counts
        # The collapsed runs in the token text, in item order.
        token = config.modalities[modality].token
        assert [int(n) for n in re.findall(rf"\[{re.escape(token)}×(\d+)\]", tokens)] == counts
    for item in record["media"]:
        assert item["member"] in out
    trained = "".join(re.findall(r"«(.*?)»", tokens, re.S))
    assert trained == "".join(m["content"] + EOT for m in record["messages"]
                              if m["role"] == "assistant")
    # the padding's run is said as padding (its token may be the end of turn's), as long as
    # the status line says
    padding = int(re.search(r"^status +kept: .* \((\d+) padding\)", out, re.M).group(1))
    assert padding > 0 and tokens.rstrip().endswith(f"×{padding}]")
    assert re.findall(r"\[padding \S+×(\d+)\]", tokens) == [str(padding)]
    assert "\033[" not in out


def test_sample_colours_and_random(capsys, clean, configs):
    code, out, _ = run(capsys, "sample", clean, "--config", configs["default"], "--index", "1",
                       "--color", "always")
    assert code == 0 and "\033[1;32m" in out and "\033[1;35m" in out and "«" not in out
    code, out, _ = run(capsys, "sample", clean, "--config", configs["default"], "--index", "1")
    assert "\033[" not in out                      # auto: captured stdout is no terminal
    _, first, _ = run(capsys, "sample", clean, "--config", configs["default"], "--random", "3",
                      "--seed", "5", "--color", "never")
    _, again, _ = run(capsys, "sample", clean, "--config", configs["default"], "--random", "3",
                      "--seed", "5", "--color", "never")
    headers = re.findall(r"^sample (\d+) ", first, re.M)
    assert len(set(headers)) == 3 and first == again
    # --key takes a key unpadded, or the record's id; --seed goes with --random alone
    table = ShardReader(str(clean)).table
    record_id = samples_table(clean)[3]["id"]
    for given in (table.key(3), "3", record_id):
        code, out, err = run(capsys, "sample", clean, "--config", configs["default"], "--key",
                             given, "--color", "never")
        assert out.startswith(f"sample {table.key(3)} "), (given, out[:200], err)
    code, _, err = run(capsys, "sample", clean, "--config", configs["default"], "--index", "1",
                       "--seed", "3")
    assert code == 2 and "--seed seeds --random" in err
    for count in ("0", "-1"):                    # a usage error, not a Python one or nothing
        with pytest.raises(SystemExit) as exited:
            run(capsys, "sample", clean, "--config", configs["default"], "--random", count)
        assert exited.value.code == 2 and f"--random: {count} is not > 0" in \
            capsys.readouterr().err


def test_sample_of_a_dropped_or_mismatched_sample_fails(capsys, faulty, configs):
    directory, keys = faulty
    code, out, err = run(capsys, "sample", directory, "--config", configs["default"],
                         "--key", keys["fault-prompt-only"], "--color", "never")
    assert code == 1
    assert "DROPPED (no_trained_tokens)" in out
    assert re.search(r"^image +expected \[\d+\] tokens per item from metadata \(no input_ids",
                     out, re.M), out
    from mimo_data.inspect.sample import _counts     # an item the metadata cannot size: ?
    assert _counts([64, None]) == "[64, ?]"
    assert "«" not in out.split("-" * 80 + "\n", 1)[1]
    assert "[<|image_pad|>×" in out                 # its tokens are still shown
    assert keys["fault-prompt-only"] in err
    code, out, err = run(capsys, "sample", directory, "--config", configs["default"],
                         "--key", keys["fault-swap"], "--color", "never")
    assert code == 1 and "marker/media mismatch" in err and "MISMATCH" in out


# --------------------------------------------------------------------------- token pieces

@pytest.fixture(scope="module")
def text_encoder(configs) -> TextEncoder:
    """The training encoder with the plain tokenizer as its backend (the reference)."""
    return TextEncoder(PreprocessConfig.from_yaml(str(configs["default"])), cache_tokens=False)


def _per_text(batch, texts) -> list[tuple[list[int], list[tuple[int, int]]]]:
    """(ids, offsets) of each text of a TokenBatch, offsets relative to the text."""
    starts = [0]
    for text in texts:
        starts.append(starts[-1] + len(text))
    return [(ids.tolist(), [tuple(o) for o in offsets.tolist()])
            for ids, offsets in (batch.text(i, starts[i]) for i in range(len(texts)))]


def _reference(backend, texts) -> list[tuple[list[int], list[tuple[int, int]]]]:
    return [(e.ids, list(e.offsets)) for e in (backend.encode(t, add_special_tokens=False)
                                               for t in texts)]


def test_piece_cache_gives_the_tokenizers_tokens(text_encoder, clean):
    backend = text_encoder.backend
    assert unsupported_reason(backend) is None
    cached = SegmentCachedTokenizer(backend, verify_first=0, verify_every=10 ** 9)
    reader = ShardReader(str(clean))
    texts = [text_encoder.render(reader.record(p)["messages"])[0] for p in range(len(reader))]
    texts += ["", "<|im_start|>", "<image><audio>", "a<|im_end|>b", "<imag", "<<image>>",
              "é漢字🙂 <image>\n\n  x  ", "  <|im_start|>  user\n\n", "<|im_end|><|im_end|>",
              "word<image>word", "\n<audio>\n", "  \t\r\n  x\r\n", "1234567890 " * 3, "a" * 300,
              "x" + " " * 40 + "y", "it's (ok)!?...--", "~`@#$%^&*_+={}[]|\\:;\"'<>,./"]
    reference = _reference(backend, texts)
    assert _per_text(cached.encode_texts(texts), texts) == reference      # one batch
    for text, expected in zip(texts, reference):                          # one at a time,
        assert _per_text(cached.encode_texts([text]), [text]) == [expected], text  # cached
    assert cached.hits > cached.misses
    # The plain tokenizer's batch has the same layout.
    assert _per_text(encode_texts(backend, texts), texts) == reference


def test_piece_cache_cuts_at_added_tokens_as_the_tokenizer_does(text_encoder):
    """Added tokens matched before normalization are cut first, the normalized ones (tokens
    added with ``tokenizer.add_tokens``) only in the text between them."""
    from tokenizers import AddedToken, Tokenizer

    backend = Tokenizer.from_str(text_encoder.backend.to_str())
    backend.add_tokens([AddedToken(token, normalized=True)
                        for token in ("<|im_start|>user", "xa", "im_st")])
    backend.add_special_tokens([AddedToken("ab", special=True, normalized=False)])
    assert unsupported_reason(backend) is None
    cached = SegmentCachedTokenizer(backend, verify_first=0, verify_every=10 ** 9)
    texts = ["<|im_start|>user\nhi", "xab", "zz xa ab", "<|im_start|>", "<|im_st",
             "baxauser<|im_start|>userim_stx"]
    assert _per_text(cached.encode_texts(texts), texts) == _reference(backend, texts)


def test_offsets_are_summed_only_for_byte_level_tokenizers_that_allow_it(text_encoder):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    assert byte_level_lengths(text_encoder.backend) is not None      # SmolLM2: byte-level BPE
    assert SegmentCachedTokenizer(text_encoder.backend)._token_lengths is not None
    spec = json.loads(text_encoder.backend.to_str())
    trimming = Tokenizer.from_str(json.dumps(dict(spec, post_processor={
        "type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True})))
    assert byte_level_lengths(trimming) is None          # GPT-2 style: offsets trimmed
    roberta = Tokenizer.from_str(json.dumps(dict(spec, post_processor={
        "type": "RobertaProcessing", "sep": ["<|im_end|>", 2], "cls": ["<|im_start|>", 1],
        "trim_offsets": True, "add_prefix_space": False})))
    assert byte_level_lengths(roberta) is None
    lowercase = Tokenizer.from_str(text_encoder.backend.to_str())
    lowercase.normalizer = normalizers.Lowercase()
    assert byte_level_lengths(lowercase) is None
    metaspace = Tokenizer(models.BPE())
    metaspace.pre_tokenizer = pre_tokenizers.Metaspace()
    assert byte_level_lengths(metaspace) is None
    # Removing characters in a Split: offsets skip them, a running sum would not.
    removing = Tokenizer.from_str(text_encoder.backend.to_str())
    removing.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(" ", behavior="removed"), pre_tokenizers.ByteLevel()])
    assert byte_level_lengths(removing) is None


def test_new_pieces_are_encoded_once_and_kept_while_there_is_room(text_encoder, clean):
    backend = text_encoder.backend
    reader = ShardReader(str(clean))
    texts = [text_encoder.render(reader.record(p)["messages"])[0] for p in range(len(reader))]
    reference = _reference(backend, texts)
    cached = SegmentCachedTokenizer(backend, verify_first=0, verify_every=10 ** 9)
    cached.encode_texts(texts[:40])
    assert _per_text(cached.encode_texts(texts), texts) == reference
    pieces = {piece for text in texts for piece in cached._split(text) if piece}
    new = pieces - set(cached._added)
    assert cached.misses == len(new)     # each piece encoded once, over both batches
    cached.encode_texts(texts)
    assert cached.misses == len(new)     # the third time, every piece from the cache
    small = SegmentCachedTokenizer(backend, max_entries=8)
    assert _per_text(small.encode_texts(texts), texts) == reference
    assert small.misses == len(new)      # more new pieces than fit: all encoded once,
    assert len(small._cache) - len(small._added) == 8     # the first 8 kept
    # A copy (copy.copy, deepcopy) is a tokenizer of its own with the same encodings.
    twin = copy.deepcopy(cached)
    assert _per_text(twin.encode_texts(texts), texts) == reference
    assert twin.misses == cached.misses and twin.token_to_id("<|im_start|>") is not None


def test_piece_cache_refuses_tokenizers_it_cannot_reproduce(text_encoder):
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    metaspace = Tokenizer(models.BPE())
    metaspace.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    assert "first piece" in unsupported_reason(metaspace)
    stripping = Tokenizer(models.BPE())
    stripping.add_special_tokens([AddedToken("<mask>", lstrip=True)])
    assert "whitespace" in unsupported_reason(stripping)
    with pytest.raises(ValueError):
        SegmentCachedTokenizer(stripping)
    # A wrong cache entry is caught by the verification against the tokenizer.
    cached = SegmentCachedTokenizer(text_encoder.backend)
    cached.encode_texts(["<|im_start|>user\nHello there"])
    entry = cached._cache["user\nHello there"]
    entry[:, 0] = entry[::-1, 0].copy()
    with pytest.raises(SegmentCacheError) as caught:
        cached.encode_texts(["<|im_start|>user\nHi", "<|im_start|>user\nHello there"])
    assert caught.value.index == 1


def test_fewer_gc_passes_restores_the_collector_and_a_freeze_of_the_caller():
    import gc

    from mimo_data.inspect.report import fewer_gc_passes

    before = gc.get_threshold(), gc.get_freeze_count()
    with fewer_gc_passes(young=50_000):
        assert gc.get_threshold()[0] == 50_000 and gc.get_freeze_count() > 0
    assert (gc.get_threshold(), gc.get_freeze_count()) == before
    gc.freeze()                          # a process that froze objects itself keeps them frozen
    try:
        frozen = gc.get_freeze_count()
        with fewer_gc_passes():
            pass
        # still frozen (an unfreeze empties the permanent generation), nothing frozen on top;
        # frozen objects that die meanwhile leave it
        assert 0 < gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()


def test_marker_scan_equals_marker_order(clean):
    from mimo_data.inspect.stats import markers_of

    reader = ShardReader(str(clean))
    messages = [reader.record(p)["messages"] for p in range(len(reader))]
    messages.append([{"role": "user", "content": "<audio><image>x<image><<audio>>"},
                     {"role": "assistant", "content": "<image"}])
    for conversation in messages:
        assert markers_of(conversation) == marker_order(conversation)


def test_inspector_on_an_edited_record_reports_both_mismatches(configs):
    """The per-sample check on a record edited in memory: markers vs media and, when the
    preprocessor keeps it, placeholders vs metadata."""
    from mimo_data.inspect.stats import SampleInspector

    config = PreprocessConfig.from_yaml(str(configs["default"]))
    inspector = SampleInspector(config)
    record = {"key": "k", "messages": [{"role": "user", "content": "<image>\nWhat?"},
                                       {"role": "assistant", "content": "A cat."}],
              "media": [{"modality": "image", "member": "img0.jpg", "width": 451,
                         "height": 300, "orientation": 1}]}
    stats, sample = inspector(0, record)
    assert sample is not None and not stats.marker_mismatch and not stats.placeholder_mismatch
    assert stats.placeholders["image"] == image_tokens(451, 300, config.modalities["image"])
    edited = copy.deepcopy(record)
    edited["media"].append(dict(record["media"][0], member="img1.jpg"))
    stats, sample = inspector(0, edited)
    assert sample is None and stats.marker_mismatch and stats.dropped == "template_mismatch"
    assert not stats.template_failure               # explained by the markers, not the template
    assert np.isclose(stats.trained, 0)


# -------------------------------------------------------------------------------------- plan

PLAN_LAYOUTS = [
    ("language=dp2;image=dp1;audio=dp1", "default", "clean"),   # fan-out: encoder dp < language dp
    # fan-in: fixed-size image tokens and one image in every sample, and variable counts
    ("language=dp1;image=dp2;audio=dp1", "fixed", "single_image"),
    ("language=dp1;image=dp2;audio=dp2", "default", "clean"),
    ("language=dp2,off0;image=dp2,off0;audio=dp2,off0", "default", "clean"),   # colocated
    ("language=pp2,dp1;image=dp1;audio=dp1", "default", "clean"),  # language PP2
]


@pytest.fixture(scope="module")
def single_image(corpus, tmp_path_factory) -> Path:
    """The LLaVA records of the corpus that hold exactly one image, as shards."""
    root = tmp_path_factory.mktemp("inspect-single-image")
    records = [dict(r, image=str(corpus / r["image"])) for r in
               json.loads((corpus / "llava.json").read_text()) if isinstance(r.get("image"), str)]
    (root / "single_image.json").write_text(json.dumps(records))
    build_dataset([root / "single_image.json"], root / "shards")
    return root / "shards"


def test_plan_refuses_colocated_fan_in_on_data_with_unequal_item_counts(capsys, clean,
                                                                         configs):
    """megatron-core's colocated bridge splits evenly (non-colocated fan-in routes any
    counts): fixed-size images, but 0 to 2 of them per sample."""
    code, _, err = run(capsys, "plan", clean, "--config", configs["fixed"], "--layout",
                       "language=tp2,off0;image=dp2,off0;audio=tp2,off0",
                       "--global-batch-size", "8", "--micro-batch-size", "2")
    assert code != 0
    assert "colocated module 'image' (dp 2)" in err and "sample(s) with 0" in err \
        and "sample(s) with 2" in err


@pytest.mark.parametrize("layout, config_name, dataset", PLAN_LAYOUTS)
def test_plan_matches_what_each_ranks_loader_delivers(capsys, request, configs, layout,
                                                      config_name, dataset):
    """Every rank's real loader (media decoded) against ``plan --json``: the same sample keys
    per step and micro-batch, and the plan's tokens per step equal the real batches' (language:
    attention-mask tokens; encoders: the tokens their actual inputs produce)."""
    from mimo_data.modalities.audio import audio_rows_to_tokens
    from mimo_data.modalities.image import image_rows_to_tokens
    from mimo_data.loading.layout import Layout
    from mimo_data.loading.loader import DataSource, build_loader

    clean = request.getfixturevalue(dataset)

    code, out, err = run(capsys, "plan", clean, "--config", configs[config_name], "--layout",
                         layout, "--global-batch-size", "8", "--micro-batch-size", "2", "--json")
    assert code == 0, err
    result = json.loads(out)
    # an encoder module no sample feeds (the single images hold no audio): warned of
    idle = {"audio": {"modalities": ["audio"], "ranks": [3]}} if dataset == "single_image" \
        else {}
    assert result["plan"]["idle"] == idle, result["plan"]["idle"]
    assert ("mimo-inspect plan: WARNING module 'audio' gets no item this epoch (the data "
            "holds no audio): its weights would not train and its rank(s) 3 do nothing for "
            "it; drop it from the layout, or give the data it is for" in err) == bool(idle), err
    config = PreprocessConfig.from_yaml(str(configs[config_name]))
    rows_to_tokens = {"image": image_rows_to_tokens, "audio": audio_rows_to_tokens}
    parsed = Layout.parse(layout)
    assert [entry["rank"] for entry in result["ranks"]] == list(range(parsed.world_size))
    source = DataSource([str(clean)], config)        # opened once for all ranks' loaders
    for entry in result["ranks"]:
        loader = build_loader(source, None, layout, entry["rank"], parsed.world_size, 8, 2,
                              seed=1)     # the plan's default seed: a run's without train.seed
        if loader is None:
            assert entry["steps"] is None
            continue
        delivered: dict = {}
        tokens: dict = {}
        for batch, metadata in loader:
            step = delivered.setdefault(metadata["step"], [])
            step.append({"keys": metadata["keys"], **(
                {"encoder_keys": metadata["encoder_keys"]} if "encoder_keys" in metadata else {})})
            per_step = tokens.setdefault(metadata["step"], {})
            if "attention_mask" in batch:
                per_step["language"] = (per_step.get("language", 0)
                                        + int(batch["attention_mask"].sum()))
            for modality, by_encoder in batch.get("modality_inputs", {}).items():
                inputs = by_encoder[modality]
                per_step[modality] = (per_step.get(modality, 0) + sum(
                    rows_to_tokens[modality](inputs, config.modalities[modality])))
        loader.close()
        planned = {step["step"]: [{"keys": mb["keys"], **(
            {"encoder_keys": mb["encoder_keys"]} if "encoder_keys" in mb else {})}
            for mb in step["micro_batches"]] for step in entry["steps"]}
        assert planned == delivered, entry["rank"]
        assert len(planned) == result["steps_per_epoch"]
        rows = [r for r in result["plan"]["ranks"] if r["rank"] == entry["rank"]]
        assert {r["module"] for r in rows} == {p["module"] for p in entry["role"]["modules"]}
        for row in rows:
            modality = next((m for m, module in entry["role"]["media"].items()
                             if module == row["module"]), "language")
            assert [s["tokens"] for s in row["steps"]] == \
                [tokens[s]["language"] if modality == "language" else tokens[s].get(modality, 0)
                 for s in sorted(tokens)], (entry["rank"], modality)


def test_plan_rejects_an_invalid_layout(capsys, clean, configs, tmp_path):
    code, out, err = run(capsys, "plan", clean, "--config", configs["default"], "--layout",
                         "language=dp3;image=dp1;audio=dp1", "--global-batch-size", "8",
                         "--micro-batch-size", "2")
    # a config error (README's exit status 2), as mimo-train's for the same LayoutError
    assert code == 2 and "INVALID" in out
    assert "FAIL layout" in err and "8" in err and "6" in err
    code, out, _ = run(capsys, "plan", clean, "--config", configs["default"], "--layout",
                       "language=dp3;image=dp1;audio=dp1", "--global-batch-size", "8",
                       "--micro-batch-size", "2", "--json")       # stdout stays JSON
    result = json.loads(out)
    assert code == 2 and result["valid"] is False and "8" in result["problem"] and \
        result["layout"].startswith("language=tp1,cp1,pp1,dp3"), result
    # a layout that does not parse (the language module misspelt): JSON too, as given, the
    # near name said
    code, out, err = run(capsys, "plan", clean, "--config", configs["default"], "--layout",
                         "langauge=dp2;image=dp1;audio=dp1", "--global-batch-size", "8",
                         "--micro-batch-size", "2", "--json")
    assert code == 2 and json.loads(out) == {
        "layout": "langauge=dp2;image=dp1;audio=dp1", "valid": False,
        "problem": "no 'language' module among langauge, image, audio (module 'langauge' is "
                   "named close to it: misspelt?): megatron-core's MimoModel needs exactly one "
                   "module named 'language'"}, out
    assert "error: --layout langauge=dp2;image=dp1;audio=dp1: no 'language' module" in err
    code, out, err = run(capsys, "plan", clean, "--config", configs["default"], "--layout",
                         "gone.yaml", "--global-batch-size", "8", "--micro-batch-size", "2",
                         "--json")       # a layout file not there: said of --layout, JSON too
    assert code == 2 and json.loads(out)["problem"] == "cannot read it (No such file or " \
        "directory)" and "error: --layout gone.yaml: cannot read it" in err, (out, err)
    binary = tmp_path / "photo.yaml"                    # a binary file named as the layout
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00")
    code, out, err = run(capsys, "plan", clean, "--config", configs["default"], "--layout",
                         str(binary), "--global-batch-size", "8", "--micro-batch-size", "2",
                         "--json")
    assert code == 2 and json.loads(out)["problem"] == f"{binary} is not UTF-8 text: give a " \
        "layout YAML", (out, err)
    # --split-media is the advisor's: a plan of one layout draws whole micro-batches, so it is
    # refused there rather than ignored
    code, _, err = run(capsys, "plan", clean, "--config", configs["default"], "--layout",
                       "language=dp1;image=dp2;audio=dp1", "--global-batch-size", "8",
                       "--micro-batch-size", "2", "--split-media")
    assert code == 2 and "--split-media goes with the layout advisor" in err, err
    # Colocated fan-in of variable-size image tokens: megatron-core's colocated bridge
    # splits evenly.
    code, out, err = run(capsys, "plan", clean, "--config", configs["default"], "--layout",
                         "language=tp2,off0;image=dp2,off0;audio=tp2,off0",
                         "--global-batch-size", "8", "--micro-batch-size", "2")
    assert code == 2 and "INVALID" in out and "colocated module 'image'" in err


def test_plan_text_summary(capsys, clean, configs, single_image):
    code, out, _ = run(capsys, "plan", clean, "--config", configs["default"], "--layout",
                       "language=dp2;image=dp1;audio=dp1", "--global-batch-size", "8",
                       "--micro-batch-size", "2")
    assert code == 0 and "\nidle " not in out
    samples = len(ShardReader(str(clean)))
    assert f"{samples // 8} steps x 2 global micro-batches of 4 samples" in out
    assert f"remainder drop: {samples % 8} samples" in out
    assert re.search(r"language\s+dp 2: mean \d\.\d\d, worst \d\.\d\d", out)
    # dp, pp, cp and tp as rank/size: a bare tp rank read as a size of 0
    row = r"^\s+(\d+)\s+(\w+)\s+(\d+/\d+)\s+(\d+/\d+)\s+(\d+/\d+)\s+(\d+/\d+)\s"
    rows = re.findall(row, out, re.M)
    one = ("0/1", "0/1", "0/1")
    assert rows == [("0", "language", "0/2", *one), ("1", "language", "1/2", *one),
                    ("2", "image", "0/1", *one), ("3", "audio", "0/1", *one)]
    # context parallelism: the CP ranks told apart, each holding half of every sequence
    code, out, _ = run(capsys, "plan", clean, "--config", configs["default"], "--layout",
                       "language=cp2;image=dp1;audio=dp1", "--global-batch-size", "8",
                       "--micro-batch-size", "2")
    assert code == 0
    rows = re.findall(row + r".*$", out, re.M)
    assert [r[:6] for r in rows[:2]] == [("0", "language", "0/1", "0/1", "0/2", "0/1"),
                                         ("1", "language", "0/1", "0/1", "1/2", "0/1")]
    mean = float(re.search(r"^\s+0\s+language.*?\s(\d+\.\d)\s+\d+\s+\d+\.\d", out,
                           re.M).group(1))
    assert out.count(f"(holds 1/2 of each sequence: ~{mean / 2:.1f} tokens/step; the row's "
                     "figures are its DP rank's, once for its cp ranks)") == 2
    # an encoder module no sample feeds: its idle line after the checks (its modality once,
    # over its two ranks)
    code, out, _ = run(capsys, "plan", single_image, "--config", configs["fixed"], "--layout",
                       "language=dp1;image=dp1;audio=dp2", "--global-batch-size", "8",
                       "--micro-batch-size", "2")
    assert code == 0 and out.rstrip().endswith(
        "\nidle      module 'audio' gets no item this epoch (the data holds no audio): its "
        "weights would not train and its rank(s) 2, 3 do nothing for it; drop it from the "
        "layout, or give the data it is for\nmodel     its rules not checked (experts over "
        "ep, heads over tp, ...): give --model (its config.json or a training YAML) for "
        "mimo-train's verdict"), out


PACKING_PLAN = ("--layout", "language=dp2;image=dp1;audio=dp1", "--global-batch-size", "8",
                "--micro-batch-size", "4")


def _first_fit_decreasing(lengths: list[int], capacity: int) -> list[int]:
    """Loads of the sequences that first-fit-decreasing fills with ``lengths``."""
    loads: list[int] = []
    for length in sorted(lengths, reverse=True):
        for i, load in enumerate(loads):
            if load + length <= capacity:
                loads[i] += length
                break
        else:
            loads.append(length)
    return loads


def _language_micro_batches(result: dict) -> list[dict]:
    """Every language DP rank's micro-batches of the dry run (no TP/CP/PP in PACKING_PLAN)."""
    return [mb for entry in result["ranks"] if entry["steps"] is not None
            and any(part["module"] == "language" for part in entry["role"]["modules"])
            for step in entry["steps"] for mb in step["micro_batches"]]


def test_plan_packing_efficiency_is_first_fit_decreasing_of_the_planned_tokens(
        capsys, clean, configs):
    """The JSON's packing figures against the dry run's per-sample tokens: sequences by a
    first-fit-decreasing written here, padded rows of seq_length, and each micro-batch cut to
    its longest sample rounded up to 64 tokens (what mimo_train/training/step.py computes
    unpacked)."""
    code, out, err = run(capsys, "plan", clean, "--config", configs["default"], *PACKING_PLAN,
                         "--json")
    assert code == 0, err
    result = json.loads(out)
    packing = result["plan"]["packing"]
    seq_length = PreprocessConfig.from_yaml(str(configs["default"])).seq_length
    multiple = 64
    parts = [mb["tokens"] for mb in _language_micro_batches(result)]
    assert len(parts) == 2 * result["steps_per_epoch"] and all(len(p) == 4 for p in parts)
    tokens = sum(map(sum, parts))
    sequences = sum(len(_first_fit_decreasing(part, seq_length)) for part in parts)
    positions = sum(4 * min(seq_length, -(-max(part) // multiple) * multiple) for part in parts)
    assert len(parts) < sequences < 4 * len(parts)          # some parts pack, none into one
    assert packing == {
        "enabled": False, "seq_length": seq_length, "tokens": tokens,
        "packed": {"sequences": sequences, "efficiency": tokens / (sequences * seq_length)},
        "padded": {"rows": 4 * len(parts), "efficiency": tokens / (4 * len(parts) * seq_length)},
        "cut_to_longest": {"length_multiple": multiple, "positions": positions,
                           "efficiency": tokens / positions}}
    assert packing["packed"]["efficiency"] > packing["padded"]["efficiency"]


def test_plan_with_packing_gives_sequences_of_at_most_seq_length(capsys, clean, configs):
    """``--packing``: every language micro-batch holds its unpacked samples, cut into
    ``sequences`` of at most seq_length tokens, as many as the plan's packed figure."""
    plans = {}
    for flags in ((), ("--packing",)):
        code, out, err = run(capsys, "plan", clean, "--config", configs["default"],
                             *PACKING_PLAN, "--json", *flags)
        assert code == 0, err
        plans[flags] = json.loads(out)
    packed, unpacked = plans[("--packing",)], plans[()]
    seq_length = packed["plan"]["packing"]["seq_length"]
    counts = []
    for mb, plain in zip(_language_micro_batches(packed), _language_micro_batches(unpacked),
                         strict=True):
        assert sorted(mb["keys"]) == sorted(plain["keys"]) and "sequences" not in plain
        assert sum(mb["sequences"]) == len(mb["keys"])
        bounds = np.cumsum([0, *mb["sequences"]])
        loads = [sum(mb["tokens"][a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
        assert max(loads) <= seq_length, mb["keys"]
        counts.append(len(mb["sequences"]))
    assert max(counts) > 1 and min(counts) < 4                 # packing had something to do
    assert sum(counts) == packed["plan"]["packing"]["packed"]["sequences"]
    assert packed["plan"]["packing"] == {**unpacked["plan"]["packing"], "enabled": True}


def test_plan_text_shows_packing_efficiency_this_plans_first(capsys, clean, configs):
    for flags, first in (((), "cut_to_longest"), (("--packing",), "packed")):
        code, out, _ = run(capsys, "plan", clean, "--config", configs["default"],
                           *PACKING_PLAN, *flags)
        assert code == 0
        assert re.search(r"^packing   language real tokens / token positions computed \(\d+ "
                         rf"tokens, seq_length \d+\), this plan's {first} first$", out,
                         re.MULTILINE)
        names = re.findall(r"^  (packed|cut_to_longest|padded) +[01]\.\d\d: ", out, re.MULTILINE)
        assert names[0] == first and sorted(names) == ["cut_to_longest", "packed", "padded"]
        # packed computes the real tokens alone: 1.00, how full its sequences are beside
        assert re.search(r"^  packed +1\.00: only the \d+ real tokens are computed \(--packing: "
                         r"no padding\), in \d+ sequences of seq_length, 0\.\d\d full$", out,
                         re.MULTILINE), out

