"""The layout advisor's answer: each ranked candidate as JSON (``result_json``: its layout,
the ``key=value`` overrides that train it, step time, MFU, memory, bottleneck) and as text
(``format_report``, with ``why`` each one ranks where it does).
"""

from __future__ import annotations

from collections.abc import Sequence

from mimo_data.loading.layout import LANGUAGE
from mimo_train.planning.advisor.cost import Candidate, Result
from mimo_train.planning.advisor.inputs import GPU, Work


def overrides(candidate: Candidate, optimizer_modules: Sequence[str] = (),
              split_media: bool = False, config_precision: str | None = None,
              packing: bool = False) -> list[str]:
    """The training config's ``key=value`` overrides that run ``candidate`` (``mimo-train``'s
    layout, optimizer.distributed, recompute and sequence parallel keys): the distributed
    optimizer's setting also for each module of ``optimizer_modules`` (those the training
    YAML's ``optimizer.modules`` names, whose own ``distributed`` would win over the global
    key), sequence parallel always (true or false, whatever the YAML says), data.split_media
    where the candidate splits or ``split_media`` (the YAML's) would, data.packing where the
    workload was packed (``packing``: the rules and the memory were a packed run's),
    train.precision where the candidate's differs from ``config_precision`` (the YAML's;
    None: a checkpoint's advice, for a config the advisor has not read, always)."""
    settings, layout = candidate.settings, candidate.layout
    distributed = str(settings.distributed_optimizer).lower()
    found = [f"layout={layout.compact()}", f"optimizer.distributed={distributed}"]
    found += [f"optimizer.modules.{m}.distributed={distributed}" for m in optimizer_modules]
    found.append(f"model.language.recompute={settings.recompute}")
    found += [f"model.encoders.{e.name}.recompute="
              f"{'full' if settings.towers == 'full' else 'none'}" for e in layout.encoders]
    found.append(f"model.language.sequence_parallel={str(settings.sequence_parallel).lower()}")
    if settings.split_media or split_media:
        found.append(f"data.split_media={str(settings.split_media).lower()}")
    if packing:
        found.append("data.packing=true")
    # the memory and step time were those of the advised precision: a run in the config's
    # other one would not be the one advised
    if settings.precision != config_precision:
        found.append(f"train.precision={settings.precision}")
    return found


def achieved_mfu(r: Result, gpus: int, device: GPU) -> float:
    """The model FLOPs per second of ``r``'s step over the peak of the GPUs its layout uses
    (``gpus``, or fewer where the request allows them)."""
    used = min(gpus, r.candidate.layout.world_size)
    return r.flops / (r.step_s * used * device.tflops * 1e12)


def result_json(r: Result, gpus: int, device: GPU, work: Work,
                optimizer_modules: Sequence[str] = (), split_media: bool = False,
                config_precision: str | None = None) -> dict:
    """``r`` as JSON (``split_media``, ``config_precision``: the training YAML's, for
    ``overrides``)."""
    settings = r.candidate.settings
    return {"layout": r.candidate.layout.compact(), "layout_full": str(r.candidate.layout),
            "ranks": r.candidate.layout.world_size,
            "overrides": overrides(r.candidate, optimizer_modules, split_media,
                                   config_precision, work.packing),
            "colocated": r.candidate.layout.colocated,
            "settings": {"precision": settings.precision,
                         "distributed_optimizer": settings.distributed_optimizer,
                         "recompute": settings.recompute,
                         # model.encoders.<module>.recompute (a tower has none or full)
                         "tower_recompute": ("full" if settings.towers == "full" else "none")
                         if r.candidate.layout.encoders else None,
                         "sequence_parallel": settings.sequence_parallel,
                         "split_media": settings.split_media},
            "step_s": r.step_s, "samples_per_s": work.global_batch_size / r.step_s,
            "mfu": achieved_mfu(r, gpus, device),
            "memory_gib": {k: v.gib() for k, v in r.memory.items()},
            "peak_memory_gib": r.peak_bytes / 2**30, "fits": r.fits,
            "busy_s": r.busy, "bottleneck": r.bottleneck, "idle_fraction": r.idle,
            "all_to_all_s": r.all_to_all, "context_all_to_all_s": r.context_all_to_all}


