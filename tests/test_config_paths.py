"""Paths in a preprocessing YAML are relative to the YAML's folder, not the working directory;
hub names stay hub names; a wrong tokenizer path is a ConfigError naming ``tokenizer:``."""

from __future__ import annotations

import os
import shutil

import pytest
import yaml

from mimo_data.preprocess.chat_tokens import TextEncoder, load_tokenizer
from mimo_data.errors import ConfigError
from mimo_data.preprocess.config import PreprocessConfig

from conftest import REPO

TOKENIZER = REPO / "assets" / "tokenizer" / "smollm2"


def _write(path, **values):
    data = yaml.safe_load((REPO / "configs" / "preprocess.yaml").read_text())
    data.update(values)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data))
    return path


def test_shipped_configs_load_from_any_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("preprocess.yaml", "preprocess_audio.yaml", "preprocess_images.yaml"):
        config = PreprocessConfig.from_yaml(str(REPO / "configs" / name))
        assert config.tokenizer == str(TOKENIZER)


def test_relative_paths_resolve_against_the_yaml_folder(tmp_path, monkeypatch):
    shutil.copytree(TOKENIZER, tmp_path / "project" / "tok")
    template = (TOKENIZER / "chat_template.jinja").read_text()
    (tmp_path / "project" / "templates").mkdir()
    (tmp_path / "project" / "templates" / "chatml.jinja").write_text(template)
    path = _write(tmp_path / "project" / "configs" / "pre.yaml", tokenizer="../tok",
                  chat_template="../templates/chatml.jinja")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    config = PreprocessConfig.from_yaml(os.path.relpath(path, elsewhere))
    assert config.tokenizer == str(tmp_path / "project" / "tok")
    assert config.chat_template == str(tmp_path / "project" / "templates" / "chatml.jinja")
    encoder = TextEncoder(config, cache_tokens=False)
    assert encoder.template == template
    text, _ = encoder.render([{"role": "user", "content": "Hi"},
                              {"role": "assistant", "content": "Hello."}])
    assert "<|im_start|>assistant\nHello.<|im_end|>" in text


def test_a_name_beside_the_yaml_is_a_path_and_inline_jinja_stays_inline(tmp_path):
    shutil.copytree(TOKENIZER, tmp_path / "smollm2")
    inline = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    config = PreprocessConfig.from_yaml(str(_write(tmp_path / "pre.yaml", tokenizer="smollm2",
                                                   chat_template=inline)))
    assert config.tokenizer == str(tmp_path / "smollm2")
    assert config.chat_template == inline


def test_hub_names_stay_hub_names(tmp_path):
    config = PreprocessConfig.from_yaml(str(_write(
        tmp_path / "pre.yaml", tokenizer="HuggingFaceTB/SmolLM2-135M-Instruct")))
    assert config.tokenizer == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_a_tokenizer_name_found_only_in_the_working_directory_is_refused(tmp_path,
                                                                        monkeypatch):
    """``tokenizer: org/tok`` not beside the YAML would be a hub name, but transformers
    would read the working directory's org/tok instead: refused, naming both folders."""
    shutil.copytree(TOKENIZER, tmp_path / "org" / "tok")
    path = _write(tmp_path / "configs" / "pre.yaml", tokenizer="org/tok")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as caught:
        PreprocessConfig.from_yaml(str(path))
    message = str(caught.value)
    assert message.startswith(f"{path}: tokenizer: org/tok is not beside the YAML "
                              f"({tmp_path / 'configs' / 'org' / 'tok'})"), message
    assert f"({tmp_path / 'org' / 'tok'})" in message


@pytest.mark.parametrize("value", ["assets/tokenizer/smollm2", "./tok", "../no/tokenizer",
                                   "ABSOLUTE", "ABSOLUTE/", "FILE"])
