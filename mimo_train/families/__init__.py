"""Model families: one module per family of transformers models mimo builds from or reads.

- ``causal_lm``: Llama, Qwen2 and Qwen3 decoders (alone, or a whole VLM's language model) as
  megatron-core's ``GPTModel``; weights in (``to_megatron``) and out (``to_hf``).
- encoder families, each an ``Encoder`` class (``base``: built from a modality config and
  dims or a pretrained directory, weights read in fp32, one row per placeholder token):
  ``qwen2_vl``, ``qwen2_5_vl``, ``siglip``, ``whisper``, ``llava`` (a LLaVA's tower).
- whole vision-language checkpoints (``model.pretrained``): a family module's ``read(config,
  path) -> VLM`` says which encoder kind takes its tower, which projection its projector is,
  where each part's weights sit and how its images are written, and its
  ``image_geometry(config, processor)`` reads the image processor's settings into a
  preprocessing config (``preprocessing_for``); its language model is ``causal_lm``'s.
  ``qwen2_vl``, ``qwen2_5_vl``, ``llava``.

A new family is one module here, registered below, plus its tests. Families that cannot be
taken are refused with the reason (``REFUSED``), never approximated.
"""

from __future__ import annotations

from functools import lru_cache

from mimo_train.config import TrainConfigError
from mimo_train.families import llava, qwen2_5_vl, qwen2_vl, siglip, whisper
from mimo_train.families.base import VLM, Encoder, EncoderBuildError, input_form

# encoder kind -> its class
ENCODERS: dict[str, type[Encoder]] = {
    "qwen2_vl": qwen2_vl.Qwen2VLVision, "qwen2_5_vl": qwen2_5_vl.Qwen2_5VLVision,
    "siglip": siglip.SiglipVision, "whisper": whisper.WhisperAudio,
    "llava": llava.LlavaVision}
# encoder kind for each input form, without a whole VLM
DEFAULT_KINDS = {("image", "dynamic"): "qwen2_vl", ("image", "fixed"): "siglip",
                 ("audio", "log-mel"): "whisper"}
# whole VLM model_type -> its family module (``read``, ``image_geometry``)
VLMS = {"qwen2_vl": qwen2_vl, "qwen2_5_vl": qwen2_5_vl, "llava": llava}
# model_type -> why mimo does not take it
REFUSED = {
    "qwen3_vl": "Qwen3-VL injects vision features into inner language layers (deepstack), "
                "which megatron-core's MimoModel cannot do: it splices them at the input "
                "embeddings only",
    "qwen3_vl_moe": "Qwen3-VL injects vision features into inner language layers (deepstack)",
    "llava_next": "LLaVA-NeXT tiles images at any resolution (any-res), which mimo's image "
                  "preprocessing does not produce",
    "llava_onevision": "LLaVA-OneVision tiles images at any resolution (any-res), which mimo's "
                       "image preprocessing does not produce",
}


def build_encoder(kind: str, modality_config, hidden_size: int, num_layers: int,
                  num_attention_heads: int, pretrained: str | None) -> Encoder:
    """The encoder class named by ``kind``, in fp32."""
    if kind not in ENCODERS:
        raise EncoderBuildError(f"encoder kind {kind!r} is unknown: use one of {sorted(ENCODERS)}")
    return ENCODERS[kind](modality_config, hidden_size, num_layers, num_attention_heads,
                          pretrained)


def default_kind(modality: str, modality_config) -> str:
    """Encoder kind that consumes this modality's preprocessing output."""
    return DEFAULT_KINDS[input_form(modality, modality_config)]


@lru_cache(maxsize=8)
def read_vlm(path: str) -> VLM:
    """The whole VLM at ``path`` (directory or cached hub name), or ``TrainConfigError``
    naming why mimo cannot take it."""
    from transformers import AutoConfig
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as error:
        raise TrainConfigError(
            f"model.pretrained is {path!r}, from which transformers cannot read a model config "
            f"({error}): give a model directory holding config.json (or a hub name already in "
            "the local cache)") from None
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

    from huggingface_hub import snapshot_download
    from transformers import AutoConfig, AutoTokenizer
    vlm = read_vlm(path)
    directory = path if os.path.isdir(path) else snapshot_download(path, local_files_only=True)
    processor = os.path.join(directory, "preprocessor_config.json")
    if not os.path.isfile(processor):
        raise TrainConfigError(f"{path} holds no preprocessor_config.json: the image "
                               "processor's settings cannot be read; write the preprocessing "
                               "config by hand")
    config = AutoConfig.from_pretrained(path)
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
