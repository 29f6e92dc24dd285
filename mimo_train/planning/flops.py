"""Training FLOPs of a step, per module, from the model's dims (``dims``) and the step's real
work: each sample's tokens, each media item's grid. Pure functions of integers (exact Python
ints); no torch.

Conventions: a matmul of ``m × k`` by ``k × n`` is ``2·m·n·k`` FLOPs; training is ``passes``
times the forward (3: forward, input gradients, weight gradients; a part that trains nothing
but sits after one that does needs its input gradients only: 2; a frozen part with nothing
trained before it runs forward only: 1; ``training_passes``). Norms, activations, softmax,
rotary and embedding lookups are not counted. These are model FLOPs: padding is not work,
and attention is counted over the whole ``s × s`` square of each sample (the convention of
Megatron-LM's and PaLM's MFU; a causal kernel computes about half of it).

Language model (``Stack``: L layers, width h, a = heads · kv channels, g = query groups ·
kv channels, MLP width f, V output rows), a sample of s tokens, forward::

    dense      s · L · 2·(h·(a + 2g) + a·h + h·f·(3 if gated else 2))
    output     t · 2·h·V                          (t of the s tokens trained: only their
                                                   logits are made, ``mcore.language_loss``)
    attention  L · 4·a·s²                         (scores Q·Kᵀ and the weighted sum, per sample)

i.e. 2 · (matmul weights) · tokens plus the attention; × 3 it is "6 · params · tokens +
12 · L · h · Σ s²" (the output layer's params on the trained tokens). Packed or not, attention
stays inside each sample, so a step's figure is the sum over its samples: Σ s over the dense
part, Σ s² over attention. A mixture of experts counts the router (2·h·E), the experts a
token goes through (k of them) and a shared expert with its sigmoid gate (Qwen3.5-MoE:
2·h·3·f_s + 2·h)::

    MLP        2·h·f·(3 if gated else 2)·k + 2·h·E + 2·h·3·f_s + 2·h

Qwen3.5's hybrid decoder (``Stack.layer_types``): its full-attention layers as above, the
query projection twice as wide (each head's query and its output gate: 2·h·(2a + 2g)); its
gated delta-net layers (``Stack.linear``: key heads H_k, value heads H_v, head dims d_k, d_v,
key_dim = H_k·d_k, value_dim = H_v·d_v, convolution kernel K; transformers'
``Qwen3_5GatedDeltaNet``, megatron-core's ``GatedDeltaNet``) instead of attention, per token::

    projections  2·h·(2·key_dim + 2·value_dim + 2·H_v) + 2·value_dim·h
                 (in_proj_qkv, in_proj_z: the output gate, in_proj_b and in_proj_a: one per
                 value head each; out_proj)
    convolution  2·K·(2·key_dim + value_dim)      (depthwise, causal: K multiply-adds per
                                                   q, k, v channel and token)
    state        H_v · 6·d_k·d_v                  (per chunk and value head, below: the state
                                                   read twice and updated once, per token)

and per sample of s tokens, the chunked gated delta rule's products within each chunk::

    chunks       H_v · (5·d_k + 3·d_v) · (⌊s/C⌋·C² + (s mod C)²)

The products are those of transformers' ``torch_chunk_gated_delta_rule``
(``models/qwen3_5/modeling_qwen3_5.py``; mimo's torch kernels, ``mcore.delta_rule``, compute
the same ones, fla's the same in blocks), q and k repeated from H_k to H_v heads first, per
chunk of C = 64 tokens and value head (tests/test_flops.py checks them against what torch's
FLOP counter counts in transformers' layer, which leaves the solves out):

    k_β·kᵀ (the UT system)           2·C²·d_k
    q·kᵀ (within the chunk)          2·C²·d_k
    triangular solves for v_β, k_β   C²·d_v + C²·d_k   (a unit lower-triangular C × C system
                                                        solved for C × d columns: C·(C-1)·d,
                                                        counted C²·d)
    (q·kᵀ)·v_new                     2·C²·d_v
    k_cumdecay·S, q·S (state reads)  2 · 2·C·d_k·d_v
    kᵀ·v_new (state update)          2·C·d_k·d_v

i.e. C²·(5·d_k + 3·d_v) + 6·C·d_k·d_v. Model FLOPs count a sample's real tokens: its last
chunk of r = s mod C tokens as an r-token chunk (r², not the C² the padded chunk computes),
each sample's chunks its own (packed samples start at a chunk boundary), as attention
counts each sample's own square. A delta-net layer has no s² term. Left out, as norms,
activations and softmax are: the gates and the other elementwise work (β = sigmoid(b), the
decay g = -exp(A_log)·softplus(a + dt_bias), the l2 norms of q and k, the decays within a
chunk, the gated norm of the output: O(C) per token and head; the attention output gate's
sigmoid and product: O(a) per token).

Encoder tower (``Tower``), an item (an image, a video, a clip) of grid (t, h, w) patches
before merging: t frames of n = h·w patches, p = n + extra positions (CLIP's CLS) each::

    patch embed  t · n · Σ 2·in·out·times         (Qwen's Conv3d, SigLIP's/CLIP's Conv2d,
                                                   Whisper's two Conv1d: in = channels · kernel)
    dense        t · p · L · 2·(layer matmuls)    (as the language model's, no output layer)
    attention    t · 4·a · (L_full · p² + L_window · Σ_windows w_i²)
    merger       t · n / m² · Σ 2·in·out           (Qwen: merge m × m patches, then an MLP)

Attention is per frame: Qwen2-VL's and Qwen2.5-VL's towers attend within each temporal
slice; Qwen2.5-VL's windowed layers (all but ``full_attention_layers``) within windows of
``window`` × ``window`` merged tokens tiled from the frame's top-left corner, the edge
windows cut (w_i: a window's patches). A Whisper clip is its padded window: the encoder runs
all ``max_source_positions`` positions whatever the clip's length. Projection (``model.
projection``), per output token (the item's placeholders): Σ 2·in·out.

``peak_tflops``: the dense peak of known GPUs by name and precision (``train.peak_tflops``
overrides it); MFU = achieved / peak.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from mimo_data.loading.layout import LANGUAGE
from mimo_train.plan.parts import Part
from mimo_train.planning.dims import CHUNK, FULL, LINEAR, Linear, ModelDims, Stack, Tower

Grid = tuple[int, int, int]


def _linears(linears: Iterable[Linear]) -> int:
    """Forward FLOPs of ``linears`` applied once (per position)."""
    return sum(2 * lin.inputs * lin.outputs * lin.times for lin in linears)


def layer_flops_per_token(stack: Stack, kind: str = FULL) -> int:
    """Forward FLOPs of one layer of ``kind`` for one token: its matmuls; a gated delta-net's
    convolution and state reads and update too (the module docstring)."""
    found = _linears(stack.layer_linears(kind))
    if kind == LINEAR:
        linear = stack.linear
        assert linear is not None, "a delta-net layer has its dims"
        found += 2 * linear.conv_kernel * (2 * linear.key_dim + linear.value_dim) + \
            linear.num_value_heads * 6 * linear.key_head_dim * linear.value_head_dim
    return found


def expert_flops_per_token(stack: Stack) -> int:
    """Forward FLOPs of one layer's routed experts for one token (the k experts it goes
    through; the router and a shared expert left out): the part of
    ``layer_flops_per_token`` that expert parallelism moves to the ranks holding the experts;
    0 for a dense MLP."""
    if not stack.experts:
        return 0
    return _linears(stack.layer_linears()[2:4])


def chunk_square(s: int, chunk: int = CHUNK) -> int:
    """Σ over the chunks of a sample of ``s`` tokens of each chunk's squared length (its last
    chunk: its own tokens)."""
    return (s // chunk) * chunk * chunk + (s % chunk) ** 2


def layer_square_flops(stack: Stack, kind: str = FULL) -> int:
    """Forward FLOPs of one layer of ``kind`` per unit of a sample's square: attention's
    4·a per s², a gated delta-net's H_v·(5·d_k + 3·d_v) per ``chunk_square``."""
    if kind == LINEAR:
        linear = stack.linear
        assert linear is not None, "a delta-net layer has its dims"
        return linear.num_value_heads * (5 * linear.key_head_dim + 3 * linear.value_head_dim)
    return 4 * stack.attention_width


