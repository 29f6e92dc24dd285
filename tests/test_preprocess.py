"""Preprocessing on the real corpus with the real SmolLM2 tokenizer: masks, placeholders,
metadata-only equality, length policy, drops, collate.

Expected values come from the input records (assistant texts) and from transformers'
``apply_chat_template`` directly, never from mimo's own rendering.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import shutil

import pytest
import torch
from transformers import AutoTokenizer

from mimo_data.shards.build import BuildOptions, build
from mimo_data.preprocess.chat_tokens import TextEncoder
from mimo_data.preprocess.collate import BatchError, Collator
from mimo_data.preprocess.preprocessor import Preprocessor, SampleDropped, preprocess_dataset
from mimo_data.errors import ConfigError
from mimo_data.modalities.image import ImageConfig
from mimo_data.preprocess.config import PreprocessConfig
from mimo_data.tally import Tally
from mimo_data.preprocess.segment_tokenizer import SegmentCachedTokenizer
from mimo_data.shards.reader import ShardReader

from conftest import CORPUS_INPUTS, REPO

TOKENIZER = str(REPO / "assets" / "tokenizer" / "smollm2")
EOT = "<|im_end|>"


@pytest.fixture(scope="module")
def dataset(corpus, tmp_path_factory) -> ShardReader:
    out = tmp_path_factory.mktemp("pre") / "shards"
    build([str(corpus / name) for name in CORPUS_INPUTS], str(out),
          BuildOptions(progress=False, max_samples_per_shard=20, workers=0))
    return ShardReader(str(out))


@pytest.fixture(scope="module")
def records(dataset) -> list[dict]:
    return [dataset.record(i) for i in range(len(dataset))]


def config(**changes) -> PreprocessConfig:
    base = PreprocessConfig.from_yaml(str(REPO / "configs" / "preprocess.yaml"))
    return dataclasses.replace(base, **{"tokenizer": TOKENIZER, **changes})


@pytest.fixture(scope="module")
def plain() -> Preprocessor:
    """The default config's metadata-only preprocessor, shared by the tests that only call it
    (each build loads and analyses the tokenizer: over a second). Its piece cache warms up
    across them, which must not change a result (the tests of the cache itself, cold then
    warm, build their own)."""
    return Preprocessor(config(), with_media=False)


@pytest.fixture(scope="module")
def with_media() -> Preprocessor:
    """The default config's preprocessor decoding media, shared likewise."""
    return Preprocessor(config())


@pytest.fixture(scope="module")
def reference_tokenizer():
    """The tokenizer as transformers loads it, untouched by mimo."""
    return AutoTokenizer.from_pretrained(TOKENIZER)


def trained_text(tokenizer, sample) -> str:
    return tokenizer.decode(sample.labels[sample.labels != -100].tolist())


def text_record_with_answer_prefix(records, prefix: str) -> dict:
    """A copy of the first text-only record with ``prefix`` put before its first answer."""
    record = copy.deepcopy(next(r for r in records if not r["media"]))
    answer = next(m for m in record["messages"] if m["role"] == "assistant")
    answer["content"] = prefix + answer["content"]
    return record


def assistant_text(record) -> str:
    return "".join(m["content"] + EOT for m in record["messages"] if m["role"] == "assistant")


def test_corpus_covers_the_golden_cases(records):
    kinds = {
        "multi_turn": any(sum(m["role"] == "assistant" for m in r["messages"]) >= 2
                          for r in records),
        "system": any(r["messages"][0]["role"] == "system" for r in records),
        "multi_image": any(sum(i["modality"] == "image" for i in r["media"]) >= 2
                           for r in records),
        "image_audio": any({i["modality"] for i in r["media"]} == {"image", "audio"}
                           for r in records),
        "text_only": any(not r["media"] for r in records),
    }
    assert all(kinds.values()), kinds


@pytest.mark.parametrize("mode", ["chat", "caption"])
def test_trained_tokens_are_exactly_assistant_text_and_eot(records, mode, reference_tokenizer):
    preprocessor = Preprocessor(config(mode=mode), with_media=False)
    for record in records:
        sample = preprocessor(record)
        assert trained_text(preprocessor.text.tokenizer, sample) == assistant_text(record), \
            record["key"]
        assert torch.equal(sample.loss_mask.bool(), sample.labels != -100)
        # No modality placeholder is ever a target.
        placeholder_ids = list(preprocessor.text.modality_token_ids.values())
        assert not torch.isin(sample.labels, torch.tensor(placeholder_ids)).any()


def test_chat_tokens_equal_the_reference_template_with_markers_expanded(records, plain,
                                                                         reference_tokenizer):
    preprocessor = plain
    tokenizer = preprocessor.text.tokenizer
    marker = {"image": "<image>", "audio": "<audio>"}
    for record in records:
        sample = preprocessor(record)
        reference = reference_tokenizer.apply_chat_template(record["messages"], tokenize=False)
        # input_ids stop one token short (the last token is only a target): take it from the
        # reference tokenization of the reference rendering.
        last = reference_tokenizer(reference, add_special_tokens=False).input_ids[-1]
        ids = sample.input_ids.tolist() + [last]
        # Collapse each run of placeholders back into its marker, then compare the text with
        # transformers' own rendering of the conversation.
        pieces, previous = [], None
        for token in ids:
            modality = next((m for m, t in preprocessor.text.modality_token_ids.items()
                             if t == token), None)
            if modality is None:
                pieces.append(tokenizer.decode([token]))
            elif previous != token:
                pieces.append(marker[modality])
            previous = token
        assert "".join(pieces) == reference, record["key"]


def test_placeholder_runs_match_token_counts_in_item_order(records, plain):
    preprocessor = plain
    ids_of = preprocessor.text.modality_token_ids
    for record in records:
        sample = preprocessor(record)
        runs, ids = [], sample.input_ids.tolist()
        for i, token in enumerate(ids):
            for modality, token_id in ids_of.items():
                if token == token_id:
                    if i and ids[i - 1] == token_id:
                        runs[-1][1] += 1
                    else:
                        runs.append([modality, 1])
        expected = [[item["modality"], None] for item in record["media"]]
        assert [m for m, _ in runs] == [m for m, _ in expected], record["key"]
        for modality in ids_of:
            assert [n for m, n in runs if m == modality] == sample.token_counts[modality]


@pytest.mark.parametrize("max_pixels", [64 * 28 * 28, 256 * 28 * 28, 1024 * 28 * 28])
def test_metadata_only_equals_full_mode_on_the_whole_corpus(dataset, max_pixels):
    image = dataclasses.replace(config().modalities["image"], max_pixels=max_pixels)
    cfg = config(modalities={**config().modalities, "image": image}, seq_length=4096)
    full, meta = Preprocessor(cfg), Preprocessor(cfg, with_media=False)
    full_tally, meta_tally = Tally(), Tally()
    full_samples = list(preprocess_dataset(dataset, full, full_tally))
    meta_samples = list(preprocess_dataset(dataset, meta, meta_tally))
    assert full_tally.kept == meta_tally.kept == len(dataset)
    collate = Collator(full)
    for a, b in zip(full_samples, meta_samples):
        assert a.key == b.key
        for name in ("input_ids", "labels", "loss_mask", "position_ids"):
            assert torch.equal(getattr(a, name), getattr(b, name)), (a.key, name)
        assert a.token_counts == b.token_counts
        assert not b.encoder_inputs
        collate([a])        # checks placeholders == counts == encoder rows for this sample
    assert any(s.encoder_inputs for s in full_samples)


