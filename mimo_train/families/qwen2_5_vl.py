"""Qwen2.5-VL: ``Qwen2_5_VLForConditionalGeneration`` checkpoints.

Laid out as Qwen2-VL's (``qwen2_vl``: the same weight prefixes, image tokens, M-RoPE positions,
no projection, one tower for images and videos); its tower (transformers'
``Qwen2_5_VisionTransformerPretrainedModel``) attends within windows except in its
``fullatt_block_indexes`` blocks, with RMSNorm and SwiGLU, and its merger maps to
``out_hidden_size``, the language width. For still images its M-RoPE positions are Qwen2-VL's; a
video's time positions step by ``tokens_per_second`` (its vision config) times the seconds each
temporal patch spans. """

from __future__ import annotations

import dataclasses

import torch

from mimo_data.modalities.image import ImageConfig
from mimo_train.families import qwen2_vl
from mimo_train.families.base import VLM

FLAT_CONFIG = qwen2_vl.FLAT_CONFIG      # its published config.json is as flat

image_geometry = qwen2_vl.image_geometry


def read(config, path: str) -> VLM:
    """Qwen2-VL's reading, with the M-RoPE time scaling of videos (``tokens_per_second``)."""
    return dataclasses.replace(qwen2_vl.read(config, path),
                               tokens_per_second=tokens_per_second(config))


def tokens_per_second(config) -> float:
    return float(config.vision_config.tokens_per_second)


def video_settings(config, processor: dict) -> dict:
    return {**qwen2_vl.video_settings(config, processor),
            "tokens_per_second": tokens_per_second(config)}


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

    @staticmethod
    def grid_inputs(tower: torch.nn.Module, grid_thw: torch.Tensor) -> dict:
        """Qwen2-VL's, and the windows: the order of the patches by window, the windows'
        boundaries and the longest window."""
        from transformers.utils.generic import get_max_seqlen
        from transformers.vision_utils import get_vision_window_index
        window_index, cu_window_seqlens = get_vision_window_index(
            grid_thw, spatial_merge_size=tower.spatial_merge_size,
            window_size=tower.window_size, patch_size=tower.patch_size)
        return {**qwen2_vl.Qwen2VLVision.grid_inputs(tower, grid_thw),
                "window_index": window_index, "cu_window_seqlens": cu_window_seqlens,
                "max_window_seqlen": get_max_seqlen(cu_window_seqlens, tower.config)}
