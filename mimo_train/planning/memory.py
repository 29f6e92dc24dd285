"""Memory of one rank in training, predicted from the model's dims (``dims``), the rank's share of
each module (TP / PP / DP), the run's settings (precision, distributed optimizer, recompute,
sequence parallel) and the tokens of its micro-batches. Pure functions of numbers; no torch.
The layout advisor (``advisor``) sums them per rank; ``tests/test_planning.py`` checks the
formulas against a hand count and ``tests/test_anomalies.py`` against a real run's peak.

Model state per parameter a rank holds (megatron-core's DDP with ``grad_reduce_in_fp32``, Adam,
as ``mimo_train.model.build`` and ``components.optimizer`` set them up)::

    weights     w = 2 (bf16) or 4 (fp32)
    gradients   4                              (the fp32 grad buffer)
    optimizer   8 (two fp32 moments) + 4 (fp32 main weights, bf16 only)
                ÷ DP with the distributed optimizer (the shard of this DP rank)

bf16: 2 + 4 + 12 = 18 bytes, 2 + 4 + 12/DP distributed; fp32: 4 + 4 + 8 = 16. A frozen part
holds its weights only; so does a part under LoRA, beside its adapters (``adapters``: r·(in +
out) parameters per adapted linear layer, split over TP as the layer, a routed expert's over
etp on the rank holding the expert), which train as any weight: their 18 bytes each (bf16) in
``Memory.adapters`` (``adapter_state_bytes``; Qwen3-VL-30B-A3B with rank 16 on every routed
expert: 629M parameters, 10.5 GiB on each rank at ep 1 without the distributed optimizer).
Parameters per rank: the language model's layers ÷ PP (the fullest stage: ceil(L / PP)
layers, of each kind as the stage holds them), their matmuls (and a gated
delta-net's convolution, A_log and dt_bias: per head) ÷ TP, their norms whole (the delta-net's
gated norm too: one weight per value channel of a head), the embedding rows ÷ TP on the first stage,
the output rows ÷ TP on the last (also with tied embeddings when PP > 1: megatron-core keeps a
copy there); an encoder module (DP only) holds its whole tower and projection.

Expert parallelism (a mixture of experts' layout ``ep``, ``etp``; etp defaults to TP):
megatron-core carves each stage's TP x DP ranks into etp x ep x expert DP, so a rank holds E /
ep whole experts of each layer, each split over etp: the routed experts' weights ÷ (ep x etp)
in place of ÷ TP, their optimizer state ÷ expert DP = TP x DP / (etp x ep) with the
distributed optimizer (``language_state_bytes``; the dense weights' ÷ DP as before). That
makes the experts' optimizer state per rank E·12 / (TP x DP) whatever ep: expert parallelism
saves the experts' weights and gradients (w + 4 bytes each), the distributed optimizer their
Adam state.

Activations kept for the backward pass, per layer, for a micro-batch of T token positions
(Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
table 2, without dropout (mimo trains without: no masks), generalised to grouped-query
attention and gated MLPs), in bytes at bf16 (× w / 2 at another precision)::

    outside the TP regions    8·h·T             (÷ TP with sequence parallel)
      two norms' inputs 2·2h, the QKV and first MLP matmuls' inputs 2·2h
    inside the TP regions     (8·a [+ 2·a] + c·f)·T ÷ TP
      Q 2a, K and V repeated to the query heads 2·2a (the local and SDPA backends repeat
      grouped keys and values before the kernel), the output projection's input 2a, and a
      fused kernel's own output 2a (flash, sdpa: kept for its backward; the local attention
      keeps the scores instead); packed rows on the varlen kernel (``Settings.varlen_rows``)
      4·a + 4·g: Q, the output (the projection's input), K and V as their groups (the
      kernel takes them unrepeated, the values a copy; a tp rank keeps one group at least,
      and context parallelism repeats them to a multiple of cp: ``rank_groups``); the MLP:
      c = 4 (2f activation input, 2f second matmul input), gated c = 6 (megatron-core's
      fused SwiGLU: the gate and up outputs 2·2f, the second matmul's input 2f); a
      transformers tower keeps the same (its QuickGELU, Qwen2.5-VL's RMSNorm and gated SiLU
      as ``model.tower_fusions`` runs them) but in its attention
      (``Stack.attention_kept``: SDPA 10·a; the Qwen family's varlen 8·a;
      tests/test_planning.py counts what autograd saves)
    attention scores          5·heads·Σ s² ÷ TP (softmax 2, its dropout 2 + mask 1, per pair)
      only where the kernel keeps them (megatron-core's local attention; flash, sdpa and
      varlen kernels do not, nor do transformers' towers) and recompute is none

with h the width, a = heads · kv channels, g = query groups · kv channels, f the MLP width, s
each sample's length (MHA with f = 4h and the local attention: 32·h·T + 5·heads·Σ s², the
paper's formula less its two dropout masks). The GPU check's two measured cases (Qwen2-VL-2B
on an H200, docs/benchmarks.md) led to the repeated keys and values, the fused kernel's
output, the towers' activations and the logits below. A mixture
of experts keeps each token's MLP activations in each of the k experts it goes through (c·f·k)
and the dispatcher's copies of it into the experts, gathered over the etp ranks, and out of
them (2·h·k·(etp + 1): 4·h·k at etp 1), a shared expert of width f_s its own 6·f_s (its gate's
one value per token left out). Under expert parallelism a rank's E / ep experts get the tokens
of ep ranks, k / ep of each on average: as many as its own tokens' k; the busiest gets
``ROUTED_IMBALANCE`` (1.1) times as many, and its routed terms are counted so. Qwen3.5's gated
attention (``Stack.attention_gate``) keeps 4·a more: the sigmoid of the gate and the attention
output it scales.

Qwen3.5's gated delta-net layers (``Stack.layer_types``, ``Stack.linear``: key heads H_k, value
heads H_v, head dims d_k, d_v, key_dim = H_k·d_k, value_dim = H_v·d_v) keep the same 8·h·T
outside the TP regions and the same MLP activations; in place of attention, what megatron-core's
``GatedDeltaNet`` with mimo's torch kernels (``mcore.delta_rule``: the path of every device
without flash-linear-attention, which mimo's lock does not install) saves for the backward
pass, per token and ÷ TP (heads and channels split), counted from the tensors autograd saves
(tests/test_planning.py measures them on the layer)::

    convolution      3 · (2·key_dim + value_dim) fp32   its input, the input in each sample's
                                                        zero-padded window (the K-1 zeros per
                                                        sample left out), its output before silu
    q, k l2 norms    (2·key_dim + 2·H_k) fp32           their inputs and norms
    gates            4·H_v fp32 + H_v · w               softplus's input and output (the decay
                                                        g), g and β in fp32, β = sigmoid(b)
    delta rule       H_v·(2·d_k + d_v) fp32             q, k (repeated to H_v heads), v
                     H_v·(6·d_k + 3·d_v + 4 + 5·C) fp32 per chunked position: the chunked q, k,
                                                        k·β, the decayed q and k, the solve for
                                                        k; v·β, the solved values, v_new; 4 per
                                                        head (β, the decays applied to q and k);
                                                        5 C × C matrices per chunk (the pairwise
                                                        decays, the UT system, q·kᵀ ...)
                     H_v·d_k·d_v fp32 per chunk          the recurrent state each chunk reads
    gated norm       4·value_dim fp32 + value_dim·w      its input, the gate z and silu(z), the
                     + H_v fp32                         normalised output; each head's rms
    out_proj input   value_dim · w

with C = 64 and w the run's width; a chunked position is a token of a sample padded to whole
chunks (each sample its own chunks: Σ ⌈s / C⌉ · C). Left out: index tensors (24 bytes per
token), the C × C mask and the weights' fp32 copies. Measured on the CPU, where megatron-core's
three ``@jit_fuser`` methods of the layer run as written (``mcore.cpu_compat``); on a GPU they
are ``torch.compile``'d, whose backward may keep less of the gates and the gated norm (not
measured: no GPU check yet). With flash-linear-attention on a GPU the
layer keeps far less (fla saves q, k, v, g, β and one C-wide matrix per token and head and
recomputes the states in the backward pass); that path is not modelled: the figure is an upper
bound there. A delta-net layer keeps no score matrices.

Recompute ``selective`` drops the scores term; ``full`` keeps only each layer's input (2·h·T, ÷
TP with sequence parallel) plus one layer's whole set (the largest kind's, in a hybrid stack),
recomputed in the backward pass. The language model's last stage adds the hidden states'
gradient, T · h · w: its loss (``mcore.language_loss``) makes the logits of the trained tokens
alone, their gradients with respect to the hidden states and the output layer's weight in the
forward pass, and keeps no logits (megatron-core's own path kept every token's fp32 softmax,
T · V ÷ TP · 4). An encoder tower counts its patches before merging (plus per-frame extra
positions) as T and its patch embedding's inputs (the pixels, w bytes each).

Temporaries at the peak, on the stage with the output layer, of a micro-batch whose R tokens
are trained (a context-parallel rank: at most all of them, at most its T ÷ CP), in chunks of
C of them (``model.language.loss_chunk_tokens``; 0: C = R), the larger of the backward pass's
end, the output layer's weight gradient before megatron-core's hook adds it to the fp32 buffer
(V·h ÷ TP at w bytes; tied embeddings at PP 1: the embedding's as well), and the forward pass's
end: one chunk's logits, min(C, R) · V ÷ TP · 4 (fp32: the logits are their fp32 copy, softmax
and gradient in place; bf16: · (4 + w), the logits and their gradient in bf16 beside the fp32
copy). When one chunk holds them all (R <= C) the weight gradient is made in the run's
precision, V·h ÷ TP · w, from the logits' gradient alone (R · V ÷ TP · w; in fp32 that is the
fp32 copy itself), whichever of the two moments is larger; else it is summed in fp32,
V·h ÷ TP · 4, and cast to the run's precision at the end, V·h ÷ TP · (4 + w), whichever is
larger. The first stage of a pipeline holds the
embedding's gradient. ``tools/bench_loss.py`` measures the output layer's on the CPU.

Context parallelism (the language module's ``cp``, ``mcore.context_parallel``): each of the
cp ranks of a DP replica holds a contiguous 1/cp of every micro-batch's sequence, and attention
runs between all-to-alls over heads (the whole sequence, heads / (tp x cp) of them): every
activation term above, the scores' (heads ÷ cp of Σ s²) and the logits' included, and the
output layer's logits temporaries, ÷ cp. Weights and gradients are not divided: every CP rank
holds its TP / PP share whole; the distributed optimizer shards the state over megatron-core's
dp x cp group (``state_bytes``' ``dp`` is then dp x cp).

Split media (``data.split_media``, ``mimo_data.loading.media_split``): with fan-in, the k =
encoder dp / language dp encoder ranks of one language DP rank each encode a contiguous part of
its micro-batch's media, cut into k parts of near-equal tokens between temporal patches (images
whole): a rank's tower activations are those of its part's patch grids (``split_grids``: a
clip's [t, h, w] becomes [t1, h, w] on one rank and [t - t1, h, w] on the next), about 1/k of
the micro-batch's instead of whole samples'. Weights, gradients and optimizer state do not
change.

In flight: under the pipeline schedule (a non-colocated layout: the encoders are stage 0, the
language model's PP stages follow; or a language model with PP > 1) the stage at position p of
S holds min(m, S - p) micro-batches (1F1B's warm-up), m micro-batches per step; colocated and
unpipelined, one. The advisor takes the fullest run of that many consecutive micro-batches of
each DP rank.

Not counted: the CUDA context, NCCL and allocator buffers and fragmentation (the advisor keeps
a headroom for them), temporary buffers of one op, the data loader.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace

from mimo_train.planning.dims import CHUNK, FULL, LINEAR, QWEN_VARLEN_ATTENTION, Stack, Tower

BYTES = {"bf16": 2, "fp32": 4}
GRAD_BYTES = 4                    # megatron-core's DDP: grad_reduce_in_fp32
MOMENT_BYTES = 8                  # Adam's two fp32 moments
MAIN_BYTES = 4                    # fp32 main weights of a bf16 run
RECOMPUTE = ("none", "selective", "full")
# expert parallelism: what the busiest of the ep ranks gets routed over the mean (tokens x k /
# ep of the expert-parallel group's), an assumption, not a measurement: the load-balancing
# loss is off by default (model.language.moe_aux_loss), the published routers were trained
# with one, and each rank's E / ep experts average out a single expert's skew
ROUTED_IMBALANCE = 1.1


def imbalance(ep: int) -> float:
    """The routed work of the busiest rank over the mean under ``ep``-way expert parallelism
    (without it every rank computes its own tokens' experts: 1)."""
    return ROUTED_IMBALANCE if ep > 1 else 1.0


@dataclass(frozen=True)
class Settings:
    """What a run sets that changes its memory: the precision, megatron-core's distributed
    optimizer, activation recompute (none, selective: the attention core, full: every layer;
    a tower has none or full, selective counts as none there), sequence parallel (the
    language model at TP > 1), whether the attention kernel keeps the score matrices and the
    tokens the loss is taken at a time (0: all). ``tower_recompute``: the encoder towers' own
    (``model.encoders.<module>.recompute``) where it differs from the language model's (None:
    ``recompute``). ``split_media``: ``data.split_media``, a fanning-in encoder module's ranks
    each encoding a token-balanced part of their language rank's micro-batch's media."""
    precision: str = "bf16"
    distributed_optimizer: bool = False
    recompute: str = "none"
    sequence_parallel: bool = False
    attention_scores: bool = False
    loss_chunk_tokens: int = 0          # model.language.loss_chunk_tokens (0: the loss at once)
    tower_recompute: str | None = None
    split_media: bool = False
    # the Qwen-family towers run mimo's varlen kernel (``model.attention`` auto or varlen on a
    # GPU in bf16), else transformers' SDPA
    tower_varlen: bool = True
    # the language model's packed rows run it too (the same, with ``data.packing``)
    varlen_rows: bool = False

    def __post_init__(self):
        if self.precision not in BYTES or self.recompute not in RECOMPUTE or \
                self.tower_recompute not in (None, *RECOMPUTE):
            raise ValueError(f"precision {self.precision!r} (bf16 / fp32), recompute "
                             f"{self.recompute!r}, tower_recompute {self.tower_recompute!r} "
                             f"({' / '.join(RECOMPUTE)})")

    @property
    def towers(self) -> str:
        """The towers' recompute: ``tower_recompute``, else the run's."""
        return self.tower_recompute or self.recompute

    @property
    def width(self) -> int:
        return BYTES[self.precision]


@dataclass(frozen=True)
class Memory:
    """Bytes one rank holds of one module (or of several, summed); ``adapters``: the LoRA
    adapters' weights, gradients and optimizer state (``adapter_state_bytes``), not in the
    first three."""
    weights: float = 0.0
    gradients: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    temporary: float = 0.0
    adapters: float = 0.0

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + \
            self.temporary + self.adapters

    def __add__(self, other: Memory) -> Memory:
        return Memory(self.weights + other.weights, self.gradients + other.gradients,
                      self.optimizer + other.optimizer, self.activations + other.activations,
                      self.temporary + other.temporary, self.adapters + other.adapters)

    def gib(self) -> dict[str, float]:
        return {k: v / 2**30 for k, v in {**asdict(self), "total": self.total}.items()}


def state_bytes(parameters: float, settings: Settings, dp: int = 1,
                trained: bool = True) -> Memory:
    """Weights, gradients and optimizer state of ``parameters`` on one rank (the module
    docstring's table); ``dp``: the ranks the distributed optimizer shards over (the DP size;
    the language model's dp x cp under context parallelism)."""
    weights = parameters * settings.width
    if not trained:
        return Memory(weights=weights)
    optimizer = parameters * (MOMENT_BYTES + (MAIN_BYTES if settings.precision == "bf16" else 0))
    if settings.distributed_optimizer:
        optimizer /= dp
    return Memory(weights, parameters * GRAD_BYTES, optimizer)


def adapter_state_bytes(dense: float, experts: float, settings: Settings, dp: int = 1,
                        expert_dp: int = 1) -> Memory:
    """The LoRA adapters of one rank (``planning.adapters``): ``dense`` parameters outside the
    routed experts, the distributed optimizer sharding their state over ``dp`` ranks (the
    language model's dp x cp), and ``experts`` of the routed experts', over ``expert_dp``;
    each trained as any weight (``state_bytes``: bf16 2 + 4 + 12 bytes), all of it in
    ``Memory.adapters``."""
    state = state_bytes(dense, settings, dp) + state_bytes(experts, settings, expert_dp)
    return Memory(adapters=state.weights + state.gradients + state.optimizer)


# --------------------------------------------------------------------------- parameters

def language_stage_parameters(stack: Stack, tp: int = 1, pp: int = 1, stage: int = 0,
                              ep: int = 1, etp: int | None = None) -> float:
    """Parameters of pipeline ``stage`` of the language model on one rank: its layers (the
    first stages take the extra ones of an uneven split; each of its kind), their matmuls ÷ tp
    but the routed experts' ÷ (ep x etp) (``etp`` None: tp, the layout's default), the
    embedding on the first stage, the output layer and final norm on the last."""
    found = 0.0
    experts = stack.layer_expert_parameters()
    for kind, layers in stack.kinds(stack.stage_layers(pp, stage)).items():
        matmuls, norms = stack.layer_parameters(kind)
        found += layers * ((matmuls - experts) / tp + norms)
    found += language_stage_expert_parameters(stack, pp, stage, ep, tp if etp is None else etp)
    rows = stack.vocab * stack.hidden / tp
    if stage == 0:
        found += rows
    if stage == pp - 1:
        found += stack.hidden + (rows if not stack.tied or pp > 1 else 0)
    return found


def language_stage_expert_parameters(stack: Stack, pp: int = 1, stage: int = 0, ep: int = 1,
                                     etp: int = 1) -> float:
    """The routed experts' share of ``language_stage_parameters`` on one rank: its stage's
    layers' experts ÷ (ep x etp): E / ep whole experts of each layer, each split over etp (what
    megatron-core's distributed optimizer shards over the expert data parallelism)."""
    return len(stack.stage_layers(pp, stage)) * stack.layer_expert_parameters() / (ep * etp)


def language_state_bytes(stack: Stack, settings: Settings, tp: int = 1, pp: int = 1,
                         stage: int = 0, dp: int = 1, ep: int = 1, etp: int | None = None,
                         expert_dp: int | None = None, trained: bool = True) -> Memory:
    """Weights, gradients and optimizer state of pipeline ``stage`` of the language model on
    one rank (``state_bytes``): the distributed optimizer shards the dense weights' state over
    the ``dp`` ranks (dp x cp under context parallelism: megatron-core's dp_cp group) and the
    routed experts' over their ``expert_dp`` ranks (default tp x dp / (etp x ep):
    megatron-core's expert data parallelism, carved from the same ranks)."""
    split = tp if etp is None else etp
    experts = language_stage_expert_parameters(stack, pp, stage, ep, split)
    dense = language_stage_parameters(stack, tp, pp, stage, ep, etp) - experts
    replicas = tp * dp // (split * ep) if expert_dp is None else expert_dp
    return state_bytes(dense, settings, dp, trained) + \
        state_bytes(experts, settings, replicas, trained)


# -------------------------------------------------------------------------- activations

def rank_groups(stack: Stack, tp: int = 1, cp: int = 1) -> tuple[int, int]:
    """A tp rank's key/value groups (at least one: megatron-core keeps a group whole) and how
    many times context parallelism repeats each, the fewest that make their count a multiple
    of ``cp`` (``mcore.context_parallel.heads_for``)."""
    heads, groups = stack.heads // tp, max(1, stack.query_groups // tp)
    repeat = next((r for r in range(1, heads // groups + 1)
                   if (heads // groups) % r == 0 and (groups * r) % cp == 0), heads // groups)
    return groups, repeat


def layer_activation_bytes(stack: Stack, tokens: float, squares: float, settings: Settings,
                           tp: int = 1, sequence_parallel: bool = False, kind: str = FULL,
                           chunked: float | None = None, ep: int = 1,
                           etp: int | None = None, cp: int = 1) -> float:
    """Bytes one layer of ``kind`` keeps for a micro-batch of ``tokens`` positions whose
    samples' squared lengths sum to ``squares`` (a gated delta-net: whose samples padded to
    whole chunks make ``chunked`` positions; default ``tokens``), without recompute (the
    module docstring's formulas); a mixture of experts laid over ``ep`` x ``etp`` ranks
    (``etp`` None: tp); under ``cp``-way context parallelism, ``tokens`` a rank's share."""
    h, f = stack.hidden, stack.ffn_hidden
    a = stack.heads * stack.kv_channels
    outside = 8 * h * tokens / (tp if sequence_parallel else 1)
    c = 6 if stack.gated else 4
    if stack.experts:
        # each token's MLP activations in each of the k experts it goes through, and the
        # dispatcher's copies: into the experts (gathered over the etp ranks) and out of them;
        # the busiest expert-parallel rank gets more than its share; a shared expert's own
        k, split = stack.experts_per_token, tp if etp is None else etp
        mlp = (c * f * k + 2 * h * k * (split + 1)) * imbalance(ep) + \
            6 * stack.shared_expert_ffn
    else:
        mlp = c * f
    if kind == LINEAR:
        kept = (outside + mlp * tokens / tp) * settings.width / 2
        return kept + delta_net_bytes(stack, tokens, tokens if chunked is None else chunked,
                                      settings.width) / tp
    gate = 4 * a if stack.attention_gate else 0
    # q and the keys and values repeated to the query heads, the output projection's input,
    # and a fused kernel's own output (the local attention keeps the scores instead); on the
    # varlen kernel q, its output and the keys and values as their groups
    if stack.attention_kept:
        core = stack.attention_kept * a
    elif settings.varlen_rows and not settings.attention_scores:
        groups, repeat = rank_groups(stack, tp, cp)     # a rank's (÷ tp below)
        core = 4 * a + 4 * groups * repeat * tp * stack.kv_channels
    else:
        core = 8 * a + (0 if settings.attention_scores else 2 * a)
    inside = (core + gate + mlp) * tokens / tp
    scores = 5 * stack.heads * squares / tp \
        if settings.attention_scores and settings.recompute == "none" else 0
    return (outside + inside + scores) * settings.width / 2


def delta_net_bytes(stack: Stack, tokens: float, chunked: float, width: int) -> float:
    """What a gated delta-net keeps between its input projection and its output projection
    (the module docstring's table) for ``tokens`` positions, ``chunked`` of them once each
    sample is padded to whole chunks, on one TP rank of one (÷ TP for more); ``width``: the
    run's bytes per value (fp32 tensors keep 4 whatever it is)."""
    linear = stack.linear
    assert linear is not None, "a delta-net layer has its dims"
    heads, dk, dv = linear.num_value_heads, linear.key_head_dim, linear.value_head_dim
    channels = 2 * linear.key_dim + linear.value_dim
    fp32 = tokens * (3 * channels + 2 * linear.key_dim + 2 * linear.num_key_heads
                     + 4 * heads + heads * (2 * dk + dv) + 4 * linear.value_dim + heads)
    fp32 += chunked * heads * (6 * dk + 3 * dv + 4 + 5 * CHUNK + dk * dv / CHUNK)
    return 4 * fp32 + tokens * width * (heads + 2 * linear.value_dim)


def stack_activation_bytes(stack: Stack, layers: int | range, tokens: float, squares: float,
                           settings: Settings, tp: int = 1, sequence_parallel: bool = False,
                           chunked: float | None = None, ep: int = 1,
                           etp: int | None = None, cp: int = 1) -> float:
    """``layers`` layers' activations (a count: the stack's first ones; or the range of them)
    for one micro-batch under the settings' recompute (``chunked``, ``ep``, ``etp``, ``cp``:
    ``layer_activation_bytes``'s): ``stack_activation_parts`` together."""
    return sum(stack_activation_parts(stack, layers, tokens, squares, settings, tp,
                                      sequence_parallel, chunked, ep, etp, cp))


def stack_activation_parts(stack: Stack, layers: int | range, tokens: float, squares: float,
                           settings: Settings, tp: int = 1, sequence_parallel: bool = False,
                           chunked: float | None = None, ep: int = 1,
                           etp: int | None = None, cp: int = 1) -> tuple[float, float]:
    """(kept, rebuilt) of ``stack_activation_bytes``: what a micro-batch keeps until its
    backward (full recompute: each layer's input), and what full recompute rebuilds of one
    layer during a backward (one micro-batch's at a time, however many are in flight)."""
    held = range(layers) if isinstance(layers, int) else layers
    if len(held) <= 0:
        return 0.0, 0.0
    whole = {kind: layer_activation_bytes(stack, tokens, squares, settings, tp,
                                          sequence_parallel, kind, chunked, ep, etp, cp)
             for kind in stack.kinds(held)}
    if settings.recompute == "full":
        inputs = 2 * stack.hidden * tokens / (tp if sequence_parallel else 1) * \
            settings.width / 2
        return len(held) * inputs, max(whole.values())
    return sum(count * whole[kind] for kind, count in stack.kinds(held).items()), 0.0


def chunked_positions(lengths: Sequence[float]) -> float:
    """Positions of samples of ``lengths`` each padded to whole delta-rule chunks."""
    return float(sum(-(-int(s) // CHUNK) * CHUNK for s in lengths))


def language_activation_bytes(stack: Stack, lengths: Sequence[float], settings: Settings,
                              tp: int = 1, pp: int = 1, stage: int = 0,
                              in_flight: int = 1, ep: int = 1,
                              etp: int | None = None, cp: int = 1) -> float:
    """A language stage's activations on one rank: ``in_flight`` micro-batches of samples of
    ``lengths`` positions each (packed: the real tokens; padded: the padded length; the whole
    sequences, of which each of the ``cp`` context-parallel ranks keeps 1/cp), its layers'
    (its experts laid over ``ep`` x ``etp`` ranks), and on the last stage the hidden states'
    gradient (made in the forward pass with the loss, ``mcore.language_loss``)."""
    kept, once = language_activation_parts(stack, lengths, settings, tp, pp, stage, ep, etp, cp)
    return in_flight * kept + once


def language_activation_parts(stack: Stack, lengths: Sequence[float], settings: Settings,
                              tp: int = 1, pp: int = 1, stage: int = 0, ep: int = 1,
                              etp: int | None = None, cp: int = 1) -> tuple[float, float]:
    """(kept, once) of one micro-batch of ``language_activation_bytes``: what it keeps until
    its backward, and what a stage holds once however many micro-batches are in flight (full
    recompute's rebuilt layer; on the last stage, where one is in flight, the hidden states'
    gradient)."""
    # context parallelism: 1/cp of the positions, and of the heads over the whole sequences
    tokens, squares = float(sum(lengths)) / cp, float(sum(s * s for s in lengths)) / cp
    sp = settings.sequence_parallel and tp > 1
    layers = stack.stage_layers(pp, stage)
    chunked = chunked_positions(lengths) if stack.linear is not None else None
    kept, once = stack_activation_parts(stack, layers, tokens, squares, settings, tp, sp,
                                        chunked, ep, etp, cp)
    if stage == pp - 1:
        once += tokens * stack.hidden * settings.width
    return kept, once


def language_temporary_bytes(stack: Stack, tokens: float, trained: float, settings: Settings,
                             tp: int = 1, pp: int = 1, stage: int = 0, cp: int = 1) -> float:
    """A language stage's temporaries at its peak (the module docstring): on the last stage of
    a micro-batch of ``tokens`` positions, ``trained`` of them trained, the larger of the
    output layer's (and tied embedding's) weight gradient and the loss's forward pass (one
    chunk's logits of the trained tokens and the output layer's weight gradient: in the run's
    precision beside them when one chunk holds them all, else summed in fp32); the
    embedding's gradient on a first stage. A context-parallel rank holds 1/cp of the
    positions, and of the trained tokens at most all of them."""
    trained = min(trained, tokens / cp)
    rows = stack.vocab * stack.hidden / tp * settings.width
    found = 0.0
    if stage == pp - 1:
        gradients = rows * (2 if stack.tied and pp == 1 else 1)
        chunk = settings.loss_chunk_tokens or trained
        # a chunk's logits: fp32 (their own fp32 copy), or bf16 and an fp32 copy
        width = 4 + (settings.width if settings.width != 4 else 0)
        outputs = min(chunk, trained) * stack.vocab / tp
        logits = outputs * width
        if trained <= chunk:            # one chunk: its weight gradient in the run's precision,
            # made from the logits' gradient in that precision once the fp32 copy is gone
            forward = max(logits, rows + outputs * settings.width)
        else:                           # summed in fp32, then cast to the run's precision
            weight = stack.vocab * stack.hidden / tp
            forward = max(weight * 4 + logits, weight * width)
        found += max(gradients, forward)
    elif stage == 0:
        found += rows
    return found


def tower_positions(tower: Tower, grids: Iterable[Sequence[int]]) -> tuple[float, float]:
    """(positions, Σ squared frame lengths) of a tower over items of patch ``grids`` (t, h, w
    before merging)."""
    positions = squares = 0.0
    for t, h, w in grids:
        frame = h * w + tower.extra_positions
        positions += t * frame
        squares += t * frame * frame
    return positions, squares


def split_grids(grids: Sequence[Sequence[int]], parts: int
                ) -> list[list[tuple[int, list[int]]]]:
    """Each of ``parts`` encoder ranks' pieces under ``data.split_media``, as (the item's index
    in ``grids``, the piece's patch grid t, h, w): ``grids`` (one language rank's micro-batch's
    items, in order) cut as the loader cuts them (``media_split.cut``: contiguous parts of
    near-equal tokens, only between temporal patches; a part may be empty)."""
    from mimo_data.loading.media_split import Item, cut
    if not grids:
        return [[] for _ in range(parts)]
    items = [Item(0, "video", i, int(t), int(t * h * w)) for i, (t, h, w) in enumerate(grids)]
    return [[(p.item, [p.stop - p.first, int(grids[p.item][1]), int(grids[p.item][2])])
             for p in part] for part in cut(items, parts)]


def tower_activation_bytes(tower: Tower, grids: Iterable[Sequence[int]], settings: Settings,
                           in_flight: int = 1) -> float:
    """An encoder tower's activations for ``in_flight`` micro-batches of items of patch
    ``grids``: its layers' (recompute none or full) and the patch embedding's inputs."""
    kept, rebuilt = tower_activation_parts(tower, grids, settings)
    return in_flight * kept + rebuilt


def tower_activation_parts(tower: Tower, grids: Iterable[Sequence[int]], settings: Settings
                           ) -> tuple[float, float]:
    """(kept, rebuilt) of one micro-batch of ``tower_activation_bytes``
    (``stack_activation_parts``'s, the patch embedding's inputs kept)."""
    grids = list(grids)
    positions, squares = tower_positions(tower, grids)
    own = tower_settings(settings)
    stack = tower.stack
    if tower.by_boundaries and own.tower_varlen:
        stack = replace(stack, attention_kept=QWEN_VARLEN_ATTENTION)
    pixels = sum(t * h * w for t, h, w in grids) * \
        sum(lin.inputs * lin.times for lin in tower.patch_embed) * own.width
    kept, rebuilt = stack_activation_parts(stack, stack.layers, positions, squares, own)
    return kept + pixels, rebuilt


def tower_settings(settings: Settings) -> Settings:
    """What of ``settings`` a transformers tower's activations depend on (the others at
    their defaults): the precision, the kernel, and the towers' recompute, all or nothing
    (selective keeps everything, the attention scores too where the kernel keeps them)."""
    return Settings(precision=settings.precision, tower_varlen=settings.tower_varlen,
                    recompute="full" if settings.towers == "full" else "none")


def in_flight(micro_batches: int, stages: int, position: int) -> int:
    """Micro-batches a pipeline stage at ``position`` of ``stages`` holds at once (1F1B)."""
    return max(1, min(micro_batches, stages - position))