def language_flops(stack: Stack, lengths: Iterable[int], passes: int = 3,
                   trained: int | None = None) -> int:
    """Training FLOPs of the language model on samples of ``lengths`` real tokens (each its
    own attention, or delta-rule chunks, packed or padded: padding is not counted; for the
    positions a padded batch computes, give the padded lengths), the output layer on
    ``trained`` of them (the trained tokens, the only ones whose logits training makes,
    ``mcore.language_loss``; None: all)."""
    lengths = [int(s) for s in lengths]
    kinds = stack.kinds()
    per_token = sum(count * layer_flops_per_token(stack, kind) for kind, count in kinds.items())
    squares = {FULL: sum(s * s for s in lengths),
               LINEAR: sum(chunk_square(s) for s in lengths) if LINEAR in kinds else 0}
    quadratic = sum(count * layer_square_flops(stack, kind) * squares[kind]
                    for kind, count in kinds.items())
    outputs = sum(lengths) if trained is None else int(trained)
    return passes * (per_token * sum(lengths) + 2 * stack.hidden * stack.vocab * outputs
                     + quadratic)


def window_sizes(tower: Tower, h: int, w: int) -> list[int]:
    """Patches of each attention window of a frame of ``h`` × ``w`` patches (Qwen2.5-VL:
    ``window`` × ``window`` merged tokens from the top-left, the edge ones cut)."""
    side, m = tower.window, tower.merge
    rows, cols = h // m, w // m
    return [min(side, rows - i) * min(side, cols - j) * m * m
            for i in range(0, rows, side) for j in range(0, cols, side)]


