"""``mimo-inspect plan --model M --gpus N``: read the model and the work, evaluate every
candidate the trainer's rules allow, rank them and print the answer (``advise``; the report
itself: ``run_advisor``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

from tqdm import tqdm

from mimo_data.inspect.advice import AdvisorRequest
from mimo_data.loading.layout import LANGUAGE, Layout, LayoutError, ModuleLayout
from mimo_train.planning.advisor.candidates import (layouts, needs_split, rank, refused,
                                                     settings_of)
from mimo_train.planning.advisor.cost import (HEADROOM, MFU, RESERVED_GIB, Advisor, Candidate,
                                              Result, usable_gib)
from mimo_train.planning.advisor.inputs import (Model, check_fit, gpu, preprocess_differs,
                                                read_model, read_work)
from mimo_train.planning.advisor.report import format_report, gib_over, result_json, why


def advise(request: AdvisorRequest, config, workload: dict) -> int:
    """Print the ranking (text or ``--json``); 0 when some layout fits, 1 when none does, 2
    for a model that cannot be read."""
    from mimo_data.loading.loader import variable_token_modalities
    from mimo_train.errors import TrainConfigError
    try:
        model = read_model(request.model, request.config, config, workload["modalities"],
                           request.precision, workload.get("vocab_size"))
    except (TrainConfigError, OSError, ValueError) as error:
        print(f"mimo-inspect plan: error: --model {request.model}: {error}", file=sys.stderr)
        return 2
    if request.gpu_memory_gib is not None and usable_gib(request.gpu_memory_gib) <= 0:
        print(f"mimo-inspect plan: error: --gpu-memory-gib {request.gpu_memory_gib:g} leaves "
              f"nothing to plan in: the advisor takes {HEADROOM:.0%} of a GPU's memory less "
              f"{RESERVED_GIB:g} GiB (the CUDA context, NCCL's buffers)", file=sys.stderr)
        return 2
    if model.packing is not None:       # a training YAML: its data.packing is the run's
        if conflict := _packing_conflict(request, model.packing):
            print(f"mimo-inspect plan: error: {conflict}", file=sys.stderr)
            return 2
        workload = {**workload, "packing": model.packing}
    report = run_advisor(model, workload, request, variable_token_modalities(config),
                         list(config.modalities))
    if request.json:
        print(json.dumps(report, indent=1))
    else:
        print(format_report(report))
    return 0 if report["ranked"] else 1


def _packing_conflict(request: AdvisorRequest, packing: bool) -> str | None:
    """What to say where ``--packing`` meets a training YAML's ``data.packing: false``."""
    return (f"--packing, but --model {request.model} says data.packing: false (the YAML's "
            "setting is the one used: drop --packing or set data.packing in the YAML)"
            if request.packing and not packing else None)


def layout_refusal(request: AdvisorRequest, config) -> tuple[str | None, bool | None, bool]:
    """Why mimo-train refuses ``request.layout`` for ``request.model`` (``plan --layout L
    --model M``: one layout, no ranking), or None; the run's ``data.packing`` where the
    model says it (None: ``--packing`` decides); and its ``data.split_media``. A training
    YAML: its own settings under that layout, through the trainer's own resolution
    (``plan.resolve``, as its start-up); a model directory: with every setting the advisor
    would try refused (``candidates.refused``).
    ValueError where the model cannot be read, or says ``data.packing: false`` to a
    ``--packing`` plan."""
    from mimo_train.config import TrainConfig
    from mimo_train.errors import TrainConfigError
    from mimo_train.plan import check_training, resolve
    from mimo_train.planning.adapters import check_run_targets
    if request.model.endswith((".yaml", ".yml")):
        if differs := preprocess_differs(request.model, request.config):
            raise ValueError(f"--model {request.model}: {differs}")
        try:
            cfg = TrainConfig.load(request.model, [
                f"layout={request.layout}", f"data.preprocess={os.path.abspath(request.config)}"])
        except (TrainConfigError, OSError) as error:
            raise ValueError(f"--model {request.model}: {error}") from None
        if conflict := _packing_conflict(request, cfg.data.packing):  # the plan is the run's
            raise ValueError(conflict)
        try:                    # as the trainer's start-up: its plan, then the checkpoint's fit
            plan = resolve(cfg)
            check_training(plan)
            check_run_targets(plan)
            check_fit(plan, config)
        except TrainConfigError as error:
            return str(error), cfg.data.packing, cfg.data.split_media
        except OSError as error:            # its tokenizer or checkpoint files unreadable
            raise ValueError(f"--model {request.model}: {error}") from None
        return None, cfg.data.packing, cfg.data.split_media
    layout = Layout.parse(request.layout)
    served = {m: module for m, module in layout.modalities.items() if m in config.modalities}
    try:
        model = read_model(request.model, request.config, config, served, request.precision)
    except (TrainConfigError, OSError, ValueError) as error:
        raise ValueError(f"--model {request.model}: {error}") from None
    reason = refused(model, layout, request, request.packing)   # (a checkpoint says none)
    return (None if reason is None else f"{reason} (whichever recompute, optimizer and "
            "parallel settings the advisor tries)"), None, False


