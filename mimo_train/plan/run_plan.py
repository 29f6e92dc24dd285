"""``resolve(cfg, preprocess) -> RunPlan``: what a run builds, decided once per process from the
training config, the preprocessing config and the checkpoints' ``config.json`` (no weights):
the parsed layout, the whole VLM, the language model, each encoder module, the projection,
the frozen and adapted parts, each module's own optimizer and memory settings. Every config
check that needs no process group runs here, the refusals of ``rules`` last, so a config that
cannot run stops before anything is built; the builders (``model``, ``components``), the
FLOPs count and the layout advisor (``planning``) take the slices they need. The plan is a
frozen value: nothing writes into the config or the plan after this.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from mimo_data.loading.layout import LANGUAGE, Layout, LayoutError
from mimo_data.preprocess.config import PreprocessConfig
from mimo_train.config import OptimizerConfig, TrainConfig
from mimo_train.errors import TrainConfigError
from mimo_train.families.base import (VLM, loaded_weight_files, model_directory,
                                      unreadable_weights)
from mimo_train.families.preprocessing_fit import foreign_tokenizer
from mimo_train.families.registry import read_vlm
from mimo_train.plan.encoders import EncoderSetting, check_vlm_projections, encoder_settings
from mimo_train.plan.language import LanguagePlan, language_plan
from mimo_train.plan.lora_targets import check_plan_targets
from mimo_train.plan.parts import (ALL_LINEAR, Adapted, Part, check_module_names, parse_parts,
                                   reaches_routed_experts)
from mimo_train.plan.rules import Facts, Settings, check


# settings a node may give its own value: a local disk's cache, what rank 0 alone writes (a
# launch script's run name of the hour, say), a node's storage credentials or endpoint
NODE_LOCAL = frozenset({"data.cache_dir", "data.storage_options", "train.tensorboard_dir",
                        "train.wandb"})


@dataclass(frozen=True)
class ModulePlan:
    """One module's own settings: its optimizer's (``optimizer.modules.<module>`` over
    ``optimizer``: rates, warmup, weight decay, the distributed optimizer, DDP's overlap and
    buckets), its LR warmup in this run (clamped to ``train.steps - 1``, and the note saying
    so) and its activation recompute."""
    optimizer: OptimizerConfig
    warmup_steps: int
    warmup_note: str | None
    recompute: str


@dataclass(frozen=True)
class RunPlan:
    """What a run builds (see the module docstring)."""
    config: TrainConfig
    preprocess: PreprocessConfig
    layout: Layout
    vlm: VLM | None                            # model.pretrained's
    language: LanguagePlan
    encoders: Mapping[str, EncoderSetting]     # by encoder module
    modules: Mapping[str, ModulePlan]          # by module of the layout
    frozen: tuple[Part, ...]                   # model.freeze
    adapted: tuple[Adapted, ...]               # model.lora

    @property
    def facts(self) -> Facts:
        """What the rules read of the model."""
        language, arch = self.language, self.language.arch
        linear = arch.linear if arch else None
        return Facts(language.num_layers, language.num_attention_heads,
                     language.num_query_groups, language.experts,
                     any(e.deepstack for e in self.encoders.values()),
                     next((e.projection for e in self.encoders.values() if e.deepstack), "none"),
                     (linear.num_key_heads, linear.num_value_heads) if linear else None,
                     tuple(name for name, e in self.encoders.items() if not e.frame_independent),
                     mlp=0 if language.experts else
                     language.ffn_hidden_size or 4 * language.hidden_size,
                     expert_mlp=arch.expert_ffn_hidden_size if arch else 0,
                     shared_expert_mlp=arch.shared_expert_ffn_hidden_size if arch else 0)

    def given(self) -> dict[str, str]:
        """Every setting the run was given that every rank must have read alike, by dotted
        key (``preprocess.`` before the preprocessing config's), each value's text; not those
        a node may set its own way (``NODE_LOCAL``)."""
        found: dict[str, str] = {}

        def walk(value, key: str) -> None:
            if key in NODE_LOCAL:
                return
            if isinstance(value, dict) and value:
                for name, inner in value.items():
                    walk(inner, f"{key}.{name}" if key else str(name))
            else:
                found[key] = repr(value)
        walk({**self.config.to_dict(), "preprocess": self.preprocess.to_dict()}, "")
        return found

    @property
    def vlm_tower_serves(self) -> tuple[str, ...]:
        """The modalities that model.pretrained's own tower encodes (not another encoder
        given in its place)."""
        if self.vlm is None:
            return ()
        return tuple(modality for e in self.encoders.values()
                     if e.spec.pretrained == self.vlm.path for modality in (e.modality, *e.also))

    @property
    def settings(self) -> Settings:
        """What the rules read of the run's settings."""
        return Settings(self.language.recompute, self.language.sequence_parallel,
                        self.config.data.packing,
                        {a.part.name: a.spec.rank for a in self.adapted},
                        {a.part.name: tuple(a.spec.targets) for a in self.adapted},
                        self.language.moe_aux_loss, self.config.data.split_media)

    def warmup_notes(self) -> list[str]:
        """The notes of the trained modules' warmups clamped to the run, each once (whichever
        modules a rank holds: rank 0 may hold a frozen one alone)."""
        frozen = {p.module for p in self.frozen if p.part is None}
        return list(dict.fromkeys(plan.warmup_note for name, plan in self.modules.items()
                                  if plan.warmup_note and name not in frozen))

    def training_summary(self) -> str:
        """What trains, for the start-up line: each frozen part, each part's LoRA adapters
        (rank, alpha, targets), the parts trained in full, e.g. ``image.encoder frozen;
        language LoRA rank 8 alpha 16 on linear_qkv (its weights fixed); image.projection in
        full``."""
        said = [f"{p.name} frozen" for p in self.frozen]
        said += [f"{a.part.name} LoRA rank {a.spec.rank} alpha {a.spec.alpha:g} on "
                 f"{', '.join(a.spec.targets)} (its weights fixed{self._experts_left(a)})"
                 for a in self.adapted]
        if not said:
            return "every module in full"
        full = self.parts_in_full()
        return "; ".join([*said, *([f"{', '.join(full)} in full"] if full else [])])

    def _experts_left(self, adapted: Adapted) -> str:
        """What to add where ``adapted``'s targets leave a mixture of experts' routed experts
        out (``all-linear`` does, as PEFT's): said, since a run would not show it."""
        language = self.language
        if adapted.part.module != LANGUAGE or not language.experts or reaches_routed_experts(
                tuple(adapted.spec.targets), language.num_layers, language.experts):
            return ""
        return ("; its routed experts not adapted" +
                (", as PEFT's all-linear leaves them" if ALL_LINEAR in adapted.spec.targets
                 else "") + ": name linear_fc1 / linear_fc2 to adapt them too")

    def parts_in_full(self) -> list[str]:
        """The parts whose own weights train (neither in ``model.freeze`` nor under LoRA), in
        the layout's order: ``language``, ``<module>.encoder``, ``<module>.projection`` (none
        where the module has no projection: a Qwen VLM's merger is its tower's)."""
        fixed = (*self.frozen, *(a.part for a in self.adapted))
        parts = [part for name in self.modules for part in (
            [name] if name == LANGUAGE else [f"{name}.encoder", f"{name}.projection"]
            if self.encoders[name].projection != "none" else [f"{name}.encoder"])]
        return [part for part in parts if not any(p.covers(part) for p in fixed)]

    def frozen_prefix(self, module: str) -> str | None:
        """The prefix of ``module``'s frozen parameters ("": all of them; None: none)."""
        return next((p.prefix for p in self.frozen if p.module == module), None)

    def memory_summary(self) -> str:
        """Each module's memory settings, for the start-up line, e.g. ``language:
        distributed optimizer, recompute full, sequence parallel, loss in chunks of 4096
        tokens; image: recompute full; audio: -``; a module that trains nothing (frozen,
        without LoRA): ``frozen``, its optimizer settings holding nothing."""
        parts = []
        for name, module in self.modules.items():
            if not self.trains(name):
                parts.append(f"{name}: frozen")
                continue
            own, ranks = module.optimizer, self.layout.module(name)
            # it shards the optimizer state over the module's dp x cp ranks, a mixture's
            # experts' over their expert dp ranks: over one, nothing
            shards = max(ranks.dp * ranks.cp, ranks.expert_dp if name == LANGUAGE
                         and self.language.experts else 1)
            sharded = "distributed optimizer" + (
                "" if shards > 1 else " (dp x cp 1: nothing to shard)")
            settings = [*([sharded] if own.distributed else []),
                        *([f"recompute {module.recompute}"] if module.recompute != "none"
                          else []),
                        *(["sequence parallel"] if name == LANGUAGE
                          and self.language.sequence_parallel else []),
                        *([f"loss in chunks of {self.language.loss_chunk_tokens} tokens"]
                          if name == LANGUAGE and self.language.loss_chunk_tokens else []),
                        *(["overlapped grad reduce" + (f" (buckets of {own.bucket_size})"
                                                       if own.bucket_size else "")]
                          if own.overlap_grad_reduce else [])]
            parts.append(f"{name}: {', '.join(settings) or '-'}")
        return "; ".join(parts)

    def trains(self, module: str, parts: tuple[str | None, ...] = (None,)) -> bool:
        """Whether ``module`` trains weights of its ``parts`` (None: the module as a whole,
        "encoder": its tower): not frozen there, or adapted by LoRA."""
        return any(a.part.module == module and a.part.part in parts for a in self.adapted) or \
            not any(p.module == module and p.part in parts for p in self.frozen)


