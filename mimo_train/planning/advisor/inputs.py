"""What the layout advisor reads: the GPU (``gpu``: its memory, peak and links), the model
(``read_model``: a training config YAML or a checkpoint, resolved as the trainer resolves it,
its dims, passes, trained parts and the facts the trainer's rules read) and the work
(``read_work``: each step's samples from the dataset's token table, ``mimo_data.inspect.
workload``: their language lengths and each encoder module's FLOPs and patch grids).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from mimo_data.inspect.advice import AdvisorRequest
from mimo_data.loading.layout import LANGUAGE, Layout
from mimo_train.plan import rules
from mimo_train.planning.adapters import Adapters
from mimo_train.planning.dims import ModelDims
from mimo_train.planning.flops import item_grid, peak_tflops, step_flops, trains, training_passes
from mimo_train.planning.gpus import GPU, GPUS


def gpu(request: AdvisorRequest, precision: str) -> GPU:
    """The GPU of ``request`` (its kind, with the memory and peak it overrides)."""
    name, memory_gib, peak_name, node, network = GPUS[request.gpu]
    tflops = request.gpu_tflops if request.gpu_tflops is not None else \
        peak_tflops(peak_name, precision) or 0.0
    memory = request.gpu_memory_gib if request.gpu_memory_gib is not None else memory_gib
    given = [*([f"{memory:g} GiB"] if request.gpu_memory_gib is not None else []),
             *([f"{tflops:g} TFLOP/s"] if request.gpu_tflops is not None else [])]
    if given:                           # the kind's name alone would say its own figures
        name = f"{name} with {' and '.join(given)} given"
    return GPU(name, memory, float(tflops), node, network, request.gpus_per_node)


# ------------------------------------------------------------------------------- the model

@dataclass
class Model:
    """The dims and what else of a training config changes memory and time."""
    dims: ModelDims
    source: str
    precision: str = "bf16"
    passes: dict = field(default_factory=dict)        # flops.training_passes
    trained: dict = field(default_factory=dict)       # part -> its own weights train
    adapters: Adapters = field(default_factory=Adapters)    # model.lora's, trained
    attention_scores: bool = False                    # model.attention local
    packing: bool | None = None                       # a training YAML's data.packing
    optimizer_modules: tuple[str, ...] = ()           # its optimizer.modules entries
    facts: rules.Facts | None = None                  # what the trainer's rules read of it
    lora: Mapping[str, int] = field(default_factory=dict)    # part under LoRA -> rank
    # the rest of the run's settings the rules read: LoRA's targets, the balancing loss
    rule_settings: rules.Settings = field(default_factory=rules.Settings)
    loss_chunk_tokens: int = 0                        # model.language.loss_chunk_tokens
    split_media: bool = False                         # a training YAML's data.split_media
    # torch's varlen kernel (model.attention varlen, or auto in bf16): the Qwen-family towers
    # on it, and with packing the language model's rows
    varlen_kernel: bool = True
    # a training YAML's own train.precision (None: a checkpoint, whose run config the advisor
    # never reads): the printed command overrides it where the advised one differs
    config_precision: str | None = None

    def kernel_settings(self, packing: bool) -> dict[str, bool]:
        """``memory.Settings``' kernel fields for a run with or without ``packing``."""
        return {"tower_varlen": self.varlen_kernel,
                "varlen_rows": self.varlen_kernel and packing}

    def parameters(self, module: str) -> int:
        if module == LANGUAGE:
            return self.dims.language.parameters()
        return self.dims.encoders[module].parameters()


def own_preprocess(path: str) -> str | None:
    """The training config YAML ``path``'s ``data.preprocess``, resolved as the trainer
    resolves it (relative to the YAML's folder), or None (unset; a YAML that does not read is
    said by the config's own loading); TrainConfigError (a ValueError) for a path of the YAML
    that cannot be resolved (a URL with one slash)."""
    import yaml

    from mimo_data.files import load_yaml
    from mimo_train.config.sources import resolve_paths
    try:
        with open(path) as f:
            data = load_yaml(f)
    except (OSError, yaml.YAMLError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("data"), dict):
        return None
    resolve_paths(data, os.path.dirname(os.path.abspath(path)))
    own = data["data"].get("preprocess")
    return own if isinstance(own, str) and own else None


