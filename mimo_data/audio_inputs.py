"""Decode audio clips and build the audio encoder's inputs (Whisper log-mel features).

Clips are decoded with soundfile (torchaudio.load needs extra libraries), downmixed, resampled
with ``torchaudio.functional.resample`` and featurized by transformers' WhisperFeatureExtractor
without its 30 s padding; the frame and token counts match ``token_counts.audio_tokens``.
"""

from __future__ import annotations

import functools
import io

import numpy as np
import soundfile
import torch
import torchaudio.functional
from transformers import WhisperFeatureExtractor

from mimo_data.media import MediaError
from mimo_data.preprocess_config import AudioConfig
from mimo_data.token_counts import audio_too_long, audio_tokens_from_frames, max_audio_samples

# The extractor's centered STFT reflect-pads by n_fft // 2 and needs more samples than that.
_WHISPER_N_FFT = 400
MIN_AUDIO_SAMPLES = _WHISPER_N_FFT // 2 + 1


def decode_audio(data: bytes, cfg: AudioConfig) -> np.ndarray:
    """Encoded audio → mono float32 samples at ``cfg.sample_rate``.

    A clip longer than ``max_duration`` is cut with ``long_audio="truncate"``; with ``"drop"``
    it raises MediaError(``audio_too_long``) for the caller to count. Undecodable bytes raise
    MediaError(``corrupt_audio``).
    """
    try:
        samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except Exception as exc:  # libsndfile errors come as soundfile.LibsndfileError / RuntimeError
        raise MediaError("corrupt_audio", f"soundfile cannot decode the audio: {exc}") from None
    if audio_too_long(len(samples), rate, cfg):
        raise MediaError("audio_too_long", f"clip of {len(samples) / rate:.2f} s is longer than "
                         f"max_duration = {cfg.max_duration} s; raise modalities.audio."
                         "max_duration or set long_audio: truncate to keep it")
    waveform = torch.from_numpy(samples.mean(axis=1, dtype=np.float32))
    if rate != cfg.sample_rate:
        waveform = torchaudio.functional.resample(waveform, rate, cfg.sample_rate)
    return waveform[:max_audio_samples(cfg)].numpy()


@functools.lru_cache(maxsize=8)
def _extractor(n_mels: int, sample_rate: int, hop_length: int) -> WhisperFeatureExtractor:
    # Built once per config: the constructor computes the mel filter bank.
    return WhisperFeatureExtractor(feature_size=n_mels, sampling_rate=sample_rate,
                                   hop_length=hop_length, n_fft=_WHISPER_N_FFT)


def audio_features(waveform: np.ndarray, cfg: AudioConfig) -> torch.Tensor:
    """Log-mel features ``float32 [len // hop_length, n_mels]`` (time-major) of one clip."""
    if len(waveform) < MIN_AUDIO_SAMPLES:
        raise MediaError("audio_too_short", f"clip of {len(waveform)} samples is shorter than the "
                         f"{MIN_AUDIO_SAMPLES} samples the log-mel features need")
    features = _extractor(cfg.n_mels, cfg.sample_rate, cfg.hop_length)(
        waveform, sampling_rate=cfg.sample_rate, padding="longest", truncation=False,
        return_tensors="pt")["input_features"]
    return features[0].T.contiguous()


def audio_encoder_inputs(clips: list[np.ndarray], cfg: AudioConfig) -> dict[str, torch.Tensor]:
    """``{"input_features": float32 [Σ frames, n_mels], "feature_lens": int64 [n]}``,
    clip by clip."""
    features = [audio_features(clip, cfg) for clip in clips]
    return {"input_features": (torch.cat(features) if features
                               else torch.empty(0, cfg.n_mels, dtype=torch.float32)),
            "feature_lens": torch.tensor([len(f) for f in features], dtype=torch.int64)}


def audio_rows_to_tokens(inputs: dict[str, torch.Tensor], cfg: AudioConfig) -> list[int]:
    """Per-clip token counts the encoder emits for ``audio_encoder_inputs`` output."""
    return [audio_tokens_from_frames(frames, cfg) for frames in inputs["feature_lens"].tolist()]
