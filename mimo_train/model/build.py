"""megatron-core ``MimoModel`` from the training config: a GPT language model, one encoder module
per encoder in the layout (encoder + projection to the language hidden size), each module of
this rank in megatron-core DDP.

Weights are initialized on the CPU from the seed (``use_cpu_initialization``), pretrained ones
read in fp32, then cast to the run's precision (``precision.cast``) and moved to the device.
The attention kernels are the run's ``AttentionChoice`` (``mcore.attention``). Checkpoints
(``components.checkpoint``) use megatron-core's sharded state dicts of the model built here and
of its optimizer (``components.optimizer``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from mimo_data.loading.layout import LANGUAGE
from mimo_train.mcore.attention import AttentionChoice, CoreAttention, LanguageModel
from mimo_train.mcore.bridge_routing import RoutedMimoModel
from mimo_train.config import EncoderConfig, TrainConfig
from mimo_train.errors import TrainConfigError
from mimo_train.families.base import Projection
from mimo_train.families.causal_lm import (check_parallel, gpt_fields, load_pretrained_language,
                                           transformer_fields)
from mimo_train.families.registry import (ENCODERS, EncoderSetting, build_encoder,
                                          encoder_settings, language_arch,
                                          predicted_vocabulary, read_vlm, vocab_rows,
                                          vocab_size)
from mimo_train.mcore.grids import Infra
from mimo_train.mcore.norms import block_spec
from mimo_train.model.lora import add_adapters, is_adapter, parts
from mimo_train.model.parts import layer_offset, module_of, replace_module
from mimo_train.mcore import (AudioModalitySubmodules, DistributedDataParallel,
                              DistributedDataParallelConfig, MimoModelConfig, ModelType, ModuleSpec,
                              TransformerConfig, VisionModalitySubmodules,
                              get_gpt_layer_local_spec)
from mimo_train.precision import cast, run_dtype, trainable

# megatron-core's submodule class of each modality an encoder takes on its own
# (registry.OWN_MODALITIES; how it splices embeddings in)
_SUBMODULES = {"image": VisionModalitySubmodules, "audio": AudioModalitySubmodules}

def language_transformer_config(cfg: TrainConfig, layout, device: torch.device):
    lm = cfg.model.language
    language = layout.language
    if lm.num_layers % language.pp:
        raise TrainConfigError(f"model.language.num_layers {lm.num_layers} does not split into "
                               f"{language.pp} pipeline stages: make it a multiple of pp")
    bf16 = cfg.train.precision == "bf16"
    dtype = run_dtype(cfg.train.precision)
    dims: dict = dict(num_layers=lm.num_layers, hidden_size=lm.hidden_size,
                      num_attention_heads=lm.num_attention_heads,
                      ffn_hidden_size=lm.ffn_hidden_size)
    if lm.pretrained:                 # the checkpoint's numerics (RMSNorm, SwiGLU, GQA, ...)
        arch = language_arch(lm.pretrained)
        check_parallel(arch, language.tp, language.pp, lm.pretrained)
        dims = transformer_fields(arch)
    return TransformerConfig(
        **dims, mrope_section=lm.mrope_section,
        tensor_model_parallel_size=language.tp, pipeline_model_parallel_size=language.pp,
        context_parallel_size=language.cp, use_cpu_initialization=True,
        perform_initialization=True, bf16=bf16, params_dtype=dtype, pipeline_dtype=dtype,
        # per-token loss: the loss function returns (sum, tokens); gradients are divided by the
        # global token count (step.finalize_grads), never by DP size
        calculate_per_token_loss=True,
        # MIMO sequences vary in length between modules and micro-batches; megatron-core then
        # needs the all-to-all MoE dispatcher even without experts
        variable_seq_lengths=True, moe_token_dispatcher_type="alltoall",
        attention_dropout=0.0, hidden_dropout=0.0,
        gradient_accumulation_fusion=False, bias_activation_fusion=device.type == "cuda",
        masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        **language_memory(cfg, language.tp))


# model.language.recompute -> megatron-core's TransformerConfig fields: selective recomputes
# the core attention (the s x s scores, softmax and dropout) in the backward pass; full keeps
# each layer's input and recomputes the whole layer (uniform method, one layer per checkpoint)
_RECOMPUTE: dict[str, dict[str, Any]] = {"none": {},
              "selective": dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
              "full": dict(recompute_granularity="full", recompute_method="uniform",
                           recompute_num_layers=1)}


def language_memory(cfg: TrainConfig, tp: int) -> dict:
    """The language model's memory settings as ``TransformerConfig`` fields
    (``model.language.recompute`` and ``sequence_parallel``); ``TrainConfigError`` where the
    layout cannot take them."""
    lm = cfg.model.language
    if lm.sequence_parallel and tp < 2:
        raise TrainConfigError(
            "model.language.sequence_parallel needs the language model's tensor parallelism: "
            f"the layout gives it tp{tp}, and sequence parallelism splits the sequence over the "
            "TP ranks for the layer norms and dropout between the TP regions; set tp >= 2 "
            "(e.g. language=tp2) or drop it")
    if lm.sequence_parallel and cfg.data.packing:
        raise TrainConfigError(
            "model.language.sequence_parallel with data.packing: a packed micro-batch's rows "
            "are not padded to a multiple of the TP size, which sequence parallelism splits "
            "them by; drop one of the two")
    return dict(_RECOMPUTE[lm.recompute], sequence_parallel=lm.sequence_parallel)


def ddp_config(cfg: TrainConfig, module: str) -> DistributedDataParallelConfig:
    """megatron-core's DDP settings of ``module`` (``optimizer.distributed``,
    ``overlap_grad_reduce``, ``bucket_size``, each settable per module). Gradients are reduced
    in fp32 whatever the weights' dtype. The overlapped reduction runs on the CPU too: gloo's
    asynchronous collectives, started from the backward hooks, and ``cpu_compat``'s streams
    that never wait (CPU work is in order)."""
    own = cfg.optimizer.of(module)
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=own.distributed,
        overlap_grad_reduce=own.overlap_grad_reduce, bucket_size=own.bucket_size)


def shared_placeholders(cfg: TrainConfig, infra: Infra, preprocess,
                        special_token_ids: dict[str, int]) -> dict[str, dict[str, int]]:
    """Per encoder module serving several modalities, ``{modality: placeholder token id}``,
    its encoder's modality first (``step.model_inputs``)."""
    return {name: {m: special_token_ids[m] for m in (setting.modality, *setting.also)}
            for name, setting in encoder_settings(cfg, infra.layout, preprocess).items()
            if setting.also}