def test_a_wrong_tokenizer_path_names_the_key_the_yaml_and_the_path(tmp_path, value):
    """Named once: a relative path with where it led, an absolute one as given (a trailing
    slash too), without the hint on relative paths."""
    (tmp_path / "a-file").write_text("")
    value = value.replace("ABSOLUTE", str(tmp_path / "no_tok")).replace(
        "FILE", str(tmp_path / "a-file"))
    path = _write(tmp_path / "configs" / "pre.yaml", tokenizer=value)
    with pytest.raises(ConfigError) as caught:
        PreprocessConfig.from_yaml(str(path))
    message = str(caught.value)
    resolved = os.path.normpath(os.path.join(tmp_path / "configs", value))
    assert message.startswith("tokenizer:") and str(path) in message and resolved in message
    assert message.count(resolved) == 1, message
    state = "is not a directory" if value.endswith("a-file") else "is not there"
    assert message.startswith(f"tokenizer: {value!r} in {path} " + (
        state + " (or give a hub name" if os.path.isabs(value) else
        f"is {resolved}, which {state}; paths are relative to the YAML's folder")), message
    assert "Repo id" not in message


def test_a_wrong_template_path_names_the_key_and_where_a_home_path_led(tmp_path):
    path = _write(tmp_path / "pre.yaml", tokenizer=str(TOKENIZER),
                  chat_template="~/no-such/chatml.jinja")
    with pytest.raises(ConfigError) as caught:
        PreprocessConfig.from_yaml(str(path))
    home = os.path.expanduser("~/no-such/chatml.jinja")
    assert str(caught.value) == f"chat_template: '~/no-such/chatml.jinja' in {path} ({home}) " \
        "is not there"


def test_a_wrong_tokenizer_path_from_a_dict_names_the_key(tmp_path):
    config = PreprocessConfig(tokenizer=str(tmp_path / "no" / "such" / "tokenizer"))
    with pytest.raises(ConfigError) as caught:
        load_tokenizer(config)
    assert str(caught.value) == f"tokenizer: '{tmp_path}/no/such/tokenizer' is not there"
    with pytest.raises(ConfigError, match=r"^tokenizer: 'no/such/' is .*/no/such, which is "
                       r"not there \(in a YAML, paths are relative to its folder\)$"):
        load_tokenizer(PreprocessConfig(tokenizer="no/such/"))
    with pytest.raises(ConfigError, match=r"^tokenizer: '/no/such/' is not there$"):
        load_tokenizer(PreprocessConfig(tokenizer="/no/such/"))


def test_a_missing_template_file_names_the_key(tmp_path):
    path = _write(tmp_path / "pre.yaml", tokenizer=str(TOKENIZER),
                  chat_template="templates/missing.jinja")
    with pytest.raises(ConfigError, match=r"^chat_template: .*missing\.jinja"):
        PreprocessConfig.from_yaml(str(path))


def test_a_folder_without_a_tokenizer_says_so_and_where_one_is(tmp_path):
    """A folder above the tokenizer's (or any folder without its files): said in those
    words, naming the folder inside that holds one, not transformers' words about
    sentencepiece and slow tokenizers."""
    shutil.copytree(TOKENIZER, tmp_path / "above" / "smollm2")
    with pytest.raises(ConfigError) as caught:
        load_tokenizer(PreprocessConfig(tokenizer=str(tmp_path / "above")))
    assert str(caught.value) == (
        f"tokenizer: {tmp_path / 'above'} holds no tokenizer files (tokenizer.json, "
        "tokenizer_config.json, a vocabulary): give the folder a model or tokenizer was saved "
        f"to (here: {tmp_path / 'above' / 'smollm2'})")
    assert "sentencepiece" not in str(caught.value)
    # a hub cache's model folder: its files two levels down, in snapshots/REVISION
    snapshot = tmp_path / "models--org--tok" / "snapshots" / "abc123"
    shutil.copytree(TOKENIZER, snapshot)
    with pytest.raises(ConfigError, match=rf"\(here: {snapshot}\)$"):
        load_tokenizer(PreprocessConfig(tokenizer=str(tmp_path / "models--org--tok")))
