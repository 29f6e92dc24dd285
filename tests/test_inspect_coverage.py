"""`mimo-inspect report` fails ``loss_mask_coverage`` when the trained tokens leave out the
assistant contents or take in user/system contents: templates built here from the shipped
SmolLM2 (ChatML) one, with ``{% generation %}`` blocks in the wrong places."""

from __future__ import annotations

import json

import pytest
import yaml

from mimo_data.inspect.cli import main

from conftest import REPO, build_dataset, write_jsonl

TOKENIZER = REPO / "assets" / "tokenizer" / "smollm2"
TURN = """{{'<|im_start|>' + message['role'] + '
' + message['content'] + '<|im_end|>' + '
'}}"""
# Only the end-of-turn token of an assistant turn is trained.
EOT_ONLY = """{{'<|im_start|>' + message['role'] + '
' + message['content']}}{% if message['role'] == 'assistant' %}{% generation %}\
{{'<|im_end|>'}}{% endgeneration %}{% else %}{{'<|im_end|>'}}{% endif %}{{'
'}}"""
# The user turns are trained as well as the assistant ones.
USER_TOO = """{% if message['role'] in ['assistant', 'user'] %}{{'<|im_start|>' + \
message['role'] + '
'}}{% generation %}{{message['content'] + '<|im_end|>'}}{% endgeneration %}{{'
'}}{% else %}""" + TURN + "{% endif %}"
# The shipped template with generation blocks around the assistant turns: right.
ASSISTANT = """{% if message['role'] == 'assistant' %}{{'<|im_start|>assistant
'}}{% generation %}{{message['content'] + '<|im_end|>'}}{% endgeneration %}{{'
'}}{% else %}""" + TURN + "{% endif %}"


def _template(turn: str) -> str:
    shipped = (TOKENIZER / "chat_template.jinja").read_text()
    assert shipped.count(TURN) == 1, "the shipped template changed: update TURN"
    return shipped.replace(TURN, turn)


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    """Text-only chats (one with a system turn, one with two exchanges), built once."""
    root = tmp_path_factory.mktemp("coverage")
    records = [
        {"id": "plain", "conversations": [
            {"from": "human", "value": "What is the capital of France?"},
            {"from": "gpt", "value": "Paris is the capital of France."}]},
        {"id": "system", "conversations": [
            {"from": "system", "value": "You answer in one short sentence."},
            {"from": "human", "value": "Why is the sky blue?"},
            {"from": "gpt", "value": "Air scatters blue light more than red light."}]},
        {"id": "two", "conversations": [
            {"from": "human", "value": "Name a prime number."},
            {"from": "gpt", "value": "Seven is prime."},
            {"from": "human", "value": "And an even one?"},
            {"from": "gpt", "value": "Two is the only even prime."}]},
        # one-letter contents are in the role headers too ("t" in "<|im_start|>", "a" in
        # "assistant", "d" in the trained "<|im_end|>" before a user turn): found after them
        {"id": "short", "conversations": [
            {"from": "human", "value": "The first letter of 'tea'?"},
            {"from": "gpt", "value": "t"},
            {"from": "human", "value": "Of 'apple'?"},
            {"from": "gpt", "value": "a"},
            {"from": "human", "value": "d"},
            {"from": "gpt", "value": "ok"},
            {"from": "human", "value": "Seven as a digit?"},
            {"from": "gpt", "value": "7"},
            {"from": "human", "value": "Who asks?"},
            {"from": "gpt", "value": "I"}]},
    ]
    build_dataset([write_jsonl(root / "chats.jsonl", records)], root / "shards")
    return root / "shards"


def _config(path, template: str | None):
    data = yaml.safe_load((REPO / "configs" / "preprocess.yaml").read_text())
    data["tokenizer"] = str(TOKENIZER)
    if template is not None:
        (path.parent / "template.jinja").write_text(template)
        data["chat_template"] = "template.jinja"
    path.write_text(yaml.safe_dump(data))
    return path


