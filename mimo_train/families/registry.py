"""The families by encoder kind and checkpoint ``model_type``, and resolving checkpoints to them:
``read_vlm`` and ``language_arch`` read a checkpoint's config into what mimo takes from it (or
refuse it with the reason), ``build_encoder`` builds an encoder module, ``preprocessing_for``
writes the preprocessing config a whole VLM expects (``mimo_train.plan`` resolves a training
config with them). Family modules never import this module.
"""

from __future__ import annotations

import dataclasses
import json
import os
from functools import lru_cache
from typing import Any

from mimo_data.errors import listed
from mimo_data.hub import not_cached
from mimo_data.preprocess import templates
from mimo_data.preprocess.config import looks_like_path
from mimo_train.checkpoint_folders import LATEST, META, step_of
from mimo_train.errors import CheckpointError, EncoderBuildError, TrainConfigError
from mimo_train.families import (causal_lm, llava, qwen2_5_vl, qwen2_vl, qwen3_5, qwen3_vl,
                                 siglip, whisper)
from mimo_train.families.base import (VLM, Encoder, input_form, model_directory,
                                      processor_settings)
from mimo_train.families.causal_lm import LanguageArch

# encoder kind -> its class
ENCODERS: dict[str, type[Encoder]] = {
    "qwen2_vl": qwen2_vl.Qwen2VLVision, "qwen2_5_vl": qwen2_5_vl.Qwen2_5VLVision,
    "qwen3_vl": qwen3_vl.Qwen3VLVision, "qwen3_vl_moe": qwen3_vl.Qwen3VLMoeVision,
    "qwen3_5": qwen3_5.Qwen3_5Vision, "qwen3_5_moe": qwen3_5.Qwen3_5MoeVision,
    "siglip": siglip.SiglipVision, "whisper": whisper.WhisperAudio,
    "llava": llava.LlavaVision}
# encoder kind for each input form, without a whole VLM
DEFAULT_KINDS = {("image", "dynamic"): "qwen2_vl", ("image", "fixed"): "siglip",
                 ("audio", "log-mel"): "whisper"}
# the modalities an encoder takes on its own (the others ride along: ``Encoder.also_takes``)
OWN_MODALITIES = tuple(dict.fromkeys(modality for modality, _ in DEFAULT_KINDS))
# whole VLM model_type -> its family module (``read``, ``image_geometry``)
VLMS = {"qwen2_vl": qwen2_vl, "qwen2_5_vl": qwen2_5_vl, "qwen3_vl": qwen3_vl,
        "qwen3_vl_moe": qwen3_vl, "qwen3_5": qwen3_5, "qwen3_5_moe": qwen3_5, "llava": llava}
# model_type -> why mimo does not take it
REFUSED = {
    "llava_next": "LLaVA-NeXT tiles images at any resolution (any-res), which mimo's image "
                  "preprocessing does not produce",
    "llava_onevision": "LLaVA-OneVision tiles images at any resolution (any-res), which mimo's "
                       "image preprocessing does not produce",
}


# model types of the original LLaVA repositories' checkpoints, which transformers reads once
# converted (its llava-hf conversions: convert_llava_weights_to_hf.py)
ORIGINAL_FORMATS = {
    kind: ("in the original LLaVA repository's format (liuhaotian/llava-v1.5-7b's model_type "
           f"{kind!r}), which transformers does not read: give its llava-hf conversion "
           "(llava-hf/llava-1.5-7b-hf for LLaVA-1.5; transformers' "
           "models/llava/convert_llava_weights_to_hf.py converts another)")
    for kind in ("llava_llama", "llava_mistral", "llava_mpt")}


def build_encoder(kind: str, modality_config, hidden_size: int, num_layers: int,
                  num_attention_heads: int, pretrained: str | None) -> Encoder:
    """The encoder class named by ``kind``, in fp32; ``pretrained`` a model directory (or
    cached hub name), a whole VLM's among them (the encoder then gets its ``VLM``)."""
    if kind not in ENCODERS:
        raise EncoderBuildError(f"encoder kind {kind!r} is unknown: use one of "
                                f"{listed(sorted(ENCODERS))}")
    source: str | VLM | None = pretrained
    if pretrained and _model_type(pretrained, "model.encoders.*.pretrained") in VLMS:
        source = read_vlm(pretrained, "model.encoders.*.pretrained")
    return ENCODERS[kind](modality_config, hidden_size, num_layers, num_attention_heads,
                          source)


def default_kind(modality: str, modality_config) -> str:
    """Encoder kind that consumes this modality's preprocessing output."""
    return DEFAULT_KINDS[input_form(modality, modality_config)]


