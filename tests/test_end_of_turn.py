"""``append_eos``: the EOS after each answer of a template that writes no end-of-turn token.

On the published llava-1.5 replica (its template follows an answer with a space and the next
``USER:``), every answer is followed by a trained ``</s>``, as LLaVA's own training does (its
``v1`` conversation's ``sep2="</s>"``): the expected ids are transformers' (the processor's
template, the tokenizer's tokens) with ``</s>`` put right after the token that ends each answer,
found from the tokenizer's offsets. Templates that end their turns (ChatML's ``<|im_end|>``:
SmolLM2, Qwen2-VL) get no extra EOS. ``mimo-inspect report`` shows the setting and counts the
appended tokens; ``mimo-generate`` stops at the EOS.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import yaml

from mimo_data.errors import ConfigError
from mimo_data.preprocess.chat_tokens import ItemTokens, TextEncoder, TextError
from mimo_data.preprocess.config import PreprocessConfig

from conftest import MODELS, REPO, build_dataset

LLAVA_1_5 = MODELS / "published" / "llava-hf--llava-1.5-7b-hf"
QWEN2_VL = MODELS / "published" / "Qwen--Qwen2-VL-2B-Instruct"
SMOLLM2 = REPO / "assets" / "tokenizer" / "smollm2"
ANSWERS = ["A cat, lying down.", "It is asleep.", "Grey and white."]
TURNS = [("system", "You describe pictures in a few words."),
         ("user", "<image>\nWhat animal is this?"), ("assistant", ANSWERS[0]),
         ("user", "What is it doing?"), ("assistant", ANSWERS[1]),
         ("user", "Its colours?"), ("assistant", ANSWERS[2])]
IMAGE_TOKENS = 3
# a template without {% generation %} blocks that writes nothing after an answer but a newline
PLAIN_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}assistant:{% endif %}")


def _encoder(tokenizer, **changes) -> TextEncoder:
    image = {"token": "<image>"} if tokenizer == LLAVA_1_5 else {}
    return TextEncoder(PreprocessConfig.from_dict({
        "tokenizer": str(tokenizer), "modalities": {"image": image}, **changes}),
        cache_tokens=False)


def _messages(turns=TURNS) -> list[dict]:
    return [{"role": role, "content": content} for role, content in turns]


def _reference_text(tokenizer_dir, turns=TURNS) -> str:
    """transformers' render: the processor's template (llava-hf keeps it beside the processor)
    on typed contents, or the tokenizer's on strings."""
    if tokenizer_dir == LLAVA_1_5:
        from transformers import AutoProcessor
        processor = AutoProcessor.from_pretrained(tokenizer_dir)
        typed = [{"role": role, "content": [
            *({"type": "image"} for _ in range(content.count("<image>"))),
            {"type": "text", "text": content.replace("<image>", "").strip()}]}
            for role, content in turns]
        return processor.apply_chat_template(typed, tokenize=False)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tokenizer_dir).apply_chat_template(
        _messages(turns), tokenize=False)


def _reference_ids(encoder: TextEncoder, text: str, eos_after: list[str]) -> list[int]:
    """The tokenizer's ids of ``text`` (its special tokens added as it adds them), each image
    token repeated IMAGE_TOKENS times, and the EOS after the token that ends each answer of
    ``eos_after`` (found in order, by the tokenizer's character offsets)."""
    tokenizer = encoder.tokenizer
    encoding = tokenizer(text, return_offsets_mapping=True)
    ids, ends = encoding["input_ids"], [end for _, end in encoding["offset_mapping"]]
    cursor, cuts = 0, []
    for answer in eos_after:
        cursor = text.index(answer, cursor) + len(answer)
        cuts.append(ends.index(cursor) + 1)
    for cut in reversed(cuts):
        ids.insert(cut, tokenizer.eos_token_id)
    image = tokenizer.convert_tokens_to_ids("<image>")
    return [i for token in ids for i in ([token] * IMAGE_TOKENS if token == image else [token])]


def _trained_runs(encoder: TextEncoder, ids: np.ndarray, mask: np.ndarray) -> list[list[int]]:
    runs = np.split(np.arange(len(mask)), np.flatnonzero(np.diff(mask.astype(int))) + 1)
    return [ids[run].tolist() for run in runs if mask[run[0]]]


