"""The training config: YAML plus ``key.path=value`` overrides, strict keys, validation rules.

A typo or a value that cannot run must stop ``mimo-train`` with a ``TrainConfigError`` that
names the full dotted key (the CLI prints those and exits 2; anything else would be a
traceback), never fall back silently to a default.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import pytest
import yaml

from mimo_data.loading.layout import Layout
from mimo_data.preprocess.config import PreprocessConfig
from mimo_train.config import EncoderConfig, LanguageConfig, TrainConfig
from mimo_train.errors import TrainConfigError

from conftest import REPO

# A complete, valid config touching every section.
FULL = """
data:
  datasets: [shards/a, shards/b]
  weights: [3, 1]
  preprocess: my/preprocess.yaml
  valid: [shards/valid]
  num_workers: 2
layout: "image=dp2;audio=dp1,off2;language=dp1,off3"
model:
  language: {num_layers: 4, hidden_size: 128, num_attention_heads: 8, vocab_size: 49280}
  encoders:
    image: {kind: qwen2_vl, hidden_size: 48, num_layers: 2, pretrained: some/dir}
    audio: {num_attention_heads: 4}
  projection: mlp
  freeze: [image]
optimizer: {lr: 2.0e-3, min_lr: 1.0e-4, warmup_steps: 5, weight_decay: 0.1}
train:
  global_batch_size: 16
  micro_batch_size: 4
  steps: 40
  eval_interval: 10
  eval_steps: 2
  seed: 7
  device: cpu
  precision: bf16
