"""The families by encoder kind and checkpoint ``model_type``, and resolving checkpoints to them:
``read_vlm`` and ``language_arch`` read a checkpoint's config into what mimo takes from it (or
refuse it with the reason), ``resolve`` fills a training config's model dims from the
checkpoints it names, ``encoder_settings`` decides each encoder module's modality, kind and
checkpoint and ``vocab_size`` the language model's rows (what ``model.build`` builds and
``planning.dims`` counts), ``build_encoder`` builds an encoder module, ``preprocessing_for``
writes the preprocessing config a whole VLM expects. Family modules never import this module.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache
from typing import Any, NamedTuple

from mimo_data.loading.layout import Layout
from mimo_train.config import LANGUAGE_DEFAULTS, EncoderConfig, LanguageConfig, TrainConfig
from mimo_train.errors import EncoderBuildError, TrainConfigError
from mimo_train.families import (causal_lm, llava, qwen2_5_vl, qwen2_vl, qwen3_vl, siglip,
                                 whisper)
from mimo_train.families.base import VLM, Encoder, input_form, model_directory
from mimo_train.families.causal_lm import LanguageArch

# encoder kind -> its class
ENCODERS: dict[str, type[Encoder]] = {
    "qwen2_vl": qwen2_vl.Qwen2VLVision, "qwen2_5_vl": qwen2_5_vl.Qwen2_5VLVision,
    "qwen3_vl": qwen3_vl.Qwen3VLVision, "qwen3_vl_moe": qwen3_vl.Qwen3VLMoeVision,
    "siglip": siglip.SiglipVision, "whisper": whisper.WhisperAudio,
    "llava": llava.LlavaVision}
# encoder kind for each input form, without a whole VLM
DEFAULT_KINDS = {("image", "dynamic"): "qwen2_vl", ("image", "fixed"): "siglip",
                 ("audio", "log-mel"): "whisper"}
# the modalities an encoder takes on its own (the others ride along: ``Encoder.also_takes``)
OWN_MODALITIES = tuple(dict.fromkeys(modality for modality, _ in DEFAULT_KINDS))
# whole VLM model_type -> its family module (``read``, ``image_geometry``)
VLMS = {"qwen2_vl": qwen2_vl, "qwen2_5_vl": qwen2_5_vl, "qwen3_vl": qwen3_vl,
        "qwen3_vl_moe": qwen3_vl, "llava": llava}
# model_type -> why mimo does not take it
REFUSED = {
    "qwen3_5": "Qwen3.5's language model interleaves gated delta-net (linear attention) "
               "layers with full attention; megatron-core runs them only with "
               "flash-linear-attention's Triton kernels, which need a CUDA GPU, and mimo does "
               "not map them yet",
    "qwen3_5_moe": "Qwen3.5's language model interleaves gated delta-net (linear attention) "
                   "layers, which megatron-core runs only with flash-linear-attention's Triton "
                   "kernels on a CUDA GPU, and its experts are not mapped yet",
    "llava_next": "LLaVA-NeXT tiles images at any resolution (any-res), which mimo's image "
                  "preprocessing does not produce",
    "llava_onevision": "LLaVA-OneVision tiles images at any resolution (any-res), which mimo's "
                       "image preprocessing does not produce",
}


def build_encoder(kind: str, modality_config, hidden_size: int, num_layers: int,
                  num_attention_heads: int, pretrained: str | None) -> Encoder:
    """The encoder class named by ``kind``, in fp32; ``pretrained`` a model directory (or
    cached hub name), a whole VLM's among them (the encoder then gets its ``VLM``)."""
    if kind not in ENCODERS:
        raise EncoderBuildError(f"encoder kind {kind!r} is unknown: use one of {sorted(ENCODERS)}")
    source: str | VLM | None = pretrained
    if pretrained and _model_type(pretrained, "model.encoders.*.pretrained") in VLMS:
        source = read_vlm(pretrained)
    return ENCODERS[kind](modality_config, hidden_size, num_layers, num_attention_heads,
                          source)


