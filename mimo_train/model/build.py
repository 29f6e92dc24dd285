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
from mimo_data.modalities.base import to_device
from mimo_data.preprocess.preprocessor import IGNORE_INDEX
from mimo_train.config import OptimizerConfig
from mimo_train.errors import TrainConfigError
from mimo_train.families.base import Projection
from mimo_train.families.causal_lm import gpt_fields, load_pretrained_language, transformer_fields
from mimo_train.families.registry import build_encoder, language_arch
from mimo_train.mcore.attention import AttentionChoice, LanguageModel
from mimo_train.mcore.bridge_routing import RoutedMimoModel
from mimo_train.mcore.language_loss import HostLabels, language_loss
from mimo_train.mcore.context_parallel import SequenceShards
from mimo_train.mcore.grids import Infra
from mimo_train.mcore.layer_specs import language_block_spec
from mimo_train.model.lora import add_adapters, is_adapter
from mimo_train.model.parts import layer_offset, module_of, replace_module
from mimo_train.model.tower_attention import set_attention
from mimo_train.model.tower_fusions import fuse
from mimo_train.plan import RunPlan
from mimo_train.plan.lora_targets import check_plan_targets
from mimo_train.planning.adapters import check_run_targets
from mimo_train.plan.encoders import EncoderSetting
from mimo_train.plan.language import LanguagePlan, Vocabulary, vocab_rows
from mimo_train.mcore import (AudioModalitySubmodules, DistributedDataParallel,
                              DistributedDataParallelConfig, MimoModelConfig, ModelType, ModuleSpec,
                              TransformerConfig, VisionModalitySubmodules, wgrad_fusion)
from mimo_train.precision import cast, run_dtype, trainable

# megatron-core's submodule class of each modality an encoder takes on its own
# (registry.OWN_MODALITIES; how it splices embeddings in)
_SUBMODULES = {"image": VisionModalitySubmodules, "audio": AudioModalitySubmodules}

def language_transformer_config(plan: RunPlan, device: torch.device | None = None):
    """megatron-core's ``TransformerConfig`` of the language model: the checkpoint's numerics
    (RMSNorm, SwiGLU, GQA, ...) or the config's dims, the layout's parallelism, the run's
    precision and memory settings; trained on ``device``, its linear layers' weight gradients
    made into their fp32 buffers (``mcore.wgrad_fusion``) where the device runs that."""
    lm, language = plan.language, plan.layout.language
    precision = plan.config.train.precision
    dtype = run_dtype(precision)
    dims: dict = dict(num_layers=lm.num_layers, hidden_size=lm.hidden_size,
                      num_attention_heads=lm.num_attention_heads,
                      ffn_hidden_size=lm.ffn_hidden_size)
    if lm.arch is not None:
        dims = transformer_fields(lm.arch)
    # megatron-core's fused SwiGLU (fusions/fused_bias_swiglu.py): keeps the first MLP
    # matmul's output alone for the backward pass and computes the same (compiled on a GPU,
    # as written on the CPU: cpu_compat); its fused GELU is the tanh approximation, not the
    # erf GELU the unfused path computes, so a GELU MLP stays unfused
    swiglu = dims.get("gated_linear_unit", False) and \
        dims.get("activation_func") is torch.nn.functional.silu
    return TransformerConfig(
        **dims, mrope_section=list(lm.mrope_section) if lm.mrope_section else None,
        tensor_model_parallel_size=language.tp, pipeline_model_parallel_size=language.pp,
        context_parallel_size=language.cp, expert_model_parallel_size=language.ep,
        expert_tensor_parallel_size=language.expert_tp, use_cpu_initialization=True,
        perform_initialization=True, bf16=precision == "bf16", params_dtype=dtype,
        pipeline_dtype=dtype,
        # per-token loss: the loss function returns (sum, tokens); gradients are divided by the
        # global token count (step.finalize_grads), never by DP size
        calculate_per_token_loss=True,
        # MIMO sequences vary in length between modules and micro-batches; megatron-core then
        # needs the all-to-all MoE dispatcher even without experts
        variable_seq_lengths=True, moe_token_dispatcher_type="alltoall",
        attention_dropout=0.0, hidden_dropout=0.0,
        gradient_accumulation_fusion=device is not None and wgrad_fusion.supported(device),
        bias_activation_fusion=swiglu,
        masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        **language_memory(lm))