checkpoint: {dir: runs/x, interval: 20, resume: false}
"""

# The least a config needs: one dataset.
MINIMAL = "data: {datasets: [shards/a]}\n"


def write(tmp_path: Path, text: str, name: str = "train.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def load(tmp_path, text=MINIMAL, *overrides) -> TrainConfig:
    return TrainConfig.load(write(tmp_path, text), list(overrides))


def load_error(tmp_path, text=MINIMAL, *overrides) -> str:
    with pytest.raises(TrainConfigError) as error:
        load(tmp_path, text, *overrides)
    return str(error.value)


# ------------------------------------------------------------------------------- YAML file

def test_yaml_file_fills_every_section(tmp_path):
    cfg = load(tmp_path, FULL)
    assert cfg.data.datasets == [str(tmp_path / "shards/a"), str(tmp_path / "shards/b")]
    assert cfg.data.weights == [3, 1]
    assert cfg.data.preprocess == str(tmp_path / "my/preprocess.yaml")
    assert cfg.data.valid == [str(tmp_path / "shards/valid")]
    assert cfg.data.num_workers == 2
    assert cfg.layout == "image=dp2;audio=dp1,off2;language=dp1,off3"
    assert cfg.model.language == LanguageConfig(num_layers=4, hidden_size=128,
                                                num_attention_heads=8, vocab_size=49280)
    assert cfg.model.encoders == {
        "image": EncoderConfig(kind="qwen2_vl", hidden_size=48, num_layers=2,
                                pretrained="some/dir"),
        "audio": EncoderConfig(num_attention_heads=4)}
    assert cfg.model.projection == "mlp" and cfg.model.freeze == ["image"]
    assert (cfg.optimizer.lr, cfg.optimizer.min_lr, cfg.optimizer.warmup_steps,
            cfg.optimizer.weight_decay) == (2e-3, 1e-4, 5, 0.1)
    run = cfg.train
    assert (run.global_batch_size, run.micro_batch_size, run.steps, run.eval_interval,
            run.eval_steps, run.seed, run.device, run.precision) == (16, 4, 40, 10, 2, 7, "cpu",
                                                                      "bf16")
    assert (cfg.checkpoint.dir, cfg.checkpoint.interval, cfg.checkpoint.resume) == (
        str(tmp_path / "runs/x"), 20, False)


def test_missing_keys_take_the_dataclass_defaults(tmp_path):
    cfg = load(tmp_path, MINIMAL)
    defaults = TrainConfig()
    assert cfg.data.datasets == [str(tmp_path / "shards/a")]
    for section in ("model", "optimizer", "train", "checkpoint"):
        assert getattr(cfg, section) == getattr(defaults, section), section
    assert cfg.layout == defaults.layout
    assert dataclasses.replace(cfg.data, datasets=[]) == defaults.data


def test_empty_sections_are_defaults(tmp_path):
    cfg = load(tmp_path, MINIMAL + "train:\nmodel:\n  encoders:\n    image:\n")
    assert cfg.train == TrainConfig().train
    assert cfg.model.encoders == {"image": EncoderConfig()}


def test_layout_may_be_a_mapping(tmp_path):
    layout = {"modules": {"language": {"dp": 2}}}
    cfg = load(tmp_path, MINIMAL + yaml.safe_dump({"layout": layout}))
    assert cfg.layout == layout


def test_to_dict_round_trips_through_yaml(tmp_path):
    cfg = load(tmp_path, FULL)
    again = load(tmp_path, yaml.safe_dump(cfg.to_dict()))
    assert again == cfg
    assert isinstance(again.model.encoders["image"], EncoderConfig)


def test_unreadable_or_non_mapping_files(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(TrainConfigError, match="nope.yaml"):
        TrainConfig.load(str(missing))
    assert "top level must be a mapping" in load_error(tmp_path, "- data\n- train\n")
    message = load_error(tmp_path, "data: {datasets: [a]\ntrain: {steps: 3}\n")
    assert "train.yaml" in message


def test_a_key_given_twice_is_refused_not_the_last_kept(tmp_path):
    """A second ``optimizer:`` section appended to a config (PyYAML keeps the last, dropping
    the first's lr without a word), a key twice in a section or in an override, and in a
    preprocessing config: each refused naming the key and both lines; YAML's merge keys
    (``<<: *defaults``) still override."""
    from mimo_data.errors import ConfigError
    from mimo_data.preprocess.config import PreprocessConfig
    message = load_error(tmp_path, "optimizer:\n  lr: 0.1\ndata: {datasets: [a]}\n"
                                   "optimizer:\n  warmup_steps: 1\n")
    assert "the key 'optimizer' is given twice (lines 1 and 4), and only the last would " \
        "count" in message, message
    assert "'lr' is given twice (lines 2 and 3)" in load_error(
        tmp_path, "optimizer:\n  lr: 0.1\n  lr: 0.2\ndata: {datasets: [a]}\n")
    with pytest.raises(TrainConfigError, match="'steps' is given twice"):
        TrainConfig.load(None, ["data.datasets=[a]", "train={steps: 3, steps: 4}"])
    merged = tmp_path / "merged.yaml"
    merged.write_text("x-: &base {lr: 0.1, min_lr: 0.0}\ndata: {datasets: [a]}\n"
                      "optimizer: {<<: *base, lr: 0.2}\n")
    with pytest.raises(TrainConfigError, match="unknown key.*x-"):
        TrainConfig.load(str(merged))           # read (not refused as a duplicate) to the end
    preprocess = tmp_path / "preprocess.yaml"
    preprocess.write_text("seq_length: 64\nseq_length: 128\n")
    with pytest.raises(ConfigError, match="'seq_length' is given twice"):
        PreprocessConfig.from_yaml(str(preprocess))


def test_empty_file_falls_to_the_datasets_rule(tmp_path):
    assert "data.datasets is empty" in load_error(tmp_path, "")


def test_no_file_only_overrides(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = TrainConfig.load(None, ["data.datasets=[x, y]", "train.steps=3"])
    assert cfg.data.datasets == [str(tmp_path / "x"), str(tmp_path / "y")]
    assert cfg.train.steps == 3


# ------------------------------------------------------------------------------- overrides

def test_a_dotted_lora_part_is_one_key_of_an_override():
    """``image.encoder`` is one part of model.lora: an override setting its rank, or the
    whole part, keeps the dotted name (a setting's name ends the path), beside a part
    without a dot."""
    cfg = TrainConfig.load(None, ["data.datasets=[x]", "model.lora.image.encoder.rank=4",
                                  "model.lora.image.projection={rank: 3}",
                                  "model.lora.language.targets=[linear_qkv]",
                                  "model.lora.audio.encoder="])           # empty: defaults
    assert {part: spec.rank for part, spec in cfg.model.lora.items()} == {
        "image.encoder": 4, "image.projection": 3, "language": 8, "audio.encoder": 8}
    assert cfg.model.lora["language"].targets == ["linear_qkv"]
    with pytest.raises(TrainConfigError, match="unknown key.*model.lora.language.rnak"):
        TrainConfig.load(None, ["data.datasets=[x]", "model.lora.language.rnak=4"])
    # ~key.path removes an entry (where =null keeps it, with its defaults), a dotted part too;
    # a clash of a module and its part says so
    parts = ["data.datasets=[x]", "model.lora={image: {rank: 4}, image.projection: {rank: 2}}"]
    assert list(TrainConfig.load(None, [*parts, "~model.lora.image"]).model.lora) == [
        "image.projection"]
    assert list(TrainConfig.load(None, [*parts, "~model.lora.image.projection"]).model.lora) \
        == ["image"]
    assert list(TrainConfig.load(None, [*parts, "model.lora.image=null"]).model.lora) == [
        "image", "image.projection"]
    for wrong, said in (("~model.lora.audio", "the config sets no model.lora.audio, so there "
                         "is nothing to remove"), ("~train.steps=3", "takes no value")):
        with pytest.raises(TrainConfigError, match=said):
            TrainConfig.load(None, [*parts, wrong])


@pytest.mark.parametrize("override, get, expected", [
    ("train.steps=50", lambda c: c.train.steps, 50),
    ("optimizer.lr=0.05", lambda c: c.optimizer.lr, 0.05),
    ("optimizer.lr=2.5e-2", lambda c: c.optimizer.lr, 0.025),
    ("optimizer.lr=1e-2", lambda c: c.optimizer.lr, 0.01),      # YAML 1.1 reads this as text
    ("data.datasets=[/x, '/y z']", lambda c: c.data.datasets, ["/x", "/y z"]),
    ("model.freeze=[image, audio]", lambda c: c.model.freeze, ["image", "audio"]),
    ("train.tensorboard_dir=/runs/tb", lambda c: c.train.tensorboard_dir, "/runs/tb"),
    ("checkpoint.dir=null", lambda c: c.checkpoint.dir, None),
    ("checkpoint.dir=", lambda c: c.checkpoint.dir, None),
    ("checkpoint.resume=false", lambda c: c.checkpoint.resume, False),
    ("model.language.vocab_size=~", lambda c: c.model.language.vocab_size, None),
    ("layout=image=dp1;language=dp2", lambda c: c.layout, "image=dp1;language=dp2"),
    ("layout={modules: {language: {dp: 2}}}", lambda c: c.layout,
     {"modules": {"language": {"dp": 2}}}),
    ("model.projection=mlp", lambda c: c.model.projection, "mlp"),
    ("checkpoint.dir=/runs/a#b", lambda c: c.checkpoint.dir, "/runs/a#b"),    # no comment
    ("checkpoint.dir='/runs/try #2'", lambda c: c.checkpoint.dir, "/runs/try #2"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_override_values_are_parsed_as_yaml(tmp_path, override, get, expected):
    base = MINIMAL + "checkpoint: {dir: runs/base}\nmodel: {language: {vocab_size: 512}}\n"
    value = get(load(tmp_path, base, override))
    assert value == expected and type(value) is type(expected)


def test_override_replaces_file_value_and_keeps_its_neighbours(tmp_path):
    cfg = load(tmp_path, FULL, "train.steps=100", "model.encoders.image.num_layers=5")
    assert cfg.train.steps == 100 and cfg.train.micro_batch_size == 4
    assert cfg.model.encoders["image"] == EncoderConfig(kind="qwen2_vl", hidden_size=48,
                                                         num_layers=5, pretrained="some/dir")


def test_override_creates_new_nested_encoder(tmp_path):
    cfg = load(tmp_path, MINIMAL, "model.encoders.image.num_layers=3",
               "model.encoders.image.pretrained=/models/vit")
    assert cfg.model.encoders == {"image": EncoderConfig(num_layers=3,
                                                          pretrained="/models/vit")}
    cfg = load(tmp_path, FULL, "model.encoders.extra.kind=siglip")
    assert set(cfg.model.encoders) == {"image", "audio", "extra"}
    assert cfg.model.encoders["extra"] == EncoderConfig(kind="siglip")


def test_override_into_empty_section(tmp_path):
    """``train:`` with nothing under it is an empty section, and overrides can fill it."""
    cfg = load(tmp_path, MINIMAL + "train:\ncheckpoint:\n", "train.steps=7",
               "checkpoint.dir=/runs/y")
    assert cfg.train.steps == 7 and cfg.checkpoint.dir == "/runs/y"


def test_later_override_wins(tmp_path):
    cfg = load(tmp_path, MINIMAL, "train.steps=5", "train.steps=9")
    assert cfg.train.steps == 9


def test_whole_section_override(tmp_path):
    cfg = load(tmp_path, FULL, "checkpoint={dir: /runs/z}")
    assert cfg.checkpoint.dir == "/runs/z" and cfg.checkpoint.interval == 0


# ------------------------------------------------------------------------ unknown keys

@pytest.mark.parametrize("key", [
    "trian", "train.stpes", "model.language.hiden_size", "model.encoders.image.depth",
    "optimizer.betas", "checkpoint.every", "data.shards"])
def test_unknown_key_in_file_names_the_full_key(tmp_path, key):
    data = {"data": {"datasets": ["a"]}}
    node = data
    *sections, name = key.split(".")
    for part in sections:
        node = node.setdefault(part, {})
    node[name] = 1
    message = load_error(tmp_path, yaml.safe_dump(data))
    assert key in message
    assert "unknown" in message


@pytest.mark.parametrize("key", [
    "trian.steps", "train.stpes", "model.language.hiden_size", "model.encoders.image.depth",
    "model.encoders.audio.num_layer", "optimizer.betas"])
def test_unknown_key_in_override_names_the_full_key(tmp_path, key):
    message = load_error(tmp_path, FULL, f"{key}=3")
    expected = key if not key.startswith("trian") else "trian"
    assert expected in message and "unknown" in message


def test_unknown_key_message_lists_the_known_ones(tmp_path):
    message = load_error(tmp_path, MINIMAL, "train.stpes=3")
    assert "steps" in message and "micro_batch_size" in message
    # a misspelt key: the one it most likely meant, and none for a key close to nothing
    assert "train.stpes (did you mean train.steps?)" in message, message
    for far in ("train.zzz=1", "model.language.foo=1", "model.encoders.image.zzz=1"):
        message = load_error(tmp_path, MINIMAL, far)        # the section's name matches nothing
        assert "did you mean" not in message, message
    # a preprocessing setting given to the training config: where it goes
    message = load_error(tmp_path, MINIMAL, "data.seq_length=512")
    assert "data.seq_length goes in the preprocessing config (the data.preprocess YAML), " \
        "not the training config" in message, message
    # a setting under transformers' name (its config's, its Trainer's): ours named
    for theirs, ours in (("model.language.router_aux_loss_coef=0.001",
                          "model.language.router_aux_loss_coef goes in "
                          "model.language.moe_aux_loss here (transformers' "
                          "router_aux_loss_coef)"),
                         ("optimizer.learning_rate=1e-5", "goes in optimizer.lr here"),
                         ("train.max_steps=100", "train.max_steps goes in train.steps here"),
                         ("train.save_steps=100", "goes in checkpoint.interval here"),
                         # flat, as TrainingArguments are written
                         ("max_steps=100", "; max_steps goes in train.steps here"),
                         ("bf16=true", "; bf16 goes in train.precision (bf16) here"),
                         ("checkpoint.save_total_limit=2", "goes in checkpoint.keep_last here"),
                         ("train.gradient_checkpointing=true", "goes in "
                          "model.language.recompute (and model.encoders.<module>.recompute) "
                          "here"),
                         ("model.attn_implementation=sdpa", "model.attn_implementation goes "
                          "in model.attention here"),
                         # PEFT's LoraConfig names under model.lora.<part>
                         ("model.lora.language.r=8", "model.lora.language.r goes in rank here "
                          "(PEFT's r)"),
                         ("model.lora.language.target_modules=[q_proj]", "goes in targets here")):
        message = load_error(tmp_path, MINIMAL, theirs)
        assert ours in message, message
    # a whole preprocessing config given as the training config: said as one
    message = load_error(tmp_path, "tokenizer: x\nseq_length: 64\nmodalities: {}\n")
    assert "is a preprocessing config (tokenizer and modalities at its top level), not a " \
        "training config: give it as the training config's data.preprocess" in message, message
    # a model's config.json, or a folder, given as the training config: said as such
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"model_type": "qwen2_vl", '
                                                    '"architectures": ["X"]}')
    for given, said in ((tmp_path / "model" / "config.json", "is a transformers model's "
                         f"config, not a training config: give its folder ({tmp_path / 'model'})"
                         " as model.pretrained of a training config"),
                        (tmp_path / "model", "is a folder: give the training config's YAML")):
        with pytest.raises(TrainConfigError, match=re.escape(said)):
            TrainConfig.load(str(given), [])


# -------------------------------------------------------------------- malformed overrides

@pytest.mark.parametrize("override", ["train.steps", "=5", ""])
def test_override_without_key_or_equals(tmp_path, override):
    assert "key.path=value" in load_error(tmp_path, MINIMAL, override)


def test_override_through_a_value_is_not_a_section(tmp_path):
    message = load_error(tmp_path, FULL, "train.steps.max=3")
    assert "train.steps.max=3" in message and "steps is not a section" in message


def test_an_override_cut_by_a_yaml_comment_is_refused(tmp_path):
    """A path with " #" in it, unquoted: YAML would read from the "#" on as a comment and the
    run take the folder before it, without a word."""
    message = load_error(tmp_path, MINIMAL, "checkpoint.dir=/runs/try #2")
    assert message == ("override 'checkpoint.dir=/runs/try #2': YAML reads the value from its "
                       "'#' on as a comment (leaving '/runs/try'); quote the value: "
                       "'checkpoint.dir=\"/runs/try #2\"'"), message


def test_override_with_invalid_yaml_value_names_the_override(tmp_path):
    message = load_error(tmp_path, MINIMAL, "data.datasets=[a, b")
    assert "data.datasets" in message


@pytest.mark.parametrize("override, key", [
    ("train.steps=abc", "train.steps"),
    ("train.steps=2.5", "train.steps"),
    ("train.steps=true", "train.steps"),
    ("train.steps={max: 3}", "train.steps"),
    ("optimizer.lr=fast", "optimizer.lr"),
    ("data.datasets=shards/a", "data.datasets"),
    ("model.freeze=image", "model.freeze"),
    ("train.device=[cpu]", "train.device"),
    ("checkpoint.resume=maybe", "checkpoint.resume"),
    ("model.encoders.image.num_layers=two", "model.encoders.image.num_layers"),
])
def test_override_of_the_wrong_type_names_the_key(tmp_path, override, key):
    message = load_error(tmp_path, MINIMAL, override)
    assert key in message


@pytest.mark.parametrize("override, key", [
    ("train=5", "train"),
    ("model.language=[1, 2]", "model.language"),
    ("model.encoders=[image]", "model.encoders"),
    ("model.encoders.image=3", "model.encoders.image"),
])
def test_section_that_is_not_a_mapping_names_the_key(tmp_path, override, key):
    message = load_error(tmp_path, MINIMAL, override)
    assert key in message and "mapping" in message


# ---------------------------------------------------------------------- validation rules

VALID = """
data: {datasets: [a, b]}
optimizer: {lr: 1.0e-3, min_lr: 1.0e-4, warmup_steps: 2}
train: {steps: 20}
"""


@pytest.mark.parametrize("overrides, fragment", [
    (["data.datasets=[]"], "data.datasets is empty"),
    (["data.weights=[1]"], "data.weights: 1 blend weights for 2 datasets"),
    (["data.weights=[1, 2, 3]"], "data.weights: 3 blend weights for 2 datasets"),
    (["data.weights=[-1, 2]"], "data.weights: blend weights [-1.0, 2.0]: each a share of the "
     "samples, a finite number >= 0"),
    (["data.weights=[0, 0]"], "data.weights: blend weights [0.0, 0.0]: each a share"),
    (["data.weights=[1, .inf]"], "data.weights: blend weights [1.0, inf]: each a share"),
    (["train.steps=0"], "train.steps is 0"),
    (["train.global_batch_size=0"], "train.global_batch_size is 0"),
    (["train.micro_batch_size=-1"], "train.micro_batch_size is -1"),
    (["train.log_interval=0"], "train.log_interval is 0"),
    (["train.eval_steps=0"], "train.eval_steps is 0"),
    (["train.device=gpu"], "train.device is 'gpu'"),
    (["train.precision=fp16"], "train.precision is 'fp16'"),
    (["optimizer.min_lr=0.01"], "optimizer.min_lr 0.01"),
    (["optimizer.min_lr=-0.0001"], "optimizer.min_lr -0.0001"),
    # the file's min_lr stays where an override lowers lr alone: the message says to give both
    (["optimizer.lr=1e-5"], "optimizer.min_lr 0.0001 must be in [0, lr=1e-05]: where "
     "optimizer.lr changes, give optimizer.min_lr beside it (e.g. optimizer.min_lr=1e-06"),
    (["optimizer.warmup_steps=-1"], "optimizer.warmup_steps is -1"),
    # a bucket size megatron-core would leave unused (no overlap_grad_reduce), per module too
    (["optimizer.bucket_size=1000"], "optimizer.bucket_size 1000 is the size of the buckets "
     "overlap_grad_reduce reduces during the backward pass, and overlap_grad_reduce is off"),
    (["optimizer.modules={image: {bucket_size: 1000}}"], "set "
     "optimizer.modules.image.overlap_grad_reduce: true, or leave bucket_size out"),
    (["data.valid=[v]"], "data.valid is set but train.eval_interval is 0"),
    (["train.eval_interval=5"], "train.eval_interval is set but data.valid"),
    (["train.eval_steps=4"], "train.eval_steps is 4 but data.valid lists no shard "
     "directory to evaluate on: it would be ignored"),
    (["model.projection=conv"], "model.projection is 'conv'"),
    (["model.attention=flash"], "model.attention is 'flash'"),
    (["train.collective_timeout_minutes=0"], "train.collective_timeout_minutes is 0"),
    (["train.profile={start: 2}"], "train.profile.dir is not set"),
    (["train.profile={dir: p, steps: 0}"], "train.profile.steps is 0"),
    (["train.profile={dir: p, start: 50}"], "train.profile covers steps 50..51, past "
     "train.steps 20: the run would end before the profile does and write none"),
    (["train.seed=-1"], "train.seed is -1: it must be in [0, 4294967295]"),
    (["train.steps=1e3"], "train.steps is '1e3' (str): it must be int (write it as 1000)"),
    (["train.seed=99999999999999999999999"], "train.seed is 99999999999999999999999: it must "
     "be in [0, 4294967295]"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_validate_rule(tmp_path, overrides, fragment):
    assert fragment in load_error(tmp_path, VALID, *overrides)


@pytest.mark.parametrize("overrides", [
    [],
    ["data.weights=[1, 3]"],
    ["data.weights=null"],
    ["optimizer.warmup_steps=19"],
    ["optimizer.warmup_steps=20"],                   # clamped at run time (warmup_steps())
    ["optimizer.warmup_steps=50"],
    ["optimizer.warmup_steps=0", "train.steps=1"],
    ["optimizer.min_lr=0.001"],
    ["optimizer.min_lr=0"],
    ["optimizer.bucket_size=1000", "optimizer.overlap_grad_reduce=true"],
    ["data.valid=[v]", "train.eval_interval=5"],
    ["train.device=cuda", "train.precision=bf16"],
    ["train.device=auto", "model.projection=linear"],
    ["model.attention=sdpa", "train.collective_timeout_minutes=0.5"],
], ids=lambda v: " ".join(v) or "base")
def test_validate_accepts_the_boundaries(tmp_path, overrides):
    """Just inside each rule: the rules above fail for the value, not for being set."""
    cfg = load(tmp_path, VALID, *overrides)
    for override in overrides:
        key, _, text = override.partition("=")
        section, name = key.split(".")
        expected = yaml.safe_load(text)
        if key == "data.valid":                       # a path list, taken from the cwd
            expected = [os.path.abspath(v) for v in expected]
        assert getattr(getattr(cfg, section), name) == expected, override


def test_validate_applies_to_a_config_built_in_code(tmp_path):
    cfg = load(tmp_path, VALID)
    cfg.validate()
    # the optimizer's bucket_size for a module's overlap (docs/training.md's example): taken
    load(tmp_path, VALID, "optimizer.bucket_size=1000",
         "optimizer.modules={language: {overlap_grad_reduce: true}}").validate()
    cfg.train.steps = 0
    with pytest.raises(TrainConfigError, match="train.steps is 0"):
        cfg.validate()
    cfg.train.steps = 2
    cfg.validate()
    cfg.train.precision = "fp8"
    with pytest.raises(TrainConfigError, match="train.precision"):
        cfg.validate()


# ------------------------------------------------------------------- the shipped configs

SHIPPED = sorted((REPO / "configs" / "train").glob("*.y*ml"))


def test_there_are_shipped_training_configs():
    assert SHIPPED, "configs/train/ should hold at least one training config"


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_config_loads_and_is_coherent(path, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)      # paths in the YAML are taken from its folder, not the cwd
    cfg = TrainConfig.load(str(path))
    # the shards make demo builds: the corpus's, or its video conversations'
    assert cfg.data.datasets in ([str(REPO / "runs" / "demo" / "shards")],
                                 [str(REPO / "runs" / "demo" / "video_shards")])
    assert cfg.checkpoint.dir == str(REPO / "runs" / path.stem / "checkpoints")
    cfg.check_inputs()
    preprocess = PreprocessConfig.from_yaml(cfg.data.preprocess)
    layout = Layout.parse(cfg.layout)
    layout.validate(layout.world_size, cfg.train.global_batch_size, cfg.train.micro_batch_size,
                    modalities=list(preprocess.modalities))
    assert set(cfg.model.encoders) <= {module.name for module in layout.encoders}
    # a module, or an encoder module's part (image.encoder)
    assert {entry.partition(".")[0] for entry in cfg.model.freeze} <= \
        {module.name for module in layout.modules}
    # The file's overrides work on it too, e.g. the demo's shorter run.
    shorter = TrainConfig.load(str(path), ["train.steps=5", "optimizer.warmup_steps=1"])
    assert shorter.train.steps == 5


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_config_three_step_smoke_run_clamps_the_warmup(path):
    """``train.steps=3`` alone: the shipped warmup (3) becomes 2 with a note; megatron-core's
    scheduler then warms up over 2 steps and decays on the third."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    import torch

    cfg = TrainConfig.load(str(path), ["train.steps=3"])
    assert cfg.optimizer.warmup_steps == 3
    warmup, note = cfg.warmup_steps()
    assert warmup == 2 and note == "optimizer.warmup_steps 3 clamped to 2 for a 3-step run"
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    opt = cfg.optimizer
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=opt.lr, min_lr=opt.min_lr, lr_warmup_steps=warmup,
        lr_decay_steps=cfg.train.steps, lr_decay_style="cosine", start_wd=0.0, end_wd=0.0,
        wd_incr_steps=cfg.train.steps, wd_incr_style="constant")
    lrs = []
    for _ in range(cfg.train.steps):
        scheduler.step(1)
        lrs.append(optimizer.param_groups[0]["lr"])
    assert lrs == pytest.approx([opt.lr / 2, opt.lr, opt.min_lr])


def test_a_clamped_warmup_is_noted_whichever_rank_says_it():
    """The README's Qwen2-VL fine-tune: rank 0 (which prints) holds the frozen tower alone,
    the language model's warmup is clamped: the plan's note says so; the frozen tower has
    none to note. Each warmup is noted once, by the key that sets it."""
    from conftest import REPO
    from mimo_train.plan import resolve

    plan = resolve(TrainConfig.load(str(REPO / "configs" / "train" / "qwen2_vl_finetune.yaml"),
                                    ["train.steps=2",
                                     "optimizer.modules={language: {warmup_steps: 5}}"]))
    assert plan.frozen[0].module == "image"
    assert [m.name for m in plan.layout.role(0).modules] == ["image"]
    assert plan.warmup_notes() == [
        "optimizer.modules.language.warmup_steps 5 clamped to 1 for a 2-step run"]
    # modules with entries of their own that take the shared warmup: one note, of the shared
    plan = resolve(TrainConfig.load(
        str(REPO / "configs" / "train" / "images_audio_colocated.yaml"),
        ["train.steps=2", "optimizer.modules={image: {distributed: false}, "
         "language: {overlap_grad_reduce: true}}"]))
    assert plan.warmup_notes() == ["optimizer.warmup_steps 3 clamped to 1 for a 2-step run"]


def test_lora_on_a_frozen_part_names_the_freeze_entry():
    """LoRA on a module whose part model.freeze lists: the entry to drop is named as given."""
    from mimo_train.plan import resolve

    with pytest.raises(TrainConfigError, match=re.escape(
            "model.lora adapts 'image', which model.freeze freezes ('image.encoder'): LoRA "
            "already keeps the part's own weights fixed; drop 'image.encoder' from "
            "model.freeze")):
        resolve(TrainConfig.load(str(REPO / "configs" / "train" / "qwen2_vl_lora.yaml"),
                                 ["model.freeze=[image.encoder]"]))


def test_warmup_within_the_run_is_kept(tmp_path):
    assert load(tmp_path, VALID).warmup_steps() == (2, None)
    assert load(tmp_path, VALID, "train.steps=1", "optimizer.warmup_steps=0"
                ).warmup_steps() == (0, None)
    assert load(tmp_path, VALID, "train.steps=1").warmup_steps()[0] == 0


# ----------------------------------------------------------------------------------- paths

def test_yaml_paths_are_taken_from_the_yaml_folder(tmp_path, monkeypatch):
    (tmp_path / "configs" / "train").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    path = write(tmp_path / "configs" / "train", """
data: {datasets: [../../shards, /abs/shards], preprocess: ../p.yaml, valid: [v]}
model:
  init_from: ../../ckpt/step_0000003
  encoders: {image: {pretrained: ../../models/vit}}
train: {tensorboard_dir: tb, eval_interval: 1}
checkpoint: {dir: ../../runs/x}
""")
    cfg = TrainConfig.load(path)
    assert cfg.data.datasets == [str(tmp_path / "shards"), "/abs/shards"]
    assert cfg.data.preprocess == str(tmp_path / "configs" / "p.yaml")
    assert cfg.data.valid == [str(tmp_path / "configs" / "train" / "v")]
    assert cfg.model.init_from == str(tmp_path / "ckpt" / "step_0000003")
    assert cfg.model.encoders["image"].pretrained == str(tmp_path / "models" / "vit")
    assert cfg.train.tensorboard_dir == str(tmp_path / "configs" / "train" / "tb")
    assert cfg.checkpoint.dir == str(tmp_path / "runs" / "x")


def test_override_paths_are_taken_from_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "cfg").mkdir()
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path / "cfg", "data: {datasets: [a], preprocess: p.yaml}\n")
    cfg = TrainConfig.load(path, ["data.datasets=[runs/s]", "checkpoint.dir=ck",
                                  "data={preprocess: q.yaml, datasets: [b]}",
                                  "model.encoders.image.pretrained=./vit"])
    assert cfg.data.datasets == [str(tmp_path / "b")]
    assert cfg.data.preprocess == str(tmp_path / "q.yaml")
    assert cfg.checkpoint.dir == str(tmp_path / "ck")
    assert cfg.model.encoders["image"].pretrained == str(tmp_path / "vit")
    # the YAML's own value, not overridden, still comes from the YAML's folder
    cfg = TrainConfig.load(path, ["checkpoint.dir=ck"])
    assert cfg.data.preprocess == str(tmp_path / "cfg" / "p.yaml")


