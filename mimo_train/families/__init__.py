"""Whole vision-language checkpoints (``model.pretrained``): which families mimo takes apart
into its modules, and where each part's weights sit.

A Qwen2-VL checkpoint (``Qwen2VLForConditionalGeneration``) gives:

- the image encoder: its vision tower with the patch merger (``model.visual.*``, or
  ``visual.*`` as the original checkpoints and transformers 5 store it), whose output
  already has the language model's width, so the projection is the identity
  (``model.projection: none``);
- the language model: ``model.language_model.*`` (or ``model.*``) and ``lm_head``
  (``hf_language``, with the
  checkpoint's M-RoPE section; the preprocessing must use ``positions: mrope``).

Other families are refused with the reason, never approximated.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from mimo_train.config import TrainConfigError

# model_type -> why mimo does not take it (yet)
REFUSED = {
    "qwen2_5_vl": "Qwen2.5-VL's windowed-attention tower is not mapped yet",
    "qwen3_vl": "Qwen3-VL injects vision features into inner language layers (deepstack), "
                "which megatron-core's MimoModel cannot do: it splices them at the input "
                "embeddings only",
    "qwen3_vl_moe": "Qwen3-VL injects vision features into inner language layers (deepstack)",
    "llava": "LLaVA checkpoints are not mapped yet",
    "llava_next": "LLaVA-NeXT tiles images at any resolution (any-res), which mimo's image "
                  "preprocessing does not produce",
    "llava_onevision": "LLaVA-OneVision tiles images at any resolution (any-res), which mimo's "
                       "image preprocessing does not produce",
}


@dataclass(frozen=True)
class VLM:
    """What mimo takes from a whole vision-language checkpoint."""
    path: str
    family: str                     # qwen2_vl
    image_token_id: int             # the placeholder the checkpoint's language model expects
    image_wrap_ids: tuple[int, int]   # the tokens it expects around each image's placeholders
    vision_prefixes: tuple[str, ...]  # where the tower's weights may sit (merger included)
    encoder_kind: str               # mimo's encoder kind for the tower
    projection: str                 # mimo's projection between tower and language model


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
    if family != "qwen2_vl":
        raise TrainConfigError(f"model.pretrained {path} is a {family!r} model, not a whole "
                               "vision-language model mimo takes (qwen2_vl); give the language "
                               "model as model.language.pretrained and each encoder as "
                               "model.encoders.<module>.pretrained instead")
    return VLM(path=path, family=family, image_token_id=int(config.image_token_id),
               image_wrap_ids=(int(config.vision_start_token_id),
                               int(config.vision_end_token_id)),
               vision_prefixes=("model.visual.", "visual."), encoder_kind="qwen2_vl",
               projection="none")


def tower_weights(vlm: VLM):
    """The checkpoint's weights (``hf_language.CheckpointWeights``) and the prefix its vision
    tower's names have in them."""
    from mimo_train.hf_language import CheckpointWeights
    weights = CheckpointWeights(vlm.path, key="model.pretrained")
    return weights, weights.prefix_of(vlm.vision_prefixes, "patch_embed.proj.weight")


def load_tower(tower: torch.nn.Module, vlm: VLM) -> None:
    """Load the vision tower's weights (in fp32) from the VLM into ``tower``, built from the
    checkpoint's ``vision_config``; every weight must come from the checkpoint."""
    weights, prefix = tower_weights(vlm)
    own = tower.state_dict()
    found = {name: weights(prefix + name) for name in own if prefix + name in weights}
    missing = sorted(set(own) - set(found))
    wrong = [f"{k} {tuple(v.shape)} vs {tuple(own[k].shape)}" for k, v in found.items()
             if v.shape != own[k].shape]
    if missing or wrong:
        raise TrainConfigError(f"model.pretrained {vlm.path}: the vision tower's weights under "
                               f"{prefix} do not fit it: missing {missing[:3]}, "
                               f"shapes {wrong[:3]}")
    tower.load_state_dict(found)


def check_preprocessing(vlm: VLM, preprocess, tokenizer) -> None:
    """``TrainConfigError`` unless the preprocessing (its config and ``tokenizer``) writes an
    image as the checkpoint expects it: its image token, between its start and end tokens."""
    image = preprocess.modalities.get("image")
    if image is None:
        return
    expected = [tokenizer.convert_ids_to_tokens(i) for i in vlm.image_wrap_ids]
    ours = tokenizer.convert_tokens_to_ids(image.token)
    if ours != vlm.image_token_id:
        raise TrainConfigError(
            f"the preprocessing tokenizer gives the image token {image.token!r} the id {ours}, "
            f"but model.pretrained {vlm.path} expects image tokens at {vlm.image_token_id}: use "
            f"the checkpoint's tokenizer (tokenizer: {vlm.path})")
    if tuple(tokenizer.convert_tokens_to_ids(list(image.wrap))) != vlm.image_wrap_ids:
        raise TrainConfigError(
            f"modalities.image.wrap is {list(image.wrap)}, but model.pretrained {vlm.path} "
            f"expects each image between the tokens {list(vlm.image_wrap_ids)} ({expected}): "
            f"set modalities.image.wrap: {expected}")
