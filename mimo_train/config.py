"""The one training config: a YAML file plus ``key.path=value`` overrides, parsed and validated.

    cfg = TrainConfig.load("configs/train/images_audio_noncolocated.yaml", ["train.steps=50"])
    resolve(cfg)        # mimo_train.families.registry: the model dims from its checkpoints

This module reads no checkpoint: the language model's dims left unset here (``None``) are filled
by the families' resolve step, from ``model.language.pretrained`` / ``model.pretrained`` or
``LANGUAGE_DEFAULTS``; the trainer takes only a resolved config.

Sections: ``data`` (shard dirs, blend weights, the preprocessing config, a validation set),
``layout`` (as the loader takes it: a string such as ``"image=dp1;audio=dp1;language=dp1"`` or a
dict), ``model`` (language-model dims, one entry per encoder module, projections, frozen
modules), ``optimizer`` (with warmup + cosine LR), ``train`` (batches, steps, eval, logging, seed,
device, precision) and ``checkpoint``. Unknown keys are errors naming the key, so a typo never
falls back silently to a default.

Paths: a relative path written in the YAML file is taken from the file's folder (``datasets:
[../../runs/demo/shards]``), one given as an override from the current directory; both are
stored absolute. ``PATH_KEYS`` lists the path keys. ``model.encoders.<name>.pretrained`` and
``model.language.pretrained`` also take a hub name (``org/model``): a value there is a path
when it is absolute, starts with ``.`` or ``~``, or exists relative to the base folder;
otherwise it is kept as a hub name.
``check_inputs`` reports a missing input path with its key and resolved path.

Warmup: ``optimizer.warmup_steps`` longer than the run is clamped to ``train.steps - 1`` (the
cosine decay needs one step), with a one-line note, so a short smoke run (``train.steps=3``)
needs no other override; the decay always spans ``train.steps``.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import yaml

from mimo_data.loading.balance import BALANCE
from mimo_data.shards.storage import is_remote, redacted
from mimo_train.errors import TrainConfigError

# model.attention values (mimo_train.mcore.attention says what each runs)
ATTENTION = ("auto", "local", "sdpa", "varlen")
# activation recomputation (docs/training.md, "Memory at real sizes"): the language model's
# model.language.recompute, an encoder module's model.encoders.<module>.recompute
LANGUAGE_RECOMPUTE = ("none", "selective", "full")
ENCODER_RECOMPUTE = ("none", "full")


@dataclass
class DataConfig:
    datasets: list = field(default_factory=list)      # shard directories or URLs (s3://...)
    weights: list | None = None                       # blend weights, one per dataset
    preprocess: str | None = None                     # PreprocessConfig YAML (required)
    valid: list = field(default_factory=list)         # shard directories for evaluation
    # worker processes per rank: the loader's on ranks that decode media, and a missing token
    # table's share of this rank
    num_workers: int = 0
    cache_dir: str | None = None    # derived tables of read-only datasets (MIMO_CACHE_DIR wins)
    # fsspec options of URL datasets (e.g. {client_kwargs: {endpoint_url: ...}}); credentials
    # belong in the environment or the client's config, not here: the YAML is copied into runs
    storage_options: dict = field(default_factory=dict)
    balance: str = "none"           # tokens: near-equal tokens per DP rank in every step
    # pack each language DP rank's micro-batch into sequences of seq_length (no padding;
    # attention stays inside each sample)
    packing: bool = False


@dataclass
class LanguageConfig:
    """The language model: random init from these dims, or ``pretrained``: a transformers
    Llama / Qwen2 / Qwen3 directory (or cached hub name), or a whole VLM's, whose
    config.json gives the dims and M-RoPE section (any also set here must agree) and whose
    weights are loaded (``mimo_train/families/causal_lm.py``)."""
    num_layers: int | None = None                     # default 2 (or the checkpoint's)
    hidden_size: int | None = None                    # default 64
    num_attention_heads: int | None = None            # default 4
    ffn_hidden_size: int | None = None                # default 4 * hidden_size
    vocab_size: int | None = None                     # default: tokenizer size, padded
    vocab_multiple: int = 128                         # padding of the default vocab size
    # M-RoPE: rotary pairs given to (time, height, width), summing to head_dim / 2 (Qwen2-VL's
    # mrope_section); the preprocessing must then use positions: mrope
    mrope_section: list | None = None
    pretrained: str | None = None
    # activation recomputation: none, selective (core attention recomputed in the backward
    # pass) or full (each layer's input kept, the layer recomputed)
    recompute: str = "none"
    # sequence parallel over the language model's tensor-parallel ranks (TP > 1; at TP 1
    # there is nothing to split and the setting is refused)
    sequence_parallel: bool = False

    def check_mrope(self, head_dim: int) -> None:
        """``TrainConfigError`` unless ``mrope_section`` (if set) splits ``head_dim``."""
        section = self.mrope_section
        if section is None:
            return
        if (len(section) != 3 or not all(isinstance(n, int) and n > 0 for n in section)
                or 2 * sum(section) != head_dim):
            raise TrainConfigError(
                f"model.language.mrope_section is {section}: give three positive counts of "
                f"rotary pairs (time, height, width) summing to head_dim / 2 = {head_dim // 2}")


# the language model's dims without a checkpoint (``families.registry.resolve`` fills them)
LANGUAGE_DEFAULTS = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4}


@dataclass
class EncoderConfig:
    """One encoder module. ``kind``: ``qwen2_vl`` or ``qwen2_5_vl`` (dynamic-resolution
    patches), ``siglip`` (fixed-size images) or ``whisper`` (log-mel frames); default from the
    modality and the preprocessing policy (a whole VLM's tower: its own kind). ``pretrained``:
    a transformers model directory (or hub name) whose weights replace the random init; its
    geometry must match the preprocessing config."""
    kind: str | None = None
    hidden_size: int = 32
    num_layers: int = 1
    num_attention_heads: int = 2
    pretrained: str | None = None
    # activation recomputation of the tower: none, or full (transformers' gradient
    # checkpointing: each layer's input kept, the layer recomputed in the backward pass)
    recompute: str = "none"


@dataclass
class ModelConfig:
    # a whole VLM (Qwen2-VL, Qwen2.5-VL, LLaVA; mimo_train/families/): the image encoder, the
    # projection and the language model from one checkpoint, unless set below
    pretrained: str | None = None
    language: LanguageConfig = field(default_factory=LanguageConfig)
    encoders: dict = field(default_factory=dict)      # module name -> EncoderConfig
    # linear | mlp (Linear-GELU-Linear) | none (identity); default: the VLM's, else linear
    projection: str | None = None
    # modules whose weights stay fixed, or an encoder module's part: image.encoder (the tower;
    # its projection trains) or image.projection
    freeze: list = field(default_factory=list)
    init_from: str | None = None                      # step_* dir of a mimo_train checkpoint
    attention: str = "auto"                           # auto | local | sdpa | varlen (attention)
    # LoRA adapters, by part as model.freeze names them (language, <module>, <module>.encoder,
    # <module>.projection) -> LoraConfig; the part's own weights stay fixed
    lora: dict = field(default_factory=dict)


@dataclass
class LoraConfig:
    """LoRA on a part's linear layers (``mimo_train.model.lora``): W x + alpha / rank * B A x,
    A random, B zero (``init_lora_weights: false``: B random too, as PEFT's option)."""
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    # layer names (linear_qkv, q_proj, ...), dotted paths or fnmatch patterns over the part's
    # linear layers (decoder.layers.*.mlp.linear_fc1), or all-linear (all but the output layer)
    targets: list = field(default_factory=lambda: ["all-linear"])
    init_lora_weights: bool = True

    def check(self, part: str) -> None:
        if self.rank < 1 or not self.alpha > 0 or not 0 <= self.dropout < 1:
            raise TrainConfigError(f"model.lora.{part}: rank {self.rank}, alpha {self.alpha}, "
                                   f"dropout {self.dropout}: use a rank >= 1, an alpha > 0 and "
                                   "a dropout in [0, 1)")
        if not self.targets or not all(isinstance(t, str) and t for t in self.targets):
            raise TrainConfigError(f"model.lora.{part}.targets is {self.targets!r}: list layer "
                                   "names or patterns, or [all-linear]")


@dataclass
class ModuleOptimizerConfig:
    """One module's own settings (``optimizer.modules.<module>``); unset ones are the
    optimizer's, but for ``min_lr`` with ``lr`` set: the optimizer's ``min_lr`` scaled as
    ``lr`` is (the same decay, from the module's rate)."""
    lr: float | None = None
    min_lr: float | None = None
    warmup_steps: int | None = None
    weight_decay: float | None = None
    distributed: bool | None = None
    overlap_grad_reduce: bool | None = None
    bucket_size: int | None = None


@dataclass
class OptimizerConfig:
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    clip_grad: float = 1.0
    # megatron-core's distributed optimizer: the fp32 main weights and Adam moments sharded
    # over the module's DP group (gradients reduce-scattered, weights all-gathered)
    distributed: bool = False
    # start each bucket's gradient reduction during the backward pass (on the CPU too: gloo's
    # asynchronous collectives), buckets of bucket_size elements (None: megatron-core's
    # default, max(40M, 1M x DP size))
    overlap_grad_reduce: bool = False
    bucket_size: int | None = None
    # module name -> ModuleOptimizerConfig (e.g. image: {lr: 1e-4}: the tower at a tenth)
    modules: dict = field(default_factory=dict)

    def of(self, module: str) -> OptimizerConfig:
        """The settings of ``module``: its own where ``modules`` sets them, else these."""
        own = self.modules.get(module) or ModuleOptimizerConfig()
        values = {f.name: getattr(own, f.name) for f in dataclasses.fields(own)
                  if getattr(own, f.name) is not None}
        if "lr" in values and "min_lr" not in values:
            values["min_lr"] = self.min_lr * values["lr"] / self.lr if self.lr else 0.0
        return dataclasses.replace(self, modules={}, **values)

    def check(self, module: str | None = None) -> None:
        where = f"optimizer.modules.{module}." if module else "optimizer."
        if not 0 <= self.min_lr <= self.lr:
            raise TrainConfigError(f"{where}min_lr {self.min_lr} must be in [0, lr={self.lr}]")
        if self.warmup_steps < 0:
            raise TrainConfigError(f"{where}warmup_steps is {self.warmup_steps}: it must be "
                                   ">= 0")
        if self.weight_decay < 0:
            raise TrainConfigError(f"{where}weight_decay is {self.weight_decay}: it must be "
                                   ">= 0")
        if self.bucket_size is not None and self.bucket_size < 1:
            raise TrainConfigError(f"{where}bucket_size is {self.bucket_size}: give a number "
                                   "of elements >= 1, or leave it unset")


@dataclass
class WandbConfig:
    """Weights & Biases beside TensorBoard (rank 0; ``pip install 'mimo[wandb]'``): the same
    fields as the JSONL records, and the config."""
    project: str | None = None
    name: str | None = None                           # default: wandb's
    mode: str = "online"                              # online | offline | disabled
    dir: str | None = None                            # default: wandb's (./wandb)


@dataclass
class RunConfig:
    global_batch_size: int = 8
    micro_batch_size: int = 2                         # per language DP rank
    steps: int = 20
    exit_interval: int = 0                            # stop once step % this == 0 (0: never)
    eval_interval: int = 0                            # 0: no evaluation
    eval_steps: int = 1
    log_interval: int = 1
    seed: int = 1
    device: str = "auto"                              # auto | cuda | cpu
    precision: str = "fp32"                           # fp32 | bf16
    # the MFU's denominator: dense peak TFLOP/s of one GPU (default: the GPU's, by its name and
    # train.precision, planning.flops.peak_tflops; none on a CPU or an unknown GPU: no MFU)
    peak_tflops: float | None = None
    collective_timeout_minutes: float = 10.0          # a collective no rank completes fails
    # steps with a non-finite loss or gradient norm are skipped; past this many the run stops
    max_skipped_steps: int = 10
    # a step whose loss is above spike_factor x the median of the last spike_window steps is
    # recorded with its samples (0: off)
    spike_factor: float = 3.0
    spike_window: int = 50
    # signals that stop the run after the current step with a checkpoint (preemption)
    exit_signals: list = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])
    tensorboard_dir: str | None = None
    wandb: WandbConfig | None = None


