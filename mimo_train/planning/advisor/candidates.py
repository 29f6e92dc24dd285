"""The candidates the layout advisor evaluates, and their order (``rank``).

Layouts (each checked with ``Layout.validate``, the loader's and trainer's check):

- colocated: every module on all N ranks, the language model tp x cp x dp (pp 1:
  megatron-core 0.19 runs colocated modules whole), encoders dp N (with variable-token inputs
  megatron-core's colocated bridge needs the encoder's dp to equal the language model's: tp
  and cp 1 then);
- non-colocated: each encoder module on its own ranks (dp only: the transformers towers run
  whole on a rank), the language model tp x cp x pp x dp on the rest, tp a power of two up to
  8, cp (context parallelism: each sample's sequence cut over cp ranks) a power of two;
- a mixture-of-experts language model, each of these also with its experts laid out by
  expert parallelism (``expert_layouts``): ep dividing the experts and tp x dp / etp, each
  expert split over etp = tp or 1 (with ep 1 too: every expert whole on each TP rank).

Settings (``settings_of``): distributed optimizer off / on, recompute none / selective / full,
the towers' full recompute alone (``model.encoders.<module>.recompute``: where the language
model's is not full), sequence parallel where allowed, split media (``data.split_media``)
where the request asks for it (``AdvisorRequest.split_media``: yes, split where the rules
allow it, else whole; both, each); every (layout, settings) pair that the trainer's rules
(``plan.rules``) refuse is left out, so the advisor never proposes what the trainer refuses.
Ranked by step time, then less recompute (the language model's, then the towers'), then no
distributed optimizer, then whole samples, then memory; each layout shown once, with its best
settings.
"""

from __future__ import annotations

import dataclasses

