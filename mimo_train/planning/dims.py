"""The model's dims as the FLOPs and memory formulas need them (``flops``, the layout advisor):
frozen dataclasses, read from a run's plan without building anything (``from_plan``: the
checkpoints' ``config.json`` through the families' own readers; the trainer's FLOPs count and
the advisor both read them so).

- ``Stack``: a transformer stack (layers, hidden width, heads, query groups, kv channels, MLP
  width, gated MLP or not; the language model's output rows and tying; a mixture of experts
  and its shared expert; Qwen3.5's hybrid decoder: each layer's kind, gated delta-net
  (``LinearAttention``) or full attention, the latter with a sigmoid output gate that doubles
  its query projection).
- ``Tower``: an encoder's transformer with what surrounds it: the patch embedding (matmuls per
  patch; Whisper's two convolutions per position), the spatial merge and the merger's matmuls
  per merged token (Qwen2-VL / Qwen2.5-VL; Qwen3-VL: one merger per deepstack layer too),
  extra positions per frame (CLIP's CLS), window attention (Qwen2.5-VL: windows of ``window``
  merged tokens a side, full attention in ``full_attention_layers``), and the patch grid of
  fixed-size items (a SigLIP / CLIP image, a Whisper clip's padded window).
- ``EncoderModule``: a tower, the modalities its module serves, the projection's matmuls per
  output token; ``ModelDims``: the language ``Stack`` and the encoder modules by layout name.

How a tower is read from its transformers config is ``tower_from_hf`` (one branch per encoder
kind); the transformers configs themselves come from the family modules (their
``random_config`` for a randomly initialised tower, the checkpoint's config otherwise), and the
language model's dims from the plan (``mimo_train.plan.language``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from mimo_train.errors import TrainConfigError
from mimo_train.families.causal_lm.architecture import FULL, LINEAR, LinearAttention
from mimo_train.plan import RunPlan
from mimo_train.plan.encoders import EncoderSetting
from mimo_train.plan.language import LanguagePlan, vocab_rows


CHUNK = 64      # the gated delta rule's chunk of tokens (transformers', fla's, mcore.delta_rule's)


class Linear(NamedTuple):
    """A matmul of ``inputs`` -> ``outputs`` features, ``times`` applications per position it
    is counted on (Whisper's first convolution: 2 frames per encoder position)."""
    inputs: int
    outputs: int
    times: int = 1


@dataclass(frozen=True)
class Stack:
    """A transformer stack; ``vocab``: the output layer's rows (0: none, an encoder)."""
    layers: int
    hidden: int
    heads: int
    query_groups: int
    kv_channels: int
    ffn_hidden: int
    gated: bool                       # gated MLP (SwiGLU: gate and up projections)
    vocab: int = 0
    tied: bool = False                # output layer shares the embedding's weights
    # a mixture of experts in every layer: ``experts`` MLPs of ``ffn_hidden``, each token
    # through ``experts_per_token`` of them, chosen by a router (0: one dense MLP)
    experts: int = 0
    experts_per_token: int = 0
    # beside the experts, a shared (gated) expert of this width every token goes through, its
    # output scaled by a sigmoid gate (a matmul hidden -> 1; Qwen3.5-MoE); 0: none
    shared_expert_ffn: int = 0
    # Qwen3.5's hybrid decoder: each layer's kind, LINEAR (a gated delta-net of ``linear``'s
    # dims) or FULL (attention); (): every layer FULL
    layer_types: tuple[str, ...] = ()
    linear: LinearAttention | None = None
    # the attention output gated by a sigmoid of a second query-wide projection (Qwen3.5:
    # q_proj gives each head's query and its gate, twice the query width)
    attention_gate: bool = False
    # what a transformers tower's attention keeps per token where it differs from
    # megatron-core's layers (``memory``), in units of a at 2 bytes (0: megatron-core's 8, +2
    # with a fused kernel); its MLP and norms keep what megatron-core's do
    # (``model.tower_fusions``)
    attention_kept: int = 0

    @property
    def attention_width(self) -> int:
        """Query heads × kv channels: the width attention scores and values run over."""
        return self.heads * self.kv_channels

    def kind(self, layer: int) -> str:
        """Layer ``layer``'s kind: LINEAR or FULL."""
        return self.layer_types[layer] if self.layer_types else FULL

    def kinds(self, layers: range | None = None) -> dict[str, int]:
        """How many of ``layers`` (default: all) are of each kind present (FULL, LINEAR)."""
        held = layers if layers is not None else range(self.layers)
        if not self.layer_types:            # every layer FULL: no walk (the advisor asks often)
            return {FULL: len(held)} if len(held) else {}
        found: dict[str, int] = {}
        for i in held:
            found[self.layer_types[i]] = found.get(self.layer_types[i], 0) + 1
        return found

    def stage_layers(self, pp: int = 1, stage: int = 0) -> range:
        """The layers of pipeline ``stage`` of ``pp`` (the first stages take the extra ones of
        an uneven split)."""
        size, extra = divmod(self.layers, pp)
        start = stage * size + min(stage, extra)
        return range(start, start + size + (1 if stage < extra else 0))

    def _mlp_linears(self) -> tuple[Linear, ...]:
        """The MLP's matmuls per token: each expert a token goes through (and the router), the
        shared expert and its gate."""
        used = self.experts_per_token or 1
        shared = self.shared_expert_ffn
        return (Linear(self.hidden, self.ffn_hidden * (2 if self.gated else 1), used),
                Linear(self.ffn_hidden, self.hidden, used),
                *((Linear(self.hidden, self.experts),) if self.experts else ()),
                *((Linear(self.hidden, 2 * shared), Linear(shared, self.hidden),
                   Linear(self.hidden, 1)) if shared else ()))

    def layer_linears(self, kind: str = FULL) -> tuple[Linear, ...]:
        """The matmuls of one layer of ``kind``, per token: attention's qkv (the query twice
        as wide with the output gate) and output, or the gated delta-net's input projections
        (q, k, v; the output gate z; beta and alpha, one per value head) and output; then the
        MLP's (each expert a token goes through, the router, the shared expert and its
        gate)."""
        if kind == LINEAR:
            linear = self._linear_dims()
            return (Linear(self.hidden, 2 * linear.key_dim + 2 * linear.value_dim
                           + 2 * linear.num_value_heads),
                    Linear(linear.value_dim, self.hidden), *self._mlp_linears())
        kv = 2 * self.query_groups * self.kv_channels
        query = self.attention_width * (2 if self.attention_gate else 1)
        return (Linear(self.hidden, query + kv), Linear(self.attention_width, self.hidden),
                *self._mlp_linears())

    def _linear_dims(self) -> LinearAttention:
        if self.linear is None:
            raise ValueError("a gated delta-net layer without its dims (Stack.linear)")
        return self.linear

    def layer_parameters(self, kind: str = FULL) -> tuple[int, int]:
        """One layer's (weights TP splits, weights every TP rank holds whole): the matmuls
        (every expert's weights; the router's and the shared gate's counted as split) and, in
        a gated delta-net, its convolution (kernel × q, k, v channels) and its per-value-head
        decay (A_log) and time-step bias (dt_bias); the two norms, and the delta-net's gated
        norm (one weight per value channel of a head, shared by the heads). The attention's
        q/k norms are not counted (kv channels each)."""
        copies = self.experts or 1
        linears = self.layer_linears(kind)
        matmuls = sum(lin.inputs * lin.outputs * (copies if i in (2, 3) else 1)
                      for i, lin in enumerate(linears))
        norms = 2 * self.hidden
        if kind == LINEAR:
            linear = self._linear_dims()
            matmuls += linear.conv_kernel * (2 * linear.key_dim + linear.value_dim) + \
                2 * linear.num_value_heads
            norms += linear.value_head_dim
        return matmuls, norms

    def layer_expert_parameters(self) -> int:
        """One layer's routed experts' weights, every expert's (the part of
        ``layer_parameters``' matmuls that expert parallelism splits over ep x etp ranks,
        where the rest splits over tp); 0 for a dense MLP."""
        if not self.experts:
            return 0
        first, second = self._mlp_linears()[:2]
        return self.experts * (first.inputs * first.outputs + second.inputs * second.outputs)

    def parameters(self) -> int:
        """Weights of the stack's layers (``layer_parameters``), its final norm and, with a
        vocabulary, the embedding and (untied) output layer; biases not counted."""
        embedding = self.vocab * self.hidden * (1 if self.tied else 2)
        return sum(count * sum(self.layer_parameters(kind))
                   for kind, count in self.kinds().items()) + self.hidden + embedding

    def active_parameters(self) -> int:
        """``parameters`` with only the experts a token goes through (a mixture's "active"
        weights)."""
        if not self.experts:
            return self.parameters()
        idle = self.experts - self.experts_per_token
        expert = sum(lin.inputs * lin.outputs for lin in self._mlp_linears()[:2])
        return self.parameters() - self.layers * idle * expert


@dataclass(frozen=True)
class Tower:
    """An encoder tower (see the module docstring)."""
    kind: str                         # mimo's encoder kind (families.registry.ENCODERS)
    stack: Stack
    patch_embed: tuple[Linear, ...]   # per patch
    output_size: int                  # width of the rows it emits
    merge: int = 1                    # spatial merge side: a merged token is merge² patches
    merger: tuple[Linear, ...] = ()   # per merged token
    extra_positions: int = 0          # per frame, without a patch (CLIP's CLS)
    window: int = 0                   # window side in merged tokens (0: full attention)
    full_attention_layers: tuple[int, ...] = ()   # with windows: the full-attention layers
    fixed_grid: tuple[int, int] | None = None     # (h, w) patches of every item; None: dynamic
    # its transformers attention takes all items at once by their boundaries: mimo's varlen
    # kernel where the run's towers take it (``Settings.tower_varlen``)
    by_boundaries: bool = False

    def parameters(self) -> int:
        linears = (*self.patch_embed, *self.merger)
        return self.stack.parameters() + sum(lin.inputs * lin.outputs for lin in linears)


@dataclass(frozen=True)
class EncoderModule:
    """An encoder module: its tower, the modalities it serves, the projection to the language
    width (matmuls per output token; () for none)."""
    tower: Tower
    modalities: tuple[str, ...]
    projection: tuple[Linear, ...]

    def parameters(self) -> int:
        return self.tower.parameters() + sum(lin.inputs * lin.outputs
                                             for lin in self.projection)


@dataclass(frozen=True)
class ModelDims:
    language: Stack
    encoders: Mapping[str, EncoderModule] = field(default_factory=dict)

    def module_of(self, modality: str) -> str | None:
        """The encoder module serving ``modality`` (None: none)."""
        return next((name for name, module in self.encoders.items()
                     if modality in module.modalities), None)


# ------------------------------------------------------------------------- transformers

def tower_from_hf(kind: str, config: Any, output_size: int | None = None) -> Tower:
    """The ``Tower`` of encoder ``kind`` from the transformers config it is built from (a
    whole model's config: its ``vision_config``); ``output_size``: the rows' width where the
    encoder widens them (LLaVA's concatenated feature layers)."""
    if kind == "whisper":
        return _whisper(config)
    config = getattr(config, "vision_config", None) or config
    if kind == "qwen2_vl":
        width, merge = config.embed_dim, config.spatial_merge_size
        stack = Stack(config.depth, width, config.num_heads, config.num_heads,
                      width // config.num_heads, int(width * config.mlp_ratio), gated=False,
                      attention_kept=SDPA_TOWER_ATTENTION)
        return Tower(kind, stack, _qwen_patch(config, width), config.hidden_size, merge,
                     (Linear(width * merge ** 2, width * merge ** 2),
                      Linear(width * merge ** 2, config.hidden_size)), by_boundaries=True)
    if kind == "qwen2_5_vl":
        width, merge = config.hidden_size, config.spatial_merge_size
        stack = Stack(config.depth, width, config.num_heads, config.num_heads,
                      width // config.num_heads, config.intermediate_size, gated=True,
                      attention_kept=SDPA_TOWER_ATTENTION)
        return Tower(kind, stack, _qwen_patch(config, width), config.out_hidden_size, merge,
                     (Linear(width * merge ** 2, width * merge ** 2),
                      Linear(width * merge ** 2, config.out_hidden_size)),
                     window=config.window_size // merge // config.patch_size,
                     full_attention_layers=tuple(config.fullatt_block_indexes),
                     by_boundaries=True)
    if kind in ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"):
        # the main merger, one per deepstack layer (Qwen3.5's tower has none)
        width, merge = config.hidden_size, config.spatial_merge_size
        stack = Stack(config.depth, width, config.num_heads, config.num_heads,
                      width // config.num_heads, config.intermediate_size, gated=False,
                      attention_kept=SDPA_TOWER_ATTENTION)
        mergers = 1 + len(getattr(config, "deepstack_visual_indexes", None) or ())
        return Tower(kind, stack, _qwen_patch(config, width), config.out_hidden_size, merge,
                     (Linear(width * merge ** 2, width * merge ** 2),
                      Linear(width * merge ** 2, config.out_hidden_size)) * mergers,
                     by_boundaries=True)
    if kind in ("siglip", "llava"):
        width, side = config.hidden_size, config.image_size // config.patch_size
        stack = Stack(config.num_hidden_layers, width, config.num_attention_heads,
                      config.num_attention_heads, width // config.num_attention_heads,
                      config.intermediate_size, gated=False,
                      attention_kept=SDPA_TOWER_ATTENTION)
        return Tower(kind, stack,
                     (Linear(config.num_channels * config.patch_size ** 2, width),),
                     output_size or width,
                     extra_positions=1 if config.model_type == "clip_vision_model" else 0,
                     fixed_grid=(side, side))
    raise TrainConfigError(f"encoder kind {kind!r} has no FLOPs reading (mimo_train/planning/"
                           "dims.py tower_from_hf)")


# a transformers tower's attention under SDPA, in units of a at 2 bytes: its queries, keys
# and values (the Qwen family's rotated, and its values a contiguous copy of the fused QKV
# projection's output, ``model.tower_fusions``), SDPA's output and its copy that is the output
# projection's input
SDPA_TOWER_ATTENTION = 10
# the Qwen family under mimo's varlen kernel (``model.tower_attention``): q, k, v (the values a
# contiguous copy) and the kernel's output, which is the output projection's input
QWEN_VARLEN_ATTENTION = 8


def _qwen_patch(config, width: int) -> tuple[Linear, ...]:
    """Qwen's patch embedding: a Conv3d over C × T × P × P, one patch at a time."""
    return (Linear(config.in_channels * config.temporal_patch_size * config.patch_size ** 2,
                   width),)


def _whisper(config) -> Tower:
    width, positions = config.d_model, config.max_source_positions
    stack = Stack(config.encoder_layers, width, config.encoder_attention_heads,
                  config.encoder_attention_heads, width // config.encoder_attention_heads,
                  config.encoder_ffn_dim, gated=False, attention_kept=SDPA_TOWER_ATTENTION)
    # conv1 (k3) on the 2 · positions frames of the padded window, conv2 (k3, stride 2)
    return Tower("whisper", stack, (Linear(3 * config.num_mel_bins, width, 2),
                                    Linear(3 * width, width)), width,
                 fixed_grid=(1, positions))


def projection_linears(kind: str | None, inputs: int, outputs: int) -> tuple[Linear, ...]:
    """``model.projection``'s matmuls per token (``families.base.Projection``)."""
    if kind == "none":
        return ()
    if kind == "mlp":
        return (Linear(inputs, outputs), Linear(outputs, outputs))
    return (Linear(inputs, outputs),)


# ------------------------------------------------------------------------- from a config

def from_plan(plan: RunPlan, tokenizer_size: int | None = None) -> ModelDims:
    """The dims of the model ``plan`` builds, without building it: the language model's
    (a checkpoint's architecture read from its ``config.json``), each encoder module's from
    its family's transformers config (a checkpoint's, or the family's ``random_config`` of
    the ``model.encoders`` dims and the preprocessing geometry). ``tokenizer_size``: the
    tokenizer's vocabulary with modality tokens (sizes the output layer as the build does;
    without it, ``model.language.vocab_size`` or the checkpoint's vocabulary)."""
    language = language_stack(plan.language, tokenizer_size, plan.layout.language.tp)
    encoders = {}
    for name, setting in plan.encoders.items():
        tower = _configured_tower(name, setting)
        encoders[name] = EncoderModule(tower, tuple(plan.layout.modalities_of(name)),
                                       projection_linears(setting.projection, tower.output_size,
                                                          language.hidden))
    return ModelDims(language, encoders)


def language_stack(language: LanguagePlan, tokenizer_size: int | None = None, tp: int = 1
                   ) -> Stack:
    """The language model's ``Stack``; its output rows those the build gives
    (``LanguagePlan.vocabulary``, ``vocab_rows``; without ``tokenizer_size``: the config's or
    the checkpoint's vocabulary)."""
    if tokenizer_size is None and language.vocab_size is None and language.arch is None:
        raise TrainConfigError("the language model's vocabulary is unknown: set "
                               "model.language.vocab_size or give the tokenizer's size")
    rows = vocab_rows(language.vocabulary(tokenizer_size or 0).rows, tp)
    arch = language.arch
    if arch is not None:
        return Stack(arch.num_layers, arch.hidden_size, arch.num_attention_heads,
                     arch.num_query_groups, arch.kv_channels,
                     arch.expert_ffn_hidden_size or arch.ffn_hidden_size, gated=True,
                     vocab=rows, tied=arch.tied, experts=arch.experts,
                     experts_per_token=arch.experts_per_token,
                     shared_expert_ffn=arch.shared_expert_ffn_hidden_size,
                     layer_types=arch.layer_types, linear=arch.linear,
                     attention_gate=arch.attention_gate)
    return Stack(language.num_layers, language.hidden_size, language.num_attention_heads,
                 language.num_attention_heads,
                 language.hidden_size // language.num_attention_heads,
                 language.ffn_hidden_size or 4 * language.hidden_size, gated=False, vocab=rows)


def _configured_tower(name: str, setting: EncoderSetting) -> Tower:
    """The tower of encoder module ``name`` built from ``setting`` (``plan.encoders``), its
    transformers config read as the family's encoder class reads it."""
    from mimo_train.families import llava
    from mimo_train.families.registry import ENCODERS, checkpoint_config
    kind, spec = setting.kind, setting.spec
    if spec.pretrained:
        config = checkpoint_config(spec.pretrained, f"model.encoders.{name}.pretrained")
        if kind == "llava":
            vision, _ = llava.tower_config(config)
            return tower_from_hf(kind, vision, llava.LlavaVision.pretrained_output_size(config))
        return tower_from_hf(kind, config)
    return tower_from_hf(kind, ENCODERS[kind].random_config(setting.config, *setting.dims))