def _report(capsys, tmp_path, directory, template, *extra):
    config = _config(tmp_path / "config.yaml", template)
    capsys.readouterr()
    code = main(["report", str(directory), "--config", str(config), "--no-progress",
                 "--json", str(tmp_path / "report.json"), *map(str, extra)])
    out, err = capsys.readouterr()
    report = json.loads((tmp_path / "report.json").read_text())
    check = next(c for c in report["checks"] if c["name"] == "loss_mask_coverage")
    return code, out, err, report, check


@pytest.mark.parametrize("template", [None, "assistant"])
def test_shipped_and_right_templates_pass(capsys, tmp_path, chats, template):
    code, out, err, report, check = _report(
        capsys, tmp_path, chats, template and _template(ASSISTANT))
    assert code == 0, err
    assert check["passed"] and check["count"] == 0
    assert "PASS  loss_mask_coverage" in out


def test_generation_block_around_only_the_end_of_turn_fails(capsys, tmp_path, chats,
                                                           monkeypatch):
    """Refused at start-up (the template's stand-in answers train their ends alone); where
    that check cannot tell (a template that branches on contents), the report's check on
    every sample does: here with the start-up check left out."""
    config = _config(tmp_path / "config.yaml", _template(EOT_ONLY))
    code = main(["report", str(chats), "--config", str(config), "--no-progress"])
    assert code == 2 and "its {% generation %} blocks hold the answer's end but not its " \
        "content" in capsys.readouterr().err
    from mimo_data.preprocess.chat_render import ChatRenderer
    monkeypatch.setattr(ChatRenderer, "_check_answers_written", lambda self: None)
    code, out, err, report, check = _report(capsys, tmp_path, chats, _template(EOT_ONLY),
                                            "--html", tmp_path / "report.html")
    assert code == 1
    assert "FAIL loss_mask_coverage" in err and "FAIL  loss_mask_coverage" in out
    assert not check["passed"] and check["count"] == 4 and check["of"] == 4
    details = [entry["detail"] for entry in report["flagged"]["loss_mask_coverage"]]
    assert all("(assistant)" in d and "not trained" in d for d in details), details
    # each one-letter answer is found in its turn, not in a header, and is not trained
    assert details[-1].split("; ") == [
        f"turn {turn} (assistant): {len(answer)} of {len(answer)} content characters not "
        "trained" for turn, answer in ((1, "t"), (3, "a"), (5, "ok"), (7, "7"), (9, "I"))]
    # The other checks do not see it: the samples are kept and have trained tokens.
    assert all(c["passed"] for c in report["checks"] if c["name"] != "loss_mask_coverage")
    page = (tmp_path / "report.html").read_text()
    assert "loss_mask_coverage" in page


def test_generation_block_around_user_turns_fails(capsys, tmp_path, chats):
    code, out, err, report, check = _report(capsys, tmp_path, chats, _template(USER_TOO))
    assert code == 1 and "FAIL loss_mask_coverage" in err
    assert check["count"] == 4
    details = [entry["detail"] for entry in report["flagged"]["loss_mask_coverage"]]
    assert all("(user)" in d and "(assistant)" not in d for d in details), details
    # A limit lets it pass, as for the other checks.
    code, _, err, _, check = _report(capsys, tmp_path, chats, _template(USER_TOO),
                                     "--max-loss-mask-coverage-failures", "4")
    assert code == 0 and check["passed"], err


