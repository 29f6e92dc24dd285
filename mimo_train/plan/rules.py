"""What mimo refuses to train, and why: one list of rules over a model's facts, a layout and a
run's settings. The trainer's start-up raises the first refusal (``plan.resolve``, before any
process group exists); the layout advisor (``planning.advisor``) drops every candidate that
any rule refuses and says why a layout you gave is not ranked. A new refusal is one function
here, registered with ``@rule``.

Pure: numbers and names in, reasons out (the rules call neither torch nor megatron-core), so
the advisor checks thousands of candidates with the trainer's own rules.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from mimo_data.errors import listed
from mimo_data.loading.layout import LANGUAGE, Layout
from mimo_train.errors import TrainConfigError
from mimo_train.plan.parts import reaches_routed_experts


@dataclass(frozen=True)
class Facts:
    """What the rules read of the model, whatever its layout: the language model's layers,
    attention heads, query groups and experts, whether a tower adds deepstack rows to the
    language model's first layers, the projection after the towers, the key and value
    heads of its gated delta-net layers (none: no such layers), and its MLP widths."""
    layers: int
    heads: int
    query_groups: int
    experts: int = 0
    deepstack: bool = False
    projection: str = "linear"
    linear_heads: tuple[int, int] | None = None
    # encoder modules whose towers do not encode each temporal patch of a clip on its own
    # (``Encoder.frame_independent``): ``data.split_media`` cannot cut their media
    whole_towers: tuple[str, ...] = ()
    # the MLP widths megatron-core splits: a dense layer's (0: a mixture of experts), each
    # routed expert's and the shared expert's (0: none)
    mlp: int = 0
    expert_mlp: int = 0
    shared_expert_mlp: int = 0


@dataclass(frozen=True)
class Settings:
    """What a run sets that the rules read: the language model's recompute and sequence
    parallelism, packing, each part under LoRA with its rank, and its targets (None: not
    known: the rules then take every layer as targeted), and the load-balancing loss."""
    recompute: str = "none"
    sequence_parallel: bool = False
    packing: bool = False
    lora: Mapping[str, int] = field(default_factory=dict)      # part -> rank
    lora_targets: Mapping[str, tuple[str, ...]] | None = None  # part -> targets
    moe_aux_loss: float = 0.0           # model.language.moe_aux_loss (0: off)
    split_media: bool = False           # data.split_media


class Refusal(NamedTuple):
    rule: str                 # the rule's function name
    reason: str               # what is refused, why, and what to change


Rule = Callable[[Facts, Layout, Settings], "str | None"]
RULES: dict[str, Rule] = {}


def rule(function: Rule) -> Rule:
    """Register ``function`` as a rule: it returns the reason it refuses, or None."""
    RULES[function.__name__] = function
    return function


def refusals(facts: Facts, layout: Layout, settings: Settings) -> list[Refusal]:
    """Every rule that refuses ``settings`` on ``layout`` for a model of ``facts``."""
    found = [(name, check(facts, layout, settings)) for name, check in RULES.items()]
    return [Refusal(name, reason) for name, reason in found if reason is not None]


def check(facts: Facts, layout: Layout, settings: Settings) -> None:
    """``TrainConfigError`` with the first refusal's reason, if any."""
    refused = refusals(facts, layout, settings)
    if refused:
        raise TrainConfigError(refused[0].reason)


# ------------------------------------------------------------------------- the layout

def _choices(field: str, count: int) -> str:
    """The values of a layout ``field`` (tp, pp, cp) that divide ``count``, as a message
    offers them: ``tp1, tp2 or tp4``."""
    fits = [f"{field}{n}" for n in range(1, count + 1) if count % n == 0]
    return f"{', '.join(fits[:-1])} or {fits[-1]}" if len(fits) > 1 else fits[0]


@rule
def language_layers_split(facts: Facts, layout: Layout, settings: Settings) -> str | None:
    pp = layout.language.pp
    if facts.layers % pp:
        return (f"the language model has {facts.layers} layers, which do not split into "
                f"language pp{pp} (pipeline stages of equal numbers of whole layers): use "
                f"{_choices('pp', facts.layers)}" if facts.layers > 1 else
                f"the language model has {facts.layers} layer, which does not split into "
                f"language pp{pp} (pipeline stages of whole layers): use pp1")
    return None


@rule
def linear_attention_heads_split(facts: Facts, layout: Layout, settings: Settings
                                 ) -> str | None:
    tp = layout.language.tp
    for what, count in zip(("key", "value"), facts.linear_heads or ()):
        if count % tp:
            return (f"the language model's gated delta-net layers have {count} {what} heads, "
                    f"which do not split into language tp{tp}: use "
                    f"{_choices('tp', math.gcd(*(facts.linear_heads or ())))}")
    return None


@rule
def language_heads_split(facts: Facts, layout: Layout, settings: Settings) -> str | None:
    tp = layout.language.tp
    for what, count in (("attention heads", facts.heads),
                        ("query groups (key/value heads)", facts.query_groups)):
        if count % tp:
            return (f"the language model has {count} {what}, which do not split into "
                    f"language tp{tp}: use "
                    f"{_choices('tp', math.gcd(facts.heads, facts.query_groups))}")
    return None