def test_hub_names_stay_hub_names(tmp_path):
    (tmp_path / "local" / "vit").mkdir(parents=True)
    cfg = load(tmp_path, MINIMAL + "model: {encoders: {image: {pretrained: "
               "HuggingFaceTB/SmolLM2-135M}, audio: {pretrained: local/vit}}}\n")
    assert cfg.model.encoders["image"].pretrained == "HuggingFaceTB/SmolLM2-135M"
    assert cfg.model.encoders["audio"].pretrained == str(tmp_path / "local" / "vit")


def test_a_name_not_beside_the_yaml_but_in_the_working_directory_is_refused(tmp_path,
                                                                           monkeypatch):
    """``model.pretrained: v/tiny`` with no v/tiny beside the YAML would be a hub name, but
    transformers reads a folder v/tiny of the working directory first: the model would depend
    on where the command runs (and the run's saved name be lost elsewhere). Refused, naming
    both folders; from another directory the same YAML keeps it a hub name."""
    (tmp_path / "cfg").mkdir()
    (tmp_path / "v" / "tiny").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    text = MINIMAL + "model: {pretrained: v/tiny}\n"
    message = load_error(tmp_path / "cfg", text)
    assert message.startswith("model.pretrained: v/tiny is not beside the YAML "
                              f"({tmp_path / 'cfg' / 'v' / 'tiny'})"), message
    assert f"the working directory has a folder of that name ({tmp_path / 'v' / 'tiny'})" \
        in message, message
    monkeypatch.chdir(tmp_path / "cfg")
    assert load(tmp_path / "cfg", text).model.pretrained == "v/tiny"
    # an override is taken from the working directory: the folder, made absolute
    monkeypatch.chdir(tmp_path)
    assert load(tmp_path / "cfg", MINIMAL, "model.pretrained=v/tiny").model.pretrained == \
        str(tmp_path / "v" / "tiny")