class _SeededEncoder(torch.nn.Module):
    """Builds the encoder right after seeding the RNG from (seed, module name), so an encoder
    and its projection start from the same weights whichever ranks build them.

    A module serving several modalities (``setting.also``) takes ``{modality: inputs}`` and
    ``placeholders``, the modality index (0: ``setting.modality``, then ``also``'s) of each
    of the batch's placeholders in token order, and returns the rows of all items in that
    order (``step.model_inputs`` gives both), as transformers scatters image and video
    features into their placeholders.
    """

    def __init__(self, seed: int, name: str, setting: EncoderSetting):
        super().__init__()
        torch.manual_seed(_module_seed(seed, name))
        spec = setting.spec
        self.encoder = build_encoder(setting.kind, setting.config, spec.hidden_size,
                                     spec.num_layers, spec.num_attention_heads, spec.pretrained)
        for modality, config in setting.also.items():
            self.encoder.take_also(modality, config)
        self.modalities = (setting.modality, *setting.also)
        # mcore.deepstack's empty rows: as wide as the tower's deepstack rows (none: the
        # module's rows after its projection, megatron-core's own)
        self.deepstack_width = self.encoder.row_width if self.encoder.deepstack else None

    def forward(self, placeholders: torch.Tensor | None = None, **inputs):
        if placeholders is None:
            return self.encoder(**inputs)
        rows, targets = [], []
        for index, modality in enumerate(self.modalities):
            if modality in inputs:
                rows.append(self.encoder.encode(modality, **inputs[modality]))
                targets.append(torch.nonzero(placeholders == index).squeeze(1))
        return torch.cat(rows)[torch.argsort(torch.cat(targets))]