def _launch(ranks: int, per_node: int, arguments: str) -> str:
    """The torchrun command line training with ``arguments`` on ``ranks`` ranks: on one node
    where they fit its ``per_node`` GPUs, else over as many nodes as they fill, each full but
    the last, as the cost model placed them (``Advisor._group_gbs``: rank r on node r //
    per_node)."""
    if ranks <= per_node:
        return f"torchrun --nproc-per-node {ranks} -m mimo_train {arguments}"
    nodes, last = -(-ranks // per_node), ranks % per_node
    return (f"torchrun --nnodes {nodes} --nproc-per-node {per_node} -m mimo_train "
            f"{arguments}" + ("" if not last else
                              f"  # {ranks} ranks: {per_node} on each node but the last, "
                              f"--nproc-per-node {last} there; give each node its --node-rank "
                              f"(0 to {nodes - 1}, the last one's {nodes - 1}) so that the "
                              "ranks lie in nodes as planned"))


def gib_over(over: float, limit: float) -> tuple[str, str]:
    """``over`` and ``limit`` (GiB, ``over`` > ``limit``) as said in "``over`` > ``limit``":
    with one decimal, or as many more (up to 4) as it takes for the first to read larger."""
    for places in range(1, 5):
        said = f"{over:.{places}f}", f"{limit:.{places}f}"
        if float(said[0]) > float(said[1]):
            break
    return said


def why(r: Result, device: GPU, gpus: int) -> str:
    # a run with LoRA: its adapters' weights, gradients and optimizer state beside the rest
    memory = "; ".join(
        f"{name} {m.total / 2**30:.1f} GiB (weights {m.weights / 2**30:.1f}, grads "
        f"{m.gradients / 2**30:.1f}, optimizer {m.optimizer / 2**30:.1f}, "
        + (f"LoRA adapters {m.adapters / 2**30:.1f}, " if m.adapters else "") +
        f"activations {m.activations / 2**30:.1f}, temporary {m.temporary / 2**30:.1f})"
        for name, m in r.memory.items())
    busy = ", ".join(f"{k} {_seconds(v)} s"
                     for k, v in sorted(r.busy.items(), key=lambda x: -x[1]))
    mfu = achieved_mfu(r, gpus, device)
    layout = r.candidate.layout
    exchange = ""
    language = next(v for k, v in r.busy.items() if LANGUAGE in k.split("+"))
    for kind, size, seconds in (("expert", layout.language.ep, r.all_to_all),
                                (f"context (cp{layout.language.cp})", layout.language.cp,
                                 r.context_all_to_all)):
        if size > 1:
            exchange += (f"; {kind} all-to-all {_seconds(seconds)} s per step "
                         f"({100 * seconds / language:.0f}% of the busiest language rank's)")
    used = layout.world_size
    fewer = f"on {used} of the {gpus} GPUs; " if used < gpus else ""
    return (f"{fewer}bottleneck {r.bottleneck} (busiest rank per step: {busy}); idle "
            f"{100 * r.idle:.0f}% of the GPU time; achieved MFU {mfu:.2f}{exchange}; memory "
            f"per rank: {memory}")


def format_report(report: dict) -> str:
    g, w, p = report["gpu"], report["workload"], report["model"]["parameters"]
    params = ", ".join(f"{m} {_count(n)}" for m, n in p.items())
    adapters = report["model"].get("adapters") or {}
    if adapters:            # model.lora's, trained where their layers' weights stay fixed
        params += " (LoRA adapters: " + ", ".join(f"{m} {_count(n)}"
                                                  for m, n in adapters.items()) + ")"
    items = ", ".join(f"{m} {n:.1f}" for m, n in w["items_per_step"].items())
    fewer = f" on 1 to {report['gpus']} GPUs" if report.get("fewer_gpus") else ""
    lines = [
        f"model     {report['model']['source']}: {params} parameters, "
        f"{report['model']['precision']}",
        f"workload  {w['steps']} step{'s' if w['steps'] != 1 else ''} of "
        f"{w['global_batch_size']} sample{'s' if w['global_batch_size'] != 1 else ''} (micro "
        f"batch {w['micro_batch_size']}{', packed' if w['packing'] else ''}): "
        f"{w['tokens_per_step']:.0f} tokens per step" + (
            f", items per step by encoder module: {items}" if items else ""),
        *([_clip_text(w["clip"])] if "clip" in w else []),
        f"gpus      {report['gpus']} x {g['name']}: {g['memory_gib']:.1f} GiB "
        f"({g['usable_gib']:.1f} usable), {g['tflops']:.0f} TFLOP/s x MFU {g['mfu']:.2f}, "
        f"{g['node_gbs']:.0f} GB/s in a node of {g['per_node']}, {g['network_gbs']:.0f} GB/s "
        "across",
        f"layouts   {report['layouts']}{fewer} ({report['candidates']} with settings): "
        f"{report['fitting_layouts']} fit, {report['dropped_layouts']} do not fit in memory "
        "with any settings",
        *([f"yours     {report['yours']}: {report['yours_not_ranked']}"]
          if report.get("yours_not_ranked") else []),
        f"{'rank':>4s} {'step s':>8s} {'samples/s':>9s} {'MFU':>5s} {'GiB/rank':>8s}  "
        f"layout  (settings)"]
    def row(r: dict) -> str:
        mark = "  <- yours" if r["layout"] == report["yours"] else ""
        return (f"{r['rank']:4d} {_seconds(r['step_s']):>8s} {r['samples_per_s']:9.2f} "
                f"{r['mfu']:5.2f} {r['peak_memory_gib']:8.1f}  {r['layout']}  "
                f"({_settings_text(r['settings'])}){mark}")
    # the top ranks in order; your layout, where ranked below them, after the other language
    # layouts (ranked above it too, some of them)
    top = [r for i, r in enumerate(report["ranked"]) if r["rank"] == i + 1]
    lines += [row(r) for r in top]
    if report.get("other_language_layouts"):
        lines.append("the best of other language layouts:")
        lines += [row(r) for r in report["other_language_layouts"]]
    below = [r for r in report["ranked"] if r not in top]
    if below:
        lines.append("yours:")
        lines += [row(r) for r in below]
    if report["ranked"]:
        lines.append("why")
        for r in report["ranked"]:
            lines.append(f"  {r['rank']}. {r['layout']}: {r['why']}")
        best = report["ranked"][0]
        source = report["model"]["source"]      # a training YAML is the run's config
        config = source if source.endswith((".yaml", ".yml")) else "..."
        arguments = f"--config {config} " + " ".join(f"'{o}'" if ";" in o else o
                                                     for o in best["overrides"])
        lines.append("train the first with: " + _launch(best["ranks"], g["per_node"], arguments))
    else:
        lines.append(_nothing_fits(report))
    if report["dropped"]:
        lines.append("closest to fitting: the least memory per rank of the tries that do not "
                     "fit" + ("; those ranked above fit" if report["ranked"] else ""))
        for r in report["dropped"]:
            name, m = _fullest(r)
            peak, usable = gib_over(r["peak_memory_gib"], g["usable_gib"])
            lines.append(f"  {r['layout']} ({_settings_text(r['settings'])}): "
                         f"{peak} GiB per rank > {usable} "
                         f"({name}: weights {m['weights']:.1f}, grads {m['gradients']:.1f}, "
                         f"optimizer {m['optimizer']:.1f}, "
                         + (f"LoRA adapters {m['adapters']:.1f}, " if m["adapters"] else "") +
                         f"activations {m['activations']:.1f}, temporary "
                         f"{m['temporary']:.1f})")
    return "\n".join(lines)


def _fullest(r: dict) -> tuple[str, dict[str, float]]:
    """The module of result ``r`` (JSON) whose rank holds the most, and its memory in GiB."""
    return max(r["memory_gib"].items(), key=lambda item: item[1]["total"])


LESS_TRAINED = ("train less of the model (LoRA, frozen parts: model.lora, model.freeze in a "
                "training YAML given as --model)")


def _nothing_fits(report: dict) -> str:
    """What to change where no layout fits: where every try's model state alone (weights,
    gradients, optimizer state, on some rank) passes a GPU's usable memory, no batch or sample
    size can help, and the line says so."""
    usable, w = report["gpu"]["usable_gib"], report["workload"]
    state = report.get("least_state_gib")
    if state is not None and state > usable:
        least, usable_said = gib_over(state, usable)
        return (f"no layout fits: the model's own state passes a GPU's memory in every try "
                f"(weights, gradients and optimizer state: {least} GiB on a rank at the "
                f"least > {usable_said} usable), whatever the batch or the samples: more GPUs "
                "(the distributed optimizer shards the optimizer state over dp), a GPU with "
                f"more memory, or {LESS_TRAINED}")
    fewer = ("a smaller micro batch" if w["micro_batch_size"] > 1 else
             "shorter samples (fewer tokens each: the media's max_pixels, a video's fps, "
             "seq_length)")
    return f"no layout fits: more GPUs, a GPU with more memory, {fewer}, or {LESS_TRAINED}"


def _clip_text(clip: dict) -> str:
    """The workload's clip (``mimo_data.inspect.clip``): what its frames and tokens became."""
    (width, height), (rw, rh), (t, rows, columns) = clip["size"], clip["resized"], clip["grid"]
    longer = (f"; training it needs seq_length >= {clip['tokens']} (the config's: "
              f"{clip['seq_length']})" if clip["tokens"] > clip["seq_length"] else "")
    written = ""
    if clip["config_frames"] < clip["sampled_frames"]:
        written += (f"; the preprocessing config as written samples {clip['config_frames']} of "
                    f"them (modalities.video.max_frames {clip['config_max_frames']}): set "
                    f"max_frames to {clip['frames']} to train every frame")
    if clip["seconds"] > clip["config_max_duration"]:
        written += (f"; it drops clips over {clip['config_max_duration']:g} s "
                    "(modalities.video.max_duration): raise it")
    return (f"clip      {clip['seconds']:g} s at {clip['fps']:g} fps: {clip['frames']} frames of "
            f"{width}x{height} resized to {rw}x{rh}, {t} temporal patches x {rows} x {columns} "
            f"= {clip['video_tokens']} video tokens; the sample {clip['tokens']} tokens{longer}"
            f"{written}")


def _count(parameters: float) -> str:
    return f"{parameters / 1e9:.2f}B" if parameters >= 1e8 else f"{parameters / 1e6:.2f}M"


def _seconds(value: float) -> str:
    return f"{value:.3f}" if value >= 0.01 else f"{value:.2e}"


def _settings_text(settings: dict) -> str:
    words = ["dist-opt" if settings["distributed_optimizer"] else "no dist-opt",
             f"recompute {settings['recompute']}"]
    if settings.get("tower_recompute") == "full" and settings["recompute"] != "full":
        words.append("tower recompute full")
    if settings["sequence_parallel"]:
        words.append("SP")
    if settings.get("split_media"):
        words.append("split media")
    return ", ".join(words)
