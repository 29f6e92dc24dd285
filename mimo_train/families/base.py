"""Encoders that take exactly the inputs ``mimo_data`` produces and emit exactly the token counts
it computed: one row per placeholder token, item by item (docs/architecture.md, "One sample").

- ``Qwen2VLVision``: dynamic-resolution uint8 patches ``[Σ patches, C·P·P]`` (one frame; the
  tower's ``C·T·P·P`` columns are made by ``normalize_pixels``) + ``image_grid_thw`` → one row
  per merged ``merge × merge`` patch group (transformers' Qwen2-VL vision tower).
- ``SiglipVision``: fixed-size uint8 images ``[n, 3, S, S]`` → ``(S / P)²`` rows per image.
- ``WhisperAudio``: log-mel frames ``[Σ frames, n_mels]`` + ``feature_lens`` → Whisper's encoder
  (its stride-2 conv is the first reduction) then average pooling for each further reduction,
  ``ceil`` at every step, as ``token_counts.audio_tokens_from_frames`` counts.

Pixel normalization happens here, on the encoder's device (``image_inputs.normalize_pixels``).
Each class is built from a transformers config (random init) or ``from_pretrained(path)``;
``path`` may also be what ``mimo-export`` wrote for the class's ``.model`` (a Whisper encoder
saved alone) or, for ``Qwen2VLVision``, a whole Qwen2-VL (its tower, ``vlm.load_tower``).
Weights are read in fp32 whatever dtype the checkpoint stores (``precision.cast`` moves the
built module to the run's dtype; the trainer may then switch ``.model`` to another attention
implementation). A transformers processor saved beside the model
(``preprocessor_config.json``) must agree with the preprocessing config (normalization, mel and
STFT settings).
tests/test_encoder_parity.py checks each kind against its transformers processor and model.

``Projection`` maps an encoder's rows to the language hidden size (training and mimo-generate).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from mimo_data.modalities.image import normalize_pixels
from mimo_data.modalities.audio import WHISPER_N_FFT, AudioConfig
from mimo_data.modalities.image import ImageConfig
from mimo_train.precision import mark_fixed


# Encoder inputs an encoder reads on the host (clip lengths that cut its batch): they stay in
# host memory, so reading them never waits for the device.
HOST_INPUTS = frozenset({"feature_lens"})


class EncoderBuildError(ValueError):
    """An encoder config that cannot produce the preprocessor's token counts."""


def _param_dtype(module: torch.nn.Module) -> torch.dtype:
    return next(module.parameters()).dtype


def check_preprocessor(pretrained: str | None, expected: dict[str, tuple[str, Any]]) -> None:
    """Refuse a local ``pretrained`` directory whose ``preprocessor_config.json`` (the
    transformers processor saved beside the model) disagrees with mimo's preprocessing:
    ``expected`` maps its field to (our config key, our value). Without that file, nothing to
    check."""
    path = Path(pretrained or "") / "preprocessor_config.json"
    if not pretrained or not path.is_file():
        return
    saved = json.loads(path.read_text())
    wrong = [f"{field} {saved[field]} (ours: {key} {value})"
             for field, (key, value) in expected.items() if field in saved and not (
                 np.shape(saved[field]) == np.shape(value)
                 and np.allclose(saved[field], value, rtol=0, atol=1e-6))]
    if wrong:
        raise EncoderBuildError(f"{path} preprocesses differently: {'; '.join(wrong)}: the "
                                "encoder would see other inputs than it was trained on; align "
                                "the preprocessing config")


def _normalization(image: ImageConfig) -> dict[str, tuple[str, Any]]:
    """The image processor's normalization fields and ours (``normalize_pixels``)."""
    return {"image_mean": ("modalities.image.mean", list(image.mean)),
            "image_std": ("modalities.image.std", list(image.std)),
            "rescale_factor": ("the uint8 scale", 1 / 255)}