def resolve(cfg: TrainConfig, preprocess: PreprocessConfig | None = None) -> RunPlan:
    """The plan of ``cfg`` (see the module docstring); ``preprocess``: its
    ``PreprocessConfig`` (default: read ``data.preprocess``). ``TrainConfigError`` naming the
    key for a config that cannot run."""
    try:
        layout = Layout.parse(cfg.layout)
    except (LayoutError, OSError) as error:
        raise TrainConfigError(f"layout {cfg.layout!r}: {error}") from None
    model = cfg.model
    check_module_names("model.encoders", model.encoders, layout, encoders_only=True)
    check_module_names("optimizer.modules", cfg.optimizer.modules, layout)
    vlm = read_vlm(model.pretrained) if model.pretrained else None
    pretrained = model.language.pretrained
    if vlm is not None:
        if pretrained not in (None, model.pretrained):
            raise TrainConfigError(
                f"model.pretrained is {model.pretrained} and model.language.pretrained "
                f"{pretrained}: the whole VLM brings its language model; drop one of the two")
        pretrained = model.pretrained
    language = language_plan(model.language, pretrained, "model.language.pretrained"
                             if vlm is None else "model.pretrained's language model")
    if preprocess is None:
        preprocess = _read_preprocess(cfg)
    try:
        _check_positions(cfg, language, preprocess)
    except TrainConfigError:        # another model's preprocessing: said as that
        foreign = foreign_tokenizer(vlm, preprocess) if vlm is not None else None
        if foreign:
            raise TrainConfigError(foreign) from None
        raise
    frozen = parse_parts(model.freeze, layout, "model.freeze", one_per_module=True)
    adapted = tuple(Adapted(part, model.lora[part.name])
                    for part in parse_parts(model.lora, layout, "model.lora"))
    for each in adapted:
        clash = next((p for p in frozen if p.covers(each.part.name) or
                      each.part.covers(p.name)), None)
        if clash is not None:
            raise TrainConfigError(
                f"model.lora adapts {each.part.name!r}, which model.freeze freezes" + (
                    "" if clash.name == each.part.name else f" ({clash.name!r})") +
                ": LoRA already keeps the part's own weights fixed; drop "
                f"{clash.name!r} from model.freeze")
    modules = {m.name: ModulePlan(cfg.optimizer.of(m.name), *cfg.warmup_steps(m.name),
                                  language.recompute if m.name == LANGUAGE else
                                  (model.encoders[m.name].recompute
                                   if m.name in model.encoders else "none"))
               for m in layout.modules}
    plan = RunPlan(cfg, preprocess, layout, vlm, language,
                   encoder_settings(cfg, layout, preprocess, vlm), modules, frozen, adapted)
    for name, setting in plan.encoders.items():
        if setting.projection == "none" and setting.output_size != language.hidden_size:
            raise TrainConfigError(
                f"encoder module {name!r} has projection none (model.encoders.{name}."
                f"projection, else model.projection), but its tower emits {setting.output_size}"
                f" features for a language width of {language.hidden_size}: use linear or mlp")
    check(plan.facts, layout, plan.settings)
    check_vlm_projections(cfg, plan.encoders, vlm)
    return plan


