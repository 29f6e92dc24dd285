"""LLaVA: whole ``LlavaForConditionalGeneration`` checkpoints (a CLIP or SigLIP tower, an MLP
projector, a Llama / Qwen2 / Qwen3 language model).

``LlavaVision`` is the tower as transformers' ``LlavaModel`` uses it: fixed-size images
(``policy: fixed``; ``crop: true`` for a CLIP image processor's short-side resize and centre
crop; ``pad: true`` for ``LlavaImageProcessor``'s ``do_pad``, each image a square first)
through the tower, the hidden states of ``vision_feature_layer`` (several layers: concatenated
along the features), the CLS row dropped under ``vision_feature_select_strategy: default``;
one row per patch. The projector (``multi_modal_projector.linear_1``, GELU, ``linear_2``) is
mimo's ``mlp`` projection, its weights loaded as the checkpoint's. Positions
are sequential, images have no wrapping tokens.

Weights sit under ``model.vision_tower.`` / ``model.multi_modal_projector.`` /
``model.language_model.`` with ``lm_head`` (transformers 4.52+), or under ``vision_tower.`` /
``multi_modal_projector.`` / ``language_model.model.`` with ``language_model.lm_head`` (the
checkpoints on the hub).

Refused: a tower other than CLIP or SigLIP, a projector activation other than GELU or without
biases, ``full`` selection on a tower with a CLS row (one token more per image than the image
modality counts), ``default`` on one without (one fewer), and a feature layer past the tower's.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from mimo_data.modalities.image import ImageConfig, normalize_pixels
from mimo_train.errors import EncoderBuildError, TrainConfigError
from mimo_train.families.base import (VLM, Encoder, check_fixed_geometry, check_preprocessor,
                                      model_directory, normalization, param_dtype,
                                      processor_settings)

TOWERS = {"clip_vision_model": True, "siglip_vision_model": False}   # -> has a CLS row
# the hub checkpoints hold the tower under vision_model. (transformers 5 drops that level)
VISION_PREFIXES = ("model.vision_tower.vision_model.", "vision_tower.vision_model.",
                   "model.vision_tower.", "vision_tower.")
PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")
# mimo's mlp Projection (Linear, GELU, Linear) -> LLaVA's projector
PROJECTOR_NAMES = (("0.weight", "linear_1.weight"), ("0.bias", "linear_1.bias"),
                   ("2.weight", "linear_2.weight"), ("2.bias", "linear_2.bias"))


def read(config, path: str) -> VLM:
    """What mimo takes from the LLaVA checkpoint at ``path`` (its ``config``), or
    ``TrainConfigError`` naming what it cannot take."""
    tower = config.vision_config.model_type
    problems = []
    if tower not in TOWERS:
        problems.append(f"a {tower!r} vision tower (CLIP and SigLIP towers are mapped)")
    if config.projector_hidden_act != "gelu":
        problems.append(f"a {config.projector_hidden_act!r} projector (GELU is mapped)")
    if not config.multimodal_projector_bias:
        problems.append("a projector without biases")
    if config.vision_feature_select_strategy == "full" and TOWERS.get(tower):
        problems.append("vision_feature_select_strategy full on a tower with a CLS row (one "
                        "token per image more than the image modality counts)")
    if config.vision_feature_select_strategy == "default" and TOWERS.get(tower) is False:
        problems.append("vision_feature_select_strategy default on a tower without a CLS row "
                        "(it drops each image's first patch: one token per image fewer than "
                        "the image modality counts; llava-interleave's checkpoints say full)")
    depth = config.vision_config.num_hidden_layers
    outside = [layer for layer in _feature_layers(config) if not -depth - 1 <= layer <= depth]
    if outside:
        problems.append(f"vision_feature_layer {outside[0]}, past its tower's hidden states "
                        f"(-{depth + 1} to {depth}: the embeddings, then {depth} layers; "
                        "transformers fails on it too)")
    if problems:
        raise TrainConfigError(f"model.pretrained {path} is a LLaVA with "
                               f"{'; '.join(problems)}, which mimo does not take")
    return VLM(path=path, family="llava", image_token_id=int(config.image_token_id),
               image_tokens_by=(("policy", "fixed"),
                                ("image_size", config.vision_config.image_size),
                                ("patch_size", config.vision_config.patch_size)),
               image_wrap_ids=(), positions="sequential", encoder_kind="llava",
               vision_prefixes=VISION_PREFIXES, projection="mlp",
               projector_names=PROJECTOR_NAMES, projector_prefixes=PROJECTOR_PREFIXES,
               language_prefixes=("model.language_model.", "language_model.model."),
               head_names=("lm_head.weight", "language_model.lm_head.weight"))


def image_geometry(config, processor: dict) -> dict:
    """``modalities.image`` geometry and normalization of the checkpoint's image processor
    (``preprocessor_config.json``) and tower."""
    crop = bool(processor.get("do_center_crop"))
    side = (processor["crop_size"] if crop else processor["size"])["height"]
    return {"policy": "fixed", "image_size": side,
            "patch_size": config.vision_config.patch_size, "crop": crop,
            **({"pad": True} if pads(processor) else {}),
            "mean": processor["image_mean"], "std": processor["image_std"]}


def pads(processor: dict) -> bool:
    """Whether the image processor settings ``processor`` pad each image to a square first:
    ``LlavaImageProcessor``'s ``do_pad`` (CLIP's processor reads no such key)."""
    return bool(processor.get("do_pad")) and str(
        processor.get("image_processor_type", "")).startswith("LlavaImageProcessor")


def _feature_layers(config) -> list[int]:
    layer = config.vision_feature_layer
    return [layer] if isinstance(layer, int) else list(layer)


def tower_config(config) -> tuple[Any, list[int]]:
    """The tower's transformers config as ``LlavaVision`` builds it from the whole LLaVA
    ``config``, and the hidden states it reads (index 0: the embeddings), counted from the
    front. The tower holds only what it reads: the layers past the deepest one read, the final
    norm and SigLIP's pooling head would take compute and never a gradient."""
    vision = copy.deepcopy(config.vision_config)
    layers = [layer % (vision.num_hidden_layers + 1) for layer in _feature_layers(config)]
    # feature layer 0 (-(depth + 1)) is the embeddings: a tower of no layers returns no
    # hidden states, so one layer is kept (its output unread)
    vision.num_hidden_layers = max(max(layers), 1)
    if hasattr(vision, "vision_use_head"):
        vision.vision_use_head = False
    return vision, layers