@lru_cache(maxsize=8)
def read_vlm(path: str, key: str = "model.pretrained", tower: bool = True) -> VLM:
    """The whole VLM at ``path`` (directory or cached hub name), or ``TrainConfigError``
    naming why mimo cannot take it (as given by ``key``; ``tower``: its tower is built, so
    its config.json must give the tower's dims)."""
    config = checkpoint_config(path, key)
    family = config.model_type
    if family in REFUSED:
        raise TrainConfigError(f"{key} {path} is a {family!r} model: {REFUSED[family]}")
    if family not in VLMS:
        raise TrainConfigError(f"{key} {path} is a {family!r} model, not a whole "
                               f"vision-language model mimo takes ({', '.join(VLMS)}); give "
                               "the language model as model.language.pretrained and each "
                               "encoder as model.encoders.<module>.pretrained instead")
    given = _given_config(path)
    flat = getattr(VLMS[family], "FLAT_CONFIG", False)     # no text_config in its own files
    missing = {part: dims for part, dims, needed in (
        ("vision_config", "the tower's dims", tower),
        ("text_config", "the language model's dims", not flat))
        if needed and given is not None and part not in given}
    if missing:
        raise TrainConfigError(f"{key} {path}: its config.json is a {family!r} model's without "
                               f"its {' and '.join(missing)} ({' and '.join(missing.values())}"
                               ", which transformers would fill with its defaults): give the "
                               "checkpoint's whole config.json")
    vlm = VLMS[family].read(config, path)
    return vlm if vlm.video_token_id is None else dataclasses.replace(
        vlm, video_inputs=_video_inputs(vlm, config, path))


# what a video processor's settings change in the tower's inputs (the pixel and frame budgets
# are the run's to choose); mean and std where its files say them, frame sampling and
# timestamps as the family's processor does them
VIDEO_INPUTS = ("mean", "std", "sampling", "timestamps")
# what video_settings reads beside them, so that it runs on a file without them
_GEOMETRY = {"patch_size": 0, "merge_size": 0, "temporal_patch_size": 0,
             "size": {"shortest_edge": 0, "longest_edge": 0}}


def _video_inputs(vlm: VLM, config, path: str) -> tuple[tuple[str, Any], ...]:
    """``VLM.video_inputs`` of the checkpoint at ``path``: its video processor's (else its
    image processor's) normalization where a file gives it (``processor_settings``), and the
    family's frame sampling and timestamps."""
    found = processor_settings(model_directory(path), "video")
    settings = VLMS[vlm.family].video_settings(
        config, {**_GEOMETRY, "image_mean": None, "image_std": None, **(found[1] if found else {})})
    settings.setdefault("sampling", "qwen2_vl")
    settings.setdefault("timestamps", False)
    return tuple((key, tuple(value) if isinstance(value, list) else value)
                 for key in VIDEO_INPUTS for value in [settings.get(key)] if value is not None)


def preprocessing_for(path: str, key: str = "model.pretrained") -> dict:
    """The preprocessing config (as YAML data) that writes images (and videos) as the whole
    VLM at ``path`` expects: its tokenizer (and chat template), image and video tokens and
    wrap tokens, positions, its image processor's geometry, pixel budgets and normalization,
    and its video processor's frame sampling where it has one; errors name ``path`` as given
    by ``key``."""
    import copy

    from transformers import AutoTokenizer

    from mimo_data.preprocess.tokenizer_loading import processor_chat_template
    vlm = read_vlm(path, key)
    # a language model mimo cannot build refused now, not at the training's start
    language_arch(path, f"{key}'s language model", weights=False)
    directory = model_directory(path)
    image_processor = processor_settings(directory, "image")
    if image_processor is None:
        raise TrainConfigError(f"{path} holds no image processor (preprocessor_config.json, or "
                               "processor_config.json with an image_processor): its settings "
                               "cannot be read; copy the processor files of the model it was "
                               "made from beside it and run this again, or write the "
                               "preprocessing config by hand (the repository's "
                               "configs/preprocess_*.yaml show one for each family)")
    config = checkpoint_config(path, key)
    family = VLMS[vlm.family]
    geometry = family.image_geometry(config, image_processor[1])
    tokenizer = AutoTokenizer.from_pretrained(path)

    def text(token_id: int, what: str) -> str:
        found = tokenizer.convert_ids_to_tokens(token_id)
        if found is None:       # transformers makes a tokenizer without its files too
            raise TrainConfigError(
                f"{path}'s tokenizer has no token {token_id} (the model's {what}): its "
                "tokenizer files (tokenizer.json, tokenizer_config.json) are missing or of "
                "another model; copy the checkpoint's own beside its config.json")
        return found

    wrap = {"wrap": [text(i, "image wrap token") for i in vlm.image_wrap_ids]
            } if vlm.image_wrap_ids else {}
    modalities = {"image": {"token": text(vlm.image_token_id, "image token"),
                            **wrap, **geometry}}
    if vlm.video_token_id is not None:
        # the video processor's own settings where the checkpoint saves them
        video_processor = processor_settings(directory, "video") or image_processor
        modalities["video"] = copy.deepcopy(   # no YAML anchors shared with the image's
            {"token": text(vlm.video_token_id, "video token"), **wrap,
             **family.video_settings(config, video_processor[1])})
    # a published template mimo copies with generation blocks: named as the one trained through
    template = templates.copy_of(tokenizer.chat_template or processor_chat_template(path))
    return {"tokenizer": os.path.abspath(path) if os.path.isdir(path) else path,
            **({"chat_template": str(template)} if template else {}),
            "mode": "chat", "positions": vlm.positions, "modalities": modalities}