def preprocess_differs(path: str, preprocess_path: str) -> str | None:
    """Why the training config YAML ``path`` would run with another preprocessing than
    ``preprocess_path`` (its own ``data.preprocess``, a file of other contents), or None
    (the same file or settings, or none set there). The plan's figures are ``--config``'s,
    the run's its YAML's: two different files would plan a run that does not happen."""
    from mimo_data.errors import ConfigError
    from mimo_data.preprocess.config import PreprocessConfig
    own = own_preprocess(path)
    if own is None or not os.path.isfile(own):
        return None                 # unset, or missing: --config is what the plan can read
    try:
        if os.path.samefile(own, preprocess_path) or \
                PreprocessConfig.from_yaml(own) == PreprocessConfig.from_yaml(preprocess_path):
            return None             # a copy, comments and order aside
    except (OSError, ConfigError, ValueError) as error:
        return f"its data.preprocess {own} cannot be read: {error}"
    return (f"its data.preprocess is {own}, and --config {preprocess_path} differs from it: "
            "the run would preprocess with its own, so the plan would count samples it does "
            f"not train; give --config {own} (or point data.preprocess at {preprocess_path})")


_TAKES = ("give a training config YAML, a transformers checkpoint directory (or its "
          "config.json) or a hub name already in the local cache")


def _checkpoint_directory(path: str) -> str:
    """The local checkpoint directory ``--model`` names: the folder of a config.json, a
    directory, or a hub name's snapshot in the local cache (``TrainConfigError`` if none)."""
    from mimo_data.hub import not_cached
    from mimo_data.preprocess.config import looks_like_path
    from mimo_train.errors import TrainConfigError
    from mimo_train.families.base import model_directory
    expanded = os.path.expanduser(path)
    if path.endswith(".json"):
        if os.path.basename(path) != "config.json":
            raise TrainConfigError(f"{path} is not a checkpoint's config.json: {_TAKES}")
        return os.path.dirname(os.path.abspath(expanded))
    if os.path.isdir(expanded):
        return expanded
    if os.path.exists(expanded):
        raise TrainConfigError(f"{path} is a file, not a model: {_TAKES}")
    if looks_like_path(path):
        raise TrainConfigError(f"{os.path.abspath(expanded)} does not exist: {_TAKES}")
    if why := not_cached(path):
        raise TrainConfigError(why)
    return model_directory(path)


def read_model(path: str, preprocess_path: str, preprocess, modalities: dict[str, str],
               precision: str | None = None, vocab_size: int | None = None) -> Model:
    """``path``: a training config YAML, a transformers checkpoint directory or its
    config.json (a whole VLM, or a language model alone); its modules named as
    ``modalities`` (modality -> module) names them, the geometry from ``preprocess``;
    ``vocab_size``: the tokenizer's (with modality tokens; else read when needed).
    ``TrainConfigError`` where the trainer would refuse the model with this preprocessing."""
    from mimo_train.config import TrainConfig
    from mimo_train.errors import TrainConfigError
    from mimo_train.plan import check_training, resolve
    from mimo_train.planning.adapters import plan_adapters
    from mimo_train.planning.dims import from_plan
    modules = list(dict.fromkeys(modalities.values()))
    layout = Layout.from_dict({"modules": {name: {"dp": 1, "rank_offset": 0}
                                           for name in [LANGUAGE, *modules]},
                               "modalities": modalities})
    yaml = path.endswith((".yaml", ".yml"))
    # the candidates' settings replace the config's memory settings (each one the trainer's
    # rules refuse on some layout, and this one is a layout of the modules alone)
    overrides = [f"data.preprocess={os.path.abspath(preprocess_path)}", f"layout={layout}",
                 "model.language.sequence_parallel=false", "model.language.recompute=none"]
    split_media, config_precision = False, None
    if yaml:
        if differs := preprocess_differs(path, preprocess_path):
            raise TrainConfigError(differs)
        cfg = TrainConfig.load(path, overrides)
        # the YAML's own precision, which the run's command line overrides where --precision
        # asks for another
        config_precision = cfg.train.precision
        if precision is not None and precision != config_precision:
            cfg = TrainConfig.load(path, [*overrides, f"train.precision={precision}"])
        # the candidates' setting (the rules refuse it on this layout of the modules alone)
        split_media, cfg.data.split_media = cfg.data.split_media, False
    else:
        directory = _checkpoint_directory(path)
        try:
            with open(os.path.join(directory, "config.json")) as f:
                whole = json.load(f)
        except FileNotFoundError:
            raise TrainConfigError(f"{directory} holds no config.json: {_TAKES}") from None
        except (OSError, ValueError) as error:
            raise TrainConfigError(f"{os.path.join(directory, 'config.json')} cannot be read "
                                   f"({error})") from None
        from mimo_train.families.registry import VLMS
        key = "model.pretrained" if "vision_config" in whole or "text_config" in whole or \
            whole.get("model_type") in VLMS else "model.language.pretrained"
        if key == "model.language.pretrained" and modalities:
            # nothing says what the encoders are: their dims would be EncoderConfig's defaults
            raise TrainConfigError(
                f"{directory} is a language model alone, and the preprocessing config has "
                f"{', '.join(sorted(modalities))}, which no encoder of it serves: give a "
                "training config YAML whose model.encoders sets each module (e.g. "
                "model.encoders.<module>.pretrained), or a whole VLM checkpoint")
        cfg = TrainConfig.load(None, ["data.datasets=[unused]", f"{key}={directory}",
                                      *overrides, f"train.precision={precision or 'bf16'}"])
    plan = resolve(cfg, preprocess)
    check_training(plan)        # as the trainer's start-up (plan_adapters: the towers' targets)
    check_fit(plan, preprocess)
    try:
        dims = from_plan(plan, vocab_size)
    except TrainConfigError as error:
        if "vocabulary" not in str(error) or vocab_size is not None:
            raise
        from mimo_data.preprocess.chat_tokens import TextEncoder
        dims = from_plan(plan, TextEncoder(preprocess).vocab_size)
    adapted = [a.part for a in plan.adapted]
    passes = training_passes(dims, plan.frozen, adapted)
    fixed = (*plan.frozen, *adapted)            # a LoRA part's own weights stay fixed
    trained = {LANGUAGE: trains(LANGUAGE, fixed),
               **{f"{m}.{p}": trains(f"{m}.{p}", fixed) for m in dims.encoders
                  for p in ("encoder", "projection")}}
    # ... but for its adapters, which train
    adapters = plan_adapters(plan, dims.language,
                             {m: e.projection for m, e in dims.encoders.items()})
    return Model(dims, path, cfg.train.precision, passes, trained, adapters,
                 cfg.model.attention == "local", cfg.data.packing if yaml else None,
                 tuple(cfg.optimizer.modules), plan.facts, plan.settings.lora, plan.settings,
                 plan.language.loss_chunk_tokens, split_media,
                 varlen_kernel=cfg.model.attention == "varlen" or (
                     cfg.model.attention == "auto" and cfg.train.precision == "bf16"),
                 config_precision=config_precision)


