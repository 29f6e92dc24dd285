"""The layout advisor of ``mimo-inspect plan --model MODEL --gpus N`` (docs/inspect.md, "The
layout advisor"): every layout of the model's modules on N GPUs, with and without the
distributed optimizer and activation recompute, its memory per rank (``memory``) and its
predicted step time from the dataset's per-step work (the token table, read by
``mimo_data.inspect.workload``; FLOPs from ``flops``), ranked; those that do not fit are
dropped, and the top few say why (memory per rank, bottleneck module, idle fraction).

Candidates (each checked with ``Layout.validate``, the loader's and trainer's check):

- colocated: every module on all N ranks, the language model tp x dp (pp 1: megatron-core 0.19
  runs colocated modules whole), encoders dp N (with variable-token inputs megatron-core's
  colocated bridge needs the encoder's dp to equal the language model's: tp 1 then);
- non-colocated: each encoder module on its own ranks (dp only: the transformers towers run
  whole on a rank), the language model tp x pp x dp on the rest; tp a power of two up to 8
  dividing the heads and query groups (a TP group stays inside a node), pp dividing the layers;
- settings: distributed optimizer off / on (where a DP size > 1), recompute none / selective /
  full (selective only where the attention kernel keeps the scores: with flash, sdpa or varlen
  kernels it saves nothing), sequence parallel where tp > 1 (unless turned off).

Step time (seconds), from per micro-batch work. R = peak FLOP/s x MFU of one GPU. A part's time
is its training FLOPs (``flops.step_flops``; the language model's positions as the trainer
computes them: packed, the real tokens; unpacked, each micro-batch cut to its longest sample
rounded up to 64, at most seq_length) / R, the language model's / (tp x pp) plus its TP
collectives (4 per layer, each 2 (tp-1)/tp x positions x h x w bytes over the node's
bandwidth); full recompute adds a forward (x (passes + 1) / passes of a trained part;
selective recompute's attention-core forward is not counted). Then:

- non-colocated, a pipeline of S = 1 + pp stages (the encoders, then the language stages), m
  global micro-batches per step: T_k(j) the slowest rank of stage k on micro-batch j (the
  encoders: the slowest module and DP rank), step = sum_j max_k T_k(j) + sum_k mean_j T_k(j)
  - mean_j max_k T_k(j) (the bottleneck stage paced, plus the fill and drain of the others);
  a language model alone with pp > 1 alike over its own stages;
- colocated: each rank runs every module on each micro-batch: step = max over ranks of the
  sum over micro-batches (or the sum of the per-micro-batch maxima where an encoder's dp
  differs from the language model's: the bridge meets every micro-batch);
- plus each module's gradient reduction after the backward pass (not overlapped): all-reduce
  2 (dp-1)/dp x 4 bytes per parameter of a rank, or with the distributed optimizer
  reduce-scatter (dp-1)/dp x 4 and all-gather (dp-1)/dp x w; over the node's bandwidth when
  the module's ranks fit in a node, else the network's; modules on separate ranks reduce at
  once (the slowest counts), colocated ones one after another.

Idle fraction: 1 - (sum over ranks of busy seconds) / (N x step). Memory: the fullest rank of
each module (``memory``), colocated ranks summing every module; a candidate fits when it is
at most the GPU's memory x 0.9 - 1 GiB (CUDA context, NCCL buffers, allocator fragmentation).
Ranked by step time, then less recompute, then no distributed optimizer, then memory; each
layout shown once, with its best settings.
"""

from __future__ import annotations

import copy
import json
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from mimo_data.loading.layout import LANGUAGE, Layout, LayoutError
from mimo_data.preprocess.collate import LENGTH_MULTIPLE
from mimo_train.planning import memory as mem
from mimo_train.planning.dims import ModelDims
from mimo_train.planning.flops import (item_grid, language_flops, peak_tflops, step_flops,
                                       trains, training_passes)


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float
    tflops: float               # dense peak at the run's precision
    node_gbs: float             # collective bus bandwidth inside a node (NVLink), GB/s
    network_gbs: float          # across nodes, per GPU, GB/s
    per_node: int = 8


# memory as the driver reports it; bandwidths: NCCL bus bandwidths of an 8-GPU NVLink node and
# a 400 Gb/s (H100, H200) or 200 Gb/s (A100) NIC per GPU, rounded down
GPUS = {"h100": ("H100 80GB", 79.6, "H100", 300.0, 40.0),
        "h200": ("H200 141GB", 140.4, "H200", 300.0, 40.0),
        "a100": ("A100 80GB", 80.0, "A100", 200.0, 20.0)}
MFU = 0.4
HEADROOM, RESERVED_GIB = 0.9, 1.0