def _check_wandb(wandb: WandbConfig) -> None:
    if not wandb.project:
        raise TrainConfigError("train.wandb.project is not set: name the W&B project (or drop "
                               "train.wandb)")
    if wandb.mode not in ("online", "offline", "disabled"):
        raise TrainConfigError(f"train.wandb.mode is {wandb.mode!r}: use online, offline or "
                               "disabled")
    import importlib.util
    if importlib.util.find_spec("wandb") is None:
        raise TrainConfigError("train.wandb is set, but the wandb package is not installed: "
                               "pip install 'mimo[wandb]' (or drop train.wandb)")


def _check_exit_signal(name: str) -> None:
    import signal

    from mimo_train.runtime.preemption import signal_number
    try:
        number = signal_number(name)
    except AttributeError:
        raise TrainConfigError(f"train.exit_signals names {name!r}, not a signal: use names "
                               "such as SIGTERM or SIGUSR1") from None
    if number in (signal.SIGKILL, signal.SIGSTOP):
        raise TrainConfigError(f"train.exit_signals names {name}, which no process can catch")


@dataclass
class CheckpointConfig:
    dir: str | None = None
    interval: int = 0                                 # 0: only at the end
    resume: bool = True                               # continue from dir's latest checkpoint
    async_save: bool = False                          # write in the background (``Saver``)


