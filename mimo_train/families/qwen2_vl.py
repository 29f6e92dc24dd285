"""Qwen2-VL: its vision tower as an encoder, and whole ``Qwen2VLForConditionalGeneration``
checkpoints.

The tower (``Qwen2VLVision``, transformers' ``Qwen2VisionTransformerPretrainedModel``) takes
dynamic-resolution uint8 patches ``[Σ patches, C·P·P]`` (one frame; the tower's ``C·T·P·P``
columns are made by ``normalize_pixels``) and ``image_grid_thw``, and emits one row per merged
``merge × merge`` patch group. Its patch merger maps to the language width, so a whole
checkpoint needs no projection (``none``).

A whole checkpoint holds the tower under ``model.visual.`` (transformers 4.52+'s layout) or
``visual.`` (the original checkpoints, and what transformers 5 writes), the language model
(``causal_lm``, a Qwen2 decoder with the checkpoint's M-RoPE section) under
``model.language_model.`` or ``model.``. Its images sit between ``<|vision_start|>`` and
``<|vision_end|>``, with M-RoPE positions.
"""

from __future__ import annotations

import torch

from mimo_data.modalities.base import to_device
from mimo_data.modalities.image import ImageConfig, normalize_pixels
from mimo_data.modalities.video import VideoConfig, normalize_video_pixels
from mimo_train.errors import EncoderBuildError
from mimo_train.families.base import (VLM, Encoder, check_preprocessor, normalization,
                                      param_dtype)

# the published config.json holds the language model's keys at its top level (no text_config)
FLAT_CONFIG = True
VISION_PREFIXES = ("model.visual.", "visual.")


def read(config, path: str) -> VLM:
    """What mimo takes from the Qwen2-VL checkpoint at ``path`` (its ``config``)."""
    return VLM(path=path, family=config.model_type,
               image_token_id=int(config.image_token_id),
               image_wrap_ids=(int(config.vision_start_token_id),
                               int(config.vision_end_token_id)),
               positions="mrope", encoder_kind=config.model_type,
               vision_prefixes=VISION_PREFIXES, projection="none",
               video_token_id=int(config.video_token_id),
               tokens_per_second=tokens_per_second(config),
               image_tokens_by=(("policy", "dynamic"),
                                ("patch_size", config.vision_config.patch_size),
                                ("merge_size", config.vision_config.spatial_merge_size),
                                ("temporal_patch_size",
                                 config.vision_config.temporal_patch_size)))


def tokens_per_second(config) -> float | None:
    """Qwen2.5-VL's M-RoPE time positions per second of video; Qwen2-VL has none (one per
    temporal patch)."""
    return None


def video_settings(config, processor: dict) -> dict:
    """``modalities.video``: the image geometry (one tower, ``image_geometry``), the frame
    sampling (the video processor's where the checkpoint saves it, else the one preprocessing
    takes by default, written out for people to see) and its per-frame pixel cap where saved;
    Qwen2-VL has no time scaling (``qwen2_5_vl.video_settings`` adds Qwen2.5-VL's)."""
    geometry = image_geometry(config, processor)
    del geometry["policy"]
    sampling = {key: processor[key] if processor.get(key) is not None else
                getattr(VideoConfig, key) for key in ("fps", "min_frames", "max_frames")}
    sampling.update((key, processor[key]) for key in ("cap_pixels_per_frame", "max_video_tokens")
                    if processor.get(key) is not None)
    return {**geometry, **sampling}


def image_geometry(config, processor: dict) -> dict:
    """``modalities.image`` geometry, pixel budgets and normalization of the checkpoint's image
    processor (``preprocessor_config.json``)."""
    size = processor.get("size") or {}
    return {"policy": "dynamic", "patch_size": processor["patch_size"],
            "merge_size": processor["merge_size"],
            "temporal_patch_size": processor["temporal_patch_size"],
            "min_pixels": processor.get("min_pixels") or size["shortest_edge"],
            "max_pixels": processor.get("max_pixels") or size["longest_edge"],
            "mean": processor["image_mean"], "std": processor["image_std"]}