def gpu(args, precision: str) -> GPU:
    name, memory_gib, peak_name, node, network = GPUS[args.gpu]
    tflops = args.gpu_tflops if args.gpu_tflops is not None else \
        peak_tflops(peak_name, precision) or 0.0
    per_node = getattr(args, "gpus_per_node", None)
    return GPU(name, args.gpu_memory_gib if args.gpu_memory_gib is not None else memory_gib,
               float(tflops), node, network, per_node if per_node is not None else 8)


# ------------------------------------------------------------------------------- the model

@dataclass
class Model:
    """The dims and what else of a training config changes memory and time."""
    dims: ModelDims
    source: str
    precision: str = "bf16"
    passes: dict = field(default_factory=dict)        # flops.training_passes
    trained: dict = field(default_factory=dict)       # part -> its own weights train
    attention_scores: bool = False                    # model.attention local
    packing: bool | None = None                       # a training YAML's data.packing
    optimizer_modules: tuple[str, ...] = ()           # its optimizer.modules entries
    deepstack: bool = False                           # an encoder adds deepstack rows

    def parameters(self, module: str) -> int:
        if module == LANGUAGE:
            return self.dims.language.parameters()
        return self.dims.encoders[module].parameters()


def read_model(path: str, preprocess_path: str, preprocess, modalities: dict[str, str],
               precision: str | None = None, vocab_size: int | None = None) -> Model:
    """``path``: a training config YAML, a transformers checkpoint directory or its
    config.json (a whole VLM, or a language model alone); its modules named as
    ``modalities`` (modality -> module) names them, the geometry from ``preprocess``;
    ``vocab_size``: the tokenizer's (with modality tokens; else read when needed)."""
    from mimo_train.config import TrainConfig
    from mimo_train.errors import TrainConfigError
    from mimo_train.planning.dims import from_config
    modules = list(dict.fromkeys(modalities.values()))
    layout = Layout.from_dict({"modules": {name: {"dp": 1, "rank_offset": 0}
                                           for name in [LANGUAGE, *modules]},
                               "modalities": modalities})
    overrides = [f"data.preprocess={os.path.abspath(preprocess_path)}", f"layout={layout}"]
    if path.endswith((".yaml", ".yml")):
        cfg = TrainConfig.load(path, overrides)
    else:
        directory = os.path.dirname(os.path.abspath(path)) if path.endswith(".json") else path
        with open(os.path.join(directory, "config.json")) as f:
            whole = json.load(f)
        key = "model.pretrained" if "vision_config" in whole or "text_config" in whole \
            else "model.language.pretrained"
        if key == "model.language.pretrained" and modalities:
            # nothing says what the encoders are: their dims would be EncoderConfig's defaults
            raise TrainConfigError(
                f"{directory} is a language model alone, and the preprocessing config has "
                f"{', '.join(sorted(modalities))}, which no encoder of it serves: give a "
                "training config YAML whose model.encoders sets each module (e.g. "
                "model.encoders.<module>.pretrained), or a whole VLM checkpoint")
        cfg = TrainConfig.load(None, ["data.datasets=[unused]", f"{key}={directory}",
                                      *overrides])
    cfg.train.precision = precision or (cfg.train.precision if path.endswith(
        (".yaml", ".yml")) else "bf16")
    try:
        dims = from_config(copy.deepcopy(cfg), preprocess, vocab_size)
    except TrainConfigError as error:
        if "vocabulary" not in str(error) or vocab_size is not None:
            raise
        from mimo_data.preprocess.chat_tokens import TextEncoder
        dims = from_config(copy.deepcopy(cfg), preprocess, TextEncoder(preprocess).vocab_size)
    frozen, adapted = list(cfg.model.freeze), list(cfg.model.lora)
    passes = training_passes(dims, frozen, adapted)
    fixed = frozen + adapted                # a LoRA part's own weights stay fixed
    trained = {LANGUAGE: trains(LANGUAGE, fixed),
               **{f"{m}.{p}": trains(f"{m}.{p}", fixed) for m in dims.encoders
                  for p in ("encoder", "projection")}}
    from mimo_train.families.registry import ENCODERS    # families read at call time only
    return Model(dims, path, cfg.train.precision, passes, trained,
                 cfg.model.attention == "local",
                 cfg.data.packing if path.endswith((".yaml", ".yml")) else None,
                 tuple(cfg.optimizer.modules),
                 any(ENCODERS[e.tower.kind].deepstack for e in dims.encoders.values()))


# ---------------------------------------------------------------------------- the work