@pytest.mark.parametrize("text, overrides, fragment", [
    ("data: {datasets: [a], preprocess: nope.yaml}\n", [], "data.preprocess: no such file: "
     "{tmp}/nope.yaml"),
    ("data: {datasets: [a]}\n", [], "data.preprocess is not set"),
    ("data: {datasets: [a], preprocess: model}\n", [], "data.preprocess: {tmp}/model is a "
     "folder (a model's?), not a preprocessing YAML: make one from a model's folder with "
     "`mimo-train --preprocessing-for MODEL_DIR > preprocess.yaml`"),
    ("data: {datasets: [a], preprocess: p.yaml}\nmodel: {init_from: ../gone}\n", [],
     "model.init_from: no such directory: {parent}/gone"),
    ("data: {datasets: [a], preprocess: p.yaml}\n", ["model.init_from=gone"],
     "model.init_from: no such directory: {cwd}/gone"),
], ids=["preprocess", "preprocess unset", "preprocess a model", "init_from in yaml",
      "init_from override"])
def test_missing_input_path_names_the_key_and_the_resolved_path(tmp_path, text, overrides,
                                                                 fragment):
    (tmp_path / "p.yaml").write_text("{}\n")
    (tmp_path / "model").mkdir()
    cfg = load(tmp_path, text, *overrides)
    with pytest.raises(TrainConfigError) as error:
        cfg.check_inputs()
    assert fragment.format(tmp=tmp_path, parent=tmp_path.parent, cwd=os.getcwd()) in \
        str(error.value)