class _SeededGPTModel(LanguageModel):
    """GPTModel built right after seeding the RNG, as ``_SeededEncoder`` (same weights with
    or without encoders on the rank; pipeline stages each draw only their layers). Its output
    rows past ``vocabulary`` (``predicted_vocabulary``) get a logit no softmax can weigh, so
    they never enter the loss nor come out of generation."""

    def __init__(self, *, seed: int, vocabulary: int, **kwargs):
        torch.manual_seed(seed)
        super().__init__(**kwargs)
        if self.post_process and self.vocab_size > vocabulary:
            self.output_layer.register_forward_hook(_mask_rows_past(vocabulary))


def _mask_rows_past(vocabulary: int):
    """A forward hook of the output layer (``ColumnParallelLinear``): the logits of rows
    ``vocabulary`` and up, whether the output holds this TP rank's rows or all of them, at
    the dtype's lowest value (not -inf: no inf - inf in what reads the logits)."""
    def hook(layer, inputs, output):
        logits, bias = output
        local = layer.output_size_per_partition
        first = 0 if logits.size(-1) != local else layer.tp_group.rank() * local
        rows = torch.arange(first, first + logits.size(-1), device=logits.device)
        return logits.masked_fill(rows >= vocabulary, torch.finfo(logits.dtype).min), bias
    return hook


def _module_seed(seed: int, name: str) -> int:
    return seed * 1_000_003 + sum(ord(c) * 31 ** i for i, c in enumerate(name)) % 1_000_003


def build_model(cfg: TrainConfig, infra: Infra, preprocess, tokenizer_size: int,
                special_token_ids: dict, device: torch.device, attention: AttentionChoice):
    """``MimoModel`` with this rank's modules DDP-wrapped (``build_optimizer`` makes its
    ``MimoOptimizer``)."""
    layout, seed = infra.layout, cfg.train.seed
    check_positions(cfg, preprocess)
    transformer = language_transformer_config(cfg, layout, device)
    encoder_transformer_config = dataclasses.replace(transformer, **{
        key: next(f.default for f in dataclasses.fields(TransformerConfig) if f.name == key)
        for key in language_memory(cfg, layout.language.tp)}) \
        if transformer.recompute_granularity or transformer.sequence_parallel else transformer
    settings = encoder_settings(cfg, layout, preprocess)
    check_deepstack(cfg, layout, settings)
    check_experts(cfg, layout)
    modality_specs, token_ids = {}, {}
    for name, setting in settings.items():
        encoder_size = _encoder_output_size(setting.spec, name, setting.kind)
        modality_specs[name] = ModuleSpec(
            module=_SUBMODULES[setting.modality],
            params=dict(pg_collection=infra.modules[name].pgs),
            submodules=dict(
                encoders={setting.modality: ModuleSpec(
                    module=_SeededEncoder, params=dict(seed=seed, name=name, setting=setting))},
                input_projections=[ModuleSpec(module=Projection, params=dict(
                    in_features=encoder_size, out_features=cfg.model.language.hidden_size,
                    kind=cfg.model.projection, initial=_projector(cfg, setting.spec)))]))
        # the module's placeholders (a module serving several modalities: its first one's,
        # step.model_inputs rewrites the others' to it)
        token_ids[name] = special_token_ids[setting.modality]
    vocab = vocab_rows(vocab_size(cfg, tokenizer_size), layout.module(LANGUAGE).tp)
    language_spec = ModuleSpec(module=_SeededGPTModel, params=dict(
        vocabulary=predicted_vocabulary(cfg, tokenizer_size) or vocab, **language_model_params(
            cfg, infra, transformer, vocab, preprocess.seq_length, attention.language)))
    model = RoutedMimoModel(MimoModelConfig(
        language_model_spec=language_spec, modality_submodules_spec=modality_specs,
        special_token_ids=token_ids, module_to_grid_map=infra.grids),
        # sequence parallel: MimoModel splits the spliced embeddings over the language TP group
        **(dict(tp_group=infra.modules[LANGUAGE].pgs.tp, cp_group=infra.modules[LANGUAGE].pgs.cp)
           if transformer.sequence_parallel and LANGUAGE in infra.local else {}))
    model.model_type = ModelType.encoder_or_decoder
    if cfg.model.language.pretrained and LANGUAGE in infra.local:
        load_language_weights(model.language_model, cfg, infra, vocab)
    frozen_parts = _frozen_parts(cfg.model.freeze, infra)
    adapted = _adapt(model, cfg, infra, frozen_parts)
    # every weight in the run's dtype, as megatron-core's Float16Module would cast it (norms
    # included) but for the rotary frequencies; the optimizer keeps fp32 main weights
    cast(model, run_dtype(cfg.train.precision))
    model.to(device)
    for name, module_infra in infra.local.items():
        module = module_of(model, name)
        if name in settings:          # in its dtype and on its device: what transformers checks
            modality = settings[name].modality
            tower = module.encoders[modality].encoder.model
            tower.set_attn_implementation(attention.encoders)
            if settings[name].spec.recompute == "full":
                recompute_tower(tower, name)
        # a frozen part's weights, and those of a part under LoRA but for its adapters
        fixed = [found[name] or "" for found in (frozen_parts, adapted) if name in found]
        for key, parameter in module.named_parameters():
            frozen = any(key.startswith(prefix) for prefix in fixed)
            parameter.requires_grad_(is_adapter(key) or trainable(parameter, frozen))
        if name not in cfg.model.freeze and not any(p.requires_grad for p in module.parameters()):
            raise TrainConfigError(f"model.freeze leaves module {name!r} nothing to train: "
                                   f"freeze the whole module ({name})")
        # encoders: the language model's config without its own memory settings
        config = transformer if name == LANGUAGE else encoder_transformer_config
        replace_module(model, name, DistributedDataParallel(
            config, ddp_config(cfg, name), module, pg_collection=module_infra.pgs))
    return model