# Qwen2-VL's ChatML with the user turns in generation blocks (images between wrap tokens)
QWEN_USER_TOO = """{% for message in messages %}{% if message['role'] == 'user' %}\
<|im_start|>user
{% generation %}{{ message['content'] }}<|im_end|>{% endgeneration %}
{% else %}<|im_start|>{{ message['role'] }}
{% generation %}{{ message['content'] }}<|im_end|>{% endgeneration %}
{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def test_a_trained_user_turn_with_images_between_wrap_tokens_fails(capsys, tmp_path, assets):
    """Qwen2-VL writes an image as <|vision_start|> placeholders <|vision_end|>: a user turn
    holding one is found around them, so training it fails the check as text alone does (it
    was not found, and passed)."""
    from mimo_train.families.registry import preprocessing_for
    qwen = REPO / "assets" / "models" / "published" / "Qwen--Qwen2-VL-2B-Instruct"
    records = [{"id": "one", "image": str(assets["jpeg"]), "conversations": [
                    {"from": "human", "value": "<image>\nWho is this?"},
                    {"from": "gpt", "value": "A person."}]},
               {"id": "two", "images": [str(assets["jpeg"]), str(assets["png"])], "conversations": [
                    {"from": "human", "value": "Compare <image> and <image>."},
                    {"from": "gpt", "value": "They differ."}]}]
    build_dataset([write_jsonl(tmp_path / "images.jsonl", records)], tmp_path / "shards")
    config = {**preprocessing_for(str(qwen)), "seq_length": 4096}
    for template, failed in ((None, []), (QWEN_USER_TOO, ["000000000", "000000001"])):
        if template is not None:
            (tmp_path / "user.jinja").write_text(template)
            config["chat_template"] = str(tmp_path / "user.jinja")
        (tmp_path / "qwen.yaml").write_text(yaml.safe_dump(config))
        capsys.readouterr()
        code = main(["report", str(tmp_path / "shards"), "--config", str(tmp_path / "qwen.yaml"),
                     "--no-progress", "--json", str(tmp_path / "report.json")])
        report = json.loads((tmp_path / "report.json").read_text())
        flagged = report["flagged"].get("loss_mask_coverage", [])
        assert (code, sorted(entry["key"] for entry in flagged)) == (1 if failed else 0, failed), \
            capsys.readouterr().err
        assert [entry["detail"] for entry in flagged] == [   # the characters of its text alone
            f"turn 0 (user): {n} of {n} content characters trained" for n in (10, 11)][
            :len(failed)], flagged


def test_a_content_with_media_is_found_around_its_wrap_and_timestamp_tokens():
    """A content's markers match the placeholders in the decoded text with the tokens the
    template writes around each (wrap tokens, Qwen3-VL's frame timestamps), whole runs only:
    three clips of 300 frames each are one marker each, and a content that is not there is
    said so at once (a regex that tried every split of the frames ran for minutes)."""
    from mimo_data.inspect.stats import _item, _locate
    clip = "".join(f"<{i / 2:.1f} seconds><|vision_start|>\x00<|vision_end|>" for i in range(300))
    text = f"<|im_start|>user\n{clip}\n{clip} and {clip}\nWhat happens?<|im_end|>"
    start, end = text.index("<0.0"), text.index("<|im_end|>")
    clips = [(a, a + len(clip)) for a in (start, start + len(clip) + 1,
                                            start + 2 * len(clip) + 6)]
    assert _locate(text, "\x00\n\x00 and \x00\nWhat happens?", 0, (), _item()) == (
        start, end, tuple(clips))
    assert _locate(text, "\x00\n\x00 and \x00\nWhat is missing?", 0, (), _item()) is None
    assert _locate(text, "\x00 and \x00\nWhat happens?", 0, (), _item()) == (
        clips[1][0], end, tuple(clips[1:]))                             # not the first clip
    assert all(text[a:b] == clip for a, b in clips)


def test_the_tokens_around_a_medium_are_not_counted_as_its_turns_characters():
    """A user turn whose image's wrap tokens and first word are trained: its trained content
    characters are the word's 3, not the wrap tokens' 30 (nor all 10 of its text)."""
    from mimo_data.inspect.stats import _item, _locate, _wrong_chars
    pieces = ["<|im_start|>user\n", "<|vision_start|>", "\x00", "<|vision_end|>\nWho",
              " is this?<|im_end|>"]
    kinds = [0, 1, 2, 1, 0]                         # 1: trained, 2: placeholders
    starts = [0]
    for piece in pieces:
        starts.append(starts[-1] + len(piece))
    text = "".join(pieces)
    found = _locate(text, "\x00\nWho is this?", 0, (), _item())
    assert found is not None and text[found.start:found.end].startswith("<|vision_start|>")
    assert _wrong_chars(found, True, text, pieces, starts, kinds, 0) == len("Who")
