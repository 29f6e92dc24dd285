"""The one training config: a YAML file plus ``key.path=value`` overrides, parsed and validated.

    cfg = TrainConfig.load("configs/train/images_audio_noncolocated.yaml", ["train.steps=50"])
    plan = resolve(cfg)     # mimo_train.plan: what the run builds, from the checkpoints it names

This module reads no checkpoint: the language model's dims left unset here (``None``) are
taken by ``mimo_train.plan.resolve`` from ``model.language.pretrained`` / ``model.pretrained`` or
``LANGUAGE_DEFAULTS``, into a frozen ``RunPlan``; the config itself is never changed.

Types: each field's annotation is the whole rule for its value (``fields``): a section is a
dataclass, ``dict[str, EncoderConfig]`` a mapping of module names to sections,
``Annotated[str, OneOf(...)]`` a choice, ``Annotated[int, Range(1)]`` a bound; the rules between
fields are ``TrainConfig.validate``'s. Errors name the full dotted key. The YAML and overrides
are read by ``sources``.

Sections: ``data`` (shard dirs, blend weights, the preprocessing config, a validation set),
``layout`` (as the loader takes it: a string such as ``"image=dp1;audio=dp1;language=dp1"`` or a
dict; checked to parse here), ``model`` (language-model dims, one entry per encoder module,
projections, frozen modules, LoRA), ``optimizer`` (with warmup + cosine LR), ``train``
(batches, steps, eval, logging, seed, device, precision) and ``checkpoint``. Unknown keys are
errors naming the key, so a typo never falls back silently to a default.

Paths: a relative path written in the YAML file is taken from the file's folder (``datasets:
[../../runs/demo/shards]``), one given as an override from the current directory; both are
stored absolute. ``sources.PATH_KEYS`` lists the path keys. ``model.encoders.<name>.pretrained`` and
``model.language.pretrained`` also take a hub name (``org/model``): a value there is a path
when it is absolute, starts with ``.`` or ``~``, or exists relative to the base folder;
otherwise it is kept as a hub name.
``check_inputs`` reports a missing input path with its key and resolved path.

Warmup: ``optimizer.warmup_steps`` as long as the run or longer is clamped to ``train.steps -
1`` (the cosine decay needs one step), with a one-line note, so a short smoke run
(``train.steps=3``) needs no other override; the decay always spans ``train.steps``.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated

import yaml

from mimo_data.arguments import RUN_SEED
from mimo_data.files import load_yaml
from mimo_data.preprocess.config import PreprocessConfig
from mimo_data.loading.balance import BALANCE
from mimo_data.loading.layout import Layout, LayoutError
from mimo_data.loading.sample_order import weights_fault
from mimo_data.shards.storage import redacted
from mimo_train.config.fields import Count, OneOf, Positive, Range, build, check_fields
from mimo_train.config.sources import apply_override, resolve_paths
from mimo_train.errors import TrainConfigError

# model.attention values (mimo_train.mcore.attention says what each runs)
ATTENTION = ("auto", "local", "sdpa", "varlen")
# activation recomputation (docs/training.md, "Memory at real sizes"): the language model's
# model.language.recompute, an encoder module's model.encoders.<module>.recompute
LANGUAGE_RECOMPUTE = ("none", "selective", "full")
ENCODER_RECOMPUTE = ("none", "full")


# the names transformers gives settings of ours (its Trainer's TrainingArguments, its model
# configs'), wherever a user coming from it writes them: said as ours (``ELSEWHERE``)
TRANSFORMERS_NAMES = {theirs: f"{ours} here (transformers' {theirs})" for theirs, ours in {
    "max_steps": "train.steps", "per_device_train_batch_size": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.global_batch_size (the micro-batches of a step: "
    "global / (micro x language dp))",
    "logging_steps": "train.log_interval", "bf16": "train.precision (bf16)",
    "seed": "train.seed", "learning_rate": "optimizer.lr",
    "warmup_steps": "optimizer.warmup_steps", "weight_decay": "optimizer.weight_decay",
    "max_grad_norm": "optimizer.clip_grad", "save_steps": "checkpoint.interval",
    "save_total_limit": "checkpoint.keep_last", "output_dir": "checkpoint.dir",
    "router_aux_loss_coef": "model.language.moe_aux_loss",
    "gradient_checkpointing": "model.language.recompute (and model.encoders.<module>.recompute)",
    "attn_implementation": "model.attention", "fp16": "train.precision (bf16 or fp32)",
    "lr_scheduler_type": "optimizer.min_lr (a cosine decay to it, after warmup_steps)",
    "resume_from_checkpoint": "checkpoint.resume (and latest in checkpoint.dir)",
    "num_train_epochs": "train.steps (an epoch's steps: mimo-inspect plan says them)"}.items()}
# PEFT's LoraConfig names of model.lora.<part>'s settings
PEFT_NAMES = {theirs: f"{ours} here (PEFT's {theirs})" for theirs, ours in {
    "r": "rank", "lora_alpha": "alpha", "lora_dropout": "dropout",
    "target_modules": "targets"}.items()}


@dataclass
class DataConfig:
    # the preprocessing config's keys, given here by mistake: where they go
    ELSEWHERE = {      # a class attribute (no annotation): not a field
        each.name: "the preprocessing config (the data.preprocess YAML), not the training "
        "config" for each in dataclasses.fields(PreprocessConfig)}
    datasets: list[str] = field(default_factory=list)  # shard directories or URLs (s3://...)
    weights: list[float] | None = None                 # blend weights, one per dataset
    preprocess: str | None = None                      # PreprocessConfig YAML (required)
    valid: list[str] = field(default_factory=list)     # shard directories for evaluation
    # worker processes per rank: the loader's on ranks that decode media, and a missing token
    # table's share of this rank
    num_workers: Count = 0
    cache_dir: str | None = None    # derived tables of read-only datasets (MIMO_CACHE_DIR wins)
    # fsspec options of URL datasets (e.g. {client_kwargs: {endpoint_url: ...}}); credentials
    # belong in the environment or the client's config, not here: the YAML is copied into runs
    storage_options: dict = field(default_factory=dict)
    # tokens: near-equal tokens per DP rank in every step
    balance: Annotated[str, OneOf(BALANCE)] = "none"
    # pack each language DP rank's micro-batch into sequences of seq_length (no padding;
    # attention stays inside each sample)
    packing: bool = False
    # an encoder module fanning in (more DP ranks than the language model's): its ranks of a
    # language rank each encode a token-balanced part of that rank's micro-batch's media,
    # images whole, a clip cut between temporal patches (one long clip over several ranks);
    # off: each encoder rank encodes whole samples. Qwen2-VL-family towers only
    split_media: bool = False
    # refuse to start (exit 1) where preprocessing drops more than this fraction of
    # data.datasets' samples (too long, damaged media ...); None: any, said at start-up
    max_dropped_fraction: Annotated[float, Range(0, 1)] | None = None


@dataclass
class LanguageConfig:
    """The language model: random init from these dims, or ``pretrained``: a transformers
    Llama / Qwen2 / Qwen3 directory (or cached hub name), or a whole VLM's, whose
    config.json gives the dims and M-RoPE section (any also set here must agree) and whose
    weights are loaded (``mimo_train/families/causal_lm/``)."""
    ELSEWHERE = TRANSFORMERS_NAMES
    num_layers: Positive | None = None                # default 2 (or the checkpoint's)
    hidden_size: Positive | None = None               # default 64
    num_attention_heads: Positive | None = None       # default 4
    ffn_hidden_size: Positive | None = None           # default 4 * hidden_size
    vocab_size: Positive | None = None                # default: tokenizer size, padded
    vocab_multiple: Positive = 128                    # padding of the default vocab size
    # M-RoPE: rotary pairs given to (time, height, width), summing to head_dim / 2 (Qwen2-VL's
    # mrope_section); the preprocessing must then use positions: mrope
    mrope_section: list[int] | None = None
    pretrained: str | None = None
    # activation recomputation: none, selective (core attention recomputed in the backward
    # pass) or full (each layer's input kept, the layer recomputed)
    recompute: Annotated[str, OneOf(LANGUAGE_RECOMPUTE)] = "none"
    # sequence parallel over the language model's tensor-parallel ranks (TP > 1; at TP 1
    # there is nothing to split and the setting is refused)
    sequence_parallel: bool = False
    # a mixture of experts' load-balancing loss (transformers' Switch loss over all MoE
    # layers), its coefficient (0: off; the checkpoint's router_aux_loss_coef is transformers'
    # when it trains with router logits), computed from the global batch's expert counts
    # (mcore.balance: one more forward pass per step)
    moe_aux_loss: Annotated[float, Range(0)] = 0.0
    # the output layer and loss taken this many tokens at a time (mcore.language_loss), so
    # that only one chunk's logits exist at once, not the micro-batch's (0: all at once);
    # the same loss and gradients
    loss_chunk_tokens: Count = 0


def check_mrope(section: list | None, head_dim: int) -> None:
    """``TrainConfigError`` unless ``model.language.mrope_section`` (if set) splits
    ``head_dim``, the rotating part of each head."""
    if section is None:
        return
    if (len(section) != 3 or not all(isinstance(n, int) and n > 0 for n in section)
            or 2 * sum(section) != head_dim):
        raise TrainConfigError(
            f"model.language.mrope_section is {section}: give three positive counts of "
            f"rotary pairs (time, height, width) summing to head_dim / 2 = {head_dim // 2}")


# the language model's dims without a checkpoint (``plan.resolve`` takes them)
LANGUAGE_DEFAULTS = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4}
# a randomly initialized encoder tower's dims where model.encoders.<module> sets none
ENCODER_DEFAULTS = {"hidden_size": 32, "num_layers": 1, "num_attention_heads": 2}


@dataclass
class EncoderConfig:
    """One encoder module. ``kind``: ``qwen2_vl`` or ``qwen2_5_vl`` (dynamic-resolution
    patches), ``siglip`` (fixed-size images) or ``whisper`` (log-mel frames); default from the
    modality and the preprocessing policy (a whole VLM's tower: its own kind). ``pretrained``:
    a transformers model directory (or hub name) whose weights replace the random init; its
    geometry must match the preprocessing config."""
    kind: str | None = None
    # a randomly initialized tower's dims (unset: ENCODER_DEFAULTS); a pretrained one's
    # come from its checkpoint
    hidden_size: Positive | None = None
    num_layers: Positive | None = None
    num_attention_heads: Positive | None = None
    pretrained: str | None = None
    # activation recomputation of the tower: none, or full (transformers' gradient
    # checkpointing: each layer's input kept, the layer recomputed in the backward pass)
    recompute: Annotated[str, OneOf(ENCODER_RECOMPUTE, "a transformers tower has no "
                                    "selective recomputation")] = "none"
    # the projection after its tower: linear | mlp | none; default model.projection (a
    # whole VLM's tower: its own projector, which this cannot replace)
    projection: Annotated[str, OneOf(("linear", "mlp", "none"))] | None = None


@dataclass
class LoraConfig:
    """LoRA on a part's linear layers (``mimo_train.model.lora``): W x + alpha / rank * B A x,
    A random, B zero (``init_lora_weights: false``: B random too, as PEFT's option)."""
    ELSEWHERE = PEFT_NAMES
    rank: Positive = 8
    alpha: Annotated[float, Range(0, open_low=True)] = 16.0
    dropout: Annotated[float, Range(0, 1, open_high=True)] = 0.0
    # layer names (linear_qkv, q_proj, ...), dotted paths or fnmatch patterns over the part's
    # linear layers (decoder.layers.*.mlp.linear_fc1), or all-linear (all but the output layer
    # and a mixture of experts' routed experts, as PEFT's)
    targets: list[str] = field(default_factory=lambda: ["all-linear"])
    init_lora_weights: bool = True


@dataclass
class ModelConfig:
    ELSEWHERE = TRANSFORMERS_NAMES
    # a whole VLM (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5, LLaVA; mimo_train/families/): the
    # image encoder, the projection and the language model from one checkpoint, unless set below
    pretrained: str | None = None
    language: LanguageConfig = field(default_factory=LanguageConfig)
    encoders: dict[str, EncoderConfig] = field(default_factory=dict)   # by module name
    # the projection after each encoder module's tower (unless its model.encoders entry says
    # another): linear | mlp (Linear-GELU-Linear) | none (identity); default linear. A whole
    # VLM's tower keeps the VLM's own projector
    projection: Annotated[str, OneOf(("linear", "mlp", "none"))] | None = None
    # modules whose weights stay fixed, or an encoder module's part: image.encoder (the tower;
    # its projection trains) or image.projection
    freeze: list[str] = field(default_factory=list)
    init_from: str | None = None                      # step_* dir of a mimo_train checkpoint
    # the attention kernels (mimo_train.mcore.attention)
    attention: Annotated[str, OneOf(ATTENTION)] = "auto"
    # LoRA adapters, by part as model.freeze names them (language, <module>, <module>.encoder,
    # <module>.projection); the part's own weights stay fixed
    lora: dict[str, LoraConfig] = field(default_factory=dict)


@dataclass
class ModuleOptimizerConfig:
    """One module's own settings (``optimizer.modules.<module>``); unset ones are the
    optimizer's, but for ``min_lr`` with ``lr`` set: the optimizer's ``min_lr`` scaled as
    ``lr`` is (the same decay, from the module's rate)."""
    lr: Annotated[float, Range(0)] | None = None
    min_lr: float | None = None
    warmup_steps: Count | None = None
    weight_decay: Annotated[float, Range(0)] | None = None
    distributed: bool | None = None
    overlap_grad_reduce: bool | None = None
    bucket_size: Positive | None = None


@dataclass
class OptimizerConfig:
    ELSEWHERE = TRANSFORMERS_NAMES
    lr: Annotated[float, Range(0)] = 1e-3
    # in [0, lr] (``check``); unset: a tenth of lr (1e-4 at the default lr), so that a
    # config giving lr alone decays from it and is not refused below 1e-4
    min_lr: float | None = None
    warmup_steps: Count = 0
    weight_decay: Annotated[float, Range(0)] = 0.0
    adam_beta1: Annotated[float, Range(0, 1, open_high=True)] = 0.9
    adam_beta2: Annotated[float, Range(0, 1, open_high=True)] = 0.95
    clip_grad: Annotated[float, Range(0)] = 1.0
    # megatron-core's distributed optimizer: the fp32 main weights and Adam moments sharded
    # over the module's DP group (gradients reduce-scattered, weights all-gathered)
    distributed: bool = False
    # start each bucket's gradient reduction during the backward pass (on the CPU too: gloo's
    # asynchronous collectives), buckets of bucket_size elements (None: megatron-core's
    # default, max(40M, 1M x DP size))
    overlap_grad_reduce: bool = False
    bucket_size: Positive | None = None
    # module name -> its own settings (e.g. image: {lr: 1e-4}: the tower at a tenth)
    modules: dict[str, ModuleOptimizerConfig] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.min_lr is None and isinstance(self.lr, (int, float)):
            self.min_lr = self.lr / 10

    def of(self, module: str) -> OptimizerConfig:
        """The settings of ``module``: its own where ``modules`` sets them, else these."""
        own = self.modules.get(module) or ModuleOptimizerConfig()
        values = {f.name: getattr(own, f.name) for f in dataclasses.fields(own)
                  if getattr(own, f.name) is not None}
        if "lr" in values and "min_lr" not in values:
            values["min_lr"] = self.min_lr * values["lr"] / self.lr if self.lr else 0.0
        return dataclasses.replace(self, modules={}, **values)

    def check(self, module: str | None = None) -> None:
        """What the fields' types do not say: ``min_lr`` in [0, ``lr``]; ``bucket_size``
        where ``overlap_grad_reduce`` uses it (megatron-core leaves it unused without): a
        module's own with its overlap, the optimizer's with its own or some module's."""
        where = f"optimizer.modules.{module}." if module else "optimizer."
        assert self.min_lr is not None                 # (__post_init__ sets it from lr)
        if not 0 <= self.min_lr <= self.lr:
            raise TrainConfigError(
                f"{where}min_lr {self.min_lr} must be in [0, lr={self.lr}]" + (
                    f": where {where}lr changes, give {where}min_lr beside it (e.g. "
                    f"{where}min_lr={self.lr / 10:g}, a tenth of it)"
                    if self.min_lr > self.lr else ""))
        if module is not None:          # (a module's: ``of``'s, its own modules gone)
            return
        unused = [("optimizer.", self.bucket_size)] if self.bucket_size is not None and not (
            self.overlap_grad_reduce or any(self.of(name).overlap_grad_reduce
                                            for name in self.modules)) else []
        unused += [(f"optimizer.modules.{name}.", own.bucket_size)
                   for name, own in self.modules.items()
                   if own.bucket_size is not None and not self.of(name).overlap_grad_reduce]
        for where, size in unused[:1]:
            raise TrainConfigError(
                f"{where}bucket_size {size} is the size of the buckets overlap_grad_reduce "
                "reduces during the backward pass, and overlap_grad_reduce is off (megatron-core "
                "then reduces all at once and would leave it unused): set "
                f"{where}overlap_grad_reduce: true, or leave bucket_size out")


@dataclass
class WandbConfig:
    """Weights & Biases beside TensorBoard (rank 0; ``pip install 'mimo[wandb]'``): the same
    fields as the JSONL records, and the config."""
    project: str | None = None
    name: str | None = None                           # default: wandb's
    mode: Annotated[str, OneOf(("online", "offline", "disabled"))] = "online"
    dir: str | None = None                            # default: wandb's (./wandb)
    # the W&B run to log into (resumed if it exists); default: the run's own, kept in
    # checkpoint.dir/wandb_run_id, so a resumed run logs into the same W&B run
    id: str | None = None


@dataclass
class ProfileConfig:
    """torch.profiler over steps ``start .. start + steps - 1`` (from 1) of every rank (and
    the step before, a lead-in it does not summarize): a
    summary per rank in ``dir/profile_rank{R}.json`` (``mimo_train.runtime.profile``), the
    Chrome trace beside it with ``trace``; on the CPU with ``waits``, the operators that would
    make the host wait on a GPU, at their callers (every operator then goes through Python:
    the profiled steps run several times slower)."""
    dir: str = ""
    start: Positive = 3
    steps: Positive = 2
    trace: bool = False
    waits: bool = False


@dataclass
class RunConfig:
    ELSEWHERE = TRANSFORMERS_NAMES
    global_batch_size: Positive = 8
    micro_batch_size: Positive = 2                    # per language DP rank
    steps: Positive = 20
    exit_interval: Count = 0                          # stop once step % this == 0 (0: never)
    # stop with a checkpoint after the first step that ends this long after the run started
    # (0: never): a job's time limit minus the longest step and save
    exit_duration_minutes: Annotated[float, Range(0)] = 0.0
    eval_interval: Count = 0                          # 0: no evaluation
    eval_steps: Positive = 1
    log_interval: Positive = 1
    # the model's, the data order's and each module's seeds derive from it (a module's a
    # million times it: within torch's 64 bits)
    seed: Annotated[int, Range(0, 2**32 - 1)] = RUN_SEED
    device: Annotated[str, OneOf(("auto", "cuda", "cpu"))] = "auto"
    precision: Annotated[str, OneOf(("fp32", "bf16"))] = "fp32"
    # the MFU's denominator: dense peak TFLOP/s of one GPU (default: the GPU's, by its name and
    # train.precision, planning.flops.peak_tflops; none on a CPU or an unknown GPU: no MFU)
    peak_tflops: Annotated[float, Range(0, open_low=True, hint="give the GPU's peak TFLOP/s "
                                        "or leave it unset")] | None = None
    # a collective no rank completes fails
    collective_timeout_minutes: Annotated[float, Range(0, open_low=True)] = 10.0
    # steps with a non-finite loss or gradient norm are skipped; past this many the run stops
    max_skipped_steps: Count = 10
    # a step whose loss is above spike_factor x the median of the last spike_window steps is
    # recorded with its samples (0: off)
    spike_factor: Annotated[float, Range(0)] = 3.0
    spike_window: Positive = 50
    # signals that stop the run after the current step with a checkpoint (preemption)
    exit_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])
    tensorboard_dir: str | None = None
    wandb: WandbConfig | None = None
    profile: ProfileConfig | None = None