def test_too_long_samples_are_dropped_and_counted(dataset, records, plain):
    unlimited = plain
    lengths = [len(unlimited(r).input_ids) for r in records]
    limit = sorted(lengths)[len(lengths) // 2]
    preprocessor = Preprocessor(config(seq_length=limit), with_media=False)
    tally = Tally()
    kept = list(preprocess_dataset(dataset, preprocessor, tally))
    too_long = sum(n > limit for n in lengths)
    assert too_long > 0
    assert tally.skipped["too_long"]["count"] == too_long
    assert len(kept) + too_long == len(records)
    assert all(len(s.input_ids) <= limit for s in kept)


def test_truncate_turns_removes_whole_trailing_turns(records, plain):
    base = plain
    record = next(r for r in records
                  if sum(m["role"] == "assistant" for m in r["messages"]) >= 2 and r["media"])
    full_length = len(base(record).input_ids)
    first = record["messages"][:[m["role"] for m in record["messages"]].index("assistant") + 1]
    short_record = dict(record, messages=first,
                        media=record["media"][:sum(m["content"].count("<image>") +
                                                   m["content"].count("<audio>")
                                                   for m in first)])
    first_length = len(base(short_record).input_ids)
    assert first_length < full_length
    truncating = Preprocessor(config(seq_length=first_length, length_policy="truncate_turns"),
                              with_media=False)
    sample = truncating(record)
    assert sample.removed_turns == len(record["messages"]) - len(first)
    assert torch.equal(sample.input_ids, base(short_record).input_ids)
    assert trained_text(truncating.text.tokenizer, sample) == assistant_text(short_record)
    with pytest.raises(SampleDropped) as dropped:
        Preprocessor(config(seq_length=first_length), with_media=False)(record)
    assert dropped.value.reason == "too_long"
    # too long even cut: the drop says the whole's length and its first exchange's
    with pytest.raises(SampleDropped) as dropped:
        Preprocessor(config(seq_length=first_length - 2, length_policy="truncate_turns"),
                     with_media=False)(record)
    assert dropped.value.detail.startswith(
        f"{full_length} tokens, above seq_length {first_length - 2} even with only its "
        f"first turns ({first_length} tokens up to its first trained answer)")
    # an image that is most of a sample too long: what lowers its tokens, with the values
    pictured = next(r for r in records if [m["modality"] for m in r["media"]] == ["image"])
    with pytest.raises(SampleDropped) as dropped:
        Preprocessor(config(seq_length=64), with_media=False)(pictured)
    assert re.fullmatch(r"\d+ tokens, above seq_length 64; \d+ of them its images': lower "
                        r"modalities.image max_pixels \(200704; min_pixels 3136 is each image's "
                        r"floor\) for fewer tokens an image, or raise seq_length",
                        dropped.value.detail), dropped.value.detail


def test_a_token_cache_error_while_truncating_names_its_sample(records, monkeypatch):
    from mimo_data.preprocess.segment_tokenizer import SegmentCacheError

    def answers(record):
        return sum(m["role"] == "assistant" for m in record["messages"])
    record = next(r for r in records if answers(r) >= 2)
    single = next(r for r in records if answers(r) == 1)     # too long, nothing to re-encode
    preprocessor = Preprocessor(config(seq_length=8, length_policy="truncate_turns"),
                                with_media=False)
    encode_batch, calls = preprocessor.text.encode_batch, []

    def failing_after_the_first_call(conversations):     # the re-encodes of kept turns fail
        calls.append(len(conversations))
        if len(calls) > 1:
            raise SegmentCacheError(0, "cached tokenization differs")
        return encode_batch(conversations)

    monkeypatch.setattr(preprocessor.text, "encode_batch", failing_after_the_first_call)
    with pytest.raises(SegmentCacheError) as caught:
        preprocessor.text_batch([single, record])
    assert caught.value.index == 1 and record["key"] in str(caught.value)


def test_prompt_only_and_literal_token_samples_are_dropped_with_reason(records, plain):
    preprocessor = plain
    record = next(r for r in records if not r["media"])
    prompt_only = dict(record, messages=[m for m in record["messages"]
                                         if m["role"] != "assistant"])
    with pytest.raises(SampleDropped) as dropped:
        preprocessor(prompt_only)
    assert dropped.value.reason == "no_trained_tokens"
    # answers with no text (whitespace only) would train the end of turn alone: to say nothing
    empty = copy.deepcopy(record)
    for message in empty["messages"]:
        if message["role"] == "assistant":
            message["content"] = " \n"
    with pytest.raises(SampleDropped) as dropped:
        preprocessor(empty)
    assert dropped.value.reason == "empty_answers" and "is empty" in dropped.value.detail
    one_empty = copy.deepcopy(record)          # beside an answer with text: trained as it is
    one_empty["messages"] += [{"role": "user", "content": "And?"},
                              {"role": "assistant", "content": ""}]
    assert preprocessor(one_empty).loss_mask.sum() > preprocessor(record).loss_mask.sum()
    literal = copy.deepcopy(record)
    literal["messages"][-1]["content"] += " <|image_pad|>"
    with pytest.raises(SampleDropped) as dropped:
        preprocessor(literal)
    assert dropped.value.reason == "literal_special_token"
    # the template's turn delimiters and the tokenizer's EOS typed in a text: a turn end the
    # template did not write, an EOS trained mid-answer
    for where, token in (("user", "<|im_end|>"), ("assistant", "<|endoftext|>")):
        typed = copy.deepcopy(record)
        turn = next(m for m in typed["messages"] if m["role"] == where)
        turn["content"] = f"Quoted {token} here. " + turn["content"]
        with pytest.raises(SampleDropped) as dropped:
            preprocessor(typed)
        assert dropped.value.reason == "literal_special_token" and \
            f"({where}) holds '{token}'" in str(dropped.value), dropped.value


@pytest.mark.parametrize("template", ["tokenizer's", "Qwen2-VL's"])
def test_a_conversation_opening_with_a_greeting_trains_it_not_the_system_prompt(records, plain,
                                                                               template):
    """An assistant turn first (a chatbot's greeting): SmolLM2's and Qwen2-VL's templates
    write their default system prompt once there are turns, which the render of no turns
    lacks; the greeting is trained to its end of turn, the system prompt is not (it was
    dropped as template_mismatch), and the text is the template's own."""
    preprocessor = plain if template == "tokenizer's" else Preprocessor(config(
        chat_template=json.loads((REPO / "tools" / "published" / "Qwen--Qwen2-VL-2B-Instruct" /
                                  "chat_template.json").read_text())["chat_template"]),
        with_media=False)
    record = next(r for r in records if not r["media"])
    greeting = {"role": "assistant", "content": "Hello! How can I help?"}
    opened = dict(record, messages=[greeting, *record["messages"]])
    encoded, alone = preprocessor(opened), preprocessor(record)
    tokenizer = preprocessor.text.tokenizer
    trained = tokenizer.decode(encoded.labels[encoded.loss_mask.bool()])
    assert trained == "Hello! How can I help?<|im_end|>" + tokenizer.decode(
        alone.labels[alone.loss_mask.bool()]), trained
    text = tokenizer.decode(encoded.input_ids)
    assert text.startswith("<|im_start|>system\n") and \
        "<|im_end|>\n<|im_start|>assistant\nHello! How can I help?<|im_end|>\n" in text, text
    assert tokenizer.decode(encoded.input_ids[:int(encoded.loss_mask.bool().nonzero()[0]) + 1]) \
        .endswith("<|im_start|>assistant\n"), text


def test_a_greeting_first_trains_it_with_a_template_that_fails_on_no_turns(records, plain):
    """Qwen3-VL's template reads ``messages[0]``, so the render of no turns (the generation
    prompt before an opening answer) fails; the greeting is trained from its own generation
    prompt, as transformers renders the conversation (it was dropped as template_error)."""
    template = json.loads((REPO / "tools" / "published" / "Qwen--Qwen3-VL-2B-Instruct" /
                           "chat_template.json").read_text())["chat_template"]
    preprocessor = Preprocessor(config(chat_template=template), with_media=False)
    record = next(r for r in records if not r["media"])
    greeting = {"role": "assistant", "content": "Hello! How can I help?"}
    encoded = preprocessor(dict(record, messages=[greeting, *record["messages"]]))
    alone = preprocessor(record)
    tokenizer = preprocessor.text.tokenizer
    trained = tokenizer.decode(encoded.labels[encoded.loss_mask.bool()])
    assert trained == "Hello! How can I help?<|im_end|>" + tokenizer.decode(
        alone.labels[alone.loss_mask.bool()]), trained
    assert tokenizer.decode(encoded.input_ids).startswith(
        "<|im_start|>assistant\nHello! How can I help?<|im_end|>\n")


@pytest.mark.parametrize("fmt, reason", [("jpeg", "corrupt_image"), ("wav", "corrupt_audio")])
def test_corrupt_media_is_dropped_and_counted(dataset, records, with_media, fmt, reason):
    """A WAV cut after the build decodes fewer frames than its metadata counted tokens for."""
    position = next(i for i, r in enumerate(records)
                    if r["media"] and r["media"][0]["format"] == fmt)
    record = records[position]
    media = dataset.media(position, record)
    member = record["media"][0]["member"]
    media[member] = media[member][: len(media[member]) // 3]
    with pytest.raises(SampleDropped) as dropped:
        with_media(record, media)
    assert dropped.value.reason == reason
    assert member in dropped.value.detail


def test_generation_block_template_gives_the_same_masks_as_incremental_rendering(records,
                                                                                   plain):
    template = plain.text.template.replace(
        "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}",
        "{% if message['role'] == 'assistant' %}{{'<|im_start|>assistant\n'}}{% generation %}"
        "{{message['content'] + '<|im_end|>'}}{% endgeneration %}{{'\n'}}{% else %}"
        "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
        "{% endif %}")
    assert "generation" in template
    marked = Preprocessor(config(chat_template=template), with_media=False)
    assert marked.text.has_generation_blocks and not plain.text.has_generation_blocks
    for record in records:
        a, b = plain(record), marked(record)
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)


@pytest.mark.parametrize("mode", ["chat", "caption", "generation"])
def test_an_answer_weighted_0_is_in_the_text_not_the_loss(records, mode, reference_tokenizer):
    """OpenAI's ``weight: 0`` on an answer (``"weight": 0`` in the shard's message): the
    tokens are the unweighted record's, the trained text the other answers' alone (from the
    record itself), whichever way the spans are found (incremental rendering, caption mode,
    a template's generation blocks). An inspector finds no coverage problem: the weighted
    answer is judged as a turn that must not be trained. Another weight in a shard is
    malformed."""
    from mimo_data.inspect.stats import SampleInspector
    record = copy.deepcopy(next(r for r in records if not r["media"] and sum(
        m["role"] == "assistant" for m in r["messages"]) >= 2))
    weighted = copy.deepcopy(record)
    answers = [m for m in weighted["messages"] if m["role"] == "assistant"]
    answers[0]["weight"] = 0
    changes = {"mode": mode} if mode != "generation" else {"chat_template": (
        reference_tokenizer.chat_template.replace(
            "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
            "'\n'}}", "{% if message['role'] == 'assistant' %}{{'<|im_start|>assistant\n'}}"
            "{% generation %}{{message['content'] + '<|im_end|>'}}{% endgeneration %}"
            "{{'\n'}}{% else %}{{'<|im_start|>' + message['role'] + '\n' + "
            "message['content'] + '<|im_end|>' + '\n'}}{% endif %}"))}
    preprocessor = Preprocessor(config(**changes), with_media=False)
    assert preprocessor.text.has_generation_blocks == (mode == "generation")
    full, sample = preprocessor(record), preprocessor(weighted)
    assert torch.equal(sample.input_ids, full.input_ids)
    assert trained_text(preprocessor.text.tokenizer, sample) == "".join(
        m["content"] + EOT for m in answers[1:])
    assert trained_text(preprocessor.text.tokenizer, full) == assistant_text(record)
    if mode != "caption":
        stats, _ = SampleInspector(preprocessor.config)(0, weighted)
        assert not stats.coverage_failure and stats.trained == int(sample.loss_mask.sum()), \
            stats.coverage_problems
    # a shard holds "weight": 0 alone: another value (a hand-made or another tool's
    # record) is refused, never read one way by the preprocessor and another by the inspector
    weighted["messages"][-1]["weight"] = None
    with pytest.raises(SampleDropped, match="weight is 0 where it has one") as caught:
        preprocessor(weighted)
    assert caught.value.reason == "malformed_record"


def test_tool_use_a_template_does_not_write_is_dropped_and_named(plain, reference_tokenizer):
    """SmolLM2's template writes a tool's turn (as a turn of role ``tool``) but neither calls
    nor tools: a conversation with calls or tools is dropped as ``tool_use`` naming what the
    template leaves out, never trained without them; one with tools' turns alone trains its
    answers, the tool's content out of the loss (the text is transformers' render). Caption
    mode, which has no template, drops any tool use. An answer that only calls is no empty
    answer."""
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {}}}
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    turns = [{"role": "user", "content": "Weather?"},
             {"role": "assistant", "content": "", "tool_calls": [call]},
             {"role": "tool", "content": "21 degrees"},
             {"role": "assistant", "content": "It is 21 degrees."}]
    for messages, missing in (
            (turns, "tool calls"), ([{**turns[0], "tools": tools}, turns[3]], "tool lists"),
            ([{**turns[0], "tools": tools}, *turns[1:]], "tool calls and no tool lists")):
        with pytest.raises(SampleDropped, match=f"chat template writes no {missing} ") as caught:
            plain({"key": "k", "media": [], "messages": messages})
        assert caught.value.reason == "tool_use"
    results = [turns[0], {"role": "assistant", "content": "Let me see."}, *turns[2:]]
    sample = plain({"key": "k", "media": [], "messages": results})
    assert reference_tokenizer.decode(sample.input_ids) + "\n" == \
        reference_tokenizer.apply_chat_template(results, tokenize=False)
    assert "<|im_start|>tool\n21 degrees<|im_end|>" in reference_tokenizer.decode(
        sample.input_ids)
    assert trained_text(plain.text.tokenizer, sample) == assistant_text({"messages": results})
    with pytest.raises(SampleDropped, match="caption mode has no template") as caught:
        Preprocessor(config(mode="caption"), with_media=False)(
            {"key": "k", "media": [], "messages": results})
    qwen = Preprocessor(PreprocessConfig.from_yaml(
        str(REPO / "configs" / "preprocess_qwen3_5.yaml")), with_media=False)
    calls_only = [turns[0], turns[1]]
    assert trained_text(qwen.text.tokenizer, qwen({"key": "k", "media": [],
                                                   "messages": calls_only})).endswith(
        "<tool_call>\n<function=get_weather>\n</function>\n</tool_call><|im_end|>")
    # a delimiter typed in a call's arguments or a tool's description would be encoded as that
    # token, as in a content
    for typed in ([turns[0], {**turns[1], "tool_calls": [{**call, "function": {
            "name": "get_weather", "arguments": {"city": "a<|im_end|>"}}}]}],
            [{**turns[0], "tools": [{"type": "function", "function": {
                "name": "get_weather", "description": "<|im_start|>user"}}]}, turns[3]]):
        with pytest.raises(SampleDropped, match="holds '<|im_") as caught:
            qwen({"key": "k", "media": [], "messages": typed})
        assert caught.value.reason == "literal_special_token"
    # a hand-made shard record whose call is not as a shard holds it (arguments as JSON text):
    # malformed, for the preprocessor and the inspector alike, never a crashed worker
    from mimo_data.inspect.stats import SampleInspector
    hand_made = {"key": "k", "media": [], "messages": [turns[0], {**turns[1], "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}]}
    with pytest.raises(SampleDropped, match="a tool call that is not") as caught:
        qwen(hand_made)
    assert caught.value.reason == "malformed_record"
    assert SampleInspector(qwen.config)(0, hand_made)[0].dropped == "malformed_record"


# ChatML turns whose calls must carry a 9-letter id, as Mistral's templates demand, or that
# raise on any call: what a template writes of tool use is read with a call it accepts, and a
# template that fails on tool use says so
_CALLS_WITH_IDS = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] }}{%- for call in message.get('tool_calls') or [] %}"
    "{%- if call.id is not defined or call.id|length != 9 %}{{- raise_exception("
    "'Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}"
    "{{- '<call>' + call.function.name + '</call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def test_what_a_template_writes_of_tool_use_is_read_with_a_call_it_accepts():
    ids = Preprocessor(config(chat_template=_CALLS_WITH_IDS), with_media=False)
    assert ids.text.renderer.tool_support() == {"tool calls", "tools' turns"}
    message = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "id": "abcdefghi", "function": {"name": "f", "arguments": {}}}]}
    sample = ids({"key": "k", "media": [], "messages": [
        {"role": "user", "content": "Go."}, message]})
    assert trained_text(ids.text.tokenizer, sample) == "<call>f</call>" + EOT
    failing = Preprocessor(config(chat_template=_CALLS_WITH_IDS.replace(
        "call.id|length != 9", "true")), with_media=False)
    with pytest.raises(SampleDropped, match="it fails on a conversation that uses them: the "
                       "chat template failed: Tool call IDs should be") as caught:
        failing({"key": "k", "media": [], "messages": [
            {"role": "user", "content": "Go."}, message]})
    assert caught.value.reason == "tool_use"