def test_checkpoint_interval_without_a_dir_is_noted_and_keep_last_is_checked():
    """``checkpoint.interval`` without ``checkpoint.dir`` saves nothing: a start-up note says
    so (the trainer prints it); ``checkpoint.keep_last`` takes a count of 1 or more."""
    base = ["data.datasets=[unused]"]
    note = TrainConfig.load(None, [*base, "checkpoint.interval=5"]).checkpoint.note()
    assert note == ("checkpoint.interval 5 is set but checkpoint.dir is not: no checkpoint "
                    "will be saved (set checkpoint.dir to save)")
    assert TrainConfig.load(None, [*base, "checkpoint.interval=5",
                                   "checkpoint.dir=ck"]).checkpoint.note() is None
    assert TrainConfig.load(None, base).checkpoint.note() is None
    assert TrainConfig.load(None, [*base, "checkpoint.keep_last=2"]).checkpoint.keep_last == 2
    # keep_last and async_save without a dir are as idle: said alike
    assert TrainConfig.load(None, [*base, "checkpoint.keep_last=2", "checkpoint.async_save=true"]
                            ).checkpoint.note() == (
        "checkpoint.keep_last 2 and checkpoint.async_save true are set but checkpoint.dir is "
        "not: no checkpoint will be saved (set checkpoint.dir to save)")
    with pytest.raises(TrainConfigError, match="checkpoint.keep_last"):
        TrainConfig.load(None, [*base, "checkpoint.keep_last=0"])