def _check_wandb(wandb: WandbConfig) -> None:
    if not wandb.project:
        raise TrainConfigError("train.wandb.project is not set: name the W&B project (or drop "
                               "train.wandb)")
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
    ELSEWHERE = TRANSFORMERS_NAMES
    dir: str | None = None
    interval: Count = 0                               # 0: only at the end
    resume: bool = True                               # continue from dir's latest checkpoint
    async_save: bool = False                          # write in the background (``Saver``)
    # keep the newest N checkpoints, deleting older step directories once a save is complete
    # (None: keep all)
    keep_last: Positive | None = None

    def note(self) -> str | None:
        """A start-up note when ``interval``, ``keep_last`` or ``async_save`` is set but
        nothing can be saved."""
        given = [f"checkpoint.{key} {str(value).lower()}" for key, value in (
            ("interval", self.interval), ("keep_last", self.keep_last),
            ("async_save", self.async_save)) if value]
        if given and not self.dir:
            return (f"{' and '.join(given)} {'is' if len(given) == 1 else 'are'} set but "
                    "checkpoint.dir is not: no checkpoint will be saved (set checkpoint.dir "
                    "to save)")
        return None


def refuse_preprocessing_config(data: dict, path: str) -> None:
    """``TrainConfigError`` where the YAML read from ``path`` is a preprocessing config (its
    keys, none of a training config's), given where a training config goes."""
    if {"tokenizer", "modalities"} & set(data) and not {"model", "data"} & set(data):
        raise TrainConfigError(
            f"{path} is a preprocessing config (tokenizer and modalities at its top level), "
            "not a training config: give it as the training config's data.preprocess "
            "(mimo-inspect: --config)")
    if {"model_type", "architectures"} & set(data) and not {"model", "data"} & set(data):
        raise TrainConfigError(
            f"{path} is a transformers model's config, not a training config: give its folder "
            f"({os.path.dirname(path)}) as model.pretrained of a training config (configs/train/"
            "holds one per family, e.g. qwen2_vl_finetune.yaml)")