def _trains_nothing(plan: RunPlan, module: str) -> bool:
    """Whether no weight of ``module`` trains: frozen whole (or its tower, where there is no
    projection) and without adapters."""
    if any(a.part.module == module for a in plan.adapted):
        return False
    parts = {p.part for p in plan.frozen if p.module == module}
    return None in parts or ("encoder" in parts and plan.encoders[module].projection == "none")


def check_training(plan: RunPlan) -> None:
    """``TrainConfigError`` for a ``model.freeze`` entry that freezes nothing (a projection
    the model has none of), ``optimizer.modules`` settings of a module nothing of which
    trains (they would be ignored), a run in which nothing trains, and a LoRA target of the
    language model that names none of its linear layers (an encoder's: ``planning.adapters.
    check_encoder_targets``, from its tower's layers). The trainer's start-up
    runs it, not ``resolve``: a checkpoint's saved config still exports and plans. Also a
    pretrained folder (or hub name in the local cache) whose weights are pickled only
    (pytorch_model.bin), before anything is built; a folder without weights (a config alone)
    plans."""
    cfg = plan.config
    named = {"model.pretrained": cfg.model.pretrained,
             "model.language.pretrained": cfg.model.language.pretrained,
             **{f"model.encoders.{name}.pretrained": encoder.pretrained
                for name, encoder in cfg.model.encoders.items()}}
    for key, path in named.items():     # pickled weights only: said before anything is built
        if path is None or (folder := _cached_folder(path)) is None:
            continue
        files = loaded_weight_files(folder)
        if files and (why := unreadable_weights(key, path, files)):
            raise TrainConfigError(why)
    for part in plan.frozen:
        if part.part == "projection" and plan.encoders[part.module].projection == "none":
            whose = f"{plan.vlm.family}'s merger is part of its tower" if plan.vlm and \
                plan.encoders[part.module].spec.pretrained == plan.vlm.path else \
                "its projection is none"
            raise TrainConfigError(
                f"model.freeze freezes {part.name!r}, which the model does not have ({whose}): "
                f"freeze '{part.module}.encoder' (the tower with it) or '{part.module}'")
    idle = [m.name for m in plan.layout.modules if _trains_nothing(plan, m.name)]
    for name in cfg.optimizer.modules:
        if name in idle:
            raise TrainConfigError(
                f"optimizer.modules.{name} is set, but nothing of {name!r} trains (model.freeze "
                f"freezes it): drop optimizer.modules.{name}, or {name!r} from model.freeze")
    if len(idle) == len(plan.layout.modules):
        raise TrainConfigError(
            f"model.freeze freezes every module ({', '.join(idle)}): nothing would train; "
            "unfreeze a module or adapt one with model.lora")
    check_plan_targets(plan.adapted, plan.language)