from mimo_data.inspect.advice import AdvisorRequest
from mimo_data.loading.layout import LANGUAGE, Layout, LayoutError
from mimo_train.plan import rules
from mimo_train.planning import memory as mem
from mimo_train.planning.advisor.cost import Result
from mimo_train.planning.advisor.inputs import Model


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def language_shapes(size: int) -> list[tuple[int, int, int, int]]:
    """(tp, cp, pp, dp) of the language model on ``size`` ranks: tp a power of two up to 8 (a
    TP group stays inside a node), cp a power of two (each divides the heads of a Qwen model;
    a cp the heads do not split, or a model it does not run, the rules refuse); what the model
    cannot split the rules refuse."""
    return [(tp, cp, pp, size // (tp * cp * pp)) for tp in (1, 2, 4, 8) if size % tp == 0
            for cp in _powers_of_two(size // tp) for pp in _divisors(size // (tp * cp))]


def _powers_of_two(n: int) -> list[int]:
    """The powers of two dividing ``n``."""
    return [1 << k for k in range(n.bit_length()) if n % (1 << k) == 0]


def expert_layouts(model: Model, tp: int, dp: int) -> list[dict[str, int]]:
    """The language module's expert fields tried on a stage of tp x dp ranks: none (the
    experts split over tp as a dense MLP, the layout's default), and for a mixture of experts
    etp 1 where tp > 1, and each ep > 1 dividing the experts and tp x dp / etp for etp tp
    (the default, left out) and 1 (megatron-core's expert grid carves etp x ep x expert dp
    out of the stage's ranks)."""
    experts = model.dims.language.experts
    if not experts:
        return [{}]
    found: list[dict[str, int]] = [{}, *([{"etp": 1}] if tp > 1 else [])]
    for ep in _divisors(experts)[1:]:
        for etp in dict.fromkeys((tp, 1)):
            if (tp * dp) % (etp * ep) == 0:
                found.append({"ep": ep, **({"etp": etp} if etp != tp else {})})
    return found


def layouts(model: Model, gpus: int, modalities: dict[str, str], global_batch_size: int,
            micro_batch_size: int, variable: list[str], expanded: list[str],
            split: bool = False) -> list[Layout]:
    """Every valid layout of the model's modules on ``gpus`` ranks (the module docstring);
    ``split``: also towers fanning in whose dp does not divide the global micro-batch, valid
    only with ``data.split_media`` (``needs_split``)."""
    encoders = list(model.dims.encoders)
    found: list[Layout] = []

    def add(spec: dict) -> None:
        try:
            layout = Layout.from_dict({"modules": spec, "modalities": modalities})
            layout.validate(gpus, global_batch_size, micro_batch_size, variable,
                            modalities=expanded, split_media=split)
        except LayoutError:
            return
        found.append(layout)

    for tp, cp, pp, dp in language_shapes(gpus):              # colocated: no stages
        if pp == 1:
            for experts in expert_layouts(model, tp, dp):
                add({LANGUAGE: {"tp": tp, "cp": cp, "pp": pp, "dp": dp, "rank_offset": 0,
                                **experts},
                     **{e: {"dp": gpus, "rank_offset": 0} for e in encoders}})
    if not encoders:
        return found

    def spread(names: list[str], ranks: int, group: int, lang_dp: int):
        """dp of each encoder module in ``names`` summing to ``ranks``."""
        if not names:
            if ranks == 0:
                yield []
            return
        choices = _divisors(group) if not split else sorted(
            set(_divisors(group)) | set(range(2 * lang_dp, ranks + 1, lang_dp)))
        for dp in choices:
            if dp <= ranks - (len(names) - 1) and (dp % lang_dp == 0 or lang_dp % dp == 0):
                for rest in spread(names[1:], ranks - dp, group, lang_dp):
                    yield [dp, *rest]

    for lang_size in range(1, gpus - len(encoders) + 1):
        for tp, cp, pp, dp in language_shapes(lang_size):
            group = micro_batch_size * dp
            if global_batch_size % group:
                continue
            for dps in spread(encoders, gpus - lang_size, group, dp):
                spec: dict = {}
                offset = 0
                for name, edp in zip(encoders, dps):
                    spec[name] = {"dp": edp, "rank_offset": offset}
                    offset += edp
                for experts in expert_layouts(model, tp, dp):
                    add({**spec, LANGUAGE: {"tp": tp, "cp": cp, "pp": pp, "dp": dp,
                                            "rank_offset": offset, **experts}})
    return found


def needs_split(layout: Layout, global_batch_size: int, micro_batch_size: int,
                variable: list[str], expanded: list[str]) -> bool:
    """Whether ``layout`` is valid only with ``data.split_media`` (a tower fanning in whose dp
    does not divide the global micro-batch)."""
    try:
        layout.validate(layout.world_size, global_batch_size, micro_batch_size, variable,
                        modalities=expanded)
    except LayoutError:
        return True
    return False


def settings_of(model: Model, layout: Layout, request: AdvisorRequest, packing: bool = False
                ) -> list[mem.Settings]:
    """The settings tried on ``layout``, those the trainer's rules (``plan.rules``) refuse
    left out: the distributed optimizer off and on (where some DP size, or the language
    model's dp x cp, is over 1), each
    recompute the request allows (selective only where the attention kernel keeps the
    scores: with flash, sdpa or varlen kernels it saves nothing; with any, also the towers'
    full recompute beside the language model's none or selective), sequence parallel where
    the rules allow it (unless the request turns it off), else without; split media as
    ``_split_media`` says."""
    found = []
    refused: dict[tuple, bool] = {}      # the rules read only these of the settings

    def takes(settings: mem.Settings) -> bool:
        key = (settings.recompute, settings.sequence_parallel, settings.split_media)
        if key not in refused:
            refused[key] = bool(_refusals(model, layout, settings, packing))
        return not refused[key]
    for alternatives in _tried(model, layout, request, packing):
        first = next((s for s in alternatives if takes(s)), None)
        if first is not None:
            found.append(first)
    return found


def refused(model: Model, layout: Layout, request: AdvisorRequest, packing: bool) -> str | None:
    """Why the trainer refuses ``layout`` with every setting ``settings_of`` would try (the
    first reason of the first setting, without sequence parallelism where that is an
    alternative), or None."""
    if settings_of(model, layout, request, packing):
        return None
    first = _tried(model, layout, request, packing)[0][-1]
    return _refusals(model, layout, first, packing)[0].reason


def _tried(model: Model, layout: Layout, request: AdvisorRequest, packing: bool
           ) -> list[list[mem.Settings]]:
    """The settings ``settings_of`` tries, as lists of alternatives in order of preference
    (with and without sequence parallelism), the kernels' fields as the model's attention
    gives them (``Model.kernel_settings``)."""
    recompute: tuple[str, ...] = mem.RECOMPUTE if request.recompute == "any" else \
        (request.recompute,)
    if not model.attention_scores:
        recompute = tuple(r for r in recompute if r != "selective") or recompute
    distributed = {"both": (False, True), "yes": (True,), "no": (False,)}[
        request.distributed_optimizer]
    if not any(m.dp * m.cp > 1 for m in layout.modules):      # it shards over dp x cp
        distributed = distributed[:1]
    parallel = (True, False) if request.sequence_parallel else (False,)
    # the towers' own full recompute where the language model's is not full (and some tower
    # trains: a frozen one keeps nothing for a backward pass)
    towers = (None, "full") if request.recompute == "any" and any(
        model.passes.get(f"{e.name}.encoder", 3) > 1 for e in layout.encoders) else (None,)
    split = _split_media(model, request)
    return [[mem.Settings(model.precision, d, r, sp, model.attention_scores,
                          model.loss_chunk_tokens, t, media, **model.kernel_settings(packing))
             for media in alternatives for sp in parallel]
            for d in distributed for r in recompute
            for t in (towers if r != "full" else (None,)) for alternatives in split]


def _split_media(model: Model, request: AdvisorRequest) -> list[tuple[bool, ...]]:
    """``data.split_media`` as ``_tried``'s alternatives: whole samples (``no``, unless the
    training YAML sets it); split where the rules allow it, else whole (``yes``: the YAML's
    true, ``--split-media``); each (``both``: ``--clip-seconds``)."""
    asked = "yes" if model.split_media and request.split_media == "no" else \
        request.split_media
    tried: dict[str, list[tuple[bool, ...]]] = {
        "no": [(False,)], "yes": [(True, False)], "both": [(False,), (True,)]}
    return tried[asked]


def _refusals(model: Model, layout: Layout, settings: mem.Settings, packing: bool
              ) -> list[rules.Refusal]:
    assert model.facts is not None, "read_model gives the facts"
    return rules.refusals(model.facts, layout, dataclasses.replace(
        model.rule_settings, recompute=settings.recompute,
        sequence_parallel=settings.sequence_parallel, packing=packing, lora=model.lora,
        split_media=settings.split_media))


RECOMPUTE_ORDER = {"none": 0, "selective": 1, "full": 2}


def rank(results: list[Result], yours: Layout | None = None) -> list[Result]:
    """Fitting results, best first, one per layout (its best settings); of equal ones, the
    layout ``yours`` first, and one that is yours in another module order (offsets moved
    along), costing the same, left out: the same layout is shown once, as you wrote it."""
    mine = str(yours) if yours is not None else None
    ordered = sorted((r for r in results if r.fits), key=lambda r: (
        round(r.step_s, 9), RECOMPUTE_ORDER[r.candidate.settings.recompute],
        RECOMPUTE_ORDER[r.candidate.settings.towers], r.candidate.settings.distributed_optimizer,
        r.candidate.settings.split_media, r.peak_bytes, str(r.candidate.layout) != mine))
    best_mine = next((r for r in ordered if str(r.candidate.layout) == mine), None)
    seen, found = set(), []
    for r in ordered:
        key = str(r.candidate.layout)
        if key in seen:
            continue
        seen.add(key)
        if best_mine is not None and key != mine and _reordered(r, best_mine):
            continue
        found.append(r)
    return found


def _reordered(result: Result, yours: Result) -> bool:
    """Whether ``result`` is ``yours`` with its modules in another order: the same modules'
    parallelism, modalities and sharing of ranks, and the same best settings, step time and
    memory (a module's offset can move it across a node's edge: then it costs otherwise)."""
    def form(layout: Layout) -> tuple:
        ranges = {m.name: (m.rank_offset, m.size) for m in layout.modules}
        return (sorted((m.name, m.tp, m.cp, m.pp, m.dp, m.ep, m.etp or m.tp)
                       for m in layout.modules), layout.modalities,
                sorted(sorted(n for n in ranges if ranges[n] == r) for r in ranges.values()))
    return (form(result.candidate.layout) == form(yours.candidate.layout)
            and result.candidate.settings == yours.candidate.settings
            and round(result.step_s, 9) == round(yours.step_s, 9)
            and result.peak_bytes == yours.peak_bytes)