# model.language.recompute -> megatron-core's TransformerConfig fields: selective recomputes
# the core attention (the s x s scores, softmax and dropout) in the backward pass; full keeps
# each layer's input and recomputes the whole layer (uniform method, one layer per checkpoint)
_RECOMPUTE: dict[str, dict[str, Any]] = {"none": {},
              "selective": dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
              "full": dict(recompute_granularity="full", recompute_method="uniform",
                           recompute_num_layers=1)}


_LANGUAGE_PARALLELISM = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                         "context_parallel_size", "expert_model_parallel_size",
                         "expert_tensor_parallel_size")


def language_memory(language: LanguagePlan) -> dict:
    """The language model's memory settings as ``TransformerConfig`` fields
    (``model.language.recompute`` and ``sequence_parallel``; ``plan.rules`` refuses what the
    layout cannot take)."""
    return dict(_RECOMPUTE[language.recompute], sequence_parallel=language.sequence_parallel)


def ddp_config(optimizer: OptimizerConfig) -> DistributedDataParallelConfig:
    """megatron-core's DDP settings of a module from its optimizer settings
    (``optimizer.distributed``, ``overlap_grad_reduce``, ``bucket_size``, each settable per
    module). Gradients are reduced in fp32 whatever the weights' dtype. The overlapped
    reduction runs on the CPU too: gloo's asynchronous collectives, started from the backward
    hooks, and ``cpu_compat``'s streams that never wait (CPU work is in order)."""
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=optimizer.distributed,
        overlap_grad_reduce=optimizer.overlap_grad_reduce, bucket_size=optimizer.bucket_size)


def shared_placeholders(plan: RunPlan, special_token_ids: dict[str, int]
                        ) -> dict[str, dict[str, int]]:
    """Per encoder module serving several modalities, ``{modality: placeholder token id}``,
    its encoder's modality first (``step.model_inputs``)."""
    return {name: {m: special_token_ids[m] for m in (setting.modality, *setting.also)}
            for name, setting in plan.encoders.items() if setting.also}


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
        self.encoder = build_encoder(setting.kind, setting.config, *setting.dims,
                                     setting.spec.pretrained)
        for modality, config in setting.also.items():
            self.encoder.take_also(modality, config)
        self.modalities = (setting.modality, *setting.also)
        # mcore.deepstack's empty rows: as wide as the tower's deepstack rows (none: the
        # module's rows after its projection, megatron-core's own)
        self.deepstack_width = self.encoder.row_width if self.encoder.deepstack else None

    def forward(self, placeholders: torch.Tensor | None = None, **inputs):
        if placeholders is None:
            return self.encoder(**inputs)
        present = [modality for modality in self.modalities if modality in inputs]
        encoded = self.encoder.encode_together({m: inputs[m] for m in present})
        # the order on the host, where the placeholders stay
        targets = torch.cat([torch.nonzero(placeholders == self.modalities.index(m)).squeeze(1)
                             for m in present])
        return encoded[to_device(torch.argsort(targets).cpu(), encoded.device)]


class _SeededGPTModel(LanguageModel):
    """GPTModel built right after seeding the RNG, as ``_SeededEncoder`` (same weights with
    or without encoders on the rank), each layer from its own seed (``language_block_spec``:
    the same weights however the pipeline splits them). Its output
    rows past ``vocabulary`` (``predicted_vocabulary``) get a logit no softmax can weigh, so
    they never enter the loss nor come out of generation. Given labels, its loss is taken at
    the trained tokens only, ``loss_chunk_tokens`` of them at a time (0: all at once;
    ``mcore.language_loss``), as many as ``host_labels`` (set by the forward step) hold."""

    def __init__(self, *, seed: int, vocabulary: int, loss_chunk_tokens: int = 0, **kwargs):
        torch.manual_seed(seed)
        super().__init__(**kwargs)
        self.vocabulary = vocabulary
        self.loss_chunk_tokens = loss_chunk_tokens
        self.host_labels = HostLabels()
        if self.post_process and self.vocab_size > vocabulary:
            self.output_layer.register_forward_hook(_mask_rows_past(vocabulary))

    def forward(self, *args, **kwargs):
        if self.post_process and kwargs.get("labels") is not None:
            kwargs["output_processor"] = self._trained_tokens_loss
        return super().forward(*args, **kwargs)

    def _trained_tokens_loss(self, *, hidden_states, output_layer, output_weight, labels, **_):
        """megatron-core's ``output_processor``: the per-token loss in place of its
        ``output_layer`` + ``compute_language_model_loss``."""
        return language_loss(hidden_states, output_layer, output_weight, labels,
                             self.loss_chunk_tokens, self.vocabulary, IGNORE_INDEX,
                             self.host_labels.take(IGNORE_INDEX, self.cp_group))


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