def memory_summary(cfg: TrainConfig, layout) -> str:
    """The memory settings of each module of ``layout``, for the start-up line, e.g.
    ``language: distributed optimizer, recompute full, sequence parallel; image: recompute
    full; audio: -``."""
    parts = []
    for module in layout.modules:
        own = cfg.optimizer.of(module.name)
        recompute = cfg.model.language.recompute if module.name == LANGUAGE else \
            (cfg.model.encoders.get(module.name) or EncoderConfig()).recompute
        settings = [*(["distributed optimizer"] if own.distributed else []),
                    *([f"recompute {recompute}"] if recompute != "none" else []),
                    *(["sequence parallel"] if module.name == LANGUAGE
                      and cfg.model.language.sequence_parallel else []),
                    *(["overlapped grad reduce" + (f" (buckets of {own.bucket_size})"
                                                   if own.bucket_size else "")]
                      if own.overlap_grad_reduce else [])]
        parts.append(f"{module.name}: {', '.join(settings) or '-'}")
    return "; ".join(parts)


def recompute_tower(tower, module: str) -> None:
    """transformers' gradient checkpointing on an encoder module's tower (non-reentrant:
    the recomputed layers' weights get their gradients through megatron-core DDP's hooks)."""
    if not getattr(tower, "supports_gradient_checkpointing", False):
        raise TrainConfigError(f"model.encoders.{module}.recompute is full, but its "
                               f"{type(tower).__name__} does not support transformers' "
                               "gradient checkpointing: set recompute: none")
    kwargs = {"use_reentrant": False}
    if hasattr(tower, "activation_checkpointing_enable"):        # transformers >= 5.2x
        tower.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        tower.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _adapt(model, cfg: TrainConfig, infra: Infra, frozen: dict) -> dict[str, str]:
    """Put ``model.lora``'s adapters on this rank's modules; module name -> the prefix of the
    parameters that adapters replace in training (their part's, "": the whole module)."""
    adapted: dict[str, str] = {}
    for part in parts(cfg.model.lora, infra.layout, cfg.model.language.num_layers):
        clash = part.module in frozen and (frozen[part.module] in (None, part.prefix)
                                           or not part.prefix)
        if clash:
            raise TrainConfigError(
                f"model.lora adapts {part.name!r}, which model.freeze freezes: LoRA already "
                "keeps the part's own weights fixed; drop it from model.freeze")
        if part.module not in infra.local:
            continue
        add_adapters(module_of(model, part.module), part, cfg.train.seed,
                     layer_offset(infra, part.module, cfg.model.language.num_layers))
        adapted[part.module] = part.prefix if part.module not in adapted else ""
    return adapted