@dataclass
class TrainConfig:
    ELSEWHERE = TRANSFORMERS_NAMES
    data: DataConfig = field(default_factory=DataConfig)
    # as the loader takes it: "image=dp1;language=dp1", a mapping, or a YAML file's path
    layout: str | dict = "language=dp1"
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
                    data = load_yaml(f) or {}
            except IsADirectoryError:
                raise TrainConfigError(f"{path} is a folder: give the training config's YAML "
                                       "file (configs/train/ holds one per family)") from None
            except OSError as error:
                raise TrainConfigError(f"cannot read training config {path}: {error}") from None
            except yaml.YAMLError as error:
                raise TrainConfigError(f"{path} is not valid YAML: {error}") from None
            except UnicodeDecodeError:
                raise TrainConfigError(f"{path} is not a text file, so no YAML: give the "
                                       "training config's YAML file (configs/train/ holds one "
                                       "per family)") from None
            if not isinstance(data, dict):
                raise TrainConfigError(f"{path}: the top level must be a mapping")
            refuse_preprocessing_config(data, path)
            resolve_paths(data, os.path.dirname(path))
        for override in overrides:
            apply_override(data, override, os.getcwd(),
                           frozenset(f.name for f in dataclasses.fields(LoraConfig)))
        config = build(cls, data, "")
        config.validate()
        return config

    @classmethod
    def from_dict(cls, data: dict) -> TrainConfig:
        """The config ``to_dict`` wrote (a checkpoint's meta.json): paths already absolute.
        What an earlier mimo wrote that this one reads otherwise is read as that one meant
        it: encoder dims it wrote as its defaults (``ENCODER_DEFAULTS``, beside a pretrained
        tower too) unset, which gives a random tower the same; ``train.profile`` left out (a
        saved run's profiling is no part of its model)."""
        data = copy.deepcopy(data)
        for entry in ((data.get("model") or {}).get("encoders") or {}).values():
            for key, default in ENCODER_DEFAULTS.items():
                if isinstance(entry, dict) and entry.get(key) == default:
                    entry[key] = None
        if isinstance(data.get("train"), dict):
            data["train"]["profile"] = None
        config = build(cls, data, "")
        config.validate()
        return config

    def to_dict(self) -> dict:
        """The config as written into checkpoints and logs: secrets in
        ``data.storage_options`` redacted."""
        data = dataclasses.asdict(self)
        data["data"]["storage_options"] = redacted(data["data"]["storage_options"])
        return data

    def validate(self) -> None:
        """Every field's type, choices and range (its annotation), then the rules between
        fields; ``TrainConfigError`` naming the key."""
        check_fields(self, "")
        run, opt = self.train, self.optimizer
        if not self.data.datasets:
            raise TrainConfigError("data.datasets is empty: list the shard directories written "
                                   "by mimo-shard build")
        fault = (None if self.data.weights is None
                 else weights_fault(self.data.weights, len(self.data.datasets)))
        if fault is not None:
            raise TrainConfigError(f"data.weights: {fault}")
        if run.wandb is not None:
            _check_wandb(run.wandb)
        if run.profile is not None and not run.profile.dir:
            raise TrainConfigError("train.profile.dir is not set: name the directory the "
                                   "profile summaries go to (or drop train.profile)")
        if run.profile is not None and run.profile.start + run.profile.steps - 1 > run.steps:
            last = run.profile.start + run.profile.steps - 1
            raise TrainConfigError(
                f"train.profile covers steps {run.profile.start}..{last}, past train.steps "
                f"{run.steps}: the run would end before the profile does and write none; lower "
                "train.profile.start or train.profile.steps")
        for name in run.exit_signals:
            _check_exit_signal(str(name))
        opt.check()
        for module in opt.modules:
            opt.of(module).check(module)
        for part, lora in self.model.lora.items():
            if not lora.targets:
                raise TrainConfigError(f"model.lora.{part}.targets is empty: list layer names "
                                       "or patterns, or [all-linear]")
        if self.data.valid and run.eval_interval < 1:
            raise TrainConfigError("data.valid is set but train.eval_interval is 0: set an "
                                   "interval (steps) or drop data.valid")
        if run.eval_interval and not self.data.valid:
            raise TrainConfigError("train.eval_interval is set but data.valid lists no shard "
                                   "directory to evaluate on")
        if run.eval_steps != 1 and not self.data.valid:      # 1: the default
            raise TrainConfigError(f"train.eval_steps is {run.eval_steps} but data.valid lists "
                                   "no shard directory to evaluate on: it would be ignored")
        try:
            Layout.parse(self.layout)
        except LayoutError as error:
            raise TrainConfigError(f"layout {self.layout!r}: {error}") from None

    def warmup_steps(self, module: str | None = None) -> tuple[int, str | None]:
        """The LR warmup of this run (of ``module``'s optimizer), and a note when its
        ``warmup_steps`` was clamped to ``train.steps - 1``."""
        warmup, steps = self.optimizer.of(module or "").warmup_steps, self.train.steps
        if warmup < steps:
            return warmup, None
        own = self.optimizer.modules.get(module or "")
        key = f"optimizer.modules.{module}" if own and own.warmup_steps is not None \
            else "optimizer"                    # one note for the modules that share it
        return steps - 1, (f"{key}.warmup_steps {warmup} clamped to {steps - 1} for a "
                           f"{steps}-step run")

    def check_inputs(self) -> None:
        """The input files exist (the shard directories are the trainer's check)."""
        if self.data.preprocess is None:
            raise TrainConfigError("data.preprocess is not set: give the preprocessing YAML "
                                   "(e.g. configs/preprocess.yaml)")
        if os.path.isdir(self.data.preprocess):
            raise TrainConfigError(f"data.preprocess: {self.data.preprocess} is a folder (a "
                                   "model's?), not a preprocessing YAML: make one from a "
                                   "model's folder with `mimo-train --preprocessing-for "
                                   "MODEL_DIR > preprocess.yaml`")
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