@dataclass
class TrainConfig:
    data: DataConfig = field(default_factory=DataConfig)
    layout: object = "language=dp1"
    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: RunConfig = field(default_factory=RunConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    @classmethod
    def load(cls, path: str | None, overrides=()) -> TrainConfig:
        """Read ``path`` (YAML; None: defaults only), apply ``key.path=value`` overrides
        (values parsed as YAML), validate."""
        data: dict = {}
        if path is not None:
            path = os.path.abspath(path)
            try:
                with open(path) as f:
                    data = yaml.safe_load(f) or {}
            except OSError as error:
                raise TrainConfigError(f"cannot read training config {path}: {error}") from None
            except yaml.YAMLError as error:
                raise TrainConfigError(f"{path} is not valid YAML: {error}") from None
            if not isinstance(data, dict):
                raise TrainConfigError(f"{path}: the top level must be a mapping")
            _resolve_paths(data, os.path.dirname(path))
        for override in overrides:
            _apply_override(data, override, os.getcwd())
        config = _build(cls, data, "")
        config.validate()
        return config

    @classmethod
    def from_dict(cls, data: dict) -> TrainConfig:
        """The config ``to_dict`` wrote (a checkpoint's meta.json): paths already absolute."""
        config = _build(cls, copy.deepcopy(data), "")
        config.validate()
        return config

    def to_dict(self) -> dict:
        """The config as written into checkpoints and logs: secrets in
        ``data.storage_options`` redacted."""
        data = dataclasses.asdict(self)
        data["data"]["storage_options"] = redacted(data["data"]["storage_options"])
        return data

    def validate(self) -> None:
        run, opt = self.train, self.optimizer
        if not self.data.datasets:
            raise TrainConfigError("data.datasets is empty: list the shard directories written "
                                   "by mimo-shard build")
        if self.data.weights is not None and len(self.data.weights) != len(self.data.datasets):
            raise TrainConfigError(f"data.weights has {len(self.data.weights)} entries for "
                                   f"{len(self.data.datasets)} datasets: give one per dataset")
        for name, value in (("train.steps", run.steps), ("train.global_batch_size",
                            run.global_batch_size), ("train.micro_batch_size",
                            run.micro_batch_size), ("train.log_interval", run.log_interval),
                            ("train.eval_steps", run.eval_steps)):
            if value < 1:
                raise TrainConfigError(f"{name} is {value}: it must be >= 1")
        if self.data.balance not in BALANCE:
            raise TrainConfigError(f"data.balance is {self.data.balance!r}: use "
                                   f"{' or '.join(BALANCE)}")
        if run.device not in ("auto", "cuda", "cpu"):
            raise TrainConfigError(f"train.device is {run.device!r}: use auto, cuda or cpu")
        if not run.collective_timeout_minutes > 0:
            raise TrainConfigError(f"train.collective_timeout_minutes is "
                                   f"{run.collective_timeout_minutes}: it must be > 0")
        if run.max_skipped_steps < 0 or run.spike_factor < 0 or run.spike_window < 1:
            raise TrainConfigError(
                f"train.max_skipped_steps {run.max_skipped_steps}, spike_factor "
                f"{run.spike_factor}, spike_window {run.spike_window}: use a count >= 0, a "
                "factor >= 0 (0: no spike records) and a window >= 1")
        if run.wandb is not None:
            _check_wandb(run.wandb)
        for name in run.exit_signals:
            _check_exit_signal(str(name))
        if run.precision not in ("fp32", "bf16"):
            raise TrainConfigError(f"train.precision is {run.precision!r}: use fp32 or bf16")
        if run.peak_tflops is not None and not run.peak_tflops > 0:
            raise TrainConfigError(f"train.peak_tflops is {run.peak_tflops}: give the GPU's "
                                   "peak TFLOP/s (> 0) or leave it unset")
        opt.check()
        for module in opt.modules:
            opt.of(module).check(module)
        for part, lora in self.model.lora.items():
            lora.check(part)
        if self.model.language.recompute not in LANGUAGE_RECOMPUTE:
            raise TrainConfigError(f"model.language.recompute is "
                                   f"{self.model.language.recompute!r}: use "
                                   f"{', '.join(LANGUAGE_RECOMPUTE)}")
        for name, encoder in self.model.encoders.items():
            if encoder.recompute not in ENCODER_RECOMPUTE:
                raise TrainConfigError(f"model.encoders.{name}.recompute is "
                                       f"{encoder.recompute!r}: use "
                                       f"{' or '.join(ENCODER_RECOMPUTE)} (a transformers "
                                       "tower has no selective recomputation)")
        if self.model.attention not in ATTENTION:
            raise TrainConfigError(f"model.attention is {self.model.attention!r}: use "
                                   f"{', '.join(ATTENTION)}")
        if self.model.projection not in (None, "linear", "mlp", "none"):
            raise TrainConfigError(f"model.projection is {self.model.projection!r}: use linear, "
                                   "mlp or none")
        if self.data.valid and run.eval_interval < 1:
            raise TrainConfigError("data.valid is set but train.eval_interval is 0: set an "
                                   "interval (steps) or drop data.valid")
        if run.eval_interval and not self.data.valid:
            raise TrainConfigError("train.eval_interval is set but data.valid lists no shard "
                                   "directory to evaluate on")

    @property
    def resolved(self) -> bool:
        """Whether the families' resolve step has filled the model
        (``mimo_train.families.registry.resolve``)."""
        language = self.model.language
        return None not in (language.num_layers, language.hidden_size,
                            language.num_attention_heads, self.model.projection)

    def warmup_steps(self, module: str | None = None) -> tuple[int, str | None]:
        """The LR warmup of this run (of ``module``'s optimizer), and a note when its
        ``warmup_steps`` was clamped to ``train.steps - 1``."""
        warmup, steps = self.optimizer.of(module or "").warmup_steps, self.train.steps
        if warmup < steps:
            return warmup, None
        key = f"optimizer.modules.{module}" if module in self.optimizer.modules else "optimizer"
        return steps - 1, (f"{key}.warmup_steps {warmup} clamped to {steps - 1} for a "
                           f"{steps}-step run")

    def check_inputs(self) -> None:
        """The input files exist (the shard directories are the trainer's check)."""
        if self.data.preprocess is None:
            raise TrainConfigError("data.preprocess is not set: give the preprocessing YAML "
                                   "(e.g. configs/preprocess.yaml)")
        wanted: list[tuple[str, str, Callable[[str], bool], str]] = [
            ("data.preprocess", self.data.preprocess, os.path.isfile, "no such file")]
        if self.model.init_from:
            wanted.append(("model.init_from", self.model.init_from, os.path.isdir,
                           "no such directory"))
        for key, path, exists, what in wanted:
            if not exists(path):
                raise TrainConfigError(
                    f"{key}: {what}: {path} (paths in the YAML are taken from its folder, "
                    "paths in key=value overrides from the current directory)")


# (section, ..., key): path values; "*" matches any key; a list value is a list of paths.
PATH_KEYS = (("data", "datasets"), ("data", "preprocess"), ("data", "valid"), ("data", "cache_dir"),
             ("model", "init_from"), ("model", "pretrained"),
             ("model", "encoders", "*", "pretrained"), ("model", "language", "pretrained"),
             ("train", "tensorboard_dir"), ("train", "wandb", "dir"), ("checkpoint", "dir"))
_HUB_KEYS = {("model", "pretrained"), ("model", "encoders", "*", "pretrained"),
             ("model", "language", "pretrained")}


def _resolve(value: str, base: str, hub: bool) -> str:
    if is_remote(value):
        return value                                  # a URL: s3://bucket/prefix ...
    expanded = os.path.expanduser(value)
    path = os.path.normpath(os.path.join(base, expanded))
    if hub and not (os.path.isabs(expanded) or value.startswith((".", "~"))
                    or os.path.exists(path)):
        return value                                  # a hub name, e.g. org/model
    return path


def _resolve_paths(data: dict, base: str) -> None:
    """Make the path values in a raw config mapping absolute, relative ones taken from
    ``base``; values of the wrong type are left for the type checks."""
    def walk(node, keys: tuple, pattern: tuple):
        if not isinstance(node, dict):
            return
        head, rest = keys[0], keys[1:]
        names = list(node) if head == "*" else [head] if head in node else []
        for name in names:
            if rest:
                walk(node[name], rest, pattern)
                continue
            value, hub = node[name], pattern in _HUB_KEYS
            if isinstance(value, str) and value:
                node[name] = _resolve(value, base, hub)
            elif isinstance(value, list):
                node[name] = [_resolve(v, base, hub) if isinstance(v, str) and v else v
                              for v in value]

    for pattern in PATH_KEYS:
        walk(data, pattern, pattern)


def _apply_override(data: dict, override: str, base: str) -> None:
    """Set ``key.path=value`` in the raw mapping; path values are taken from ``base``."""
    key, sep, text = override.partition("=")
    if not sep or not key:
        raise TrainConfigError(f"override {override!r} is not key.path=value "
                               "(e.g. train.steps=50)")
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        if node.get(part) is None:                    # absent, or an empty YAML section
            node[part] = {}
        child = node[part]
        if not isinstance(child, dict):
            raise TrainConfigError(f"override {override!r}: {part} is not a section")
        node = child
    try:
        value = yaml.safe_load(text) if text else None
    except yaml.YAMLError as error:
        raise TrainConfigError(f"override {override!r}: the value is not valid YAML "
                               f"({error.__class__.__name__}); quote it or fix the brackets"
                               ) from None
    alone: Any = value                                # the override as a mapping of its own
    for part in reversed(parts):
        alone = {part: alone}
    _resolve_paths(alone, base)
    for part in parts:
        alone = alone[part]
    node[parts[-1]] = alone


def _build(cls, data, where: str):
    """Dataclass ``cls`` from a mapping, recursively; unknown keys are errors."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise TrainConfigError(f"{where.rstrip('.') or 'the config'} must be a mapping, "
                               f"got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise TrainConfigError(f"unknown key(s) {', '.join(where + k for k in unknown)}; "
                               f"known under {where or 'the top level'}: {', '.join(fields)}")
    values = {}
    for name, value in data.items():
        kind = _SECTIONS.get((cls, name))
        if kind in _NAMED:
            if not isinstance(value or {}, dict):
                raise TrainConfigError(f"{where}{name} must be a mapping of module name to "
                                       f"settings, got {value!r}")
            value = {module: _build(kind, spec, f"{where}{name}.{module}.")
                     for module, spec in (value or {}).items()}
        elif kind is not None:               # a section (None: an optional one left out)
            value = None if value is None and fields[name].default is None else \
                _build(kind, value, f"{where}{name}.")
        else:
            value = _typed(str(fields[name].type), value, where + name)
        values[name] = copy.deepcopy(value)
    return cls(**values)


# Field annotations (strings: ``from __future__ import annotations``) -> accepted types.
_TYPES: dict[str, type | tuple[type, ...]] = {"int": int, "float": (int, float), "str": str,
                                              "bool": bool, "list": list}


def _typed(annotation: str, value: Any, key: str) -> Any:
    """``value`` if it fits the field's annotation (e.g. ``int``, ``list | None``); a float
    field also takes text such as ``1e-4``, which YAML 1.1 does not read as a number."""
    names = [name.strip() for name in annotation.split("|")]
    if value is None and "None" in names:
        return value
    for name in names:
        kinds: Any = _TYPES.get(name)
        if kinds is None:                             # e.g. object: anything goes
            return value
        if isinstance(value, kinds) and not (isinstance(value, bool) and name != "bool"):
            return float(value) if name == "float" else value
        if name == "float" and isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    raise TrainConfigError(f"{key} is {value!r} ({type(value).__name__}): it must be "
                           f"{' or '.join(names)}")


_SECTIONS = {(TrainConfig, "data"): DataConfig, (TrainConfig, "model"): ModelConfig,
             (TrainConfig, "optimizer"): OptimizerConfig, (TrainConfig, "train"): RunConfig,
             (TrainConfig, "checkpoint"): CheckpointConfig,
             (ModelConfig, "language"): LanguageConfig, (ModelConfig, "encoders"): EncoderConfig,
             (ModelConfig, "lora"): LoraConfig, (OptimizerConfig, "modules"): ModuleOptimizerConfig,
             (RunConfig, "wandb"): WandbConfig}
# sections that map names (modules, parts) to settings of one kind
_NAMED = (EncoderConfig, LoraConfig, ModuleOptimizerConfig)