def check_fit(plan, preprocess) -> None:
    """The trainer's start-up check that the preprocessing is the one a whole VLM's
    checkpoint (``plan.vlm``) takes (its tokens, geometry, positions), with the
    preprocessing's own tokenizer, and the one each pretrained encoder's saved processor
    does (its normalization, an audio encoder's sampling rate and features: as the encoder's
    build would refuse, before it): ``TrainConfigError`` naming what differs."""
    from mimo_train.plan.encoders import check_processors
    if plan.vlm is not None:
        from mimo_data.preprocess.tokenizer_loading import load_tokenizer
        from mimo_train.families.preprocessing_fit import check_preprocessing
        check_preprocessing(plan.vlm, preprocess, load_tokenizer(preprocess),
                            plan.vlm_tower_serves)
    check_processors(plan.encoders)


# ---------------------------------------------------------------------------- the work

def _near_square(n: int) -> list[int]:
    """A (1, rows, columns) token grid holding ``n`` tokens, near square (the item's own grid
    where the loader's metadata gives none)."""
    rows = max(1, math.isqrt(max(n, 1)))
    return [1, rows, -(-max(n, 1) // rows)]


@dataclass
class Work:
    """Per sample of the workload's steps: its language lengths and trained tokens and each
    encoder module's training FLOPs and patch grids (before merging)."""
    lengths: list[list[int]]                     # [step][sample]
    trained: list[list[int]]                     # [step][sample]: the output layer's tokens
    encoder_flops: dict[str, list[list[int]]]    # module -> [step][sample]
    grids: dict[str, list[list[list]]]           # module -> [step][sample] -> patch grids
    micro_batch_size: int
    global_batch_size: int
    seq_length: int
    packing: bool


def read_work(model: Model, workload: dict) -> Work:
    dims = model.dims
    encoders = list(dims.encoders)
    lengths: list[list[int]] = []
    trained: list[list[int]] = []
    flops: dict[str, list[list[int]]] = {m: [] for m in encoders}
    grids: dict[str, list[list[list]]] = {m: [] for m in encoders}
    for step in workload["steps"]:
        lengths.append([s["tokens"] for s in step])
        trained.append([s["trained"] for s in step])
        for m in encoders:
            flops[m].append([])
            grids[m].append([])
        for sample in step:
            counts = {mod: [items] for mod, items in sample["items"].items()
                      if dims.module_of(mod)}
            token_grids = {mod: [sample.get("grids", {}).get(mod) or
                                 [_near_square(n) for n in items]]
                           for mod, items in sample["items"].items() if dims.module_of(mod)}
            found = step_flops(dims, [0], counts, token_grids, model.passes)
            for m in encoders:
                flops[m][-1].append(found[m])
                tower = dims.encoders[m].tower
                grids[m][-1].append([item_grid(tower, g) for mod, rows in token_grids.items()
                                     if dims.module_of(mod) == m for g in rows[0]])
    return Work(lengths, trained, flops, grids, workload["micro_batch_size"],
                workload["global_batch_size"], workload["seq_length"], workload["packing"])
