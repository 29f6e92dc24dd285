"""What a candidate costs: its predicted step time, idle fraction, bottleneck and memory per
rank (``Advisor.evaluate``), for one model and workload on one kind of GPU.

Step time (seconds), from per micro-batch work. R = peak FLOP/s x MFU of one GPU. A part's time
is its training FLOPs (``flops.step_flops``; the language model's positions as the trainer
computes them: packed, the real tokens; unpacked, each micro-batch cut to its longest sample
rounded up to 64, at most seq_length) / R, the language model's / (tp x pp) plus its TP
collectives (4 per layer, each 2 (tp-1)/tp x positions x h x w bytes over the node's
bandwidth); full recompute adds a forward (x (passes + 1) / passes of a trained part; selective
recompute's attention-core forward is not counted; nor are the collectives it repeats), and so
does the balancing loss (``model.language.moe_aux_loss``: its counting pass runs every module
forward once more a step, ``mcore.balance``). A mixture of experts (``layer_traffic``): its
layers' TP collectives are the attention's 2 (and a shared expert's 2), plus megatron-core's
dispatcher: over the etp ranks a gather of the routed tokens and a scatter of the experts'
output, forward and backward, 4 (etp-1)/tp x positions x k x h x w bytes over the node's
bandwidth; with ep > 1, 4 all-to-alls (dispatch and combine, forward and backward) of the
rank's own routed tokens, 4 (ep-1)/ep x positions / tp x k x h x w bytes, over the node's
bandwidth where every expert-parallel group lies in one node, else the network's. Expert
parallelism does not change a rank's expert FLOPs on average (its E/ep experts get the tokens
of ep ranks), but the busiest rank gets ``memory.ROUTED_IMBALANCE`` times its share: its routed
experts' FLOPs, traffic and activations are counted so. Context parallelism (the language
module's cp, ``mcore.context_parallel``): each of the cp ranks of a DP replica computes 1/cp of
its micro-batch's positions (the attention: the whole sequence for 1/cp of the heads), so the
language model's FLOPs per rank are / (tp x cp x pp), its TP collectives those of 1/cp of the
positions, and its attention adds 4 all-to-alls a layer forward and 4 backward
(``context_traffic``: queries, keys, values and the output, each of the rank's positions / cp x
its heads (key/value groups repeated up to a multiple of cp where fewer) x kv channels x w
bytes, (cp-1)/cp of it to other ranks), over the node's bandwidth where every CP group lies in
one node, else the network's; unpadded micro-batches are cut to a multiple of lcm(64, cp x tp),
as the trainer pads them. An encoder rank's work is its samples' (1/dp of each global
micro-batch), or with split media (``data.split_media``, a fanning-in module, k = encoder dp /
language dp) its token-balanced part of its language rank's media (``memory.split_grids``);
full recompute of the tower (``Settings.towers``: its own or the language model's) adds its
forward alike. Then:

- non-colocated, a pipeline of S = 1 + pp stages (the encoders, then the language stages), m
  global micro-batches per step: T_k(j) the slowest rank of stage k on micro-batch j (the
  encoders: the slowest module and DP rank), step = sum_j max_k T_k(j) + sum_k mean_j T_k(j)
  - mean_j max_k T_k(j) (the bottleneck stage paced, plus the fill and drain of the others);
  a language model alone with pp > 1 alike over its own stages;
- colocated: each rank runs every module on each micro-batch: step = max over ranks of the
  sum over micro-batches (or the sum of the per-micro-batch maxima where an encoder's dp
  differs from the language model's: the bridge meets every micro-batch);
- plus each module's gradient reduction after the backward pass (not overlapped): all-reduce
  2 (dp-1)/dp x 4 bytes per trained parameter of a rank (a part under LoRA: its adapters',
  ``planning.adapters``), or with the distributed optimizer
  reduce-scatter (dp-1)/dp x 4 and all-gather (dp-1)/dp x w; the language model's routed
  experts over their expert dp (tp x dp / (etp x ep)) instead; each over the node's bandwidth
  where every group it reduces over lies in one node, else the network's (a module spanning
  nodes by its pipeline stages reduces within each); modules on separate ranks reduce at
  once (the slowest counts), colocated ones one after another. The language model's dense
  gradients reduce over dp x cp (megatron-core's dp_cp group: each CP rank's gradient is its
  part of the sequence's).

Idle fraction: 1 - (sum over ranks of busy seconds) / (N x step). Memory: the fullest rank of
each module (``memory``; LoRA adapters' ``Memory.adapters``: the rank's share of them, by
``planning.adapters``), colocated ranks summing every module; a candidate fits when it is
at most the GPU's memory x 0.9 - 1 GiB (CUDA context, NCCL buffers, allocator fragmentation).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from mimo_data.loading.layout import LANGUAGE, Layout, ModuleLayout
from mimo_data.preprocess.collate import LENGTH_MULTIPLE
from mimo_train.planning import memory as mem
from mimo_train.planning.advisor.inputs import GPU, Model, Work
from mimo_train.planning.dims import Stack
from mimo_train.planning.flops import expert_flops_per_token, language_flops

MFU = 0.4                          # the assumed fraction of the peak (--mfu)
HEADROOM, RESERVED_GIB = 0.9, 1.0


def usable_gib(memory_gib: float) -> float:
    """The GiB a rank may plan in on a GPU of ``memory_gib`` (``Advisor.usable_bytes``; what
    is left: the CUDA context, NCCL's buffers, the allocator's fragmentation)."""
    return memory_gib * HEADROOM - RESERVED_GIB


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
    all_to_all: float = 0.0              # of the busiest language rank's busy seconds per step:
                                         # the expert dispatcher's all-to-alls
    context_all_to_all: float = 0.0      # ... and context parallelism's (attention's)


    @property
    def peak_bytes(self) -> float:
        return max(m.total for m in self.memory.values())


class Advisor:
    """Evaluates candidates of one model and workload on one kind of GPU."""

    def __init__(self, model: Model, work: Work, device: GPU, mfu: float = MFU):
        """``mfu``: the assumed fraction of the peak (``--mfu``)."""
        self.model, self.work, self.device, self.mfu = model, work, device, mfu
        self.rate = device.tflops * 1e12 * mfu  # FLOP/s of one GPU
        # what many candidates share, computed once: each language and encoder module's
        # parts of a step for a DP size, and a tower's activations for a micro-batch's grids
        self._language_cache: dict = {}
        self._encoder_cache: dict = {}
        self._tower_cache: dict = {}
        # ... and a module's seconds and activations for those parts under its own settings
        self._times_cache: dict = {}
        self._language_held_cache: dict = {}
        self._encoder_held_cache: dict = {}
        self._bandwidth_cache: dict = {}        # a group's: (offset, size, stride, ranks)
        self._comm_cache: dict = {}             # a language rank's: (positions, module)

    # -- per part ------------------------------------------------------------------------
    def _positions(self, lengths: list[int], multiple: int = 1) -> list[int]:
        """The positions the trainer computes of samples of ``lengths``: packed, the real
        tokens; unpacked, each cut to the longest rounded up to lcm(64, ``multiple``) (cp x tp
        under context parallelism), at most seq_length."""
        if self.work.packing or not lengths:
            return lengths
        step = math.lcm(LENGTH_MULTIPLE, multiple)
        cut = min(self.work.seq_length, -(-max(lengths) // step) * step)
        return [cut] * len(lengths)

    def _parts(self, group: int, parts: int) -> list[list[range]]:
        """Sample index ranges of each global micro-batch of ``group`` samples split in
        ``parts`` contiguous parts."""
        size = group // parts
        return [[range(j * group + q * size, j * group + (q + 1) * size) for q in range(parts)]
                for j in range(self.work.global_batch_size // group)]

    def _language(self, step: int, group: int, dp: int, multiple: int = 1
                  ) -> list[list[tuple[float, list[int], int]]]:
        """(training FLOPs, positions, trained tokens) of each language DP part of each
        micro-batch (the whole DP replica's, its cp ranks' together; ``multiple``:
        ``_positions``')."""
        key = (step, group, dp, multiple)
        if key not in self._language_cache:
            lengths, trained = self.work.lengths[step], self.work.trained[step]
            passes = self.model.passes.get(LANGUAGE, 3)
            found = []
            for parts in self._parts(group, dp):
                row = []
                for part in parts:
                    positions = self._positions([lengths[i] for i in part], multiple)
                    outputs = sum(trained[i] for i in part)
                    row.append((float(language_flops(self.model.dims.language, positions,
                                                     passes, outputs)), positions, outputs))
                found.append(row)
            self._language_cache[key] = found
        return self._language_cache[key]

    def _encoder_parts(self, step: int, module: ModuleLayout, lang: ModuleLayout, group: int,
                       split: bool) -> list[list[tuple[float, list]]]:
        """(training FLOPs, patch grids) of each DP rank of encoder ``module`` on each global
        micro-batch of ``group`` samples: whole samples, 1/dp of them each; ``split``
        (``data.split_media`` on a fanning-in module: k = dp / language dp), its language
        rank's media cut into k token-balanced parts (``memory.split_grids``), a piece's FLOPs
        its sample's times its share of the sample's patches (exact for a frame-independent
        tower's clip: every temporal patch costs the same)."""
        key = (step, module.name, module.dp, lang.dp, group, split)
        if key not in self._encoder_cache:
            self._encoder_cache[key] = self._encoder_parts_of(step, module, lang, group, split)
        return self._encoder_cache[key]

    def _encoder_parts_of(self, step: int, module: ModuleLayout, lang: ModuleLayout,
                          group: int, split: bool) -> list[list[tuple[float, list]]]:
        flops, grids = self.work.encoder_flops[module.name][step], \
            self.work.grids[module.name][step]
        if not split:
            return [[(float(sum(flops[i] for i in part)), [g for i in part for g in grids[i]])
                     for part in row] for row in self._parts(group, module.dp)]
        found: list[list[tuple[float, list]]] = []
        for row in self._parts(group, lang.dp):
            found.append([])
            for part in row:                # a language rank's samples, its k encoder ranks
                owners = [i for i in part for _ in grids[i]]
                patches = {i: sum(t * h * w for t, h, w in grids[i]) for i in part}
                pieces = mem.split_grids([g for i in part for g in grids[i]],
                                         module.dp // lang.dp)
                found[-1] += [(sum(flops[owners[item]] * t * h * w / patches[owners[item]]
                                   for item, (t, h, w) in piece),
                               [grid for _, grid in piece]) for piece in pieces]
        return found

    # -- evaluation ----------------------------------------------------------------------
    def evaluate(self, candidate: Candidate) -> Result:
        layout, settings = candidate.layout, candidate.settings
        work = self.work
        lang = layout.language
        group = work.micro_batch_size * lang.dp
        m = work.global_batch_size // group
        colocated = layout.colocated
        stages = (1 if layout.encoders and not colocated else 0) + lang.pp
        lang_first = 1 if layout.encoders and not colocated else 0
        recompute = settings.recompute
        lang_factor = self._pass_factor(LANGUAGE, recompute)
        steps = len(work.lengths)
        step_times, busy_totals = [], []
        busy: dict[str, float] = {}
        act: dict[str, float] = {}
        all_to_all = context = 0.0
        multiple = lang.cp * lang.tp if lang.cp > 1 else 1
        for s in range(steps):
            lang_t, step_all_to_all, step_context = self._language_times(
                s, group, lang, multiple, lang_factor)                     # [j][r]
            all_to_all += step_all_to_all / steps
            context += step_context / steps
            enc_t: dict[str, list[list[float]]] = {}
            for e in layout.encoders:
                factor = self._pass_factor(e.name, settings.towers)
                split = settings.split_media and e.dp > lang.dp and not colocated
                parts = self._encoder_parts(s, e, lang, group, split)       # [j][q]
                enc_t[e.name] = [[f * factor / self.rate for f, _ in row] for row in parts]
                if self.model.passes.get(f"{e.name}.encoder", 3) == 1:
                    continue                    # forward only: nothing kept for a backward
                act[e.name] = max(act.get(e.name, 0.0), self._encoder_held(
                    s, e, lang, group, split, settings,
                    1 if colocated else mem.in_flight(m, stages, 0)))
            lang_backward = self.model.passes.get(LANGUAGE, 3) > 1
            for stage in sorted({0, lang.pp - 1}) if lang_backward else ():
                k = 1 if colocated or stages == 1 else \
                    mem.in_flight(m, stages, lang_first + stage)
                held, temporary = self._language_held(s, group, lang, multiple, settings,
                                                      stage, k)
                act[f"{LANGUAGE}{stage}"] = max(act.get(f"{LANGUAGE}{stage}", 0.0), held)
                act[f"temporary{stage}"] = max(act.get(f"temporary{stage}", 0.0), temporary)
            if colocated:
                per_rank = [[row[rank // (lang.tp * lang.cp)] + sum(
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
                maxima = [max(column) for column in zip(*stage_t)]
                compute = sum(maxima) + sum(sum(t) / m for t in stage_t) - sum(maxima) / m
                syncs = {x.name: self._dp_sync(x.name, layout, settings)
                         for x in layout.modules}
                sync = max(syncs.values())
                # each DP rank's (a column's) micro-batches, the busiest
                busy_step = {e.name: max(map(sum, zip(*enc_t[e.name]))) + syncs[e.name]
                             for e in layout.encoders}
                busy_step[LANGUAGE] = max(map(sum, zip(*lang_t))) + syncs[LANGUAGE]
                total_busy = sum(sum(sum(row) for row in enc_t[e.name]) + syncs[e.name] * e.dp
                                 for e in layout.encoders) + \
                    (sum(sum(row) for row in lang_t) + syncs[LANGUAGE] * lang.dp) * \
                    lang.tp * lang.cp * lang.pp
            step_times.append(compute + sync)
            busy_totals.append(total_busy)
            for name, seconds in busy_step.items():
                busy[name] = busy.get(name, 0.0) + seconds / steps
        step_s = sum(step_times) / steps
        idle = 1 - sum(busy_totals) / steps / (layout.world_size * step_s) if step_s else 0.0
        memory = self._memory(layout, settings, act, colocated)
        bottleneck = max(busy, key=lambda k: busy[k])
        return Result(candidate, step_s, memory, busy, max(0.0, idle), bottleneck,
                      self._model_flops,
                      max(x.total for x in memory.values()) <= self.usable_bytes,
                      all_to_all, context)

    def _language_times(self, step: int, group: int, lang: ModuleLayout, multiple: int,
                        factor: float) -> tuple[list[list[float]], float, float]:
        """Seconds of each language DP rank on each micro-batch of ``step`` ([j][r]), and of
        the busiest rank's step its expert and context all-to-alls; once per language module
        (candidates differ mostly in their towers)."""
        key = (step, group, lang, multiple, factor)
        if key not in self._times_cache:
            language = self._language(step, group, lang.dp, multiple)
            times = [[self._language_seconds(f, sum(pos), lang, factor) for f, pos, _ in row]
                     for row in language]
            comm = [[self._language_comm(sum(pos), lang) for _, pos, _ in row]
                    for row in language]
            self._times_cache[key] = (
                times, max(sum(row[r][1] for row in comm) for r in range(lang.dp)),
                max(sum(row[r][2] for row in comm) for r in range(lang.dp)))
        return self._times_cache[key]

    def _language_held(self, step: int, group: int, lang: ModuleLayout, multiple: int,
                       settings: mem.Settings, stage: int, k: int) -> tuple[float, float]:
        """The activations of the fullest DP rank of language ``stage`` at their peak, ``k``
        micro-batches in flight, and its temporaries; once per language module, settings and
        ``k``."""
        key = (step, group, lang.tp, lang.cp, lang.pp, lang.dp, lang.ep, lang.etp, multiple,
               settings, stage, k)                          # where its ranks start: no matter
        if key not in self._language_held_cache:
            stack = self.model.dims.language
            language = self._language(step, group, lang.dp, multiple)
            self._language_held_cache[key] = (
                max(_held([mem.language_activation_parts(
                    stack, row[r][1], settings, lang.tp, lang.pp, stage, ep=lang.ep,
                    etp=lang.etp, cp=lang.cp) for row in language], k)
                    for r in range(lang.dp)),
                max(mem.language_temporary_bytes(stack, sum(row[r][1]), row[r][2], settings,
                                                 lang.tp, lang.pp, stage, lang.cp)
                    for row in language for r in range(lang.dp)))
        return self._language_held_cache[key]

    def _encoder_held(self, step: int, module: ModuleLayout, lang: ModuleLayout, group: int,
                      split: bool, settings: mem.Settings, k: int) -> float:
        """The activations of encoder ``module``'s fullest DP rank at their peak, ``k``
        micro-batches in flight; once per encoder and language DP size, settings and ``k``."""
        own = mem.tower_settings(settings)         # the others change nothing of a tower's
        parts_key = (step, module.name, module.dp, lang.dp, group, split, own)
        if parts_key not in self._encoder_held_cache:  # each DP rank's micro-batches' [q][j]
            parts = self._encoder_parts(step, module, lang, group, split)       # [j][q]
            tower = self.model.dims.encoders[module.name].tower
            self._encoder_held_cache[parts_key] = (
                [[self._tower_held(module.name, tower, row[q][1], own) for row in parts]
                 for q in range(module.dp)], {})
        ranks, peaks = self._encoder_held_cache[parts_key]
        if k not in peaks:
            peaks[k] = max(_held(held, k) for held in ranks)
        return peaks[k]

    def _tower_held(self, name: str, tower, grids: list, settings: mem.Settings
                    ) -> tuple[float, float]:
        """``memory.tower_activation_parts`` of encoder ``name``'s ``grids``, once each."""
        key = (name, tuple(tuple(grid) for grid in grids), settings)
        if key not in self._tower_cache:
            self._tower_cache[key] = mem.tower_activation_parts(tower, grids, settings)
        return self._tower_cache[key]

    @functools.cached_property
    def _model_flops(self) -> float:
        """Model FLOPs per step of the work (real tokens), whatever the layout."""
        work = self.work
        return float(sum(language_flops(self.model.dims.language, lengths,
                                        self.model.passes.get(LANGUAGE, 3), sum(trained)) +
                         sum(sum(work.encoder_flops[e][s]) for e in work.encoder_flops)
                         for s, (lengths, trained) in enumerate(zip(work.lengths,
                                                                    work.trained)))
                     / len(work.lengths))

    @property
    def usable_bytes(self) -> float:
        return usable_gib(self.device.memory_gib) * 2**30

    def _pass_factor(self, module: str, recompute: str) -> float:
        """A module's work over its training passes': full recompute's forward (where it
        trains), and the balancing loss's counting pass (a forward of every module)."""
        part = LANGUAGE if module == LANGUAGE else f"{module}.encoder"
        passes = self.model.passes.get(part, 3)
        extra = (recompute == "full" and passes > 1) + \
            (self.model.rule_settings.moe_aux_loss > 0)
        return (passes + extra) / passes

    def _language_seconds(self, flops: float, positions: float, module: ModuleLayout,
                          factor: float) -> float:
        """Seconds of one language rank on its DP rank's part of a micro-batch (``flops``
        over ``positions``, the whole replica's): its share of the FLOPs (/ tp x cp x pp),
        the busiest expert-parallel rank's routed excess, its TP, expert TP, expert and
        context all-to-all traffic."""
        stack = self.model.dims.language
        excess = (mem.imbalance(module.ep) - 1) * self.model.passes.get(LANGUAGE, 3) * \
            positions * stack.layers * expert_flops_per_token(stack)
        return (flops + excess) * factor / (module.tp * module.cp * module.pp) / self.rate + \
            sum(self._language_comm(positions, module))

    def _language_comm(self, positions: float, module: ModuleLayout
                       ) -> tuple[float, float, float]:
        """(TP and expert TP, expert all-to-all, context all-to-all) seconds of one language
        rank's layers on a micro-batch of ``positions`` (its DP replica's, 1/cp of them
        this rank's; the module docstring)."""
        key = (positions, module)
        if key not in self._comm_cache:
            self._comm_cache[key] = self._language_comm_of(positions, module)
        return self._comm_cache[key]

    def _language_comm_of(self, positions: float, module: ModuleLayout
                          ) -> tuple[float, float, float]:
        stack, width = self.model.dims.language, mem.BYTES[self.model.precision]
        tp_bytes, exchange = layer_traffic(stack, positions / module.cp, width, module.tp,
                                           module.ep, module.expert_tp)
        heads = context_traffic(stack, positions, width, module.tp, module.cp)
        layers = stack.layers / module.pp
        return (layers * tp_bytes / (self._tp_gbs(module) * 1e9),
                layers * exchange / (self._ep_gbs(module) * 1e9) if exchange else 0.0,
                layers * heads / (self._cp_gbs(module) * 1e9) if heads else 0.0)

    def _tp_gbs(self, module: ModuleLayout) -> float:
        """The bandwidth of the module's tensor-parallel groups (tp consecutive ranks, the
        expert TP groups within them): the network's where one spans two nodes (a module
        starting at rank 6 of 8-GPU nodes, tp4)."""
        return self._group_gbs(module, 1, max(module.tp, module.expert_tp))

    def _cp_gbs(self, module: ModuleLayout) -> float:
        """The bandwidth of the module's context-parallel groups (the grid's order is tp, cp,
        dp, pp: cp ranks tp apart)."""
        return self._group_gbs(module, module.tp, module.cp)

    def _ep_gbs(self, module: ModuleLayout) -> float:
        """The bandwidth of the module's expert-parallel groups (the expert view's order is
        etp, ep: ep ranks etp apart)."""
        return self._group_gbs(module, module.expert_tp, module.ep)

    def _group_gbs(self, module: ModuleLayout, stride: int, size: int) -> float:
        """A node's bandwidth when each of the module's groups of ``size`` ranks ``stride``
        apart (in blocks of stride x size ranks) lies in one node, else the network's (the
        slowest group paces the collective)."""
        key = (module.rank_offset, module.size, stride, size)
        if key not in self._bandwidth_cache:
            per_node = self.device.per_node
            self._bandwidth_cache[key] = next((
                self.device.network_gbs
                for base in range(module.rank_offset, module.rank_offset + module.size,
                                  stride * size)
                for t in range(stride)
                if len({(base + t + k * stride) // per_node for k in range(size)}) > 1),
                self.device.node_gbs)
        return self._bandwidth_cache[key]

    def _dp_sync(self, name: str, layout: Layout, settings: mem.Settings) -> float:
        """Seconds of the module's gradient reduction: over its DP ranks, the language model's
        routed experts over their expert DP ranks (megatron-core's second buffer); a part
        under LoRA, its adapters' alone."""
        module = layout.module(name)
        params = experts = 0.0
        if self._trains(name):
            params = self._rank_parameters(name, module, 0)
            experts = self._expert_parameters(name, module, 0)
        own, own_experts = self._adapter_parameters(name, module, 0)
        params, experts = params + own + own_experts, experts + own_experts
        if not params:
            return 0.0
        dense = module.dp * (module.cp if name == LANGUAGE else 1)       # dp_cp
        # each over its own groups' bandwidth: dp_cp ranks tp apart; expert DP ranks etp x ep
        # apart (megatron-core's expert view: etp, ep, edp)
        return self._reduce(params - experts, dense, settings) / (
            self._group_gbs(module, module.tp, dense) * 1e9) + \
            self._reduce(experts, module.expert_dp, settings) / (
                self._group_gbs(module, module.expert_tp * module.ep, module.expert_dp) * 1e9)

    @staticmethod
    def _reduce(params: float, dp: int, settings: mem.Settings) -> float:
        """Bytes each rank sends reducing the gradients of ``params`` over ``dp`` ranks
        (all-reduce, or reduce-scatter and all-gather with the distributed optimizer)."""
        if dp == 1 or not params:
            return 0.0
        share = (dp - 1) / dp
        return share * params * (mem.GRAD_BYTES + settings.width) \
            if settings.distributed_optimizer else 2 * share * params * mem.GRAD_BYTES

    def _trains(self, name: str) -> bool:
        if name == LANGUAGE:
            return self.model.trained.get(LANGUAGE, True)
        return self.model.trained.get(f"{name}.encoder", True) or \
            self.model.trained.get(f"{name}.projection", True)

    def _rank_parameters(self, name: str, module, stage: int) -> float:
        if name == LANGUAGE:
            return mem.language_stage_parameters(self.model.dims.language, module.tp,
                                                 module.pp, stage, module.ep, module.etp)
        return float(self.model.parameters(name))

    def _expert_parameters(self, name: str, module, stage: int) -> float:
        """The routed experts' share of ``_rank_parameters`` (0 but for the language model)."""
        if name != LANGUAGE:
            return 0.0
        return mem.language_stage_expert_parameters(self.model.dims.language, module.pp, stage,
                                                    module.ep, module.expert_tp)

    def _adapter_parameters(self, name: str, module, stage: int) -> tuple[float, float]:
        """(dense, routed experts') LoRA adapter parameters of one rank of the module's
        ``stage`` (``planning.adapters``; an encoder module's whole)."""
        return self.model.adapters.rank_parameters(name, self.model.dims.language, module,
                                                   stage)

    def _state(self, name: str, module, stage: int, settings: mem.Settings) -> mem.Memory:
        dense, experts = self._adapter_parameters(name, module, stage)
        if name == LANGUAGE:
            # the distributed optimizer shards the dense weights' state over the DP x CP ranks
            # (megatron-core's dp_cp group), the routed experts' over their expert DP ranks;
            # the LoRA adapters' alike
            return mem.language_state_bytes(
                self.model.dims.language, settings, module.tp, module.pp, stage,
                module.dp * module.cp,
                module.ep, module.etp, module.expert_dp, self.model.trained.get(LANGUAGE, True)
            ) + mem.adapter_state_bytes(dense, experts, settings, module.dp * module.cp,
                                        module.expert_dp)
        adapters = mem.adapter_state_bytes(dense, 0.0, settings, module.dp)
        encoder = self.model.dims.encoders[name]
        tower = mem.state_bytes(encoder.tower.parameters(), settings, module.dp,
                                self.model.trained.get(f"{name}.encoder", True))
        projection = encoder.parameters() - encoder.tower.parameters()
        return tower + mem.state_bytes(projection, settings, module.dp,
                                       self.model.trained.get(f"{name}.projection", True)) + \
            adapters

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


def layer_traffic(stack: Stack, positions: float, width: int, tp: int = 1, ep: int = 1,
                  etp: int | None = None) -> tuple[float, float]:
    """Bytes one rank sends per layer of ``stack`` on a micro-batch of ``positions`` (its DP
    rank's), forward and backward, at ``width`` bytes a value: (over its TP group: the
    attention's and a dense MLP's or shared expert's collectives, each 2 (tp-1)/tp of the
    hidden states, and the dispatcher's gather and scatter over the etp ranks; over its
    expert-parallel group: the all-to-alls). A mixture of experts' routed tokens are k per
    token, the busiest expert-parallel rank's ``memory.imbalance`` times the mean."""
    hidden = positions * stack.hidden * width
    # a layer's attention and MLP each all-reduce (a gather and a scatter under sequence
    # parallelism) once forward and once backward; a mixture of experts' MLP only with a
    # shared expert
    collectives = 2 + (2 if not stack.experts or stack.shared_expert_ffn else 0)
    tp_bytes = collectives * 2 * (tp - 1) / tp * hidden
    if not stack.experts:
        return tp_bytes, 0.0
    routed = hidden * stack.experts_per_token * mem.imbalance(ep)
    # the dispatcher gathers the tokens its ep rank got over the etp ranks, forward, and
    # scatters the experts' output back; backward the reverse: 4 x (etp-1)/etp of etp x the
    # rank's routed tokens (1 / tp of the micro-batch's under sequence parallelism)
    split = tp if etp is None else etp
    tp_bytes += 4 * (split - 1) / tp * routed
    # dispatch and combine all-to-alls, forward and backward, of the rank's own routed
    # tokens, (ep-1)/ep of them to other ranks
    return tp_bytes, 4 * (ep - 1) / ep * routed / tp


def context_traffic(stack: Stack, positions: float, width: int, tp: int = 1,
                    cp: int = 1) -> float:
    """Bytes one rank sends per layer of ``stack`` on a micro-batch of ``positions`` (its DP
    replica's: 1/cp of them this rank's) under ``cp``-way context parallelism, forward and
    backward, at ``width`` bytes a value: the attention's all-to-alls over heads of its
    queries, keys, values and output (``mcore.context_parallel``), each (cp-1)/cp of the
    rank's positions / cp x its heads x kv channels; key/value groups repeated the fewest
    times that make them a multiple of cp (``context_parallel.heads_for``). 0 at cp 1."""
    if cp == 1:
        return 0.0
    heads = stack.heads // tp
    groups, repeat = mem.rank_groups(stack, tp, cp)
    # forward: q and the output (heads each), k and v (their repeated groups each); backward
    # the same again
    values = 2 * (2 * heads + 2 * groups * repeat) * stack.kv_channels * positions / cp
    return (cp - 1) / cp * values * width


def _held(parts: list[tuple[float, float]], k: int) -> float:
    """A stage's activations at their peak: what ``k`` consecutive micro-batches keep (the
    first of each of ``parts``), and the most one of them holds once (the second: full
    recompute's rebuilt layer, one backward at a time)."""
    return _window([kept for kept, _ in parts], k) + max((once for _, once in parts),
                                                         default=0.0)


def _window(values: list[float], k: int) -> float:
    """The most ``k`` consecutive ``values`` sum to (micro-batches held at once)."""
    k = max(1, min(k, len(values)))
    return max((sum(values[i:i + k]) for i in range(len(values) - k + 1)), default=0.0)