def test_weights_the_spans_cannot_follow_and_empty_trained_answers_are_dropped(records,
                                                                                plain):
    """A template writing two ``{% generation %}`` blocks an answer: its spans cannot be
    matched to the answers, so a weighted sample is a template_mismatch (unweighted, it trains
    both blocks). An empty trained answer beside a weighted one with text trains its end of
    turn alone: empty_answers. ``truncate_turns`` keeps a prefix ending on a trained answer."""
    record = copy.deepcopy(next(r for r in records if not r["media"] and sum(
        m["role"] == "assistant" for m in r["messages"]) >= 2))
    answers = [m for m in record["messages"] if m["role"] == "assistant"]
    twice = plain.text.template.replace(
        "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}",
        "{% if message['role'] == 'assistant' %}{{'<|im_start|>assistant\n'}}{% generation %}"
        "{{message['content']}}{% endgeneration %}{% generation %}{{'<|im_end|>'}}"
        "{% endgeneration %}{{'\n'}}{% else %}{{'<|im_start|>' + message['role'] + '\n' + "
        "message['content'] + '<|im_end|>' + '\n'}}{% endif %}")
    marked = Preprocessor(config(chat_template=twice), with_media=False)
    assert marked.text.has_generation_blocks
    assert int(marked(record).loss_mask.sum()) > 0
    answers[0]["weight"] = 0
    with pytest.raises(SampleDropped, match="one {% generation %} block an answer") as caught:
        marked(record)
    assert caught.value.reason == "template_mismatch"
    answers[-1]["content"] = ""
    with pytest.raises(SampleDropped, match=r"every trained answer \(1 of") as caught:
        plain(record)
    assert caught.value.reason == "empty_answers"
    exchanges = [{"role": role, "content": f"{role} {k}."} for k in range(3)
                 for role in ("user", "assistant")]
    exchanges[3]["weight"] = 0                       # the middle answer
    three = dict(record, messages=exchanges)
    truncating = Preprocessor(config(seq_length=len(plain(three).input_ids) - 1,
                                     length_policy="truncate_turns"), with_media=False)
    assert truncating(three).removed_turns == 4      # to the first answer, not the middle