def build_model(plan: RunPlan, infra: Infra, vocabulary: Vocabulary,
                special_token_ids: dict, device: torch.device, attention: AttentionChoice):
    """``MimoModel`` with this rank's modules DDP-wrapped (``build_optimizer`` makes its
    ``MimoOptimizer``)."""
    layout, seed = plan.layout, plan.config.train.seed
    # the LoRA targets, before any weight is read (the trainer's config phase checked the
    # language model's: a run built from a plan in code, a tool's, is checked here)
    check_plan_targets(plan.adapted, plan.language)
    check_run_targets(plan)
    transformer = language_transformer_config(plan, device)
    # the encoders' DDP config: the language model's without its memory settings and
    # parallelism (megatron-core warns of experts under tp without sequence parallelism)
    encoder_transformer_config = dataclasses.replace(transformer, **{
        key: next(f.default for f in dataclasses.fields(TransformerConfig) if f.name == key)
        for key in [*language_memory(plan.language), *_LANGUAGE_PARALLELISM]})
    modality_specs, token_ids = {}, {}
    for name, setting in plan.encoders.items():
        modality_specs[name] = ModuleSpec(
            module=_SUBMODULES[setting.modality],
            params=dict(pg_collection=infra.modules[name].pgs),
            submodules=dict(
                encoders={setting.modality: ModuleSpec(
                    module=_SeededEncoder, params=dict(seed=seed, name=name, setting=setting))},
                input_projections=[ModuleSpec(module=Projection, params=dict(
                    in_features=setting.output_size, out_features=plan.language.hidden_size,
                    kind=setting.projection, initial=_projector(plan, setting)))]))
        # the module's placeholders (a module serving several modalities: its first one's,
        # step.model_inputs rewrites the others' to it)
        token_ids[name] = special_token_ids[setting.modality]
    vocab = vocab_rows(vocabulary.rows, layout.language.tp)
    language_spec = ModuleSpec(module=_SeededGPTModel, params=dict(
        vocabulary=vocabulary.predicted or vocab, **language_model_params(
            plan, infra, transformer, vocab, attention.language)))
    model = RoutedMimoModel(MimoModelConfig(
        language_model_spec=language_spec, modality_submodules_spec=modality_specs,
        special_token_ids=token_ids, module_to_grid_map=infra.grids),
        # sequence and context parallel: MimoModel splits the spliced embeddings over the
        # language TP and CP groups (context parallel: mcore.context_parallel's cut)
        **(dict(tp_group=infra.modules[LANGUAGE].pgs.tp, cp_group=infra.modules[LANGUAGE].pgs.cp)
           if (transformer.sequence_parallel or transformer.context_parallel_size > 1)
           and LANGUAGE in infra.local else {}))
    if model.partition_adapter is not None and transformer.context_parallel_size > 1:
        model.partition_adapter = SequenceShards(model.partition_adapter.cfg)
    model.model_type = ModelType.encoder_or_decoder
    if plan.language.pretrained and LANGUAGE in infra.local:
        load_language_weights(model.language_model, plan.language, infra, vocab)
    adapted = _adapt(model, plan, infra)
    # every weight in the run's dtype, as megatron-core's Float16Module would cast it (norms
    # included) but for the rotary frequencies; the optimizer keeps fp32 main weights
    cast(model, run_dtype(plan.config.train.precision))
    model.to(device)
    frozen_modules = {p.module for p in plan.frozen if p.part is None}
    for name, module_infra in infra.local.items():
        module = module_of(model, name)
        if name in plan.encoders:     # in its dtype and on its device: what transformers checks
            modality = plan.encoders[name].modality
            encoder = module.encoders[modality].encoder
            tower = encoder.model
            served = set_attention(tower, attention.encoders, encoder.attends_by_boundaries)
            fuse(tower, served)
            if transformer.gradient_accumulation_fusion:
                wgrad_fusion.fuse_linears(module)   # the tower's and projection's linears
            if plan.modules[name].recompute == "full":
                recompute_tower(tower, name)
        # a frozen part's weights, and those of a part under LoRA but for its adapters
        fixed = [prefix for prefix in (plan.frozen_prefix(name), adapted.get(name))
                 if prefix is not None]
        for key, parameter in module.named_parameters():
            frozen = any(key.startswith(prefix) for prefix in fixed)
            parameter.requires_grad_(is_adapter(key) or trainable(parameter, frozen))
        if name not in frozen_modules and not any(p.requires_grad for p in module.parameters()):
            raise TrainConfigError(f"model.freeze leaves module {name!r} nothing to train: "
                                   f"freeze the whole module ({name})")
        # encoders: the language model's config without its memory settings and parallelism
        config = transformer if name == LANGUAGE else encoder_transformer_config
        replace_module(model, name, DistributedDataParallel(
            config, ddp_config(plan.modules[name].optimizer), module,
            pg_collection=module_infra.pgs))
    return model


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