def default_kind(modality: str, modality_config) -> str:
    """Encoder kind that consumes this modality's preprocessing output."""
    return DEFAULT_KINDS[input_form(modality, modality_config)]


def vocab_size(cfg: TrainConfig, tokenizer_size: int) -> int:
    """The language model's embedding and output rows (before ``vocab_rows``): the config's
    ``model.language.vocab_size``, else the tokenizer's vocabulary (a pretrained checkpoint's,
    when larger) padded to ``model.language.vocab_multiple`` as megatron-core pads it. The
    same rows under every layout, so a checkpoint loads under any TP size; a pretrained
    model's rows past its vocabulary never enter a softmax (``predicted_vocabulary``)."""
    lm = cfg.model.language
    needed = predicted_vocabulary(cfg, tokenizer_size) or tokenizer_size
    if lm.vocab_size is None:
        return -(-needed // lm.vocab_multiple) * lm.vocab_multiple
    if lm.vocab_size < tokenizer_size:
        raise TrainConfigError(f"model.language.vocab_size {lm.vocab_size} is smaller than the "
                               f"tokenizer's {tokenizer_size} tokens (modality tokens included):"
                               f" token ids would index past the embedding; set it >= "
                               f"{tokenizer_size} or leave it unset")
    if lm.vocab_size < needed:
        raise TrainConfigError(f"model.language.vocab_size {lm.vocab_size} is smaller than the "
                               f"vocabulary of model.language.pretrained ({needed}): set it >= "
                               f"{needed} or leave it unset")
    return lm.vocab_size


def predicted_vocabulary(cfg: TrainConfig, tokenizer_size: int) -> int | None:
    """The entries a pretrained language model predicts: its checkpoint's vocabulary, or the
    tokenizer's when larger; rows past it (``model.language.vocab_size``, TP padding) never
    enter a softmax. None for a model trained from scratch: all its rows are its own."""
    pretrained = cfg.model.language.pretrained
    if not pretrained:
        return None
    return max(tokenizer_size, language_arch(pretrained, weights=False).vocab_size)


def vocab_rows(rows: int, tp: int) -> int:
    """The embedding and output rows split over ``tp`` ranks: ``rows`` padded up to a multiple
    of ``tp`` (megatron-core splits them evenly; a TP size dividing ``vocab_multiple`` adds
    none)."""
    return -(-rows // tp) * tp


class EncoderSetting(NamedTuple):
    """What an encoder module is built from."""
    modality: str                  # the modality its encoder ``takes``
    config: Any                    # that modality's preprocessing config
    spec: EncoderConfig            # a whole VLM's tower: its kind and pretrained filled in
    kind: str
    also: dict[str, Any]           # further modalities it serves (``Encoder.also_takes``)


def encoder_settings(cfg: TrainConfig, layout: Layout, preprocess) -> dict[str, EncoderSetting]:
    """module name -> its ``EncoderSetting``, validated: what ``model.build`` builds and
    ``planning.dims`` counts."""
    settings = {}
    unknown = sorted(set(cfg.model.encoders) - {m.name for m in layout.encoders})
    if unknown:
        raise TrainConfigError(f"model.encoders has {unknown}, which the layout {layout} does "
                               "not name: rename them to the layout's encoder modules")
    for module in layout.encoders:
        served = layout.modalities_of(module.name)
        for modality in served:
            if modality not in preprocess.modalities:
                raise TrainConfigError(
                    f"layout module {module.name!r} serves {modality}, which the "
                    "preprocessing config does not expand: add "
                    f"modalities.{modality} to it or drop the module")
        for dim in ("tp", "cp", "pp"):
            if getattr(module, dim) != 1:
                raise TrainConfigError(
                    f"encoder module {module.name!r} has {dim} {getattr(module, dim)}: the "
                    "transformers encoders run whole on each rank; use dp only for encoders")
        spec = cfg.model.encoders.get(module.name) or EncoderConfig()
        own = [m for m in served if m in OWN_MODALITIES]
        if len(own) > 1:
            raise TrainConfigError(f"encoder module {module.name!r} serves {own}: give each "
                                   "its own encoder module")
        if not own:
            raise TrainConfigError(
                f"encoder module {module.name!r} serves {served}, which no encoder takes on "
                "its own: serve them from the module of an encoder that also takes them (the "
                "Qwen2-VL towers take video beside images: image=dp1,video)")
        modality = own[0]
        modality_config = preprocess.modalities[modality]
        form = input_form(modality, modality_config)
        if modality == "image" and cfg.model.pretrained and spec.pretrained is None:
            vlm = read_vlm(cfg.model.pretrained)       # the whole VLM's tower
            if spec.kind not in (None, vlm.encoder_kind):
                raise TrainConfigError(
                    f"model.encoders.{module.name}.kind is {spec.kind!r}, but the tower of "
                    f"model.pretrained {vlm.path} is a {vlm.encoder_kind}: drop the key")
            if ENCODERS[vlm.encoder_kind].takes != form:
                raise TrainConfigError(
                    f"model.pretrained {vlm.path} has a {vlm.encoder_kind} vision tower, which "
                    f"takes {ENCODERS[vlm.encoder_kind].takes[1]} images, but the "
                    f"preprocessing config gives {form[1]} ones: use its image geometry "
                    f"(policy: {ENCODERS[vlm.encoder_kind].takes[1]})")
            spec = dataclasses.replace(spec, kind=vlm.encoder_kind, pretrained=vlm.path)
        kind = spec.kind or default_kind(modality, modality_config)
        if kind not in ENCODERS or ENCODERS[kind].takes != form:
            raise TrainConfigError(
                f"model.encoders.{module.name}.kind is {kind!r}, but the preprocessing config "
                f"gives {form[1]} {modality} inputs, for "
                f"{default_kind(modality, modality_config)!r}")
        also = [m for m in served if m != modality]
        refused = [m for m in also if m not in ENCODERS[kind].also_takes]
        if refused:
            raise TrainConfigError(
                f"encoder module {module.name!r} serves {served}, but its {kind} encoder "
                f"encodes {[modality, *ENCODERS[kind].also_takes]} only: give {refused} "
                "their own encoder module")
        settings[module.name] = EncoderSetting(modality, modality_config, spec, kind,
                                               {m: preprocess.modalities[m] for m in also})
    return settings


@lru_cache(maxsize=8)
def read_vlm(path: str) -> VLM:
    """The whole VLM at ``path`` (directory or cached hub name), or ``TrainConfigError``
    naming why mimo cannot take it."""
    config = checkpoint_config(path, "model.pretrained")
    family = config.model_type
    if family in REFUSED:
        raise TrainConfigError(f"model.pretrained {path} is a {family!r} model: {REFUSED[family]}")
    if family not in VLMS:
        raise TrainConfigError(f"model.pretrained {path} is a {family!r} model, not a whole "
                               f"vision-language model mimo takes ({', '.join(VLMS)}); give "
                               "the language model as model.language.pretrained and each "
                               "encoder as model.encoders.<module>.pretrained instead")
    return VLMS[family].read(config, path)


def preprocessing_for(path: str) -> dict:
    """The preprocessing config (as YAML data) that writes images (and videos) as the whole
    VLM at ``path`` expects: its tokenizer (and chat template), image and video tokens and
    wrap tokens, positions, its image processor's geometry, pixel budgets and normalization,
    and its video processor's frame sampling where it has one."""
    import copy
    import json
    import os

    from transformers import AutoTokenizer
    vlm = read_vlm(path)
    directory = model_directory(path)
    processor = os.path.join(directory, "preprocessor_config.json")
    if not os.path.isfile(processor):
        raise TrainConfigError(f"{path} holds no preprocessor_config.json: the image "
                               "processor's settings cannot be read; write the preprocessing "
                               "config by hand")
    config = checkpoint_config(path, "model.pretrained")
    family = VLMS[vlm.family]
    with open(processor) as f:
        image_processor = json.load(f)
    geometry = family.image_geometry(config, image_processor)
    tokenizer = AutoTokenizer.from_pretrained(path)
    wrap = {"wrap": tokenizer.convert_ids_to_tokens(list(vlm.image_wrap_ids))
            } if vlm.image_wrap_ids else {}
    modalities = {"image": {"token": tokenizer.convert_ids_to_tokens(vlm.image_token_id),
                            **wrap, **geometry}}
    if vlm.video_token_id is not None:
        # the video processor's own settings where the checkpoint saves them
        video_processor = os.path.join(directory, "video_preprocessor_config.json")
        if os.path.isfile(video_processor):
            with open(video_processor) as f:
                image_processor = json.load(f)
        modalities["video"] = copy.deepcopy(   # no YAML anchors shared with the image's
            {"token": tokenizer.convert_ids_to_tokens(vlm.video_token_id), **wrap,
             **family.video_settings(config, image_processor)})
    return {"tokenizer": os.path.abspath(path) if os.path.isdir(path) else path,
            "mode": "chat", "positions": vlm.positions, "modalities": modalities}


@lru_cache(maxsize=16)
def checkpoint_config(path: str, key: str):
    """transformers' config of the checkpoint at ``path`` (directory or cached hub name), or
    ``TrainConfigError`` naming ``key``."""
    from transformers import AutoConfig
    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as error:
        raise TrainConfigError(
            f"{key} is {path!r}, from which transformers cannot read a model config ({error}): "
            "give a model directory holding config.json (or a hub name already in the local "
            "cache)") from None


def _model_type(path: str, key: str) -> str:
    return checkpoint_config(path, key).model_type


def language_arch(path: str, key: str = "model.language.pretrained",
                  weights: bool = True) -> LanguageArch:
    """The architecture of the language model at ``path``: a causal LM's, or a whole VLM's
    language model (``read_vlm`` says where its weights sit; ``weights=False``: the dims from
    ``config.json`` alone, where the weights sit not read)."""
    config = checkpoint_config(path, key)
    vlm = read_vlm(path) if getattr(config, "text_config", None) is not None else None
    return causal_lm.read_architecture(path, key, vlm, weights)


def resolve(cfg: TrainConfig) -> TrainConfig:
    """Fill ``cfg``'s model from the checkpoints it names (in place; returns it): a whole VLM
    (``model.pretrained``) gives the language model and the projection kind; the language
    model's dims and M-RoPE section come from its checkpoint (a dim also set in the config must
    agree), else from the defaults. Reads checkpoint configs only, no weights; idempotent."""
    model = cfg.model
    projection = "linear"
    if model.pretrained is not None:
        vlm = read_vlm(model.pretrained)
        if model.language.pretrained not in (None, model.pretrained):
            raise TrainConfigError(
                f"model.pretrained is {model.pretrained} and model.language.pretrained "
                f"{model.language.pretrained}: the whole VLM brings its language model; drop "
                "one of the two")
        model.language.pretrained = model.pretrained
        projection = vlm.projection
    if model.projection is None:
        model.projection = projection
    _resolve_language(model.language)
    return cfg


def _resolve_language(language: LanguageConfig) -> None:
    if language.pretrained is None:
        for name, default in LANGUAGE_DEFAULTS.items():
            if getattr(language, name) is None:
                setattr(language, name, default)
        assert language.hidden_size and language.num_attention_heads    # the defaults, at least
        language.check_mrope(language.hidden_size // language.num_attention_heads)
        return
    arch = language_arch(language.pretrained, weights=False)
    for name in (*LANGUAGE_DEFAULTS, "ffn_hidden_size"):
        given, actual = getattr(language, name), getattr(arch, name)
        if given is not None and given != actual:
            raise TrainConfigError(
                f"model.language.{name} is {given}, but model.language.pretrained "
                f"{language.pretrained} has {name} {actual}: drop the key or make them agree")
        setattr(language, name, actual)
    if arch.mrope_section is not None:
        if language.mrope_section is not None and \
                list(language.mrope_section) != list(arch.mrope_section):
            raise TrainConfigError(
                f"model.language.mrope_section is {language.mrope_section}, but "
                f"model.language.pretrained {language.pretrained} has "
                f"{list(arch.mrope_section)}: drop the key or make them agree")
        language.mrope_section = list(arch.mrope_section)
    language.check_mrope(arch.kv_channels)