def test_template_that_rewrites_earlier_turns_is_an_error_not_a_silent_mask(records):
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                "{% if loop.last %} (final){% endif %}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    preprocessor = Preprocessor(config(chat_template=template), with_media=False)
    record = next(r for r in records if sum(m["role"] == "assistant"
                                            for m in r["messages"]) >= 2)
    with pytest.raises(SampleDropped, match=r"the turns before it, rendered with the generation "
                       r"prompt, end '[^'\n<]*\? \(final\)<\|im_end\|>\\n<\|im_start\|>"
                       r"assistant', followed by it '[^'\n<]*\?<\|im_end\|>\\n<\|im_start\|>"
                       r"assistant\\n.*give a chat_template with \{% generation %\} blocks"
                       r".*qwen3_5.jinja") as dropped:
        preprocessor(record)
    assert dropped.value.reason == "template_mismatch"
    # a turn rendered shorter than the generation prompt before it: what the prompt writes past
    from mimo_data.preprocess.chat_render import _rewritten
    assert "rendered with the generation prompt, end '<think>\\n', followed by it ''" in \
        _rewritten("<u>hi</u><a>\n<think>\n", "<u>hi</u><a>\n", "<u>hi</u><a>\n<u>x</u>")
    # a template that writes no answer at all: refused at start-up (not left to drop every
    # sample), said so, not to add generation blocks
    silent = ("{% for m in messages %}{% if m['role'] != 'assistant' %}<|im_start|>"
              "{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(ConfigError, match=r"the configured chat_template writes no answer"):
        Preprocessor(config(chat_template=silent), with_media=False)
    # one that writes no answer but an end token after the last turn: the same
    ending = silent.replace("{% if add_generation_prompt %}", "{% if messages[-1]['role'] == "
                            "'assistant' %}</s>{% endif %}{% if add_generation_prompt %}")
    with pytest.raises(ConfigError, match=r"the configured chat_template writes no answer"):
        Preprocessor(config(chat_template=ending), with_media=False)
    # one that writes an earlier answer otherwise (its reasoning left out, as Qwen3's does):
    # not said to write none
    hiding = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == "
              "'assistant' and not loop.last %}{{ m['content'].split('</think>')[-1] }}"
              "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    thinking = copy.deepcopy(record)
    first = next(m for m in thinking["messages"] if m["role"] == "assistant")
    first["content"] = "<think>hmm</think>" + first["content"]
    with pytest.raises(SampleDropped, match="does not render turn \\d+ as an extension of the "
                       "turns before it.*where the conversation ends with it the template "
                       "writes '<think>hmm</think>") as dropped:
        Preprocessor(config(chat_template=hiding), with_media=False)(thinking)
    assert dropped.value.reason == "template_mismatch"


def test_template_whose_generation_blocks_hold_the_role_header_is_refused_at_start():
    """A {% generation %} block opened before an answer's role header would train
    ``<|im_start|>assistant`` (the generation prompt the model is given at inference) with
    every answer: refused at start-up, as text trained after an answer is, never trained
    silently (``mimo-inspect report``'s loss_mask_coverage does not see role headers)."""
    header = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}"
              "<|im_start|>assistant\n{{ m['content'] }}<|im_end|>\n{% endgeneration %}"
              "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
              "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(ConfigError, match=r"its \{% generation %\} blocks hold the generation "
                       "prompt"):
        Preprocessor(config(chat_template=header), with_media=False)
    # the block opened after the header: the answer and its end of turn, as the
    # tokenizer's own template trains them
    after = header.replace("{% generation %}<|im_start|>assistant\n",
                           "<|im_start|>assistant\n{% generation %}")
    Preprocessor(config(chat_template=after), with_media=False)


