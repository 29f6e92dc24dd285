"""Qwen2.5-VL: ``Qwen2_5_VLForConditionalGeneration`` checkpoints.

Laid out as Qwen2-VL's (``qwen2_vl``: the same weight prefixes, image tokens, M-RoPE
positions, no projection); its tower (transformers' ``Qwen2_5_VisionTransformerPretrainedModel``)
attends within windows except in its ``fullatt_block_indexes`` blocks, with RMSNorm and SwiGLU,
and its merger maps to ``out_hidden_size``, the language width. For still images its M-RoPE
positions are Qwen2-VL's (the seconds-per-grid scaling concerns video only).
"""

from __future__ import annotations

from mimo_data.modalities.image import ImageConfig
from mimo_train.families import qwen2_vl

read, image_geometry = qwen2_vl.read, qwen2_vl.image_geometry


class Qwen2_5VLVision(qwen2_vl.Qwen2VLVision):
    """Qwen2.5-VL vision tower: patches → merged-patch embeddings ``[Σ tokens, hidden]``."""

    @staticmethod
    def tower_class():
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel)
        return Qwen2_5_VisionTransformerPretrainedModel

    @staticmethod
    def random_config(image: ImageConfig, hidden_size: int, num_layers: int,
                      num_attention_heads: int):
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import (
            Qwen2_5_VLVisionConfig)
        return Qwen2_5_VLVisionConfig(
            depth=num_layers, hidden_size=hidden_size, out_hidden_size=hidden_size,
            intermediate_size=2 * hidden_size, num_heads=num_attention_heads, in_channels=3,
            patch_size=image.patch_size, spatial_merge_size=image.merge_size,
            temporal_patch_size=image.temporal_patch_size,
            window_size=2 * image.patch_size * image.merge_size,
            fullatt_block_indexes=[num_layers - 1])