def _adapt(model, plan: RunPlan, infra: Infra) -> dict[str, str]:
    """Put ``model.lora``'s adapters on this rank's modules; module name -> the prefix of the
    parameters that adapters replace in training (their part's, "": the whole module)."""
    adapted: dict[str, str] = {}
    for each in plan.adapted:
        module = each.part.module
        if module not in infra.local:
            continue
        add_adapters(module_of(model, module), each, plan.config.train.seed,
                     layer_offset(infra, module, plan.language.num_layers))
        adapted[module] = each.part.prefix if module not in adapted else ""
    return adapted


def language_model_params(plan: RunPlan, infra: Infra, transformer, vocab: int,
                          backend: str) -> dict:
    """``_SeededGPTModel`` arguments of this rank's language model (random init or the
    architecture of ``model.language.pretrained``), its core attention ``backend``."""
    role = infra.role
    language = role.module(LANGUAGE) if any(p.name == LANGUAGE for p in role.modules) else None
    arch = plan.language.arch
    gpt = dict(gpt_fields(arch) if arch else dict(position_embedding_type="rope",
                                                  share_embeddings_and_output_weights=False))
    if plan.language.mrope_section:
        gpt["position_embedding_type"] = "mrope"
    first_layer = language.pp_rank * (plan.language.num_layers // language.module.pp) \
        if language is not None else 0
    seed = _module_seed(plan.config.train.seed, LANGUAGE)
    block = language_block_spec(
        transformer, backend=backend, experts=arch.experts if arch else 0,
        qk_norm=bool(arch and arch.qk_norm), first_layer=first_layer, seed=seed,
        linear_layers=[arch.linear_layer(i) for i in range(arch.num_layers)] if arch else ())
    return dict(
        seed=seed, packed_rows=backend != "local",
        loss_chunk_tokens=plan.language.loss_chunk_tokens,
        mrope_interleaved=bool(arch and arch.mrope_interleaved),
        config=transformer,
        transformer_layer_spec=block, vocab_size=vocab,
        max_sequence_length=plan.preprocess.seq_length,
        **gpt,
        # MimoModel scatters the spliced embeddings over the TP ranks itself (sequence
        # parallel); the embedding layer must not scatter the text's first
        scatter_embedding_sequence_parallel=False,
        pre_process=language is None or language.first_stage,
        post_process=language is None or language.last_stage,
        pg_collection=infra.modules[LANGUAGE].pgs)


def load_language_weights(language_model, language: LanguagePlan, infra: Infra,
                          vocab: int) -> None:
    """Load this rank's part of the language model's checkpoint into the built (not yet
    DDP-wrapped) language model; a checkpoint loaded later (resume, init_from) replaces it."""
    path = language.pretrained
    assert path is not None
    part = infra.role.module(LANGUAGE)
    arch = language_arch(path)
    # expert parallelism: this rank's run of each layer's experts (megatron-core's
    # local_expert_indices), each cut over the expert tensor parallelism
    share = arch.experts // part.module.ep
    load_pretrained_language(
        language_model, path, arch, tp_rank=part.tp_rank,
        tp_size=part.module.tp, vocab_size=vocab,
        layer_offset=layer_offset(infra, LANGUAGE, language.num_layers),
        experts=range(part.ep_rank * share, (part.ep_rank + 1) * share) if arch.experts
        else None, expert_tp=(part.etp_rank, part.module.expert_tp))


def _projector(plan: RunPlan, setting: EncoderSetting) -> dict | None:
    """The whole VLM's projector weights for the projection after its tower (None: none, or
    not the VLM's tower)."""
    if plan.vlm is None or setting.spec.pretrained != plan.vlm.path:
        return None
    return plan.vlm.projector()