def checkpoint_config(path: str, key: str):
    """transformers' config of the checkpoint at ``path`` (directory or cached hub name), or
    ``TrainConfigError`` naming ``key``; read once per path (shared: not to be changed)."""
    if looks_like_path(path) and not os.path.isdir(os.path.expanduser(path)):
        # not a hub name either: say so instead of the hub's "Repo id must be in the form"
        raise TrainConfigError(f"{key} is {path!r}: {os.path.abspath(os.path.expanduser(path))} "
                               "is not a directory (give a model directory holding config.json, "
                               "or a hub name already in the local cache)")
    if why := not_cached(path):
        raise TrainConfigError(f"{key}: {why}")
    if why := _adapter_folder(path) or _training_checkpoint(path, key):
        raise TrainConfigError(f"{key}: {why}")
    from huggingface_hub.errors import StrictDataclassError
    try:
        return _read_config(path)
    except (OSError, ValueError, StrictDataclassError) as error:
        original = ORIGINAL_FORMATS.get(str((_given_config(path) or {}).get("model_type")))
        if original:
            raise TrainConfigError(f"{key} {path} is {original}") from None
        raise TrainConfigError(
            f"{key} is {path!r}, from which transformers cannot read a model config ({error}): "
            "give a model directory holding config.json (or a hub name already in the local "
            "cache)") from None


def _adapter_folder(path: str) -> str | None:
    """Why the directory ``path`` is no model to train from: PEFT's adapters saved alone
    (``adapter_config.json``, no ``config.json``), whose base and what to do it names; None
    otherwise."""
    directory = os.path.expanduser(path)
    adapter = os.path.join(directory, "adapter_config.json")
    if not os.path.isfile(adapter) or os.path.exists(os.path.join(directory, "config.json")):
        return None
    try:
        with open(adapter) as f:
            base = json.load(f).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        base = None
    return (f"{path} holds PEFT adapters alone (adapter_config.json, no config.json), not a "
            f"model: give their base ({base or 'base_model_name_or_path in adapter_config.json'}) "
            "as the model, or merge the adapters into it first (PEFT's merge_and_unload, then "
            "save_pretrained; mimo-export without --adapters for a mimo run) and give that folder")


def _training_checkpoint(path: str, key: str) -> str | None:
    """Why the directory ``path`` given as ``key`` is no model to train from: a mimo-train
    checkpoint (a step's folder, its ``meta.json``, or a checkpoint.dir, its ``latest``),
    whose weights model.init_from takes; None otherwise."""
    directory = os.path.expanduser(path)
    if os.path.exists(os.path.join(directory, "config.json")) or not any(
            os.path.isfile(os.path.join(directory, name)) for name in (META, LATEST)):
        return None
    try:        # the model it trained: a step's meta.json, or the one its latest names
        with open(os.path.join(step_of(directory), META)) as f:
            trained = json.load(f)["config"]
        for part in key.split("."):     # the checkpoint's own value of ``key``
            trained = trained[part]
    except (OSError, ValueError, KeyError, TypeError, CheckpointError):   # an empty latest too
        trained = None
    model = f" ({trained}, the model it trained)" if isinstance(trained, str) else \
        " (the model it trained, or none)"
    return (f"{path} is a mimo-train checkpoint, not a transformers model: to train on from "
            f"its weights, give it as model.init_from and keep {key}{model}; for a "
            f"transformers model of it: mimo-export --checkpoint {path} --output OUT")


@lru_cache(maxsize=16)
def _given_config(path: str) -> dict | None:
    """The checkpoint's config.json as written (no defaults filled); None where it cannot be
    read so (transformers read it: its own errors are said)."""
    try:
        with open(os.path.join(model_directory(path), "config.json")) as f:
            given = json.load(f)
    except (OSError, ValueError):
        return None
    return given if isinstance(given, dict) else None


def _read_config(path: str):
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(path)


def _model_type(path: str, key: str) -> str:
    return checkpoint_config(path, key).model_type


def language_arch(path: str, key: str = "model.language.pretrained",
                  weights: bool = True) -> LanguageArch:
    """The architecture of the language model at ``path``: a causal LM's, or a whole VLM's
    language model (``read_vlm`` says where its weights sit; ``weights=False``: the dims from
    ``config.json`` alone, where the weights sit not read)."""
    config = checkpoint_config(path, key)
    vlm = read_vlm(path, key, tower=False) \
        if getattr(config, "text_config", None) is not None else None
    return causal_lm.read_architecture(path, key, vlm, weights)
