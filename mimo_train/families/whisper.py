"""Whisper: its encoder as the audio encoder.

``WhisperAudio`` takes log-mel frames ``[Σ frames, n_mels]`` and ``feature_lens``, runs
Whisper's encoder (its stride-2 conv is the first reduction) then average pooling for each
further reduction, ``ceil`` at every step, as ``token_counts.audio_tokens_from_frames`` counts.
``pretrained`` may be a whole Whisper model or an encoder saved alone (``mimo-export``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mimo_data.modalities.audio import WHISPER_N_FFT, AudioConfig
from mimo_train.families.base import Encoder, check_preprocessor, param_dtype
from mimo_train.errors import EncoderBuildError
from mimo_train.precision import mark_fixed


# WhisperFeatureExtractor takes log10 of the power clamped at 1e-10, clamps that to 8 below its
# maximum, then maps x -> (x + 4) / 4. Its padding (zero samples) has power 0: log10 -10, so
# it becomes max(-10, max - 8) -> max(-1.5, the maximum feature - 2).
_LOG_MEL_FLOOR = 2.0
_SILENCE = (-10.0 + 4.0) / 4.0


class WhisperAudio(Encoder):
    """Whisper encoder on per-clip log-mels → ``[Σ tokens, hidden]``, clip by clip.

    Whisper's encoder takes exactly ``2 * max_source_positions`` frames, so each clip is padded
    to that window with the value Whisper's own padding (zero samples) takes in the clip's
    log-mel: the clip's maximum minus 2, the floor of its 8-decade clamp (above the clip's
    minimum when the clip does not reach that floor), but never below -1.5, zero power's
    log-mel (a quiet or silent clip's maximum minus 2 is below it). The outputs past the
    clip's frames are dropped. (Whisper's own 30 s features also have one or two frames past
    the clip that still see its tail; here they are padding: docs/preprocessing.md says what
    that changes.)

    Its position table is sinusoidal and fixed in Whisper (transformers builds it frozen, but
    ``from_pretrained`` hands it back trainable): it is marked fixed, never trained.
    """
    takes = ("audio", "log-mel")

    @classmethod
    def checkpoint_types(cls) -> tuple[str, ...]:
        return ("whisper",)

    @staticmethod
    def random_config(audio: AudioConfig, hidden_size: int, num_layers: int,
                      num_attention_heads: int):
        """The transformers config of a randomly initialised encoder of these dims, its window
        the longest clip ``audio`` gives."""
        from transformers import WhisperConfig
        frames = math.ceil(audio.max_duration * audio.sample_rate / audio.hop_length)
        return WhisperConfig(
            num_mel_bins=audio.n_mels, d_model=hidden_size, encoder_layers=num_layers,
            encoder_attention_heads=num_attention_heads, encoder_ffn_dim=2 * hidden_size,
            max_source_positions=math.ceil(frames / 2), dropout=0.0)

    @classmethod
    def build_tower(cls, config, dtype: torch.dtype | None = None) -> torch.nn.Module:
        """Whisper's encoder of ``config`` (a whole Whisper model's or the encoder's), in
        ``dtype`` (None: the default dtype)."""
        from transformers.models.whisper.modeling_whisper import WhisperEncoder
        tower = WhisperEncoder(config)
        return tower if dtype is None else tower.to(dtype)

    @classmethod
    def check_processor(cls, pretrained: str | None, modality_config) -> None:
        check_preprocessor(pretrained, {
            "feature_size": ("modalities.audio.n_mels", modality_config.n_mels),
            "sampling_rate": ("modalities.audio.sample_rate", modality_config.sample_rate),
            "hop_length": ("modalities.audio.hop_length", modality_config.hop_length),
            "n_fft": ("the log-mel window", WHISPER_N_FFT)}, part="audio")

    def __init__(self, audio: AudioConfig, hidden_size: int, num_layers: int,
                 num_attention_heads: int, pretrained: str | None = None):
        super().__init__()
        if not audio.reductions or audio.reductions[0] != 2:
            raise EncoderBuildError(f"modalities.audio.reductions is {list(audio.reductions)}: "
                                    "the Whisper encoder's first reduction is its stride-2 conv; "
                                    "start the list with 2")
        frames = math.ceil(audio.max_duration * audio.sample_rate / audio.hop_length)
        from transformers import AutoConfig, AutoModel
        from transformers.models.whisper.modeling_whisper import WhisperEncoder
        if pretrained and "WhisperEncoder" in (AutoConfig.from_pretrained(pretrained)
                                               .architectures or ()):
            # saved alone (mimo-export)
            self.model = WhisperEncoder.from_pretrained(pretrained, dtype=torch.float32)
        elif pretrained:
            self.model = AutoModel.from_pretrained(pretrained, dtype=torch.float32).get_encoder()
        else:
            self.model = self.build_tower(self.random_config(audio, hidden_size, num_layers,
                                                             num_attention_heads))
        mark_fixed(self.model, ("embed_positions.weight",))
        config = self.model.config
        if config.num_mel_bins != audio.n_mels or 2 * config.max_source_positions < frames:
            raise EncoderBuildError(
                f"audio encoder {pretrained or ''} takes {config.num_mel_bins} mel bins and "
                f"{2 * config.max_source_positions} frames; the preprocessing config gives "
                f"{audio.n_mels} bins and up to {frames} frames (max_duration "
                f"{audio.max_duration}s): align modalities.audio")
        self.check_processor(pretrained, audio)
        self.audio = audio
        self.window = 2 * config.max_source_positions
        self.output_size = config.d_model

    def forward(self, input_features: torch.Tensor, feature_lens: torch.Tensor) -> torch.Tensor:
        lengths = feature_lens.tolist()
        clips = torch.split(input_features, lengths)
        padded = input_features.new_empty(len(clips), self.audio.n_mels, self.window)
        for out, clip in zip(padded, clips):
            out[:, :len(clip)] = clip.T
            out[:, len(clip):] = (clip.max() - _LOG_MEL_FLOOR).clamp(min=_SILENCE)
        hidden = self.model(padded.to(param_dtype(self))).last_hidden_state
        rows = []
        for states, frames in zip(hidden, lengths):
            states = states[:-(-frames // 2)]
            for reduction in self.audio.reductions[1:]:
                states = F.avg_pool1d(states.T[None], reduction, reduction, ceil_mode=True)[0].T
            rows.append(states)
        if not rows:
            return hidden.new_empty(0, self.output_size)
        return torch.cat(rows)