# ---------------------------------------------------------------------------- llava-1.5

def test_llava_1_5_answers_are_each_followed_by_a_trained_eos():
    encoder = _encoder(LLAVA_1_5)
    assert encoder.eos_appending.on and encoder.eos_appending.token == "</s>"
    encoded = encoder.encode(_messages(), [ItemTokens("image", IMAGE_TOKENS)])
    eos = encoder.tokenizer.eos_token_id
    assert encoded.ids.tolist() == _reference_ids(encoder, _reference_text(LLAVA_1_5), ANSWERS)
    at = np.flatnonzero(encoded.ids == eos)
    assert len(at) == len(ANSWERS) and encoded.loss_mask[at].all()      # one per answer
    runs = _trained_runs(encoder, encoded.ids, encoded.loss_mask)
    assert [run[-1] for run in runs] == [eos] * len(ANSWERS)
    # the token before each EOS is its answer's last: each run is the answer, then the EOS
    assert [encoder.tokenizer.decode(run[:-1]).strip() for run in runs] == ANSWERS


def test_llava_1_5_with_append_eos_false_or_true():
    """false: the published template's tokens as they are, nothing after an answer trained;
    true: the same as auto."""
    messages, items = _messages(), [ItemTokens("image", IMAGE_TOKENS)]
    off = _encoder(LLAVA_1_5, append_eos=False)
    assert not off.eos_appending.on
    encoded = off.encode(messages, items)
    assert encoded.ids.tolist() == _reference_ids(off, _reference_text(LLAVA_1_5), [])
    assert off.tokenizer.eos_token_id not in encoded.ids
    assert [off.tokenizer.decode(run).strip() for run in
            _trained_runs(off, encoded.ids, encoded.loss_mask)] == ANSWERS
    on, auto = _encoder(LLAVA_1_5, append_eos=True), _encoder(LLAVA_1_5)
    assert on.eos_appending.on
    assert np.array_equal(on.encode(messages, items).ids, auto.encode(messages, items).ids)


def test_an_empty_answer_beside_one_out_of_the_loss_is_named():
    """llava-1.5's template writes no {% generation %} block for an empty answer (no typed
    part): with an answer of weight 0 in the conversation the spans cannot be matched to the
    answers, and the empty answer is named as why, not the template's blocks."""
    from mimo_data.preprocess.chat_render import TextError
    turns = [("user", "Q"), ("assistant", ""), ("user", "Q2"), ("assistant", "B"),
             ("user", "Q3"), ("assistant", "C")]
    messages = _messages(turns)
    messages[3]["weight"] = 0
    with pytest.raises(TextError, match=r"writes 2 answer span\(s\) for 3 answers, so the "
                       "answers with weight 0 cannot be left out of the loss: answer 1 is "
                       "empty, and the template writes no {% generation %} block for an empty "
                       "answer: give it text, or leave the turn out") as error:
        _encoder(LLAVA_1_5).encode(messages, [])
    assert error.value.reason == "template_mismatch"


def test_the_preprocessor_counts_the_appended_eos():
    """Token counts (what the token table records) include one EOS per answer."""
    from mimo_data.preprocess.preprocessor import Preprocessor
    record = {"key": "k", "messages": _messages(TURNS[:1] + [
        ("user", "What is a tar file?"), ("assistant", ANSWERS[0]),
        ("user", "And a zip file?"), ("assistant", ANSWERS[1])]), "media": []}
    counts = {}
    for setting in ("auto", False):
        config = PreprocessConfig.from_dict({"tokenizer": str(LLAVA_1_5), "modalities": {},
                                             "append_eos": setting})
        sample = Preprocessor(config, with_media=False).text_batch([record])[0]
        counts[setting] = (len(sample.ids) - 1, int(sample.loss_mask.sum()))
    assert counts["auto"] == (counts[False][0] + 2, counts[False][1] + 2)


LLAVA_INTERLEAVE = MODELS / "published" / "llava-hf--llava-interleave-qwen-0.5b-hf"


@pytest.mark.parametrize("tokenizer", [LLAVA_1_5, LLAVA_INTERLEAVE, QWEN2_VL],
                         ids=["llava-1.5", "llava-interleave", "qwen2-vl"])