def _cached_folder(path: str) -> str | None:
    """The folder of the model ``path`` names: a local folder, or a hub name's snapshot in the
    local hub cache; None where neither is there (a name the cache lacks is said where the
    model is built)."""
    try:
        return model_directory(path)
    except (OSError, ValueError):     # huggingface_hub's not-cached and invalid-name errors
        return None


def _read_preprocess(cfg: TrainConfig) -> PreprocessConfig:
    """``data.preprocess``, once the config's input paths are checked (``check_inputs``)."""
    from mimo_data.errors import ConfigError
    cfg.check_inputs()
    assert cfg.data.preprocess is not None              # check_inputs says so otherwise
    try:
        return PreprocessConfig.from_yaml(cfg.data.preprocess)
    except ConfigError as error:                       # it names the file
        raise TrainConfigError(f"data.preprocess: {error}") from None


def _check_positions(cfg: TrainConfig, language: LanguagePlan,
                     preprocess: PreprocessConfig) -> None:
    """``TrainConfigError`` unless the preprocessing's position ids are what the language
    model's rotary embedding takes (M-RoPE ids for an ``mrope_section``)."""
    mrope = language.mrope_section is not None
    if mrope != (preprocess.positions == "mrope"):
        raise TrainConfigError(
            f"the preprocessing config ({cfg.data.preprocess}) has positions: "
            f"{preprocess.positions}, but model.language " +
            ("has an mrope_section: set positions: mrope there" if mrope else
             "has no mrope_section: set model.language.mrope_section (three counts of "
             "rotary pairs) or positions: sequential"))