def test_template_that_writes_answers_without_their_content_is_refused_at_start(
        reference_tokenizer, tmp_path):
    """A template that writes an answer's header and end but not its content (reading
    ``message['text']``, or the answer's typed parts where it is a string) would train every
    answer's end token alone: refused at once, naming the template, not left to a report."""
    turn = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
            "{% if m['role'] == 'assistant' %}ANSWER{% else %}{{ m['content'] }}{% endif %}"
            "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% endif %}")
    for answer in ("", "{{ m['text'] }}", "{% for p in m['content'] %}{{ p['text'] }}{% endfor %}"):
        with pytest.raises(ConfigError, match=r"the configured chat_template does not train an "
                           r"answer's content as the answer \(a stand-in answer \"mimo's "
                           r"stand-in answer\" trains '<\|im_end\|>'\): every answer would "
                           r"train its end of turn alone; does it read message\['text'\]"):
            Preprocessor(config(chat_template=turn.replace("ANSWER", answer)), with_media=False)
    # an answer written with text of the template's after it (here a quote): said as other
    # text trained, the piece shown
    with pytest.raises(ConfigError, match=re.escape(
            "trains '\"mimo\\'s stand-in answer\"<|im_end|>'): every answer would train "
            "other text")):
        Preprocessor(config(chat_template=turn.replace("ANSWER", "\"{{ m['content'] }}\"")),
                     with_media=False)
    # a template that writes no assistant turn at all (the first message's content alone):
    # refused as writing no answer, not left to drop every sample as not ending its turn
    with pytest.raises(ConfigError, match=r"the configured chat_template writes no answer \(a "
                       r"stand-in answer .* is not in its render of a conversation\)"):
        Preprocessor(config(chat_template="{{ messages[0]['content'] }}"), with_media=False)
    # a template that refuses one of the two stand-in conversations (a system turn; or none):
    # the other one still tells
    for refuses in ("messages[0]['role'] == 'system'", "messages[0]['role'] != 'system'"):
        with pytest.raises(ConfigError, match=r"every answer would train its end of turn alone"):
            Preprocessor(config(chat_template=f"{{% if {refuses} %}}{{{{ raise_exception("
                                "'no') }}{% endif %}" + turn.replace("ANSWER", "")),
                         with_media=False)
    # generation blocks around the end of turn alone: said so
    with pytest.raises(ConfigError, match=r"its \{% generation %\} blocks hold the answer's end "
                       "but not its content: put the content inside them"):
        Preprocessor(config(chat_template=turn.replace(
            "ANSWER", "{{ m['content'] }}").replace(
            "<|im_end|>\n{% endfor %}", "{% if m['role'] == 'assistant' %}{% generation %}"
            "<|im_end|>{% endgeneration %}{% else %}<|im_end|>{% endif %}\n{% endfor %}")),
            with_media=False)
    # end-of-turn tokens after an answer are no other text: Phi-3's end, then the EOS ending
    # the text (whatever append_eos), and ChatML's <|im_end|> where the tokenizer's EOS is a
    # base checkpoint's <|endoftext|>, appended after it (append_eos: true)
    ending = turn.replace("ANSWER", "{{ m['content'] }}").replace(
        "{% endfor %}", "{% endfor %}{% if not add_generation_prompt %}{{ eos_token }}{% endif %}")
    for append in ("auto", True, False):
        Preprocessor(config(chat_template=ending, append_eos=append), with_media=False)
    base = tmp_path / "base"
    reference_tokenizer.save_pretrained(base)
    settings = json.loads((base / "tokenizer_config.json").read_text())
    (base / "tokenizer_config.json").write_text(json.dumps(
        {**settings, "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}))
    chatml = turn.replace("ANSWER", "{{ m['content'] }}")
    for append in ("auto", True):
        Preprocessor(config(tokenizer=str(base), chat_template=chatml, append_eos=append),
                     with_media=False)
    # Phi-3's form: its turns end <|end|>, the whole text with the EOS (<|endoftext|>): each
    # earlier turn is its render less that EOS, every answer trained through its turn's end
    two = {"key": "k", "media": [], "messages": [
        {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "6."}]}
    for append in ("auto", False):
        phi = Preprocessor(config(tokenizer=str(base), chat_template=ending, append_eos=append),
                           with_media=False)
        assert trained_text(reference_tokenizer, phi(two)) == "4.<|im_end|>6.<|im_end|>", append
    # the turn's end the tokenizer's padding token (Llama-3 base with pad <|eot_id|>), or an
    # added token not marked special: no other text either
    for pad in ("<|im_end|>", "<|endoftext|>"):
        (base / "tokenizer_config.json").write_text(json.dumps(
            {**settings, "eos_token": "<|endoftext|>" if pad == "<|im_end|>" else "</s>",
             "pad_token": pad}))
        Preprocessor(config(tokenizer=str(base), chat_template=chatml), with_media=False)
    # typed parts for a user's content, a string for an answer (what llava-hf's templates
    # take, edited): the answer as given, never the parts' Python text
    mixed = turn.replace("{{ m['content'] }}", "{% for p in m['content'] %}{{ p['text'] }}"
                         "{% endfor %}").replace("ANSWER", "{{ m['content'] }}")
    record = {"key": "k", "media": [], "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4."}, {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6."}]}
    sample = Preprocessor(config(chat_template=mixed), with_media=False)(record)
    answers = [m["content"] for m in record["messages"] if m["role"] == "assistant"]
    assert trained_text(reference_tokenizer, sample) == "".join(f"{a}<|im_end|>" for a in answers)


def test_template_that_changes_contents_masks_what_it_renders(records, reference_tokenizer):
    # The template trims contents, so the conversation-shape skeleton (contents inserted
    # verbatim) does not stand for the padded samples: they must take the per-sample renders.
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}"
                "<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    preprocessor = Preprocessor(config(chat_template=template), with_media=False)
    for i, record in enumerate(records):
        record = copy.deepcopy(record)
        for message in record["messages"]:
            if message["role"] == "assistant" and i % 2:
                message["content"] = "  " + message["content"] + " \n"
        sample = preprocessor(record)
        expected = "".join(m["content"].strip() + EOT for m in record["messages"]
                           if m["role"] == "assistant")
        assert trained_text(preprocessor.text.tokenizer, sample) == expected, record["key"]


def test_contents_looking_like_skeleton_placeholders_are_plain_text(records, plain):
    preprocessor = plain
    record = text_record_with_answer_prefix(records, "\ue0000\ue001 and \ue0001\ue001")
    sample = preprocessor(record)
    assert trained_text(preprocessor.text.tokenizer, sample) == assistant_text(record)


def test_token_crossing_into_the_answer_is_a_template_mismatch(records):
    # The generation prompt ends inside a word the answer completes: "Reply" + "ing ..." is
    # one token, half prompt and half answer.
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                "{% if m['role'] == 'assistant' %}Reply{% endif %}{{ m['content'] }}<|im_end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\nReply{% endif %}")
    preprocessor = Preprocessor(config(chat_template=template), with_media=False)
    record = text_record_with_answer_prefix(records, "ing now: ")
    with pytest.raises(SampleDropped) as dropped:
        preprocessor(record)
    assert dropped.value.reason == "template_mismatch" and "crosses" in dropped.value.detail


def test_an_empty_token_inside_an_answer_is_never_trained():
    """A token covering no characters (offsets (a, a)) predicts no text of the answer,
    wherever it lies: the mask trains exactly the tokens with characters inside the span."""
    import numpy as np
    from mimo_data.preprocess.chat_render import TrainedSpan
    from mimo_data.preprocess.trained_spans import TrainedSpans
    text = "Q? Hello there"
    spans = TrainedSpans()
    spans.add(0, 0, [TrainedSpan(3, len(text), True)])
    offsets = np.array([(0, 2), (2, 3), (3, 8), (8, 8), (8, 14), (14, 14)])
    failed: dict = {}
    mask = spans.inside(offsets, text, [0], failed)
    assert not failed
    assert mask.trained.tolist() == [False, False, True, False, True, False]
    assert mask.eos_at.tolist() == [5] and mask.eos_texts.tolist() == [0]


def test_piece_cached_tokenization_gives_the_tokenizers_samples(records):
    cached = Preprocessor(config(), with_media=False)
    plain = Preprocessor(config(), with_media=False,
                         text=TextEncoder(config(), cache_tokens=False))
    assert isinstance(cached.text.backend, SegmentCachedTokenizer)
    assert not isinstance(plain.text.backend, SegmentCachedTokenizer)
    for record in records * 2:                       # the second time from the cache
        a, b = cached(record), plain(record)
        for name in ("input_ids", "labels", "loss_mask", "position_ids"):
            assert torch.equal(getattr(a, name), getattr(b, name)), (record["key"], name)


def _text_result(result):
    """What text_batch made of a record, comparable with ==."""
    if isinstance(result, SampleDropped):
        return result.reason, result.detail
    return (result.key, result.ids.tolist(), result.loss_mask.tolist(), result.token_counts,
            result.items, result.removed_turns)


def _faulty_records(records) -> list:
    """The corpus with damaged copies of its records mixed in (one fault each)."""
    text_only = text_record_with_answer_prefix(records, "")
    with_image = next(r for r in records if [m["modality"] for m in r["media"]] == ["image"])
    faults = {
        "literal": lambda r: r["messages"][0].update(content="<|image_pad|> " +
                                                     r["messages"][0]["content"]),
        "extra_item": lambda r: r["media"].append(dict(r["media"][0], member="x.jpg")),
        "no_items": lambda r: r["media"].clear(),
        "x_prefix": lambda r: r["messages"][-1].update(content="x" + r["messages"][-1]["content"]),
        "blank_lines": lambda r: r["messages"][-1].update(content="\n\n" +
                                                          r["messages"][-1]["content"]),
        "long": lambda r: r.update(messages=r["messages"] * 40, media=r["media"] * 40),
        "prompt_only": lambda r: r.update(messages=r["messages"][:1]),
        "no_messages": lambda r: r.update(messages=[]),
        "bad_role": lambda r: r["messages"][0].update(role="narrator"),
        "bad_width": lambda r: r["media"][0].update(width=[1]),
        "bad_shape": lambda r: r["media"][0].update(width=1),
    }
    mixed = []
    for n, (name, damage) in enumerate(faults.items()):
        needs_image = name in ("extra_item", "no_items", "bad_width", "bad_shape")
        record = copy.deepcopy(with_image if needs_image else [text_only, with_image][n % 2])
        record["key"] = f"fault-{name}"
        damage(record)
        mixed += [record, *records[n::len(faults)]]
    return mixed + [None, "not a record"]


@pytest.mark.parametrize("changes", [{}, {"mode": "caption"}, {"seq_length": 200,
                                                              "length_policy": "truncate_turns"},
                                     {"chat_template": "generation"}], ids=str)
def test_a_batch_of_records_gives_each_record_its_own_result(records, plain, changes):
    """text_batch on a batch mixing good and faulty records equals each record alone (through
    the plain tokenizer): no fault, length policy or cache state leaks into another record."""
    if changes.get("chat_template") == "generation":
        plain_template = plain.text.template
        changes = {"chat_template": plain_template.replace(
            "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
            "'\n'}}", "{% if message['role'] == 'assistant' %}{{'<|im_start|>assistant\n'}}"
            "{% generation %}{{message['content'] + '<|im_end|>'}}{% endgeneration %}"
            "{{'\n'}}{% else %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
            " + '<|im_end|>' + '\n'}}{% endif %}")}
        assert "generation" in changes["chat_template"]
    batched = Preprocessor(config(**changes), with_media=False)
    alone = Preprocessor(config(**changes), with_media=False,
                         text=TextEncoder(config(**changes), cache_tokens=False))
    mixed = _faulty_records(records)
    expected = [_text_result(alone.text_batch([record])[0]) for record in mixed]
    assert len({r[0] for r in expected if len(r) == 2}) >= 5     # several drop reasons
    for batch in (mixed, mixed[::-1]):                           # cold and warm cache
        got = [_text_result(result) for result in batched.text_batch(batch)]
        assert got == (expected if batch is mixed else expected[::-1])


@pytest.mark.parametrize("setting", ["padding", "truncation"])
@pytest.mark.parametrize("cache_tokens", [True, False])
def test_tokenizer_saved_with_padding_or_truncation_on_tokenizes_texts_whole(
        records, plain, tmp_path, setting, cache_tokens):
    """A tokenizer.json saved with padding or truncation on (transformers keeps both) must
    not pad a batch of texts to its longest or cut a conversation at max_length."""
    import json
    import shutil

    from tokenizers import Tokenizer

    from mimo_data.preprocess.segment_tokenizer import encode_texts, unsupported_reason

    directory = tmp_path / "tokenizer"
    shutil.copytree(TOKENIZER, directory)
    spec = json.loads((directory / "tokenizer.json").read_text())
    spec[setting] = ({"strategy": "BatchLongest", "direction": "Right", "pad_to_multiple_of": None,
                      "pad_id": 2, "pad_type_id": 0, "pad_token": EOT} if setting == "padding"
                     else {"direction": "Right", "max_length": 64, "strategy": "LongestFirst",
                           "stride": 0})
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    changed = dataclasses.replace(config(), tokenizer=str(directory))
    preprocessor = Preprocessor(changed, with_media=False,
                                text=TextEncoder(changed, cache_tokens=cache_tokens))
    assert isinstance(preprocessor.text.backend, SegmentCachedTokenizer) == cache_tokens
    reference = plain
    assert ([_text_result(r) for r in preprocessor.text_batch(records)] ==
            [_text_result(r) for r in reference.text_batch(records)])
    # The piece cache refuses such a tokenizer, the plain batch call a padding one.
    backend = Tokenizer.from_str(json.dumps(spec))
    assert {"padding": "pads", "truncation": "truncates"}[setting] in unsupported_reason(backend)
    if setting == "padding":
        with pytest.raises(ValueError, match="pads"):
            encode_texts(backend, ["a", "longer text"])


@pytest.mark.parametrize("name, delimiters", [
    ("Qwen--Qwen2-VL-2B-Instruct", {"<|im_start|>", "<|im_end|>", "<|endoftext|>",
                                    "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                                    "<|video_pad|>"}),
    ("llava-hf--llava-1.5-7b-hf", {"<s>", "</s>", "<unk>", "<pad>"})])
def test_delimiter_tokens_are_the_templates_and_the_tokenizers_own(name, delimiters):
    """What a record's text may not type: the special tokens the published chat template
    writes and the BOS / EOS / pad / unknown tokens; Qwen-VL's grounding tokens
    (``<|box_start|>`` ...) are data, LLaVA's ``<image>`` is mimo's marker."""
    from transformers import AutoTokenizer

    from mimo_data.preprocess.typed_tokens import TypedTokens, delimiter_tokens

    tokenizer = AutoTokenizer.from_pretrained(REPO / "assets" / "models" / "published" / name)
    found = delimiter_tokens(tokenizer, tokenizer.chat_template)
    assert found == delimiters
    typed = TypedTokens(found)
    assert typed.error([("m", "<|object_ref_start|>a cat<|object_ref_end|><|box_start|>(1,2),"
                              "(3,4)<|box_end|> <image>")]) is None
    for token in delimiters:
        error = typed.error([("m", "ok"), ("n", f"a {token}b")])
        assert error is not None and error.detail.startswith(f"n holds {token!r}"), token


def test_a_process_loads_a_tokenizer_folder_once_until_its_files_change(tmp_path):
    """The preprocessing's tokenizer is loaded once per process and folder: the same object
    while the folder's files are the same, a new one with the new files as soon as one changes
    (a template rewritten, same size; one of transformers' named templates added); a config
    whose modality token the tokenizer lacks gets a tokenizer of its own with it added, the
    shared one left as its files say; ``shared=False`` (the export, which sets its template)
    is always a new one."""
    import shutil

    from mimo_data.preprocess.tokenizer_loading import load_tokenizer, shared_tokenizer

    folder = tmp_path / "tok"
    shutil.copytree(TOKENIZER, folder)
    first = load_tokenizer(config(tokenizer=str(folder)))
    assert load_tokenizer(config(tokenizer=str(folder))) is first
    assert load_tokenizer(config(tokenizer=str(folder)), shared=False) is not first
    # the same files elsewhere are another folder's tokenizer (a path in messages and saves)
    assert load_tokenizer(config(tokenizer=TOKENIZER)) is not first

    template = folder / "chat_template.jinja"
    template.write_text("{{ 'A' }}")
    changed = load_tokenizer(config(tokenizer=str(folder)))
    assert changed is not first and changed.chat_template == "{{ 'A' }}"
    template.write_text("{{ 'B' }}")                    # the same size, within a clock tick
    assert load_tokenizer(config(tokenizer=str(folder))).chat_template == "{{ 'B' }}"
    (folder / "additional_chat_templates").mkdir()      # transformers' named templates
    (folder / "additional_chat_templates" / "tool_use.jinja").write_text("{{ 'T' }}")
    assert load_tokenizer(config(tokenizer=str(folder))).chat_template == {
        "default": "{{ 'B' }}", "tool_use": "{{ 'T' }}"}

    base = config(tokenizer=str(folder))
    image = dataclasses.replace(base.modalities["image"], token="<|mimo_new_image|>")
    added = load_tokenizer(dataclasses.replace(base, modalities={**base.modalities,
                                                                 "image": image}))
    files = shared_tokenizer(str(folder))               # the folder's, no token added
    assert added is not files and added.convert_tokens_to_ids("<|mimo_new_image|>") >= \
        len(files)
    assert files.backend_tokenizer.token_to_id("<|mimo_new_image|>") is None
    assert load_tokenizer(base) is not added and \
        load_tokenizer(base).backend_tokenizer.token_to_id("<|mimo_new_image|>") is None


@pytest.mark.parametrize("name", ["smollm2", "Qwen--Qwen3.5-4B", "llava-hf--llava-1.5-7b-hf"])
def test_a_tokenizer_of_its_own_encodes_as_the_loaded_one(name):
    """TextEncoder's private tokenizer (the loaded one's model shared, its pipeline and added
    tokens given again) encodes and decodes as the loaded tokenizer, special tokens and
    normalization included, and takes added tokens without changing it; from a tokenizer.json
    saved with padding on, it pads nothing; from one splitting special tokens, it splits
    none."""
    import json

    from tokenizers import AddedToken, Tokenizer

    from mimo_data.preprocess.tokenizer_loading import tokenizer_of_its_own

    source = REPO / "assets" / ("tokenizer" if name == "smollm2" else "models/published") / name
    texts = ["<|im_start|>user\nWhat's in <b>this</b>? 漢字 🙂 cafe\u0301<|im_end|>\n",
             "  x\n\n\ty ", "<|endoftext|> <s> </s> [INST] 12345 e\u0301"]

    def encodings(tokenizer):
        return [(e.ids, e.offsets, e.tokens) for special in (False, True)
                for e in tokenizer.encode_batch(texts, add_special_tokens=special)]

    loaded = AutoTokenizer.from_pretrained(source).backend_tokenizer
    size = loaded.get_vocab_size(with_added_tokens=True)
    own = tokenizer_of_its_own(loaded)
    assert encodings(own) == encodings(loaded)
    ids = loaded.encode(texts[0]).ids
    assert own.decode(ids) == loaded.decode(ids) and own.decode(ids, False) == loaded.decode(
        ids, False)
    own.add_special_tokens([AddedToken("<marker>", special=True, normalized=False)])
    assert own.token_to_id("<marker>") == size and loaded.token_to_id("<marker>") is None
    assert loaded.get_vocab_size(with_added_tokens=True) == size
    # transformers' split_special_tokens (a tokenizer's setting, or a call's, left set) spells
    # special tokens out; the template's and the markers' stay tokens here
    loaded.encode_special_tokens = True
    own = tokenizer_of_its_own(loaded)
    assert own.encode_special_tokens is False and encodings(own) != encodings(loaded)
    loaded.encode_special_tokens = False
    assert encodings(own) == encodings(loaded)
    spec = json.loads((REPO / "assets" / "tokenizer" / "smollm2" / "tokenizer.json").read_text())
    spec["padding"] = {"strategy": "BatchLongest", "direction": "Right", "pad_id": 2,
                       "pad_to_multiple_of": None, "pad_type_id": 0, "pad_token": EOT}
    padding = Tokenizer.from_str(json.dumps(spec))
    own = tokenizer_of_its_own(padding)
    assert own.padding is None and encodings(own) != encodings(padding)
    padding.no_padding()
    assert encodings(own) == encodings(padding)


def test_special_tokens_are_added_and_the_vocab_size_reported(reference_tokenizer):
    text = TextEncoder(config())
    assert text.vocab_size == len(reference_tokenizer) + 2
    assert set(text.modality_token_ids.values()) == {len(reference_tokenizer),
                                                     len(reference_tokenizer) + 1}


def test_collate_mixes_text_only_and_media_samples(dataset, records, with_media):
    preprocessor = with_media
    collate = Collator(preprocessor)
    picks = [next(i for i, r in enumerate(records) if not r["media"]),
             next(i for i, r in enumerate(records)
                  if sum(m["modality"] == "image" for m in r["media"]) >= 2),
             next(i for i, r in enumerate(records)
                  if {m["modality"] for m in r["media"]} == {"image", "audio"})]
    samples = [preprocessor(records[i], dataset.media(i, records[i])) for i in picks]
    batch, metadata = collate(samples)
    seq = preprocessor.config.seq_length
    for name in ("input_ids", "labels", "loss_mask", "position_ids", "attention_mask"):
        assert batch[name].shape == (3, seq), name
    assert metadata["keys"] == [records[i]["key"] for i in picks]
    assert set(batch) == {"input_ids", "labels", "loss_mask", "position_ids", "attention_mask",
                          "modality_inputs", "packing_kwargs"}
    images = batch["modality_inputs"]["image"]["image"]
    expected_grids = torch.cat([s.encoder_inputs["image"]["image_grid_thw"]
                                for s in samples if "image" in s.encoder_inputs])
    assert torch.equal(images["image_grid_thw"], expected_grids)
    assert batch["attention_mask"].sum(1).tolist() == [len(s.input_ids) for s in samples]
    assert (batch["labels"][~batch["attention_mask"]] == -100).all()
    # A batch whose counts disagree with its placeholders is refused.
    metadata["token_counts"]["image"][1][0] += 1
    with pytest.raises(BatchError):
        collate.check(batch, metadata)


def test_fixed_resolution_images_have_constant_token_counts(dataset, records):
    image = ImageConfig(policy="fixed", image_size=224, patch_size=14)
    cfg = config(modalities={**config().modalities, "image": image})
    preprocessor = Preprocessor(cfg)
    position = next(i for i, r in enumerate(records)
                    if sum(m["modality"] == "image" for m in r["media"]) >= 2)
    sample = preprocessor(records[position], dataset.media(position, records[position]))
    assert sample.token_counts["image"] == [(224 // 14) ** 2] * len(sample.token_counts["image"])
    assert sample.encoder_inputs["image"]["pixel_values"].shape[1:] == (3, 224, 224)
    Collator(preprocessor)([sample])


def test_answer_starting_with_blank_lines_is_kept_with_only_the_blank_lines_untrained(records,
                                                                                      plain):
    preprocessor = plain
    record = text_record_with_answer_prefix(records, "\n\n")
    sample = preprocessor(record)
    trained = trained_text(preprocessor.text.tokenizer, sample)
    assert trained.lstrip("\n") == assistant_text(record).lstrip("\n")
    assert trained.endswith(EOT)


def test_caption_sample_ending_with_media_is_dropped_not_cut(records):
    preprocessor = Preprocessor(config(mode="caption"), with_media=False)
    record = copy.deepcopy(next(r for r in records
                                if [m["modality"] for m in r["media"]] == ["image"]))
    image_turn = {"role": "user", "content": "<image>"}
    record["messages"].append(image_turn)
    record["media"].append(copy.deepcopy(record["media"][0]))
    record["media"][1]["member"] = "img1.jpg"
    with pytest.raises(SampleDropped) as dropped:
        preprocessor(record)
    assert dropped.value.reason == "ends_with_media"


@pytest.mark.parametrize("damage", ["no_messages", "bad_role", "item_without_size"])
def test_malformed_records_are_dropped_with_a_reason(records, plain, damage):
    preprocessor = plain
    record = copy.deepcopy(next(r for r in records if r["media"]))
    if damage == "no_messages":
        del record["messages"]
    elif damage == "bad_role":
        record["messages"][0]["role"] = "narrator"
    else:
        del record["media"][0]["frames" if record["media"][0]["modality"] == "audio" else "width"]
    with pytest.raises(SampleDropped) as dropped:
        preprocessor(record)
    assert dropped.value.reason == "malformed_record"


def test_an_encoder_rank_decodes_only_its_own_modality(dataset, records, with_media):
    position = next(i for i, r in enumerate(records)
                    if {m["modality"] for m in r["media"]} == {"image", "audio"})
    record = records[position]
    media = dataset.media(position, record)
    audio = next(m["member"] for m in record["media"] if m["modality"] == "audio")
    media[audio] = b"not audio at all"          # an images rank must not even look at it
    images_only = Preprocessor(config(), with_media={"image"})
    sample = images_only(record, media)
    assert set(sample.encoder_inputs) == {"image"}
    assert sample.token_counts["audio"]         # the text still holds the audio placeholders
    with pytest.raises(SampleDropped):
        with_media(record, media)


def test_preprocessor_pickles_as_its_config_and_modalities(records, plain):
    import pickle
    original = Preprocessor(config(), with_media={"image"})
    copy_ = pickle.loads(pickle.dumps(original))
    assert copy_.media_modalities == {"image"} and copy_.config == original.config
    metadata_only = plain
    unpickled = pickle.loads(pickle.dumps(metadata_only))
    for record in records[:10]:
        a, b = metadata_only(record), unpickled(record)
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)


def test_modalities_missing_means_defaults_and_empty_means_text_only():
    assert set(PreprocessConfig.from_dict({"tokenizer": TOKENIZER}).modalities) == \
        {"image", "audio"}
    assert PreprocessConfig.from_dict({"tokenizer": TOKENIZER, "modalities": {}}).modalities \
        == {}
    assert set(PreprocessConfig.from_dict({"tokenizer": TOKENIZER,
                                           "modalities": {"audio": {}}}).modalities) == {"audio"}


def test_a_model_given_for_the_preprocessing_config_says_how_to_make_one(tmp_path):
    """A model's folder, or its config.json, given where the preprocessing YAML goes: said to
    be that, with the command that derives the YAML from it."""
    from mimo_data.errors import ConfigError
    model = REPO / "assets" / "models" / "tiny-qwen2-vl"
    for given, what in ((model, "is a folder (a model's?)"),
                        (model / "config.json", "is a transformers model config")):
        with pytest.raises(ConfigError) as refused:
            PreprocessConfig.from_yaml(str(given))
        assert f"{given} {what}" in str(refused.value) and str(refused.value).endswith(
            "`mimo-train --preprocessing-for MODEL_DIR > preprocess.yaml`")


def test_chat_template_takes_a_template_or_one_the_tokenizer_names(tmp_path):
    """``chat_template``: Jinja, a file, or the name of one of the tokenizer's templates
    (``additional_chat_templates/``); another tool's template name (LLaMA-Factory's
    ``template: qwen2_vl``) is refused, naming the tokenizer's (it was rendered as the text)."""
    from mimo_data.errors import ConfigError
    from mimo_data.preprocess.tokenizer_loading import chat_template, load_tokenizer
    shutil.copytree(REPO / "assets" / "tokenizer" / "smollm2", tmp_path / "tok")
    (tmp_path / "tok" / "additional_chat_templates").mkdir()
    plain = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (tmp_path / "tok" / "additional_chat_templates" / "plain.jinja").write_text(plain)
    config = PreprocessConfig.from_dict({"tokenizer": str(tmp_path / "tok"),
                                         "chat_template": "plain"})
    assert chat_template(config, load_tokenizer(config)) == plain
    wrong = dataclasses.replace(config, chat_template="qwen2_vl")
    with pytest.raises(ConfigError, match=r"chat_template is 'qwen2_vl', neither Jinja \(no "
                       r"\{ in it\), a template file, nor a template the tokenizer names "
                       r"\(default, plain\)"):
        chat_template(wrong, load_tokenizer(wrong))
    # a template Jinja cannot read: a config error (exit 2) naming it, not a traceback
    from mimo_data.preprocess.chat_render import ChatRenderer
    broken = dataclasses.replace(config, chat_template=plain[:-len("{% endfor %}")] + "}")
    with pytest.raises(ConfigError, match=r"^the configured chat_template is not a template "
                       r"Jinja reads \(TemplateSyntaxError line 1: .*\): mend it"):
        ChatRenderer(broken, load_tokenizer(broken))
    # the tokenizer's own template broken (no chat_template configured): named as the
    # tokenizer's, not as a configured one
    shutil.copytree(tmp_path / "tok", tmp_path / "broken-tok")
    (tmp_path / "broken-tok" / "chat_template.jinja").write_text(broken.chat_template)
    own = PreprocessConfig.from_dict({"tokenizer": str(tmp_path / "broken-tok")})
    with pytest.raises(ConfigError, match=rf"^tokenizer '{re.escape(str(tmp_path))}/broken-tok'"
                       r"'s chat template is not a template Jinja reads \(TemplateSyntaxError"
                       r".*branch\), or give one as chat_template$"):
        ChatRenderer(own, load_tokenizer(own))


def test_a_misspelt_or_missing_preprocessing_yaml_is_named_with_the_key_it_meant(tmp_path):
    """A YAML's misspelt key: its file, the key, and the known key it most likely meant (none
    for a key close to nothing); a YAML that is not there: the file, not a raw OSError; an
    empty one, a list, a binary file: said, with how to make one."""
    from mimo_data.errors import ConfigError
    text = (REPO / "configs" / "preprocess.yaml").read_text()
    given = tmp_path / "preprocess.yaml"
    for old, new, said in (
            ("seq_length:", "seq_lenght:", "unknown top-level key(s) seq_lenght "
             "(did you mean seq_length?); known: append_eos, "),
            ("max_pixels:", "max_pixel:", "modalities.image: unknown key(s) max_pixel "
             "(did you mean max_pixels?)"),
            ("seq_length:", "zzz: 1\nseq_length:", "unknown top-level key(s) zzz; known")):
        assert old in text
        given.write_text(text.replace(old, new, 1).replace(
            "../assets", str(REPO / "assets")))
        with pytest.raises(ConfigError) as refused:
            PreprocessConfig.from_yaml(str(given))
        assert str(refused.value).startswith(f"{given}: {said}"), str(refused.value)
    with pytest.raises(ConfigError, match=f"cannot read the preprocessing config "
                       f"{tmp_path}/none.yaml: No such file or directory"):
        PreprocessConfig.from_yaml(str(tmp_path / "none.yaml"))
    (tmp_path / "empty.yaml").write_text("")      # a failed `--preprocessing-for M > it`
    with pytest.raises(ConfigError, match=f"{tmp_path}/empty.yaml holds no setting \\(an empty "
                       "file\\): a preprocessing config YAML is made from a model's folder"):
        PreprocessConfig.from_yaml(str(tmp_path / "empty.yaml"))
    (tmp_path / "list.yaml").write_text("- tokenizer: x\n")
    (tmp_path / "binary.yaml").write_bytes(b"\xff\xfe\x00binary")
    for name, said in (("list.yaml", "holds a list, not the mapping of settings"),
                       ("binary.yaml", "is not a text file, so no YAML")):
        with pytest.raises(ConfigError, match=f"{tmp_path}/{name} {said}"):
            PreprocessConfig.from_yaml(str(tmp_path / name))


@pytest.mark.parametrize("where, value, said", [
    ("seq_length", "1024", "seq_length is '1024' (str): it must be a whole number (write 1024, "
     "without quotes)"),
    ("seq_length", "1e6", "seq_length is '1e6' (str): it must be a whole number (write 1000000: "
     "YAML reads 1e6 as text)"),
    ("seq_length", "1.0e+6", "seq_length is '1.0e+6' (str): it must be a whole number (write "
     "1000000, without quotes)"),
    ("seq_length", 1024.0,
     "seq_length is 1024.0 (float): it must be a whole number (write 1024)"),
    ("audio.max_duration", "nan", "modalities.audio.max_duration is 'nan' (str): it must be a "
     "number"),
    ("audio.max_duration", float("inf"), "modalities.audio.max_duration is inf (float): it must "
     "be a number"),                               # YAML's .inf
    ("image.merge_size", 2.5,
     "modalities.image.merge_size is 2.5 (float): it must be a whole number"),
    ("image.max_pixels", "200704",
     "modalities.image.max_pixels is '200704' (str): it must be a whole number (write 200704, "
     "without quotes)"),
    ("image.token", ["<|image_pad|>"],
     "modalities.image.token is ['<|image_pad|>'] (list): it must be text"),
    ("image.wrap", "<|vision_start|>", "modalities.image.wrap is '<|vision_start|>' (str): it "
     "must be a list, e.g. [<|vision_start|>, ...]"),
    ("image.crop", "false", "modalities.image.crop is 'false' (str): it must be true or false"),
    ("tokenizer", None, "tokenizer is missing: give the model's tokenizer (a local folder or a "
     "hub name)"),
    # sizes and rates of 0 or less: named here, not a division by zero in preprocessing
    ("image.merge_size", 0, "modalities.image.merge_size is 0: it must be at least 1"),
    ("image.patch_size", -14, "modalities.image.patch_size is -14: it must be at least 1"),
    ("audio.hop_length", 0, "modalities.audio.hop_length is 0: it must be at least 1"),
    ("audio.sample_rate", 0, "modalities.audio.sample_rate is 0: it must be at least 1"),
    ("audio.reductions", [0, 2], "modalities.audio.reductions is (0, 2): each must be at "
     "least 1"),
    ("audio.max_duration", 0.0, "modalities.audio.max_duration is 0.0: it must be above 0"),
    ("audio.max_duration", 0, "modalities.audio.max_duration is 0: it must be above 0"),
    ("video.merge_size", 0, "modalities.video.merge_size is 0: it must be at least 1"),
])
def test_a_value_of_the_wrong_type_is_refused_naming_its_key(where, value, said):
    """A preprocessing config's value of the wrong type is a ConfigError naming the key, never
    a traceback from the code that uses it or token counts from a ``merge_size: 2.5``; a
    number's text is a float (``max_duration: 1e1``), a YAML list a tuple."""
    from mimo_data.errors import ConfigError
    data: dict = {"tokenizer": TOKENIZER, "modalities": {"image": {}, "audio": {}}}
    section, _, key = where.rpartition(".")
    target = data["modalities"].setdefault(section, {}) if section else data
    if value is None:
        del target[key]
    else:
        target[key] = value
    with pytest.raises(ConfigError) as refused:
        PreprocessConfig.from_dict(data)
    assert str(refused.value) == said
    taken = PreprocessConfig.from_dict({"tokenizer": TOKENIZER, "captions": None, "modalities": {
        "audio": {"max_duration": "1e1", "reductions": [2, 2], "wrap": None}}})
    audio = taken.modalities["audio"]       # (a section's key alone: its defaults)
    assert audio.max_duration == 10.0 and audio.reductions == (2, 2) and audio.wrap == ()
    assert taken.captions == PreprocessConfig(TOKENIZER).captions