def test_a_loader_state_of_another_seed_or_data_is_refused_in_config_terms():
    """The loader's resume refusals name what the config sets (``train.seed``,
    ``train.global_batch_size``), not the loader's Python arguments."""
    from types import SimpleNamespace

    from mimo_data.loading.loader import STATE_FORMAT, STATE_VERSION, LoaderError, RankLoader
    loader = SimpleNamespace(source=SimpleNamespace(fingerprint="b" * 64),
                             order=SimpleNamespace(seed=2, global_batch_size=4))
    state = {"format": STATE_FORMAT, "version": STATE_VERSION, "fingerprint": "b" * 64,
             "seed": 1, "global_batch_size": 4}
    with pytest.raises(LoaderError, match=r"seed 1, this run 2: set train\.seed=1 "):
        RankLoader.load_state_dict(loader, state)            # type: ignore[arg-type]
    with pytest.raises(LoaderError, match=r"needs train\.global_batch_size=8"):
        RankLoader.load_state_dict(loader, {**state, "global_batch_size": 8})  # type: ignore
    with pytest.raises(LoaderError) as refused:
        RankLoader.load_state_dict(loader, {**state, "fingerprint": "a" * 64})  # type: ignore
    assert "allow_fingerprint_mismatch" not in str(refused.value)
    assert "model.init_from=CHECKPOINT" in str(refused.value)


