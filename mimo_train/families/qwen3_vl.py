"""Qwen3-VL: ``Qwen3VLForConditionalGeneration`` and ``Qwen3VLMoeForConditionalGeneration``
checkpoints (the MoE variant: the same tower, a mixture-of-experts language model,
``causal_lm``'s ``qwen3_moe``).

Laid out as Qwen2-VL's (``qwen2_vl``: one tower for images and videos under ``model.visual.``,
the language model under ``model.language_model.``, image and video tokens between
``<|vision_start|>`` and ``<|vision_end|>``, M-RoPE positions, no projection). What differs:

- the tower (transformers' ``Qwen3VLVisionModel``: learned position embeddings resampled to
  each grid, LayerNorm + GELU blocks, 16-pixel patches) also returns **deepstack** features:
  the hidden states after each of its ``deepstack_visual_indexes`` blocks, each through its own
  merger. The language model adds the k-th of them to its hidden states at the visual
  positions after its decoder layer k. ``Qwen3VLVision`` emits them beside the main rows, one
  row per placeholder ``[main | deepstack 0 | … | deepstack K-1]`` (``(1 + K) × width``), so
  they cross any bridge with the main rows in one transfer; ``mcore.deepstack`` adds them in
  the language model;
- the language model is Qwen3's or Qwen3-MoE's (qk-norm, no qkv bias) with M-RoPE laid out
  interleaved (``causal_lm``: ``LanguageArch.mrope_interleaved``);
- videos: the video processor samples frames evenly over the clip, and the text carries
  ``<{t:.1f} seconds>`` before each temporal patch, each patch between its own wrap tokens
  (``modalities.video``: ``sampling: qwen3_vl``, ``timestamps: true``); M-RoPE time positions
  do not scale with seconds.
"""

from __future__ import annotations

import torch

from mimo_data.modalities.image import ImageConfig
from mimo_train.families import qwen2_vl

# Qwen2-VL's: the same tokens, prefixes and projection; no time scaling of video positions
image_geometry, read = qwen2_vl.image_geometry, qwen2_vl.read


def video_settings(config, processor: dict) -> dict:
    """``modalities.video``: Qwen2-VL's geometry and frame-rate settings from the video
    processor, its even frame sampling, and text timestamps per temporal patch."""
    return {**qwen2_vl.video_settings(config, processor), "sampling": "qwen3_vl",
            "timestamps": True}


def resampled_grid_inputs(tower: torch.nn.Module, grid_thw: torch.Tensor) -> dict:
    """Qwen2-VL's ``grid_inputs``, and where each patch reads the learned position table
    resampled to its grid (the taps and their weights): the towers of Qwen3-VL and Qwen3.5."""
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights
    indices, weights = get_vision_interpolation_indices_and_weights(
        grid_thw, num_grid_per_side=tower.num_grid_per_side, mode=tower.interpolation_mode,
        align_corners=tower.interpolation_align_corners,
        spatial_merge_size=tower.config.spatial_merge_size)
    return {**qwen2_vl.Qwen2VLVision.grid_inputs(tower, grid_thw),
            "interp_indices": indices, "interp_weights": weights}


class Qwen3VLVision(qwen2_vl.Qwen2VLVision):
    """Qwen3-VL vision tower: patches → ``[Σ tokens, (1 + K) · out_hidden_size]``, each row a
    placeholder's main embedding followed by its K deepstack embeddings."""
    deepstack = True

    @staticmethod
    def tower_class():
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel
        return Qwen3VLVisionModel

    @staticmethod
    def random_config(image: ImageConfig, hidden_size: int, num_layers: int,
                      num_attention_heads: int):
        from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
        return Qwen3VLVisionConfig(
            depth=num_layers, hidden_size=hidden_size, out_hidden_size=hidden_size,
            intermediate_size=2 * hidden_size, num_heads=num_attention_heads, in_channels=3,
            patch_size=image.patch_size, spatial_merge_size=image.merge_size,
            temporal_patch_size=image.temporal_patch_size,
            deepstack_visual_indexes=list(range(min(3, num_layers - 1))))

    grid_inputs = staticmethod(resampled_grid_inputs)

    @property
    def row_width(self) -> int:
        return self.output_size * (1 + len(self.model.config.deepstack_visual_indexes))

    def rows(self, output) -> torch.Tensor:
        return torch.cat([output.pooler_output, *output.deepstack_features], dim=-1)


class Qwen3VLMoeVision(Qwen3VLVision):
    """Qwen3-VL-MoE's vision tower: Qwen3-VL's, under its own transformers class."""

    @staticmethod
    def tower_class():
        from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import (
            Qwen3VLMoeVisionModel)
        return Qwen3VLMoeVisionModel