def tower_flops(tower: Tower, grids: Iterable[Grid], passes: int = 3) -> int:
    """Training FLOPs of ``tower`` on items of ``grids``: (t, h, w) patches before merging."""
    stack = tower.stack
    windowed = 0
    if tower.window:
        windowed = stack.layers - len({i for i in tower.full_attention_layers
                                       if 0 <= i < stack.layers})
    dense = layer_flops_per_token(stack) * stack.layers
    total = 0
    for t, h, w in grids:
        patches = h * w
        positions = patches + tower.extra_positions
        square = positions * positions
        attention = (stack.layers - windowed) * square
        if windowed:
            attention += windowed * sum(n * n for n in window_sizes(tower, h, w))
        total += t * (patches * _linears(tower.patch_embed) + positions * dense
                      + 4 * stack.attention_width * attention
                      + patches // tower.merge ** 2 * _linears(tower.merger))
    return passes * total


def projection_flops(linears: Sequence[Linear], tokens: int, passes: int = 3) -> int:
    """Training FLOPs of a projection on ``tokens`` output rows."""
    return passes * tokens * _linears(linears)


def item_grid(tower: Tower, token_grid: Sequence[int] | None) -> Grid:
    """The patch grid a tower runs for an item whose placeholder tokens lie on
    ``token_grid`` (t, h, w merged tokens; ``modalities.*.token_grid``): a fixed-size tower's
    own grid, else the token grid unmerged."""
    if tower.fixed_grid is not None:
        return (1, *tower.fixed_grid)
    if token_grid is None:
        raise ValueError(f"a {tower.kind} tower needs each item's token grid")
    t, h, w = token_grid
    return (int(t), int(h) * tower.merge, int(w) * tower.merge)


def trains(part: str, frozen: Iterable[Part] = (), adapted: Iterable[Part] = ()) -> bool:
    """Whether ``part`` (``language``, ``<module>.encoder``, ``<module>.projection``) computes
    weight gradients given ``model.freeze``'s parts ``frozen`` and the parts under LoRA
    ``adapted`` (each a part or its whole module): under LoRA it trains (its adapters), else
    it trains unless frozen. Whether its own (base) weights train, with gradients and
    optimizer state: ``trains(part, (*frozen, *adapted))``."""
    return any(p.covers(part) for p in adapted) or not any(p.covers(part) for p in frozen)


def training_passes(dims: ModelDims, frozen: Iterable[Part] = (), adapted: Iterable[Part] = ()
                    ) -> dict[str, int]:
    """Passes of each part (``language``, ``<module>.encoder``, ``<module>.projection``)
    given ``model.freeze``'s entries ``frozen`` and the parts under LoRA ``adapted`` (those
    train: 3, weight gradients of the adapters only, counted as a whole pass; ``trains``): 3
    where the part trains, 2 where only a part before it does (input gradients flow through
    it), 1 where nothing up to it trains (forward only). Data flows tower -> projection ->
    language."""
    frozen, adapted = list(frozen), list(adapted)
    found: dict[str, int] = {}
    upstream = False
    for name in dims.encoders:
        tower = trains(f"{name}.encoder", frozen, adapted)
        projection = trains(f"{name}.projection", frozen, adapted)
        found[f"{name}.encoder"] = 3 if tower else 1
        found[f"{name}.projection"] = 3 if projection else 2 if tower else 1
        upstream |= tower or projection
    found[LANGUAGE] = 3 if trains(LANGUAGE, frozen, adapted) else 2 if upstream else 1
    return found


def step_flops(dims: ModelDims, tokens: Iterable[int],
               token_counts: Mapping[str, Iterable[Iterable[int]]],
               token_grids: Mapping[str, Iterable[Iterable[Sequence[int] | None]]],
               part_passes: Mapping[str, int] | None = None,
               trained: Iterable[int] | None = None) -> dict[str, int]:
    """Training FLOPs per module (``language`` and each encoder module, layout names) of
    samples with ``tokens`` real tokens each, ``trained`` of them trained (None: all), their
    media items' placeholder counts by modality (``token_counts``: per sample, per item) and
    token grids (``token_grids``, likewise; a loader micro-batch's metadata holds them all).
    ``part_passes``: ``training_passes`` (default 3 everywhere)."""
    part_passes = part_passes or {}
    found = {LANGUAGE: language_flops(dims.language, tokens, part_passes.get(LANGUAGE, 3),
                                      None if trained is None else sum(int(n) for n in trained))}
    found.update(dict.fromkeys(dims.encoders, 0))
    for modality, rows in token_counts.items():
        module = dims.module_of(modality)
        if module is None:
            continue
        encoder = dims.encoders[module]
        counts = [int(n) for row in rows for n in row]
        grid_rows = token_grids.get(modality) if encoder.tower.fixed_grid is None else None
        grids = [item_grid(encoder.tower, g) for row in grid_rows for g in row] \
            if grid_rows is not None else [item_grid(encoder.tower, None)] * len(counts)
        found[module] += tower_flops(encoder.tower, grids,
                                     part_passes.get(f"{module}.encoder", 3)) + \
            projection_flops(encoder.projection, sum(counts),
                             part_passes.get(f"{module}.projection", 3))
    return found


# dense bf16 / fp32 peaks (TFLOP/s) by a name part, the first that matches (NVIDIA's data
# sheets, SXM unless named; fp32: the plain fp32 rate, TF32 being off in torch by default)
PEAKS = (("H100 PCIe", 756.0, 51.0), ("H100 NVL", 835.0, 60.0), ("H100", 989.0, 67.0),
         ("H200", 989.0, 67.0), ("H800", 989.0, 67.0), ("A100", 312.0, 19.5),
         ("A800", 312.0, 19.5), ("L40S", 362.0, 91.6))


def peak_tflops(device_name: str | None, precision: str) -> float | None:
    """The dense peak TFLOP/s of the GPU named ``device_name`` at ``precision`` (bf16 /
    fp32); None for a CPU or a GPU not in ``PEAKS``."""
    for part, bf16, fp32 in PEAKS:
        if device_name and part.lower() in device_name.lower():
            return bf16 if precision == "bf16" else fp32
    return None