class Qwen2VLVision(Encoder):
    """Qwen2-VL vision tower: patches → merged-patch embeddings ``[Σ tokens, hidden]``, for
    images and (``take_also("video", ...)``) videos with the same weights, as transformers'
    ``get_image_features`` and ``get_video_features`` call the one tower."""
    takes = ("image", "dynamic")
    also_takes = ("video",)
    head_dim_multiple = 4       # the rotary's half of a head over rows, half over columns
    video: VideoConfig | None = None
    # transformers' towers of this family (and its subclasses': Qwen2.5-VL, Qwen3-VL,
    # Qwen3.5) attend per frame (``cu_seqlens`` of h x w per temporal patch), repeat the
    # rotary and resampled position embeddings per frame and lay Qwen2.5-VL's windows within
    # it (tests/test_media_split.py checks each)
    frame_independent = True
    attends_by_boundaries = True

    @classmethod
    def checkpoint_types(cls) -> tuple[str, ...]:
        return (cls.tower_class().config_class.model_type,)

    @staticmethod
    def pretrained_output_size(config) -> int:
        config = getattr(config, "vision_config", None) or config
        return getattr(config, "out_hidden_size", None) or config.hidden_size

    @staticmethod
    def tower_class():
        from transformers.models.qwen2_vl.modeling_qwen2_vl import (
            Qwen2VisionTransformerPretrainedModel)
        return Qwen2VisionTransformerPretrainedModel

    @classmethod
    def build_tower(cls, config, dtype: torch.dtype | None = None) -> torch.nn.Module:
        """``tower_class`` of ``config``'s vision config (of ``config`` where it has none)."""
        vision = getattr(config, "vision_config", None) or config
        return cls.tower_class()._from_config(vision, dtype=dtype or vision.dtype)

    @staticmethod
    def random_config(image: ImageConfig, hidden_size: int, num_layers: int,
                      num_attention_heads: int):
        from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
        return Qwen2VLVisionConfig(
            depth=num_layers, embed_dim=hidden_size, hidden_size=hidden_size,
            num_heads=num_attention_heads, mlp_ratio=2, in_channels=3,
            patch_size=image.patch_size, spatial_merge_size=image.merge_size,
            temporal_patch_size=image.temporal_patch_size)

    @classmethod
    def check_processor(cls, pretrained: str | None, modality_config) -> None:
        check_preprocessor(pretrained, normalization(modality_config))

    def __init__(self, image: ImageConfig, hidden_size: int, num_layers: int,
                 num_attention_heads: int, pretrained: str | VLM | None = None):
        super().__init__()
        if isinstance(pretrained, VLM):     # a whole VLM: its tower (merger included)
            from transformers import AutoConfig
            self.model = self.build_tower(AutoConfig.from_pretrained(pretrained.path),
                                          dtype=torch.float32)
            pretrained.load_tower(self.model)
            pretrained = pretrained.path
        elif pretrained:
            self.model = self.tower_class().from_pretrained(pretrained, dtype=torch.float32)
        else:
            self.model = self.build_tower(self.random_config(
                image, hidden_size, num_layers, num_attention_heads))
        config = self.model.config
        geometry = {"patch_size": image.patch_size, "spatial_merge_size": image.merge_size,
                    "temporal_patch_size": image.temporal_patch_size}
        wrong = {k: (getattr(config, k), v) for k, v in geometry.items() if getattr(config, k) != v}
        if wrong:
            raise EncoderBuildError(f"vision encoder {pretrained or ''} geometry "
                                    f"{ {k: a for k, (a, _) in wrong.items()} } differs from the "
                                    "preprocessing config "
                                    f"{ {k: b for k, (_, b) in wrong.items()} }"
                                    ": the token counts would not match; align modalities.image")
        self.check_processor(pretrained, image)
        self.image = image
        self.output_size = getattr(config, "out_hidden_size", None) or config.hidden_size

    def take_also(self, modality: str, modality_config) -> None:
        if modality != "video":
            super().take_also(modality, modality_config)
        fields = ("patch_size", "merge_size", "temporal_patch_size")
        wrong = {f: (getattr(modality_config, f), getattr(self.image, f)) for f in fields
                 if getattr(modality_config, f) != getattr(self.image, f)}
        if wrong:
            raise EncoderBuildError(
                "modalities.video " + ", ".join(f"{f} {v} differs from modalities.image's {i}"
                                                for f, (v, i) in wrong.items())
                + ": one tower encodes both; align them")
        self.video = modality_config

    def encode(self, modality: str, **inputs: torch.Tensor) -> torch.Tensor:
        if modality != "video":
            return self(**inputs)
        return self.rows(self.run_tower(self.model, *self._patches(modality, inputs)))

    def encode_together(self, inputs: dict[str, dict]) -> torch.Tensor:
        """Images and clips through the tower in one call, their patches and grids one after
        another: the tower attends within each item (each image, each frame's window) and
        its other layers act on each patch, so every item's rows are its own call's (up to
        floating-point rounding: a matmul over more rows may round otherwise); two
        calls would dispatch every layer twice, forward and backward (~1,500 operators and
        as many views a micro-batch for Qwen2-VL-2B's 32 layers, tools/bench_operators.py;
        a pass of small kernels for the clips)."""
        if len(inputs) == 1:
            (modality, kwargs), = inputs.items()
            return self.encode(modality, **kwargs)
        patches = [self._patches(m, kwargs) for m, kwargs in inputs.items()]
        pixels, grids = torch.cat([p for p, _ in patches]), torch.cat([g for _, g in patches])
        del patches                     # the modalities' own copies, not kept by the tower
        return self.rows(self.run_tower(self.model, pixels, grids))

    def forward(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        return self.rows(self.run_tower(self.model, *self._patches(
            "image", {"pixel_values": pixel_values, "image_grid_thw": image_grid_thw})))

    def _patches(self, modality: str, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """A modality's normalized patches in the tower's dtype, and its items' grids."""
        if modality == "video":
            assert self.video is not None, "take_also('video', ...) first"
            pixels = normalize_video_pixels(inputs["pixel_values_videos"], self.video)
            return pixels.to(param_dtype(self)), inputs["video_grid_thw"]
        pixels = normalize_pixels(inputs["pixel_values"], self.image)
        return pixels.to(param_dtype(self)), inputs["image_grid_thw"]

    @classmethod
    def run_tower(cls, model: torch.nn.Module, pixels: torch.Tensor, grid_thw: torch.Tensor):
        """transformers' tower ``model`` on ``pixels``, given what its forward would otherwise
        derive from ``grid_thw`` on the pixels' device: made on the host from the host
        ``grid_thw`` (``base.HOST_INPUTS``), so the tower reads no device value (each
        derivation waits for the GPU: ``tolist``, ``max().item()``, data-sized
        ``repeat_interleave``) and launches none of their small per-item kernels.
        ``grid_thw`` on a device is read once."""
        derived = cls.grid_inputs(model, grid_thw.cpu())
        # an attention without boundaries (transformers' sdpa) splits items by them on the host
        host = ("cu_seqlens", "cu_window_seqlens") if derived["max_seqlen"] is None else ()
        placed = {key: value if key in host or not isinstance(value, torch.Tensor)
                  else to_device(value, pixels.device) for key, value in derived.items()}
        return model(hidden_states=pixels, grid_thw=grid_thw, **placed)

    @staticmethod
    def grid_inputs(tower: torch.nn.Module, grid_thw: torch.Tensor) -> dict:
        """The inputs transformers' ``tower`` derives from a host ``grid_thw``, by its own
        functions (``transformers.vision_utils``), under the keys its forward takes them
        precomputed: the rotary position ids, the items' boundaries and the longest item
        (``None`` unless the attention is given boundaries)."""
        from transformers.vision_utils import (get_vision_attention_seqlens,
                                               get_vision_position_ids)
        cu_seqlens, max_seqlen = get_vision_attention_seqlens(grid_thw, tower.config)
        return {"position_ids": get_vision_position_ids(grid_thw, tower.spatial_merge_size),
                "cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen}

    def rows(self, output) -> torch.Tensor:
        """The placeholders' rows of the tower's ``output``: its merged patches."""
        return output.pooler_output


def use_published_positions(model) -> None:
    """Make transformers' Qwen2-VL or Qwen2.5-VL ``model`` (its ``…ForConditionalGeneration``)
    position the text after each image or clip as the published checkpoints were trained:
    at the item's largest position plus one (Qwen's own ``get_rope_index``, transformers up to
    5.2, vLLM), as ``mimo_data.preprocess.positions`` does in training. transformers from 5.3
    continues it at the item's start plus its grid's larger side instead, which for a clip
    whose time positions pass that side (most clips: Qwen2.5-VL's advance by
    ``tokens_per_second`` a second) puts the answer before the clip's last frames in time.
    ``mimo-generate`` runs its model so; the item's own positions stay transformers'."""
    import inspect
    inner = model.model
    theirs = inner.get_rope_index
    signature = inspect.signature(theirs)

    def get_rope_index(*args, **kwargs):
        given = signature.bind(*args, **kwargs).arguments      # however transformers calls it
        positions, _ = theirs(*args, **kwargs)
        return continued_after_items(positions, given["mm_token_type_ids"],
                                     given.get("attention_mask"))

    inner.get_rope_index = get_rope_index


def continued_after_items(positions: torch.Tensor, kinds: torch.Tensor,
                          attention_mask: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``positions`` ``[3, B, S]`` (transformers' ``get_rope_index``), each run of text after an
    item (``kinds``: ``mm_token_type_ids``, 0 for text) continued at the largest position before
    it plus one, each item shifted with it; and each row's ``rope_deltas`` ``[B, 1]``."""
    out = positions.clone()
    deltas = []
    for row in range(positions.shape[1]):
        real = attention_mask[row].bool() if attention_mask is not None else \
            torch.ones(positions.shape[2], dtype=torch.bool, device=positions.device)
        given, kind = positions[:, row, real], kinds[row, real]
        placed = torch.empty_like(given)
        bounds = [0, *((kind[1:] != kind[:-1]).nonzero().flatten() + 1).tolist(), kind.numel()]
        cursor = 0
        for begin, end in zip(bounds, bounds[1:]):
            if kind[begin] == 0:
                placed[:, begin:end] = cursor + torch.arange(end - begin, device=given.device)
            else:                   # an item: its start (every axis of its first token) moved
                placed[:, begin:end] = given[:, begin:end] - given[0, begin] + cursor
            cursor = int(placed[:, begin:end].max()) + 1
        out[:, row, real] = placed
        deltas.append(cursor - kind.numel())
    return out, torch.tensor(deltas, device=positions.device).unsqueeze(1)