@rule
def language_mlp_split(facts: Facts, layout: Layout, settings: Settings) -> str | None:
    tp, etp = layout.language.tp, layout.language.expert_tp
    if facts.mlp % tp:
        return (f"the language model's MLP is {facts.mlp} wide (model.language.ffn_hidden_size, "
                "default 4 x hidden_size, or the checkpoint's intermediate_size), which "
                f"language tp{tp} does not divide (megatron-core splits the width evenly over "
                f"the TP ranks): choose a tp that divides {facts.mlp}, or, training from "
                f"scratch, set model.language.ffn_hidden_size to a multiple of {tp}")
    if facts.expert_mlp % etp:
        return (f"the language model's experts are {facts.expert_mlp} wide (the checkpoint's "
                f"moe_intermediate_size), which the experts' etp{etp} does not divide (each "
                "expert's width splits evenly over its etp ranks; etp defaults to tp): choose "
                f"an etp that divides {facts.expert_mlp}")
    if facts.shared_expert_mlp % tp:
        return (f"the language model's shared expert is {facts.shared_expert_mlp} wide (the "
                f"checkpoint's shared_expert_intermediate_size), which language tp{tp} does "
                f"not divide: choose a tp that divides {facts.shared_expert_mlp}")
    return None


@rule
def language_context_parallel_heads(facts: Facts, layout: Layout, settings: Settings
                                    ) -> str | None:
    cp, tp = layout.language.cp, layout.language.tp
    heads = facts.heads // tp
    if cp > 1 and heads % cp:
        return (f"language cp{cp} splits each tensor-parallel rank's {heads} attention heads "
                f"(the model's {facts.heads} over tp{tp}) over its context-parallel ranks "
                "(mimo's context parallelism is an all-to-all over heads; ring attention, for "
                f"heads cp does not divide, is not built): use {_choices('cp', heads)}")
    return None


@rule
def language_context_parallel_colocated(facts: Facts, layout: Layout, settings: Settings
                                        ) -> str | None:
    cp = layout.language.cp
    if cp > 1 and layout.colocated and layout.encoders:
        own = layout.on_own_ranks()
        return (f"language cp{cp} in a colocated layout: megatron-core's colocated bridge "
                "takes no context parallelism; put the encoders on ranks of their own (e.g. "
                f"'{own.compact()}' on {own.world_size} ranks)")
    return None


