"""SigLIP: its vision tower as an encoder of fixed-size images.

``SiglipVision`` takes uint8 images ``[n, 3, S, S]`` (``policy: fixed``, squashed to ``S``) and
emits ``(S / P)²`` rows per image, the patch states of transformers' ``SiglipVisionModel``
(its pooling head left out).
"""

from __future__ import annotations

import copy

import torch

from mimo_data.modalities.image import ImageConfig, normalize_pixels
from mimo_train.families.base import (Encoder, check_fixed_geometry, check_preprocessor,
                                      normalization, param_dtype)


class SiglipVision(Encoder):
    """SigLIP vision tower: fixed-size images → ``[n · (S/P)², hidden]``."""
    takes = ("image", "fixed")
    # images are never cut and each is encoded alone: data.split_media deals them whole
    frame_independent = True

    @classmethod
    def checkpoint_types(cls) -> tuple[str, ...]:
        return ("siglip_vision_model", "siglip")

    @staticmethod
    def random_config(image: ImageConfig, hidden_size: int, num_layers: int,
                      num_attention_heads: int):
        """The transformers config of a randomly initialised tower of these dims."""
        from transformers import SiglipVisionConfig
        return SiglipVisionConfig(
            hidden_size=hidden_size, intermediate_size=2 * hidden_size,
            num_hidden_layers=num_layers, num_attention_heads=num_attention_heads,
            image_size=image.image_size, patch_size=image.patch_size, vision_use_head=False)

    @classmethod
    def build_tower(cls, config, dtype: torch.dtype | None = None) -> torch.nn.Module:
        """``SiglipVisionModel`` of ``config``'s vision config (of ``config`` where it has
        none), its pooling head left out."""
        from transformers import SiglipVisionModel
        vision = copy.copy(getattr(config, "vision_config", None) or config)
        vision.vision_use_head = False
        return SiglipVisionModel._from_config(vision, dtype=dtype or vision.dtype)

    @classmethod
    def check_processor(cls, pretrained: str | None, modality_config) -> None:
        check_preprocessor(pretrained, normalization(modality_config))

    def __init__(self, image: ImageConfig, hidden_size: int, num_layers: int,
                 num_attention_heads: int, pretrained: str | None = None):
        super().__init__()
        from transformers import SiglipVisionModel
        if pretrained:
            # the pooling head is not used (one row per patch): leave it out
            self.model = SiglipVisionModel.from_pretrained(pretrained, vision_use_head=False,
                                                           dtype=torch.float32)
        else:
            self.model = self.build_tower(self.random_config(
                image, hidden_size, num_layers, num_attention_heads))
        config = self.model.config
        check_fixed_geometry(config.image_size, config.patch_size, image,
                             f"vision encoder {pretrained or ''}")
        self.check_processor(pretrained, image)
        self.image = image
        self.output_size = config.hidden_size

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        pixels = normalize_pixels(pixel_values, self.image).to(param_dtype(self))
        hidden = self.model(pixel_values=pixels).last_hidden_state
        return hidden.reshape(-1, hidden.size(-1))