class LlavaVision(Encoder):
    """A LLaVA checkpoint's tower: fixed-size images → ``[n · (S/P)², hidden · layers]``."""
    takes = ("image", "fixed")
    # images are never cut (Image.cut_units is 1) and each is encoded alone: data.split_media
    # only deals whole images over the fan-in ranks, which gives the same rows
    frame_independent = True

    @staticmethod
    def pretrained_output_size(config) -> int:
        return config.vision_config.hidden_size * len(_feature_layers(config))

    @classmethod
    def build_tower(cls, config, dtype: torch.dtype | None = None) -> torch.nn.Module:
        """The tower of the whole LLaVA ``config`` (``tower_config``), its final norm left
        out."""
        from transformers import AutoModel
        vision, _ = tower_config(config)
        tower = AutoModel.from_config(vision, dtype=dtype or vision.dtype)
        tower.post_layernorm = torch.nn.Identity()
        return tower

    @classmethod
    def check_processor(cls, pretrained: str | None, modality_config) -> None:
        if pretrained:
            check_preprocessor(pretrained, normalization(modality_config))
            check_resize(pretrained, modality_config)

    def __init__(self, image: ImageConfig, hidden_size: int, num_layers: int,
                 num_attention_heads: int, pretrained: str | VLM | None = None):
        super().__init__()
        from transformers import AutoConfig
        if not isinstance(pretrained, VLM) or pretrained.family != "llava":
            raise EncoderBuildError(f"encoder kind llava takes its tower from a whole LLaVA "
                                    f"checkpoint (model.pretrained), not {pretrained!r}")
        vlm, pretrained = pretrained, pretrained.path
        config = AutoConfig.from_pretrained(pretrained)
        vision, self.layers = tower_config(config)
        self.model = self.build_tower(config, dtype=torch.float32)
        vlm.load_tower(self.model)
        check_fixed_geometry(vision.image_size, vision.patch_size, image,
                             f"the vision tower of {pretrained}")
        self.check_processor(pretrained, image)
        self.image = image
        self.drop_cls = config.vision_feature_select_strategy == "default"
        self.output_size = self.pretrained_output_size(config)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        pixels = normalize_pixels(pixel_values, self.image).to(param_dtype(self))
        states = self.model(pixel_values=pixels, output_hidden_states=True).hidden_states
        hidden = torch.cat([states[layer] for layer in self.layers], dim=-1)
        if self.drop_cls:
            hidden = hidden[:, 1:]
        return hidden.reshape(-1, hidden.size(-1))


def check_resize(pretrained: str, image: ImageConfig) -> None:
    """``EncoderBuildError`` unless the processor saved with the checkpoint resizes as the
    preprocessing does: squashed to the square, or (``crop``) the short side to ``image_size``
    then the centre square."""
    found = processor_settings(model_directory(pretrained), "image")
    if found is None:
        return
    path, saved = found
    side = image.image_size
    crop = bool(saved.get("do_center_crop"))
    size = saved.get("size") or {}
    theirs = (crop, (saved.get("crop_size") or {}).get("height") if crop
              else size.get("height"), size.get("shortest_edge") if crop else size.get("width"))
    if theirs != (image.crop, side, side):
        raise EncoderBuildError(
            f"{path} resizes with size {size}, do_center_crop {crop}, crop_size "
            f"{saved.get('crop_size')}; the preprocessing config gives image_size {side}, crop "
            f"{image.crop}: set modalities.image.image_size and crop to the processor's")
    pad = pads(saved)
    if pad != image.pad:
        raise EncoderBuildError(
            f"{path} " + ("pads each image to a square of its image_mean colour first (do_pad: "
                          "true, LLaVA's image_aspect_ratio pad)" if pad else
                          "pads no image (no do_pad)") +
            f"; the preprocessing config gives pad {image.pad}: set modalities.image.pad: "
            f"{str(pad).lower()}")