@pytest.mark.parametrize("answer", ["3", "A cat."])
def test_the_first_token_after_the_generation_prompt_is_trained(tokenizer, answer):
    """What a completion-only recipe trains: every token after the generation prompt's (the
    template's render of the turns before the answer with ``add_generation_prompt``, by the
    tokenizer's own encoding). That first token is what the model writes first at inference:
    LLaVA-1.5's space after ``ASSISTANT:`` where it is a token of its own (before a digit),
    llava-interleave's newline that opens its ``{% generation %}`` block (the replica's
    tokenizer keeps it a token of its own; Qwen's, which the published one is, merges it with
    the prompt's newline into a token left untrained)."""
    from transformers import AutoProcessor
    processor = AutoProcessor.from_pretrained(tokenizer)
    turns = [("user", "How many cats?"), ("assistant", answer), ("user", "And dogs?"),
             ("assistant", "None.")]
    typed = [{"role": role, "content": [{"type": "text", "text": text}]} for role, text in turns]
    # mimo's ids without the EOS it appends, and which of them are trained
    encoder = _encoder(tokenizer, modalities={})
    encoded = encoder.encode(_messages(turns), [])
    ids, mask = encoded.ids, encoded.loss_mask.astype(bool)
    if encoder.eos_appending.on:         # LLaVA-1.5: the </s> mimo appends after each answer
        kept = ids != encoder.tokenizer.eos_token_id
        ids, mask = ids[kept], mask[kept]
    for turn in (1, 3):
        prompt = processor.apply_chat_template(typed[:turn], add_generation_prompt=True,
                                               tokenize=True)
        prompt = prompt["input_ids"] if isinstance(prompt, dict) else prompt
        prompt = prompt[0] if isinstance(prompt[0], list) else prompt
        assert ids[:len(prompt)].tolist() == prompt
        assert mask[len(prompt)] and not mask[len(prompt) - 1]


@pytest.mark.parametrize("answer", ["    return x", "Roses\nare red.\n"])
def test_an_answers_own_whitespace_stays_in_typed_parts(answer):
    """llava-interleave's template takes typed parts: an answer with no marker beside it
    keeps its indentation and its last newline, as transformers renders the typed part (mimo
    stripped every part)."""
    from transformers import AutoProcessor
    processor = AutoProcessor.from_pretrained(LLAVA_INTERLEAVE)
    turns = [("user", "Show me."), ("assistant", answer)]
    typed = [{"role": role, "content": [{"type": "text", "text": text}]} for role, text in turns]
    encoded = _encoder(LLAVA_INTERLEAVE, modalities={}).encode(_messages(turns), [])
    reference = processor.apply_chat_template(typed, tokenize=True)
    reference = reference["input_ids"] if isinstance(reference, dict) else reference
    reference = reference[0] if isinstance(reference[0], list) else reference
    assert encoded.ids.tolist() == reference
    trained = processor.tokenizer.decode(encoded.ids[encoded.loss_mask.astype(bool)])
    assert answer.strip() in trained, trained


# -------------------------------------------------------- templates that end their turns

@pytest.mark.parametrize("tokenizer", [SMOLLM2, QWEN2_VL], ids=["smollm2", "qwen2-vl"])
@pytest.mark.parametrize("setting", ["auto", True])
def test_a_template_ending_its_turns_gets_no_extra_eos(tokenizer, setting):
    """ChatML ends every turn with <|im_end|>, the tokenizer's EOS: the ids are the template's
    (one EOS per message), each answer trained through its <|im_end|>."""
    turns = [(role, content.replace("<image>\n", "")) for role, content in TURNS]
    encoder = _encoder(tokenizer, append_eos=setting)
    assert encoder.eos_appending.on is (setting is True)
    encoded = encoder.encode(_messages(turns), [])
    assert encoded.ids.tolist() == _reference_ids(encoder, _reference_text(tokenizer, turns), [])
    eos = encoder.tokenizer.eos_token_id
    assert int((encoded.ids == eos).sum()) == len(turns)
    runs = _trained_runs(encoder, encoded.ids, encoded.loss_mask)
    assert [encoder.tokenizer.decode(run) for run in runs] == [
        answer + "<|im_end|>" for answer in ANSWERS]
    if setting == "auto":
        assert encoder.eos_appending.reason == ("auto: the chat template ends each answer with "
                                                "'<|im_end|>'")