# model.freeze's parts of an encoder module -> the prefix of their parameter names
_PARTS = {"encoder": "encoders.", "projection": "input_projections."}


def _frozen_parts(freeze: list, infra: Infra) -> dict:
    """module name -> the prefix of its frozen parameters (None: all of them; absent: none)
    from ``model.freeze``'s entries: a module, or an encoder module's ``encoder`` or
    ``projection`` (``image.encoder``: the tower frozen, its projection trained)."""
    parts: dict = {}
    for entry in freeze:
        name, _, part = entry.partition(".")
        if name not in infra.modules or (part and (part not in _PARTS or name == LANGUAGE)):
            raise TrainConfigError(
                f"model.freeze names {entry!r}, not a module of the layout {infra.layout} nor "
                f"an encoder module's part: use one of {list(infra.modules)}, or "
                f"<module>.encoder / <module>.projection for an encoder module")
        if name in parts and (not part or parts[name] != _PARTS[part]):
            raise TrainConfigError(f"model.freeze names {name!r} twice: freeze the module "
                                   f"({name}) or one of its parts")
        parts[name] = _PARTS[part] if part else None
    return parts


def check_deepstack(cfg: TrainConfig, layout, settings: dict[str, EncoderSetting]) -> None:
    """``TrainConfigError`` where an encoder with deepstack features (``mcore.deepstack``)
    meets what cannot carry them: a projection (the rows are main + deepstack columns),
    context parallelism (not split as the embeddings are), or the language model's full
    recompute (a recomputed layer adds rows that are no input of its checkpoint: their
    gradient would run twice through the tower, or, under pipeline stages, be the next
    micro-batch's)."""
    deep = [name for name, setting in settings.items() if ENCODERS[setting.kind].deepstack]
    if not deep:
        return
    lm, language = cfg.model.language, layout.language
    problems = [what for what, bad in (
        (f"model.projection {cfg.model.projection} (the tower's rows hold its deepstack "
         "features beside the main ones: projection none)", cfg.model.projection != "none"),
        (f"language cp{language.cp}", language.cp > 1),
        ("model.language.recompute full (use selective)", lm.recompute == "full"))
        if bad]
    if problems:
        raise TrainConfigError(f"encoder module(s) {deep} add deepstack features to the "
                               f"language model's first layers, which does not work with "
                               f"{'; '.join(problems)}: drop it")


def check_experts(cfg: TrainConfig, layout) -> None:
    """``TrainConfigError`` for a mixture-of-experts language model under tensor parallelism
    without sequence parallelism (megatron-core's MoE layer refuses to train so), and for
    LoRA on it (adapters would wrap each expert's layers, which the export does not map)."""
    pretrained = cfg.model.language.pretrained
    if not pretrained or not language_arch(pretrained, weights=False).experts:
        return
    if layout.language.tp > 1 and not cfg.model.language.sequence_parallel:
        raise TrainConfigError(
            f"model.language.pretrained {pretrained} is a mixture of experts, which "
            f"megatron-core trains under tensor parallelism (the layout's language "
            f"tp{layout.language.tp}) only with sequence parallelism: set "
            "model.language.sequence_parallel=true (not with data.packing), or tp1")
    adapted = [p.name for p in parts(cfg.model.lora, layout, cfg.model.language.num_layers)
               if p.module == LANGUAGE]
    if adapted:
        raise TrainConfigError(f"model.lora adapts {adapted}, a mixture-of-experts language "
                               "model: adapters on its layers (its experts' among them) are "
                               "not supported yet; adapt the tower (<module>.encoder) or train "
                               "the language model whole")