class Qwen2VLVision(torch.nn.Module):
    """Qwen2-VL vision tower: patches → merged-patch embeddings ``[Σ tokens, hidden]``."""

    def __init__(self, image: ImageConfig, hidden_size: int, num_layers: int,
                 num_attention_heads: int, pretrained: str | None = None):
        super().__init__()
        from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
        from transformers.models.qwen2_vl.modeling_qwen2_vl import (
            Qwen2VisionTransformerPretrainedModel)
        from transformers import AutoConfig
        whole = pretrained and getattr(AutoConfig.from_pretrained(pretrained), "vision_config",
                                       None)
        if whole:                       # a whole Qwen2-VL: its tower (merger included)
            from mimo_train.vlm import load_tower, read_vlm
            self.model = Qwen2VisionTransformerPretrainedModel._from_config(
                whole, dtype=torch.float32)
            load_tower(self.model, read_vlm(pretrained))
        elif pretrained:
            self.model = Qwen2VisionTransformerPretrainedModel.from_pretrained(
                pretrained, dtype=torch.float32)
        else:
            self.model = Qwen2VisionTransformerPretrainedModel._from_config(Qwen2VLVisionConfig(
                depth=num_layers, embed_dim=hidden_size, hidden_size=hidden_size,
                num_heads=num_attention_heads, mlp_ratio=2, in_channels=3,
                patch_size=image.patch_size, spatial_merge_size=image.merge_size,
                temporal_patch_size=image.temporal_patch_size))
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
        check_preprocessor(pretrained, _normalization(image))
        self.image = image
        self.output_size = config.hidden_size

    def forward(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
        pixels = normalize_pixels(pixel_values, self.image).to(_param_dtype(self))
        return self.model(hidden_states=pixels, grid_thw=image_grid_thw).pooler_output


class SiglipVision(torch.nn.Module):
    """SigLIP vision tower: fixed-size images → ``[n · (S/P)², hidden]``."""

    def __init__(self, image: ImageConfig, hidden_size: int, num_layers: int,
                 num_attention_heads: int, pretrained: str | None = None):
        super().__init__()
        from transformers import SiglipVisionConfig, SiglipVisionModel
        if pretrained:
            # the pooling head is not used (one row per patch): leave it out
            self.model = SiglipVisionModel.from_pretrained(pretrained, vision_use_head=False,
                                                           dtype=torch.float32)
        else:
            self.model = SiglipVisionModel._from_config(SiglipVisionConfig(
                hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                num_hidden_layers=num_layers, num_attention_heads=num_attention_heads,
                image_size=image.image_size, patch_size=image.patch_size,
                vision_use_head=False))
        config = self.model.config
        if (config.image_size, config.patch_size) != (image.image_size, image.patch_size):
            raise EncoderBuildError(
                f"vision encoder {pretrained or ''} takes {config.image_size}px images in "
                f"{config.patch_size}px patches; the preprocessing config gives "
                f"{image.image_size}px / {image.patch_size}px: align modalities.image")
        check_preprocessor(pretrained, _normalization(image))
        self.image = image
        self.output_size = config.hidden_size

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        pixels = normalize_pixels(pixel_values, self.image).to(_param_dtype(self))
        hidden = self.model(pixel_values=pixels).last_hidden_state
        return hidden.reshape(-1, hidden.size(-1))


# WhisperFeatureExtractor clamps log10 power to 8 below its maximum, then maps x -> (x + 4) / 4:
# silence (zero samples) becomes the maximum feature minus 8 / 4.
_LOG_MEL_FLOOR = 2.0


class WhisperAudio(torch.nn.Module):
    """Whisper encoder on per-clip log-mels → ``[Σ tokens, hidden]``, clip by clip.

    Whisper's encoder takes exactly ``2 * max_source_positions`` frames, so each clip is padded
    to that window with the value Whisper's own padding (zero samples) takes in the clip's
    log-mel: the clip's maximum minus 2, the floor of its 8-decade clamp (above the clip's
    minimum when the clip does not reach that floor). The outputs past the clip's frames are
    dropped.

    Its position table is sinusoidal and fixed in Whisper (transformers builds it frozen, but
    ``from_pretrained`` hands it back trainable): it is marked fixed, never trained.
    """

    def __init__(self, audio: AudioConfig, hidden_size: int, num_layers: int,
                 num_attention_heads: int, pretrained: str | None = None):
        super().__init__()
        if not audio.reductions or audio.reductions[0] != 2:
            raise EncoderBuildError(f"modalities.audio.reductions is {list(audio.reductions)}: "
                                    "the Whisper encoder's first reduction is its stride-2 conv; "
                                    "start the list with 2")
        frames = math.ceil(audio.max_duration * audio.sample_rate / audio.hop_length)
        from transformers import AutoConfig, AutoModel, WhisperConfig
        from transformers.models.whisper.modeling_whisper import WhisperEncoder
        if pretrained and "WhisperEncoder" in (AutoConfig.from_pretrained(pretrained)
                                               .architectures or ()):
            # saved alone (mimo-export)
            self.model = WhisperEncoder.from_pretrained(pretrained, dtype=torch.float32)
        elif pretrained:
            self.model = AutoModel.from_pretrained(pretrained, dtype=torch.float32).get_encoder()
        else:
            self.model = WhisperEncoder(WhisperConfig(
                num_mel_bins=audio.n_mels, d_model=hidden_size, encoder_layers=num_layers,
                encoder_attention_heads=num_attention_heads, encoder_ffn_dim=2 * hidden_size,
                max_source_positions=math.ceil(frames / 2), dropout=0.0))
        mark_fixed(self.model, ("embed_positions.weight",))
        config = self.model.config
        if config.num_mel_bins != audio.n_mels or 2 * config.max_source_positions < frames:
            raise EncoderBuildError(
                f"audio encoder {pretrained or ''} takes {config.num_mel_bins} mel bins and "
                f"{2 * config.max_source_positions} frames; the preprocessing config gives "
                f"{audio.n_mels} bins and up to {frames} frames (max_duration "
                f"{audio.max_duration}s): align modalities.audio")
        check_preprocessor(pretrained, {
            "feature_size": ("modalities.audio.n_mels", audio.n_mels),
            "sampling_rate": ("modalities.audio.sample_rate", audio.sample_rate),
            "hop_length": ("modalities.audio.hop_length", audio.hop_length),
            "n_fft": ("the log-mel window", WHISPER_N_FFT)})
        self.audio = audio
        self.window = 2 * config.max_source_positions
        self.output_size = config.d_model

    def forward(self, input_features: torch.Tensor, feature_lens: torch.Tensor) -> torch.Tensor:
        lengths = feature_lens.tolist()
        clips = torch.split(input_features, lengths)
        padded = input_features.new_empty(len(clips), self.audio.n_mels, self.window)
        for out, clip in zip(padded, clips):
            out[:, :len(clip)] = clip.T
            out[:, len(clip):] = clip.max() - _LOG_MEL_FLOOR
        hidden = self.model(padded.to(_param_dtype(self))).last_hidden_state
        rows = []
        for states, frames in zip(hidden, lengths):
            states = states[:-(-frames // 2)]
            for reduction in self.audio.reductions[1:]:
                states = F.avg_pool1d(states.T[None], reduction, reduction, ceil_mode=True)[0].T
            rows.append(states)
        if not rows:
            return hidden.new_empty(0, self.output_size)
        return torch.cat(rows)


def build_encoder(kind: str, modality_config, hidden_size: int, num_layers: int,
                  num_attention_heads: int, pretrained: str | None) -> torch.nn.Module:
    """The encoder class named by ``kind`` (see the module docstring), in fp32."""
    classes = {"qwen2_vl": Qwen2VLVision, "siglip": SiglipVision, "whisper": WhisperAudio}
    if kind not in classes:
        raise EncoderBuildError(f"encoder kind {kind!r} is unknown: use one of {sorted(classes)}")
    return classes[kind](modality_config, hidden_size, num_layers, num_attention_heads,
                         pretrained)


def default_kind(modality: str, modality_config) -> str:
    """Encoder kind that consumes this modality's preprocessing output."""
    if modality == "audio":
        return "whisper"
    return "qwen2_vl" if modality_config.policy == "dynamic" else "siglip"


class Projection(torch.nn.Sequential):
    """Encoder hidden size -> language hidden size (``model.projection``): one Linear
    (``linear``), Linear-GELU-Linear (``mlp``), or nothing (``none``: the identity, for a
    tower that already emits the language width, as Qwen2-VL's merger does)."""

    def __init__(self, in_features: int, out_features: int, kind: str):
        if kind == "none":              # the tower already outputs the language width
            if in_features != out_features:
                raise EncoderBuildError(f"model.projection is none, but the encoder emits "
                                        f"{in_features} features for a language width of "
                                        f"{out_features}: use linear or mlp")
            super().__init__()
        elif kind == "mlp":
            super().__init__(torch.nn.Linear(in_features, out_features), torch.nn.GELU(),
                             torch.nn.Linear(out_features, out_features))
        else:
            super().__init__(torch.nn.Linear(in_features, out_features))
