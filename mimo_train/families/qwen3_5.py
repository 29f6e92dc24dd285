"""Qwen3.5: ``Qwen3_5ForConditionalGeneration`` and ``Qwen3_5MoeForConditionalGeneration``
checkpoints (the MoE variant: the same tower, a mixture-of-experts language model with a shared
expert).

Laid out as Qwen3-VL's (``qwen3_vl``: one tower for images and videos under ``model.visual.``,
the language model under ``model.language_model.``, the same processors, tokens between
``<|vision_start|>`` and ``<|vision_end|>``, interleaved M-RoPE, no projection, Qwen3-VL's video
sampling and timestamps). What differs:

- the tower (transformers' ``Qwen3_5VisionModel``) is Qwen3-VL's without deepstack features:
  one row per placeholder, already the decoder's width;
- the language model is a hybrid (``causal_lm``'s ``qwen3_5`` / ``qwen3_5_moe``): three of
  every four layers gated delta-net (linear attention, ``mcore.gated_delta_net``), the fourth
  gated full attention; norms of ``1 + weight``; a quarter of each head rotates; the
  multi-token-prediction layers (``mtp.*``) are carried through export untrained;
- the published chat template writes earlier assistant turns without their reasoning, so the
  loss of a conversation of several turns cannot be placed through it: mimo trains through
  its copy (``mimo_data.preprocess.templates``), the published text with ``{% generation %}``
  blocks around what each assistant turn writes, wherever the published one is given.
"""

from __future__ import annotations

from mimo_data.modalities.image import ImageConfig
from mimo_train.families import qwen2_vl, qwen3_vl

# Qwen3-VL's: the same tokens, prefixes, processors and video rules
image_geometry, read, video_settings = qwen3_vl.image_geometry, qwen3_vl.read, \
    qwen3_vl.video_settings


class Qwen3_5Vision(qwen2_vl.Qwen2VLVision):
    """Qwen3.5's vision tower: patches → merged-patch embeddings ``[Σ tokens, out_hidden]``."""

    @staticmethod
    def tower_class():
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel
        return Qwen3_5VisionModel

    grid_inputs = staticmethod(qwen3_vl.resampled_grid_inputs)

    @staticmethod
    def random_config(image: ImageConfig, hidden_size: int, num_layers: int,
                      num_attention_heads: int):
        from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig
        return Qwen3_5VisionConfig(
            depth=num_layers, hidden_size=hidden_size, out_hidden_size=hidden_size,
            intermediate_size=2 * hidden_size, num_heads=num_attention_heads, in_channels=3,
            patch_size=image.patch_size, spatial_merge_size=image.merge_size,
            temporal_patch_size=image.temporal_patch_size)


class Qwen3_5MoeVision(Qwen3_5Vision):
    """Qwen3.5-MoE's vision tower: Qwen3.5's, under its own transformers class."""

    @staticmethod
    def tower_class():
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel
        return Qwen3_5MoeVisionModel