def test_a_base_checkpoints_eos_is_not_the_turn_end(tmp_path):
    """A base checkpoint's tokenizer (Qwen2-VL-2B's, Qwen2.5 / Qwen3 base: the ChatML template,
    but the EOS <|endoftext|>): the ids are the template's, each answer trained through the
    <|im_end|> the template writes after it, no EOS added; the report names <|im_end|>."""
    import shutil
    shutil.copytree(QWEN2_VL, tmp_path / "base", ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((tmp_path / "base" / "tokenizer_config.json").read_text())
    (tmp_path / "base" / "tokenizer_config.json").write_text(json.dumps(
        {**config, "eos_token": "<|endoftext|>"}))
    turns = [(role, content.replace("<image>\n", "")) for role, content in TURNS]
    encoder = _encoder(tmp_path / "base")
    assert encoder.tokenizer.eos_token == "<|endoftext|>"
    assert not encoder.eos_appending.on and encoder.eos_appending.reason == (
        "auto: the chat template ends each answer with '<|im_end|>'")
    encoded = encoder.encode(_messages(turns), [])
    assert encoded.ids.tolist() == _reference_ids(encoder, _reference_text(tmp_path / "base",
                                                                           turns), [])
    runs = _trained_runs(encoder, encoded.ids, encoded.loss_mask)
    assert [encoder.tokenizer.decode(run) for run in runs] == [
        answer + "<|im_end|>" for answer in ANSWERS]


def test_a_template_without_generation_blocks_or_end_of_turn_token():
    """Incremental rendering: each answer, without the newline after it, then the EOS; with
    append_eos false such a turn cannot be trained to stop, and the error says what to set."""
    turns = [("user", "What is a tar file?"), ("assistant", ANSWERS[0]),
             ("user", "And a zip file?"), ("assistant", ANSWERS[1])]
    encoder = _encoder(SMOLLM2, chat_template=PLAIN_TEMPLATE, modalities={})
    assert encoder.eos_appending.on
    encoded = encoder.encode(_messages(turns), [])
    text = "".join(f"{role}: {content}\n" for role, content in turns)
    assert encoded.ids.tolist() == _reference_ids(encoder, text, ANSWERS[:2])
    runs = _trained_runs(encoder, encoded.ids, encoded.loss_mask)
    assert [encoder.tokenizer.decode(run).strip() for run in runs] == [
        answer + "<|im_end|>" for answer in ANSWERS[:2]]
    off = _encoder(SMOLLM2, chat_template=PLAIN_TEMPLATE, modalities={}, append_eos=False)
    with pytest.raises(TextError, match="append_eos: true"):
        off.encode(_messages(turns), [])


def test_append_eos_takes_auto_true_or_false():
    with pytest.raises(ConfigError, match="append_eos is 'yes': use auto, true or false"):
        PreprocessConfig(tokenizer=str(SMOLLM2), append_eos="yes")


def test_caption_mode_writes_the_eos_itself():
    encoder = _encoder(SMOLLM2, mode="caption", modalities={}, append_eos=True)
    assert not encoder.eos_appending.on
    encoded = encoder.encode(_messages(TURNS[3:5]), [])
    assert int((encoded.ids == encoder.tokenizer.eos_token_id).sum()) == 1


# --------------------------------------------------------------------- mimo-inspect report

def test_inspect_report_shows_the_setting_and_counts_the_eos(tmp_path, capsys):
    from mimo_data.inspect.cli import main
    records = [{"id": f"r{n}", "conversations": [
        {"from": "human", "value": f"Question {n}?"}, {"from": "gpt", "value": ANSWERS[0]},
        {"from": "human", "value": "And then?"}, {"from": "gpt", "value": ANSWERS[1]}]}
        for n in range(3)]
    (tmp_path / "records.json").write_text(json.dumps(records))
    build_dataset([tmp_path / "records.json"], tmp_path / "shards")
    reports, outputs = {}, {}
    for setting in ("auto", False):
        config = tmp_path / f"preprocess-{setting}.yaml"
        config.write_text(yaml.safe_dump({"tokenizer": str(LLAVA_1_5), "modalities": {},
                                          "append_eos": setting}))
        out = tmp_path / f"report-{setting}.json"
        capsys.readouterr()
        assert main(["report", str(tmp_path / "shards"), "--config", str(config), "--json",
                     str(out), "--no-progress"]) == 0
        outputs[setting] = capsys.readouterr().out
        reports[setting] = json.loads(out.read_text())
    assert reports["auto"]["append_eos"] == {
        "setting": "auto", "on": True, "token": "</s>",
        "reason": "auto: the chat template writes no end-of-turn token after an answer"}
    assert reports[False]["append_eos"]["on"] is False
    assert ("end of turn append_eos auto: </s> appended after each answer (trained); auto: "
            "the chat template writes no end-of-turn token after an answer") in outputs["auto"]
    assert "end of turn append_eos false: no EOS appended" in outputs[False]
    answers = 2 * len(records)
    for count in ("real", "trained"):
        assert (reports["auto"]["tokens"][count] ==
                reports[False]["tokens"][count] + answers), count
    assert (reports["auto"]["tables"]["token_table"] !=
            reports[False]["tables"]["token_table"])


# --------------------------------------------------------------------------- mimo-generate

@pytest.fixture(scope="module")
def llava_export(tmp_path_factory):
    """The llava-1.5 replica as ``mimo-export`` lays out a whole VLM: its files, the
    preprocessing config ``mimo-train --preprocessing-for`` derives, the manifest."""
    from mimo_train.families.registry import preprocessing_for
    out = tmp_path_factory.mktemp("llava-export")
    for name in os.listdir(LLAVA_1_5):
        if not name.startswith("."):
            os.symlink(LLAVA_1_5 / name, out / name)
    (out / "preprocess.yaml").write_text(yaml.safe_dump(preprocessing_for(str(LLAVA_1_5))))
    (out / "manifest.json").write_text(json.dumps({
        "step": 0, "checkpoint": "-", "preprocess": "preprocess.yaml", "vlm": "llava",
        "modules": {}, "language": ".",
        "modality_tokens": {"image": {"token": "<image>", "id": 32000}}}))
    return out


def test_generation_stops_at_the_eos(llava_export):
    """The replica's output rows of </s> and of its second greedy token swapped: its answer
    stops where that token was, with </s>; also when the model's generation config names no
    end token."""
    import torch

    from mimo_train.hf.generate import Generator
    generator = Generator(str(llava_export))
    eos = generator.tokenizer.eos_token_id
    free = generator.generate("What is a tar file?", max_new_tokens=6).token_ids
    assert len(free) == 6 and eos not in free
    stop = free.index(free[1])
    with torch.no_grad():
        rows = generator.vlm.get_output_embeddings().weight
        rows[[free[1], eos]] = rows[[eos, free[1]]]
    for configured in (generator.vlm.generation_config.eos_token_id, None):
        generator.vlm.generation_config.eos_token_id = configured
        answer = generator.generate("What is a tar file?", max_new_tokens=6)
        assert answer.token_ids == free[:stop] + [eos], configured
        assert answer.text == generator.tokenizer.decode(free[:stop], skip_special_tokens=True)


def test_generation_stops_at_the_templates_turn_end_too(tmp_path):
    """A base checkpoint's tokenizer (EOS <|endoftext|>, ChatML's <|im_end|> ending each
    trained answer) and a generation config naming no end token: generation stops at both."""
    from mimo_train.families.registry import preprocessing_for
    from mimo_train.hf.generate import Generator
    for name in os.listdir(QWEN2_VL):
        if name != "tokenizer_config.json":
            os.symlink(QWEN2_VL / name, tmp_path / name)
    config = json.loads((QWEN2_VL / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {**config, "eos_token": "<|endoftext|>"}))
    (tmp_path / "preprocess.yaml").write_text(yaml.safe_dump(preprocessing_for(str(tmp_path))))
    (tmp_path / "manifest.json").write_text(json.dumps({
        "step": 0, "checkpoint": "-", "preprocess": "preprocess.yaml", "vlm": "qwen2_vl",
        "modules": {}, "language": ".", "modality_tokens": {}}))
    generator = Generator(str(tmp_path), "cpu")
    generator.vlm.generation_config.eos_token_id = None
    tokenizer = generator.tokenizer
    assert generator.stop_ids() == [tokenizer.convert_tokens_to_ids("<|endoftext|>"),
                                     tokenizer.convert_tokens_to_ids("<|im_end|>")]