def test_urls_only_where_a_url_is_read_and_a_one_slash_url_is_named(tmp_path):
    """Datasets, validation sets and TensorBoard's folder take URLs; a checkpoint folder, a
    model or the cache given as one would be a local folder named ``s3:`` (the run's
    checkpoints lost on each node's disk): refused, saying what to give. A URL with one slash
    is named with the URL meant."""
    config = load(tmp_path, MINIMAL, "data.datasets=[s3://b/ds]", "data.valid=[gs://b/v]",
                  "train.eval_interval=5",
                  "train.tensorboard_dir=s3://b/tb")
    assert (config.data.datasets, config.data.valid) == (["s3://b/ds"], ["gs://b/v"])
    assert load_error(tmp_path, MINIMAL, "checkpoint.dir=s3://b/ck") == (
        "checkpoint.dir: s3://b/ck is a URL, and checkpoint.dir is a path of this machine's "
        "filesystem: every rank writes its part of a checkpoint into it: give a shared "
        "filesystem's folder (and copy checkpoints to the bucket after, if wanted)")
    assert "model.pretrained: s3://b/qwen2vl is a URL, and model.pretrained is a path of this " \
        "machine's filesystem: copy it here first (e.g. `aws s3 sync URL DIR`" in \
        load_error(tmp_path, MINIMAL, "model.pretrained=s3://b/qwen2vl")
    assert load_error(tmp_path, MINIMAL, "data.datasets=[s3:/b/ds]") == (
        "data.datasets: s3:/b/ds is a URL with one slash after its scheme? write s3://b/ds")
    # file: URLs are the local paths they name; a name with a colon is no URL
    config = load(tmp_path, MINIMAL, "data.datasets=[file:///srv/ds,file:/srv/b,run.1:/x]")
    assert config.data.datasets == ["/srv/ds", "/srv/b", os.path.abspath("run.1:/x")]


def test_a_list_given_as_one_value_says_the_list_form(tmp_path):
    assert load_error(tmp_path, MINIMAL, "data.datasets=s3://b/ds") == (
        "data.datasets is 's3://b/ds' (str): it must be list, e.g. data.datasets=[s3://b/ds] "
        "on the command line")


@pytest.mark.parametrize("lr", [2.0e-5, 1.0e-4, 1.0e-2])
def test_lr_alone_takes_a_tenth_as_min_lr(tmp_path, lr):
    """A fine-tune's usual lr given alone (no min_lr) is not refused for the default min_lr,
    nor left flat at lr=1e-4 (the README's LoRA example): min_lr defaults to lr / 10."""
    cfg = load(tmp_path, "data: {datasets: [a]}\n", f"optimizer.lr={lr}")
    assert cfg.optimizer.min_lr == pytest.approx(lr / 10)
    assert TrainConfig().optimizer.min_lr == pytest.approx(1e-4)