def check_positions(cfg: TrainConfig, preprocess) -> None:
    """``TrainConfigError`` unless the preprocessing's position ids are what the language
    model's rotary embedding takes (M-RoPE ids for ``mrope_section``)."""
    mrope = cfg.model.language.mrope_section is not None
    if mrope != (preprocess.positions == "mrope"):
        raise TrainConfigError(
            f"the preprocessing config ({cfg.data.preprocess}) has positions: "
            f"{preprocess.positions}, but model.language " +
            ("has an mrope_section: set positions: mrope there" if mrope else
             "has no mrope_section: set model.language.mrope_section (three counts of "
             "rotary pairs) or positions: sequential"))


def language_model_params(cfg: TrainConfig, infra: Infra, transformer, vocab: int,
                          max_sequence_length: int, backend: str) -> dict:
    """``_SeededGPTModel`` arguments of this rank's language model (random init or the
    architecture of ``model.language.pretrained``), its core attention ``backend``."""
    role = infra.role
    language = role.module(LANGUAGE) if any(p.name == LANGUAGE for p in role.modules) else None
    pretrained = cfg.model.language.pretrained
    arch = language_arch(pretrained) if pretrained else None
    gpt = dict(gpt_fields(arch) if arch else dict(position_embedding_type="rope",
                                                  share_embeddings_and_output_weights=False))
    if cfg.model.language.mrope_section:
        gpt["position_embedding_type"] = "mrope"
    layer_spec = get_gpt_layer_local_spec(
        num_experts=arch.experts or None, moe_grouped_gemm=False, normalization="RMSNorm",
        qk_layernorm=arch.qk_norm) if arch else get_gpt_layer_local_spec()
    layer_spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
        module=CoreAttention, params=dict(backend=backend))
    return dict(
        seed=_module_seed(cfg.train.seed, LANGUAGE), packed_rows=backend != "local",
        mrope_interleaved=bool(arch and arch.mrope_interleaved),
        config=transformer,
        transformer_layer_spec=block_spec(layer_spec, transformer), vocab_size=vocab,
        max_sequence_length=max_sequence_length,
        **gpt,
        # MimoModel scatters the spliced embeddings over the TP ranks itself (sequence
        # parallel); the embedding layer must not scatter the text's first
        scatter_embedding_sequence_parallel=False,
        pre_process=language is None or language.first_stage,
        post_process=language is None or language.last_stage,
        pg_collection=infra.modules[LANGUAGE].pgs)


def load_language_weights(language_model, cfg: TrainConfig, infra: Infra, vocab: int) -> None:
    """Load this rank's part of ``model.language.pretrained`` into the built (not yet
    DDP-wrapped) language model; a checkpoint loaded later (resume, init_from) replaces it."""
    path = cfg.model.language.pretrained
    assert path is not None
    part = infra.role.module(LANGUAGE)
    load_pretrained_language(
        language_model, path, language_arch(path), tp_rank=part.tp_rank,
        tp_size=part.module.tp, vocab_size=vocab,
        layer_offset=layer_offset(infra, LANGUAGE, cfg.model.language.num_layers))


def _projector(cfg: TrainConfig, spec: EncoderConfig) -> dict | None:
    """The whole VLM's projector weights for the projection after its tower (None: none, or
    not the VLM's tower)."""
    if not cfg.model.pretrained or spec.pretrained != cfg.model.pretrained:
        return None
    return read_vlm(cfg.model.pretrained).projector()


def _encoder_output_size(spec: EncoderConfig, name: str, kind: str) -> int:
    if spec.pretrained is None:
        return spec.hidden_size
    from transformers import AutoConfig
    try:
        config = AutoConfig.from_pretrained(spec.pretrained)
    except (OSError, ValueError) as error:
        raise TrainConfigError(
            f"model.encoders.{name}.pretrained is {spec.pretrained!r}, from which transformers "
            f"cannot read a model config ({error}): give a model directory holding config.json "
            "(or a hub name already in the local cache), or unset it for a random init"
        ) from None
    return ENCODERS[kind].pretrained_output_size(config)