@rule
def language_context_parallel_linear_attention(facts: Facts, layout: Layout,
                                               settings: Settings) -> str | None:
    cp, tp = layout.language.cp, layout.language.tp
    for what, count in zip(("key", "value"), facts.linear_heads or ()):
        if cp > 1 and (count // tp) % cp:
            return (f"language cp{cp} splits each tensor-parallel rank's {count // tp} gated "
                    f"delta-net {what} heads (the model's {count} over tp{tp}) over its "
                    "context-parallel ranks (all-to-all over heads): use "
                    f"{_choices('cp', count // tp)}")
    return None


@rule
def encoders_run_whole(facts: Facts, layout: Layout, settings: Settings) -> str | None:
    for module in layout.encoders:
        for dim in ("tp", "cp", "pp"):
            if getattr(module, dim) != 1:
                return (f"encoder module {module.name!r} has {dim} {getattr(module, dim)}: the "
                        "transformers encoders run whole on each rank; use dp only for "
                        "encoders")
    return None


@rule
def split_media_needs_fan_in(facts: Facts, layout: Layout, settings: Settings) -> str | None:
    if not settings.split_media:
        return None
    language = layout.language
    fanning = [m for m in layout.encoders if layout.fans_in(m)]
    if not fanning:
        return (f"data.split_media cuts each language rank's media over the encoder ranks that "
                f"fan in to it; this layout has none (an encoder module with more DP ranks than "
                f"{LANGUAGE!r}'s {language.dp}, on ranks of its own): drop data.split_media or "
                f"give the tower's module more ranks, e.g. 'image=dp{2 * language.dp},video'")
    whole = [m.name for m in fanning if m.name in facts.whole_towers]
    if whole:
        return (f"data.split_media: the tower of encoder module {whole[0]!r} does not encode "
                "each frame on its own (the Qwen2-VL family's towers do: Qwen2-VL, "
                "Qwen2.5-VL, Qwen3-VL, Qwen3.5; and the CLIP and SigLIP towers, whose images are "
                "never cut), so its rows would change if its media were cut over its ranks; "
                "drop data.split_media (each encoder rank then encodes whole samples)")
    return None


# -------------------------------------------------------------------- the settings

@rule
def sequence_parallel_needs_tp(facts: Facts, layout: Layout, settings: Settings) -> str | None:
    tp = layout.language.tp
    if settings.sequence_parallel and tp < 2:
        return ("model.language.sequence_parallel needs the language model's tensor "
                f"parallelism: the layout gives it tp{tp}, and sequence parallelism splits the "
                "sequence over the TP ranks for the layer norms and dropout between the TP "
                "regions; set tp >= 2 (e.g. language=tp2) or drop it")
    return None


@rule
def sequence_parallel_unpacked(facts: Facts, layout: Layout, settings: Settings) -> str | None:
    if settings.sequence_parallel and settings.packing and layout.language.cp < 2:
        return ("model.language.sequence_parallel with data.packing: a packed micro-batch's "
                "rows are not padded to a multiple of the TP size, which sequence parallelism "
                "splits them by (they are under context parallelism, language cp2 or more); "
                "drop one of the two")
    return None


@rule
def lora_rank_splits_over_tp(facts: Facts, layout: Layout, settings: Settings) -> str | None:
    tp, rank = layout.language.tp, settings.lora.get(LANGUAGE)
    if rank is not None and rank % tp:        # A of a column-parallel layer: split by rows
        return (f"model.lora.language.rank {rank} does not split over the language model's tp "
                f"{tp}: make it a multiple of {tp}")
    return None


# ----------------------------------------------------------------------- the model

@rule
def deepstack_projection(facts: Facts, layout: Layout, settings: Settings) -> str | None:
    if facts.deepstack and facts.projection != "none":
        return (f"a tower adds deepstack features to the language model's first layers, so "
                f"its rows hold them beside the main ones: projection {facts.projection} "
                "(model.encoders.<module>.projection, else model.projection) cannot map them; "
                "use projection none")
    return None


@rule
def deepstack_full_recompute(facts: Facts, layout: Layout, settings: Settings) -> str | None:
    if facts.deepstack and settings.recompute == "full":
        return ("a tower adds deepstack features to the language model's first layers, which "
                "model.language.recompute full would recompute without them (their gradient "
                "would run twice through the tower, or be the next micro-batch's under "
                "pipeline stages): use selective")
    return None


@rule
def experts_need_sequence_parallel(facts: Facts, layout: Layout, settings: Settings
                                   ) -> str | None:
    tp = layout.language.tp
    if facts.experts and tp > 1 and not settings.sequence_parallel:
        fix = ("use tp1, or drop data.packing (which sequence parallelism does not run with "
               "at cp1) and set model.language.sequence_parallel=true"
               if settings.packing and layout.language.cp < 2 else
               "set model.language.sequence_parallel=true, or tp1")
        return (f"the language model is a mixture of experts, which megatron-core trains under "
                f"tensor parallelism (the layout's language tp{tp}) only with sequence "
                f"parallelism: {fix}")
    return None


@rule
def expert_parallel_needs_experts(facts: Facts, layout: Layout, settings: Settings
                                  ) -> str | None:
    fields = layout.language.expert_fields
    if fields and not facts.experts:
        given = ",".join(f"{name}{value}" for name, value in fields.items())
        return (f"the layout gives the language module {given}, expert parallelism, but its "
                "layers are dense (no mixture of experts): remove ep/etp from the layout")
    return None


@rule
def experts_split_over_ep(facts: Facts, layout: Layout, settings: Settings) -> str | None:
    ep = layout.language.ep
    if facts.experts and facts.experts % ep:
        return (f"the language model has {facts.experts} experts per layer, which do not "
                f"split over the layout's language ep{ep} (each expert-parallel rank holds "
                "the same number of whole experts): choose an ep that divides "
                f"{facts.experts}")
    return None


@rule
def balancing_loss_needs_experts(facts: Facts, layout: Layout, settings: Settings
                                 ) -> str | None:
    if settings.moe_aux_loss and not facts.experts:
        return (f"model.language.moe_aux_loss is {settings.moe_aux_loss}, a mixture of experts' "
                "load-balancing loss, but the language model's layers are dense (no router): "
                "remove it")
    return None


@rule
def balancing_loss_not_fully_recomputed(facts: Facts, layout: Layout, settings: Settings
                                        ) -> str | None:
    if settings.moe_aux_loss and facts.experts and settings.recompute == "full":
        return ("model.language.moe_aux_loss attaches each router's share of the loss in the "
                "forward pass, with the micro-batch's real tokens, and model.language.recompute "
                "full runs the layers again in the backward pass, after later micro-batches "
                "have set theirs: use recompute selective or none, or set moe_aux_loss 0")
    return None


@rule
def expert_lora_rank_splits_over_etp(facts: Facts, layout: Layout, settings: Settings
                                     ) -> str | None:
    etp, rank = layout.language.expert_tp, settings.lora.get(LANGUAGE)
    if not facts.experts or rank is None or rank % etp == 0:
        return None
    targets = None if settings.lora_targets is None else settings.lora_targets.get(LANGUAGE)
    if targets is not None and not reaches_routed_experts(tuple(targets), facts.layers,
                                                          facts.experts):
        return None
    which = "may take in" if targets is None else f"{listed(targets)} take in"
    return (f"model.lora.language.rank {rank} does not split over the experts' etp {etp}: the "
            f"language model's targets {which} its routed experts, each split over etp{etp} "
            "ranks, and the adapter of an expert's linear_fc1 splits A by its rank rows over "
            f"them as linear_qkv's is over tp; make the rank a multiple of {etp}, or leave the "
            "routed experts out of the targets")