def run_advisor(model: Model, workload: dict, request: AdvisorRequest, variable: list[str],
                expanded: list[str]) -> dict:
    """The advisor's report (JSON-ready) of ``model`` on ``workload`` for ``request``."""
    device = gpu(request, model.precision)
    work = read_work(model, workload)
    advisor = Advisor(model, work, device, request.mfu if request.mfu is not None else MFU)
    sizes = range(1, request.gpus + 1) if request.fewer_gpus else [request.gpus]
    split = model.split_media or request.split_media != "no"
    candidates = [layout for size in sizes for layout in layouts(
        model, size, workload["modalities"], work.global_batch_size, work.micro_batch_size,
        variable, expanded, split)]
    yours = Layout.parse(request.layout) if request.layout else None
    not_ranked = None               # why your layout is not ranked, where it cannot be
    if yours is not None and yours.world_size not in sizes:
        not_ranked = f"not ranked: uses {yours.world_size} GPUs, not {request.gpus}" + \
            (" or fewer" if request.fewer_gpus else "")
    elif yours is not None:
        try:
            yours.validate(yours.world_size, work.global_batch_size, work.micro_batch_size,
                           variable, modalities=expanded, split_media=split)
        except LayoutError as error:
            not_ranked = f"not ranked: {error}"
        else:
            reason = refused(model, yours, request, work.packing)
            if reason is not None:
                not_ranked = f"not ranked: the trainer refuses it: {reason}"
            elif str(yours) not in {str(x) for x in candidates}:
                candidates.append(yours)
    # a tower fanning in whose dp does not divide the global micro-batch: split media only
    only_split = {str(layout) for layout in candidates if split and needs_split(
        layout, work.global_batch_size, work.micro_batch_size, variable, expanded)}
    tried = [Candidate(layout, settings) for layout in candidates
             for settings in settings_of(model, layout, request, work.packing)
             if settings.split_media or str(layout) not in only_split]
    # seconds to minutes for a large cluster's thousands of candidates: a bar at a terminal
    # (None: tqdm's own check), not silence
    results = [advisor.evaluate(candidate) for candidate in tqdm(
        tried, desc="mimo-inspect plan", unit=" candidates",
        disable=None if request.progress else True, file=sys.stderr, leave=False)]
    ranked = rank(results, yours)
    dropped = sorted((r for r in results if not r.fits), key=lambda r: r.peak_bytes)
    # a layout's settings that change nothing of its fullest rank shown once
    dropped = list({(str(r.candidate.layout), round(r.peak_bytes)): r for r in reversed(
        dropped)}.values())[::-1]
    dropped_layouts = {str(r.candidate.layout) for r in dropped} - \
        {str(r.candidate.layout) for r in ranked}
    shown = ranked[:request.top]
    if yours is not None:
        mine = [r for r in ranked if str(r.candidate.layout) == str(yours)]
        if mine and mine[0] not in shown:
            shown.append(mine[0])
        tried_yours = [r for r in results if str(r.candidate.layout) == str(yours)]
        if not mine and tried_yours and not_ranked is None:     # tried, fitting with none
            least = min(tried_yours, key=lambda r: r.peak_bytes)
            peak, usable = gib_over(least.peak_bytes / 2**30, advisor.usable_bytes / 2**30)
            # the module whose ranks set that figure: a tower's is not the language
            # model's, which more context or tensor parallelism would not lower
            # (colocated modules: one key, "language+image")
            fullest = max(least.memory, key=lambda module: least.memory[module].total)
            not_ranked = (f"not ranked: it fits with none of the settings tried: {peak} GiB "
                          f"per rank at the least > {usable} usable, on its {fullest} ranks" + (
                              f" (more {fullest} ranks, with data.split_media, share a step's "
                              "media)" if LANGUAGE not in fullest.split("+") else ""))
    dims = model.dims
    return {
        "model": {"source": model.source, "precision": model.precision,
                  "parameters": {LANGUAGE: dims.language.parameters(),
                                 **{m: e.parameters() for m, e in dims.encoders.items()}},
                  "trained": model.trained,
                  # model.lora's adapters: module -> parameters (all ranks')
                  "adapters": model.adapters.parameters()},
        "gpus": request.gpus, "fewer_gpus": request.fewer_gpus,
        "gpu": {"name": device.name, "memory_gib": device.memory_gib,
                "usable_gib": advisor.usable_bytes / 2**30, "tflops": device.tflops,
                "mfu": advisor.mfu, "node_gbs": device.node_gbs,
                "network_gbs": device.network_gbs, "per_node": device.per_node},
        "workload": {"steps": len(work.lengths), "global_batch_size": work.global_batch_size,
                     "micro_batch_size": work.micro_batch_size, "packing": work.packing,
                     "epochs_read": workload.get("epochs", 1),
                     "tokens_per_step": sum(map(sum, work.lengths)) / len(work.lengths),
                     "items_per_step": {m: sum(len(g) for step in work.grids[m] for g in step)
                                        / len(work.lengths) for m in work.grids},
                     **({"clip": workload["clip"]} if "clip" in workload else {})},
        "candidates": len(results),
        "layouts": len({str(c.layout) for c in tried}),
        "fitting_layouts": len(ranked), "dropped_layouts": len(dropped_layouts),
        # of the tries that do not fit, the least model state (weights, gradients, optimizer
        # state) of their fullest rank: above the usable memory, no batch or sample size helps
        "least_state_gib": min((max(m.weights + m.gradients + m.optimizer + m.adapters
                                    for m in r.memory.values()) / 2**30 for r in dropped),
                               default=None),
        "yours": yours.compact() if yours is not None else None,
        "yours_not_ranked": not_ranked,
        "ranked": [{**result_json(r, request.gpus, device, work, model.optimizer_modules,
                                  model.split_media, model.config_precision),
                    "rank": ranked.index(r) + 1, "why": why(r, device, request.gpus)}
                   for r in shown],
        # the best of each language layout the shown ones lack (the fastest may all be one
        # language layout beside towers of other sizes)
        "other_language_layouts": [
            {**result_json(r, request.gpus, device, work, model.optimizer_modules,
                           model.split_media, model.config_precision),
             "rank": ranked.index(r) + 1} for r in _other_languages(ranked, shown)],
        "dropped": [result_json(r, request.gpus, device, work, model.optimizer_modules,
                                model.split_media, model.config_precision)
                    for r in dropped[:3]],
    }


OTHER_LANGUAGE_LAYOUTS = 3      # shown beside the top, each the best of its language layout


def _other_languages(ranked: list[Result], shown: list[Result]) -> list[Result]:
    """The best result of each language layout (the language module's parallel sizes, where
    on the ranks aside) that no shown result has, fastest first, at most
    ``OTHER_LANGUAGE_LAYOUTS``."""
    def language(r: Result) -> ModuleLayout:
        return dataclasses.replace(r.candidate.layout.language, rank_offset=0)
    seen = {language(r) for r in shown}
    found: list[Result] = []
    for r in ranked:
        if language(r) not in seen and len(found) < OTHER_LANGUAGE_LAYOUTS:
            seen.add(language(r))
            found.append(r)
    return found