def _near_square(n: int) -> list[int]:
    """A (1, rows, columns) token grid holding ``n`` tokens, near square (the item's own grid
    where the loader's metadata gives none)."""
    rows = max(1, math.isqrt(max(n, 1)))
    return [1, rows, -(-max(n, 1) // rows)]


@dataclass
class Work:
    """Per sample of the workload's steps: its language lengths and each encoder module's
    training FLOPs and patch grids (before merging)."""
    lengths: list[list[int]]                     # [step][sample]
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
    flops: dict[str, list[list[int]]] = {m: [] for m in encoders}
    grids: dict[str, list[list[list]]] = {m: [] for m in encoders}
    for step in workload["steps"]:
        lengths.append([s["tokens"] for s in step])
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
    return Work(lengths, flops, grids, workload["micro_batch_size"],
                workload["global_batch_size"], workload["seq_length"], workload["packing"])


# ---------------------------------------------------------------------------- a candidate

@dataclass(frozen=True)
class Candidate:
    layout: Layout
    settings: mem.Settings


@dataclass
class Result:
    candidate: Candidate
    step_s: float
    memory: dict[str, mem.Memory]        # module (or "colocated") -> its fullest rank
    busy: dict[str, float]               # module -> busy seconds of its busiest rank per step
    idle: float
    bottleneck: str
    flops: float                         # model FLOPs per step (real tokens)
    fits: bool = True

    @property
    def peak_bytes(self) -> float:
        return max(m.total for m in self.memory.values())


class Advisor:
    """Evaluates candidates of one model and workload on one kind of GPU."""

    def __init__(self, model: Model, work: Work, device: GPU, mfu: float = MFU):
        """``mfu``: the assumed fraction of the peak (``--mfu``)."""
        self.model, self.work, self.device, self.mfu = model, work, device, mfu
        self.rate = device.tflops * 1e12 * mfu  # FLOP/s of one GPU
        self._language_cache: dict = {}

    # -- per part ------------------------------------------------------------------------
    def _positions(self, lengths: list[int]) -> list[int]:
        if self.work.packing or not lengths:
            return lengths
        cut = min(self.work.seq_length, -(-max(lengths) // LENGTH_MULTIPLE) * LENGTH_MULTIPLE)
        return [cut] * len(lengths)

    def _parts(self, group: int, parts: int) -> list[list[range]]:
        """Sample index ranges of each global micro-batch of ``group`` samples split in
        ``parts`` contiguous parts."""
        size = group // parts
        return [[range(j * group + q * size, j * group + (q + 1) * size) for q in range(parts)]
                for j in range(self.work.global_batch_size // group)]

    def _language(self, step: int, group: int, dp: int) -> list[list[tuple[float, list[int]]]]:
        """(training FLOPs, positions) of each language DP part of each micro-batch."""
        key = (step, group, dp)
        if key not in self._language_cache:
            lengths = self.work.lengths[step]
            passes = self.model.passes.get(LANGUAGE, 3)
            self._language_cache[key] = [
                [(float(language_flops(self.model.dims.language, self._positions(
                    [lengths[i] for i in part]), passes)), self._positions(
                    [lengths[i] for i in part])) for part in parts]
                for parts in self._parts(group, dp)]
        return self._language_cache[key]

    # -- evaluation ----------------------------------------------------------------------
    def evaluate(self, candidate: Candidate) -> Result:
        layout, settings = candidate.layout, candidate.settings
        dims, work = self.model.dims, self.work
        lang = layout.language
        group = work.micro_batch_size * lang.dp
        m = work.global_batch_size // group
        colocated = layout.colocated and len(layout.modules) > 1
        stages = (1 if layout.encoders and not colocated else 0) + lang.pp
        lang_first = 1 if layout.encoders and not colocated else 0
        recompute = settings.recompute
        lang_factor = self._recompute_factor(LANGUAGE, recompute)
        steps = len(work.lengths)
        step_times, busy_totals = [], []
        busy: dict[str, float] = {}
        act: dict[str, float] = {}
        for s in range(steps):
            language = self._language(s, group, lang.dp)        # [j][r]
            lang_t = [[f * lang_factor / (lang.tp * lang.pp) / self.rate
                       + self._tp_comm(sum(pos), lang.tp, lang.pp) for f, pos in row]
                      for row in language]
            enc_t: dict[str, list[list[float]]] = {}
            for e in layout.encoders:
                factor = self._recompute_factor(e.name, recompute)
                ranges = self._parts(group, e.dp)
                flops = work.encoder_flops[e.name][s]
                enc_t[e.name] = [[sum(flops[i] for i in part) * factor / self.rate
                                  for part in row] for row in ranges]
                if self.model.passes.get(f"{e.name}.encoder", 3) == 1:
                    continue                    # forward only: nothing kept for a backward
                tower = dims.encoders[e.name].tower
                for q in range(e.dp):           # each DP rank's micro-batches, k in flight
                    kept = [mem.tower_activation_bytes(tower, [
                        g for i in row[q] for g in work.grids[e.name][s][i]], settings)
                        for row in ranges]
                    act[e.name] = max(act.get(e.name, 0.0), _window(
                        kept, 1 if colocated else mem.in_flight(m, stages, 0)))
            lang_backward = self.model.passes.get(LANGUAGE, 3) > 1
            for stage in sorted({0, lang.pp - 1}) if lang_backward else ():
                k = 1 if colocated or stages == 1 else \
                    mem.in_flight(m, stages, lang_first + stage)
                for r in range(lang.dp):
                    kept = [mem.language_activation_bytes(
                        dims.language, row[r][1], settings, lang.tp, lang.pp, stage)
                        for row in language]
                    act[f"{LANGUAGE}{stage}"] = max(act.get(f"{LANGUAGE}{stage}", 0.0),
                                                    _window(kept, k))
                    act[f"temporary{stage}"] = max(act.get(f"temporary{stage}", 0.0), max(
                        mem.language_temporary_bytes(dims.language, sum(row[r][1]), settings,
                                                     lang.tp, lang.pp, stage)
                        for row in language))
            if colocated:
                per_rank = [[row[rank // lang.tp] + sum(
                    enc_t[e.name][j][rank * e.dp // layout.world_size] for e in layout.encoders)
                    for j, row in enumerate(lang_t)] for rank in range(layout.world_size)]
                same_dp = all(e.dp == lang.dp for e in layout.encoders)
                compute = max(sum(r) for r in per_rank) if same_dp else \
                    sum(max(r[j] for r in per_rank) for j in range(m))
                busy_step = {"+".join(x.name for x in layout.modules): max(sum(r) for r in
                                                                            per_rank)}
                total_busy = sum(sum(r) for r in per_rank)
                sync = sum(self._dp_sync(name, layout, settings) for name in
                           [x.name for x in layout.modules])
                busy_step = {k: v + sync for k, v in busy_step.items()}
                total_busy += sync * layout.world_size
            else:
                stage_t = []                              # [k][j]
                if layout.encoders:
                    stage_t.append([max(max(enc_t[e.name][j]) for e in layout.encoders)
                                    for j in range(m)])
                lang_stage = [max(row) for row in lang_t]
                stage_t += [lang_stage] * lang.pp
                maxima = [max(stage_t[k][j] for k in range(len(stage_t))) for j in range(m)]
                compute = sum(maxima) + sum(sum(t) / m for t in stage_t) - sum(maxima) / m
                syncs = {x.name: self._dp_sync(x.name, layout, settings)
                         for x in layout.modules}
                sync = max(syncs.values())
                busy_step = {e.name: max(sum(row[q] for row in enc_t[e.name])
                                         for q in range(e.dp)) + syncs[e.name]
                             for e in layout.encoders}
                busy_step[LANGUAGE] = max(sum(row[r] for row in lang_t)
                                          for r in range(lang.dp)) + syncs[LANGUAGE]
                total_busy = sum(sum(sum(row) for row in enc_t[e.name]) + syncs[e.name] * e.dp
                                 for e in layout.encoders) + \
                    (sum(sum(row) for row in lang_t) + syncs[LANGUAGE] * lang.dp) * \
                    lang.tp * lang.pp
            step_times.append(compute + sync)
            busy_totals.append(total_busy)
            for name, seconds in busy_step.items():
                busy[name] = busy.get(name, 0.0) + seconds / steps
        step_s = sum(step_times) / steps
        idle = 1 - sum(busy_totals) / steps / (layout.world_size * step_s) if step_s else 0.0
        memory = self._memory(layout, settings, act, colocated)
        bottleneck = max(busy, key=lambda k: busy[k])
        model_flops = sum(language_flops(dims.language, lengths,
                                         self.model.passes.get(LANGUAGE, 3)) +
                          sum(sum(work.encoder_flops[e][s]) for e in work.encoder_flops)
                          for s, lengths in enumerate(work.lengths)) / steps
        usable = self.usable_bytes
        return Result(candidate, step_s, memory, busy, max(0.0, idle), bottleneck,
                      float(model_flops), max(x.total for x in memory.values()) <= usable)

    @property
    def usable_bytes(self) -> float:
        return (self.device.memory_gib * HEADROOM - RESERVED_GIB) * 2**30

    def _recompute_factor(self, module: str, recompute: str) -> float:
        part = LANGUAGE if module == LANGUAGE else f"{module}.encoder"
        passes = self.model.passes.get(part, 3)
        return (passes + 1) / passes if recompute == "full" and passes > 1 else 1.0

    def _tp_comm(self, positions: float, tp: int, pp: int) -> float:
        if tp == 1:
            return 0.0
        stack = self.model.dims.language
        volume = 2 * (tp - 1) / tp * positions * stack.hidden * \
            mem.BYTES[self.model.precision]
        return 4 * stack.layers / pp * volume / (self.device.node_gbs * 1e9)

    def _dp_sync(self, name: str, layout: Layout, settings: mem.Settings) -> float:
        module = layout.module(name)
        if module.dp == 1 or not self._trains(name):
            return 0.0
        params = self._rank_parameters(name, module, 0)
        share = (module.dp - 1) / module.dp
        volume = share * params * (mem.GRAD_BYTES + settings.width) \
            if settings.distributed_optimizer else 2 * share * params * mem.GRAD_BYTES
        bandwidth = self.device.node_gbs if module.size <= self.device.per_node \
            else self.device.network_gbs
        return volume / (bandwidth * 1e9)

    def _trains(self, name: str) -> bool:
        if name == LANGUAGE:
            return self.model.trained.get(LANGUAGE, True)
        return self.model.trained.get(f"{name}.encoder", True) or \
            self.model.trained.get(f"{name}.projection", True)

    def _rank_parameters(self, name: str, module, stage: int) -> float:
        if name == LANGUAGE:
            return mem.language_stage_parameters(self.model.dims.language, module.tp,
                                                 module.pp, stage)
        return float(self.model.parameters(name))

    def _state(self, name: str, module, stage: int, settings: mem.Settings) -> mem.Memory:
        if name == LANGUAGE:
            return mem.state_bytes(self._rank_parameters(name, module, stage), settings,
                                   module.dp, self.model.trained.get(LANGUAGE, True))
        encoder = self.model.dims.encoders[name]
        tower = mem.state_bytes(encoder.tower.parameters(), settings, module.dp,
                                self.model.trained.get(f"{name}.encoder", True))
        projection = encoder.parameters() - encoder.tower.parameters()
        return tower + mem.state_bytes(projection, settings, module.dp,
                                       self.model.trained.get(f"{name}.projection", True))

    def _memory(self, layout: Layout, settings: mem.Settings, act: dict,
                colocated: bool) -> dict[str, mem.Memory]:
        lang = layout.language
        language = {}
        for stage in sorted({0, lang.pp - 1}):
            language[stage] = self._state(LANGUAGE, lang, stage, settings) + \
                mem.Memory(activations=act.get(f"{LANGUAGE}{stage}", 0.0),
                           temporary=act.get(f"temporary{stage}", 0.0))
        worst = max(language.values(), key=lambda x: x.total)
        encoders = {e.name: self._state(e.name, e, 0, settings) +
                    mem.Memory(activations=act.get(e.name, 0.0)) for e in layout.encoders}
        if colocated:
            total = worst
            for value in encoders.values():
                total = total + value
            return {"+".join(x.name for x in layout.modules): total}
        return {LANGUAGE: worst, **encoders}


def _window(values: list[float], k: int) -> float:
    """The most ``k`` consecutive ``values`` sum to (micro-batches held at once)."""
    k = max(1, min(k, len(values)))
    return max((sum(values[i:i + k]) for i in range(len(values) - k + 1)), default=0.0)


# ----------------------------------------------------------------------------- candidates

def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def language_shapes(model: Model, size: int) -> list[tuple[int, int, int]]:
    """(tp, pp, dp) of the language model on ``size`` ranks."""
    stack = model.dims.language
    found = []
    for tp in (1, 2, 4, 8):
        if size % tp or stack.heads % tp or stack.query_groups % tp:
            continue
        for pp in _divisors(size // tp):
            if stack.layers % pp == 0:
                found.append((tp, pp, size // (tp * pp)))
    return found


def layouts(model: Model, gpus: int, modalities: dict[str, str], global_batch_size: int,
            micro_batch_size: int, variable: list[str], expanded: list[str]) -> list[Layout]:
    """Every valid layout of the model's modules on ``gpus`` ranks (the module docstring)."""
    encoders = list(model.dims.encoders)
    found: list[Layout] = []

    def add(spec: dict) -> None:
        try:
            layout = Layout.from_dict({"modules": spec, "modalities": modalities})
            layout.validate(gpus, global_batch_size, micro_batch_size, variable,
                            modalities=expanded)
        except LayoutError:
            return
        found.append(layout)

    for tp, pp, dp in language_shapes(model, gpus):           # colocated
        if pp == 1 or not encoders:
            add({LANGUAGE: {"tp": tp, "pp": pp, "dp": dp, "rank_offset": 0},
                 **{e: {"dp": gpus, "rank_offset": 0} for e in encoders}})
    if not encoders:
        return found

    def spread(names: list[str], ranks: int, group: int, lang_dp: int):
        """dp of each encoder module in ``names`` summing to ``ranks``."""
        if not names:
            if ranks == 0:
                yield []
            return
        for dp in _divisors(group):
            if dp <= ranks - (len(names) - 1) and (dp % lang_dp == 0 or lang_dp % dp == 0):
                for rest in spread(names[1:], ranks - dp, group, lang_dp):
                    yield [dp, *rest]

    for lang_size in range(1, gpus - len(encoders) + 1):
        for tp, pp, dp in language_shapes(model, lang_size):
            group = micro_batch_size * dp
            if global_batch_size % group:
                continue
            for dps in spread(encoders, gpus - lang_size, group, dp):
                spec: dict = {}
                offset = 0
                for name, edp in zip(encoders, dps):
                    spec[name] = {"dp": edp, "rank_offset": offset}
                    offset += edp
                spec[LANGUAGE] = {"tp": tp, "pp": pp, "dp": dp, "rank_offset": offset}
                add(spec)
    return found


def settings_of(model: Model, layout: Layout, args, packing: bool = False
                ) -> list[mem.Settings]:
    """The settings tried on ``layout``: sequence parallel only where tp > 1 and the data is
    not packed (the trainer refuses sequence_parallel with data.packing), and always there for
    a mixture-of-experts language model (megatron-core's MoE layer needs it: packed, no
    setting); with deepstack rows no full recompute (``model.build.check_deepstack``)."""
    recompute: tuple[str, ...] = mem.RECOMPUTE if args.recompute == "any" else \
        (args.recompute,)
    if not model.attention_scores:
        recompute = tuple(r for r in recompute if r != "selective") or recompute
    if model.deepstack:
        recompute = tuple(r for r in recompute if r != "full")
    multi_dp = any(m.dp > 1 for m in layout.modules)
    distributed = {"both": (False, True), "yes": (True,), "no": (False,)}[
        args.distributed_optimizer]
    if not multi_dp:
        distributed = distributed[:1]
    sp = not args.no_sequence_parallel and layout.language.tp > 1 and not packing
    if model.dims.language.experts and layout.language.tp > 1 and not sp:
        return []
    return [mem.Settings(model.precision, d, r, sp, model.attention_scores)
            for d in distributed for r in recompute]


def compact(layout: Layout) -> str:
    """The layout as the compact string, defaults left out."""
    parts = []
    colocated = layout.colocated and len(layout.modules) > 1
    for m in layout.modules:
        dims = [f"{d}{getattr(m, d)}" for d in ("tp", "pp", "dp") if getattr(m, d) > 1] or \
            ["dp1"]
        if colocated:
            dims.append("off0")
        tags = [t for t in layout.modalities_of(m.name) if t != m.name]
        parts.append(f"{m.name}=" + ",".join(dims + tags))
    return ";".join(parts)


RECOMPUTE_ORDER = {"none": 0, "selective": 1, "full": 2}


def rank(results: list[Result]) -> list[Result]:
    """Fitting results, best first, one per layout (its best settings)."""
    ordered = sorted((r for r in results if r.fits), key=lambda r: (
        round(r.step_s, 9), RECOMPUTE_ORDER[r.candidate.settings.recompute],
        r.candidate.settings.distributed_optimizer, r.peak_bytes))
    seen, found = set(), []
    for r in ordered:
        key = str(r.candidate.layout)
        if key not in seen:
            seen.add(key)
            found.append(r)
    return found


# ----------------------------------------------------------------------------- reporting

def overrides(candidate: Candidate, optimizer_modules: Sequence[str] = ()) -> list[str]:
    """The training config's ``key=value`` overrides that run ``candidate`` (``mimo-train``'s
    layout, optimizer.distributed, recompute and sequence parallel keys): the distributed
    optimizer's setting also for each module of ``optimizer_modules`` (those the training
    YAML's ``optimizer.modules`` names, whose own ``distributed`` would win over the global
    key), sequence parallel always (true or false, whatever the YAML says)."""
    settings, layout = candidate.settings, candidate.layout
    distributed = str(settings.distributed_optimizer).lower()
    found = [f"layout={compact(layout)}", f"optimizer.distributed={distributed}"]
    found += [f"optimizer.modules.{m}.distributed={distributed}" for m in optimizer_modules]
    found.append(f"model.language.recompute={settings.recompute}")
    found += [f"model.encoders.{e.name}.recompute="
              f"{'full' if settings.recompute == 'full' else 'none'}" for e in layout.encoders]
    found.append(f"model.language.sequence_parallel={str(settings.sequence_parallel).lower()}")
    return found


def achieved_mfu(r: Result, gpus: int, device: GPU) -> float:
    """The model FLOPs per second of ``r``'s step over the ``gpus`` GPUs' peak."""
    return r.flops / (r.step_s * gpus * device.tflops * 1e12)


def result_json(r: Result, gpus: int, device: GPU, work: Work,
                optimizer_modules: Sequence[str] = ()) -> dict:
    settings = r.candidate.settings
    return {"layout": compact(r.candidate.layout), "layout_full": str(r.candidate.layout),
            "overrides": overrides(r.candidate, optimizer_modules),
            "colocated": r.candidate.layout.colocated,
            "settings": {"precision": settings.precision,
                         "distributed_optimizer": settings.distributed_optimizer,
                         "recompute": settings.recompute,
                         "sequence_parallel": settings.sequence_parallel},
            "step_s": r.step_s, "samples_per_s": work.global_batch_size / r.step_s,
            "mfu": achieved_mfu(r, gpus, device),
            "memory_gib": {k: v.gib() for k, v in r.memory.items()},
            "peak_memory_gib": r.peak_bytes / 2**30, "fits": r.fits,
            "busy_s": r.busy, "bottleneck": r.bottleneck, "idle_fraction": r.idle}


def why(r: Result, device: GPU, gpus: int) -> str:
    memory = "; ".join(
        f"{name} {m.total / 2**30:.1f} GiB (weights {m.weights / 2**30:.1f}, grads "
        f"{m.gradients / 2**30:.1f}, optimizer {m.optimizer / 2**30:.1f}, activations "
        f"{m.activations / 2**30:.1f}, temporary {m.temporary / 2**30:.1f})"
        for name, m in r.memory.items())
    busy = ", ".join(f"{k} {_seconds(v)} s"
                     for k, v in sorted(r.busy.items(), key=lambda x: -x[1]))
    mfu = achieved_mfu(r, gpus, device)
    return (f"bottleneck {r.bottleneck} (busiest rank per step: {busy}); idle "
            f"{100 * r.idle:.0f}% of the GPU time; achieved MFU {mfu:.2f}; memory per rank: "
            f"{memory}")


def advise(args, config, workload: dict) -> int:
    """``mimo-inspect plan --model M --gpus N``: print the ranking (text or ``--json``); 0 when
    some layout fits, 1 when none does, 2 for a model that cannot be read."""
    from mimo_data.loading.loader import variable_token_modalities
    from mimo_train.errors import TrainConfigError
    try:
        model = read_model(args.model, args.config, config, workload["modalities"],
                           args.precision, workload.get("vocab_size"))
    except (TrainConfigError, OSError, ValueError) as error:
        print(f"mimo-inspect plan: error: --model {args.model}: {error}", file=sys.stderr)
        return 2
    if model.packing is not None:       # a training YAML: its data.packing is the run's
        if getattr(args, "packing", False) and not model.packing:
            print(f"mimo-inspect plan: error: --packing, but --model {args.model} says "
                  "data.packing: false (the YAML's setting is the one used: drop --packing or "
                  "set data.packing in the YAML)", file=sys.stderr)
            return 2
        workload = {**workload, "packing": model.packing}
    report = run_advisor(model, workload, args, variable_token_modalities(config),
                         list(config.modalities))
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(format_report(report))
    return 0 if report["ranked"] else 1


def run_advisor(model: Model, workload: dict, args, variable: list[str],
                expanded: list[str]) -> dict:
    """The advisor's report (JSON-ready) of ``model`` on ``workload`` with the CLI's
    ``args`` (gpus, gpu, gpu_memory_gib, gpu_tflops, mfu, distributed_optimizer, recompute,
    no_sequence_parallel, top, layout)."""
    device = gpu(args, model.precision)
    work = read_work(model, workload)
    advisor = Advisor(model, work, device, args.mfu if args.mfu is not None else MFU)
    candidates = layouts(model, args.gpus, workload["modalities"], work.global_batch_size,
                         work.micro_batch_size, variable, expanded)
    yours = Layout.parse(args.layout) if getattr(args, "layout", None) else None
    not_ranked = None               # why your layout is not ranked, where it cannot be
    if yours is not None and yours.world_size != args.gpus:
        not_ranked = f"not ranked: uses {yours.world_size} GPUs, not {args.gpus}"
    elif yours is not None:
        try:
            yours.validate(args.gpus, work.global_batch_size, work.micro_batch_size, variable,
                           modalities=expanded)
        except LayoutError as error:
            not_ranked = f"not ranked: {error}"
        else:
            if str(yours) not in {str(x) for x in candidates}:
                candidates.append(yours)
    results = [advisor.evaluate(Candidate(layout, settings)) for layout in candidates
               for settings in settings_of(model, layout, args, work.packing)]
    ranked = rank(results)
    dropped = sorted((r for r in results if not r.fits), key=lambda r: r.peak_bytes)
    dropped_layouts = {str(r.candidate.layout) for r in dropped} - \
        {str(r.candidate.layout) for r in ranked}
    top = ranked[:args.top]
    shown = list(top)
    if yours is not None:
        mine = [r for r in ranked if str(r.candidate.layout) == str(yours)]
        if mine and mine[0] not in shown:
            shown.append(mine[0])
    dims = model.dims
    return {
        "model": {"source": model.source, "precision": model.precision,
                  "parameters": {LANGUAGE: dims.language.parameters(),
                                 **{m: e.parameters() for m, e in dims.encoders.items()}},
                  "trained": model.trained},
        "gpus": args.gpus,
        "gpu": {"name": device.name, "memory_gib": device.memory_gib,
                "usable_gib": advisor.usable_bytes / 2**30, "tflops": device.tflops,
                "mfu": advisor.mfu, "node_gbs": device.node_gbs,
                "network_gbs": device.network_gbs, "per_node": device.per_node},
        "workload": {"steps": len(work.lengths), "global_batch_size": work.global_batch_size,
                     "micro_batch_size": work.micro_batch_size, "packing": work.packing,
                     "epochs_read": workload.get("epochs", 1),
                     "tokens_per_step": sum(map(sum, work.lengths)) / len(work.lengths),
                     "items_per_step": {m: sum(len(g) for step in work.grids[m] for g in step)
                                        / len(work.lengths) for m in work.grids}},
        "candidates": len(results), "layouts": len(candidates),
        "fitting_layouts": len(ranked), "dropped_layouts": len(dropped_layouts),
        "yours": compact(yours) if yours is not None else None,
        "yours_not_ranked": not_ranked,
        "ranked": [{**result_json(r, args.gpus, device, work, model.optimizer_modules),
                    "rank": ranked.index(r) + 1, "why": why(r, device, args.gpus)}
                   for r in shown],
        "dropped": [result_json(r, args.gpus, device, work, model.optimizer_modules)
                    for r in dropped[:3]],
    }


def format_report(report: dict) -> str:
    g, w, p = report["gpu"], report["workload"], report["model"]["parameters"]
    params = ", ".join(f"{m} {n / 1e9:.2f}B" if n >= 1e8 else f"{m} {n / 1e6:.2f}M"
                       for m, n in p.items())
    items = ", ".join(f"{m} {n:.1f}" for m, n in w["items_per_step"].items())
    lines = [
        f"model     {report['model']['source']}: {params} parameters, "
        f"{report['model']['precision']}",
        f"workload  {w['steps']} step{'s' if w['steps'] != 1 else ''} of "
        f"{w['global_batch_size']} samples (micro batch "
        f"{w['micro_batch_size']}{', packed' if w['packing'] else ''}): "
        f"{w['tokens_per_step']:.0f} tokens per step" + (f", items per step: {items}"
                                                          if items else ""),
        f"gpus      {report['gpus']} x {g['name']}: {g['memory_gib']:.1f} GiB "
        f"({g['usable_gib']:.1f} usable), {g['tflops']:.0f} TFLOP/s x MFU {g['mfu']:.2f}, "
        f"{g['node_gbs']:.0f} GB/s in a node of {g['per_node']}, {g['network_gbs']:.0f} GB/s "
        "across",
        f"layouts   {report['layouts']} ({report['candidates']} with settings): "
        f"{report['fitting_layouts']} fit, {report['dropped_layouts']} do not fit in memory "
        "with any settings",
        *([f"yours     {report['yours']}: {report['yours_not_ranked']}"]
          if report.get("yours_not_ranked") else []),
        f"{'rank':>4s} {'step s':>8s} {'samples/s':>9s} {'MFU':>5s} {'GiB/rank':>8s}  "
        f"layout  (settings)"]
    for r in report["ranked"]:
        mark = "  <- yours" if r["layout"] == report["yours"] else ""
        lines.append(f"{r['rank']:4d} {_seconds(r['step_s']):>8s} {r['samples_per_s']:9.2f} "
                     f"{r['mfu']:5.2f} {r['peak_memory_gib']:8.1f}  {r['layout']}  "
                     f"({_settings_text(r['settings'])}){mark}")
    if report["ranked"]:
        lines.append("why")
        for r in report["ranked"]:
            lines.append(f"  {r['rank']}. {r['layout']}: {r['why']}")
        best = report["ranked"][0]
        lines.append("train the first with: mimo-train --config ... " +
                     " ".join(f"'{o}'" if ";" in o else o for o in best["overrides"]))
    else:
        lines.append("no layout fits: more GPUs, a GPU with more memory, or a smaller micro "
                     "batch")
    if report["dropped"]:
        lines.append("smallest settings that do not fit (a layout may fit with others, above)")
        for r in report["dropped"]:
            lines.append(f"  {r['layout']} ({_settings_text(r['settings'])}): "
                         f"{r['peak_memory_gib']:.1f} GiB per rank > {g['usable_gib']:.1f}")
    return "\n".join(lines)


def _seconds(value: float) -> str:
    return f"{value:.3f}" if value >= 0.01 else f"{value:.2e}"


def _settings_text(settings: dict) -> str:
    words = ["dist-opt" if settings["distributed_optimizer"] else "no dist-opt",
             f"recompute {settings['recompute']}"]
    if settings["sequence_parallel"]:
        words.append("SP")
    return ", ".join(words)
