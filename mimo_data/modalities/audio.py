"""Decode audio clips and build the audio encoder's inputs (Whisper log-mel features).

Clips are decoded with soundfile (torchaudio.load needs extra libraries), downmixed, resampled
with ``torchaudio.functional.resample`` and featurized as transformers' WhisperFeatureExtractor
does without its 30 s padding; the frame and token counts match ``token_counts.audio_tokens``.
"""

from __future__ import annotations

import functools
import io

import numpy as np
import soundfile
import torch
import torchaudio.functional
from transformers import WhisperFeatureExtractor

from mimo_data.modalities.media import MediaError
from mimo_data.preprocess.config import AudioConfig
from mimo_data.modalities.token_counts import audio_too_long, audio_tokens_from_frames, max_audio_samples

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
def _log_mel_constants(n_mels: int, sample_rate: int, hop_length: int):
    """The extractor's STFT window and mel filter bank ``[n_fft // 2 + 1, n_mels]``, as float32
    tensors, built once per config."""
    extractor = WhisperFeatureExtractor(feature_size=n_mels, sampling_rate=sample_rate,
                                        hop_length=hop_length, n_fft=_WHISPER_N_FFT)
    return (torch.hann_window(_WHISPER_N_FFT),
            torch.from_numpy(extractor.mel_filters).to(torch.float32))


def audio_features(waveform: np.ndarray, cfg: AudioConfig) -> torch.Tensor:
    """Log-mel features ``float32 [len // hop_length, n_mels]`` (time-major) of one clip.

    The steps of ``WhisperFeatureExtractor._torch_extract_fbank_features`` with its window and
    filter bank (equal up to float rounding, tested), minus its per-call set-up and batching,
    with the power as ``re² + im²`` instead of the slower complex ``abs() ** 2``, and the
    product ordered to come out time-major.
    """
    if len(waveform) < MIN_AUDIO_SAMPLES:
        raise MediaError("audio_too_short", f"clip of {len(waveform)} samples is shorter than the "
                         f"{MIN_AUDIO_SAMPLES} samples the log-mel features need")
    window, filters = _log_mel_constants(cfg.n_mels, cfg.sample_rate, cfg.hop_length)
    # torch.stft(center=True)'s own steps, the same floats: its reflect pad kernel (and np.pad's
    # Python set-up) costs several times these three copies, and it transforms a last frame
    # that the extractor drops. Frames come out frame-major, so the product is time-major.
    waveform = np.asarray(waveform, np.float32)
    half = _WHISPER_N_FFT // 2
    padded = np.empty(len(waveform) + 2 * half, np.float32)
    padded[half:-half] = waveform
    padded[:half] = waveform[half:0:-1]
    padded[-half:] = waveform[-2:-half - 2:-1]
    frames = torch.from_numpy(padded).unfold(0, _WHISPER_N_FFT, cfg.hop_length)[:-1] * window
    spectrum = torch.fft.rfft(frames).numpy()
    power = np.square(spectrum.real)
    power += np.square(spectrum.imag)
    features = (torch.from_numpy(power) @ filters).clamp_(min=1e-10).log10_()
    return features.clamp_(min=features.max().item() - 8.0).add_(4.0).div_(4.0)


def audio_encoder_inputs(clips: list[np.ndarray], cfg: AudioConfig) -> dict[str, torch.Tensor]:
    """``{"input_features": float32 [Σ frames, n_mels], "feature_lens": int64 [n]}``,
    clip by clip."""
    features = [audio_features(clip, cfg) for clip in clips]
    # A single clip's features as they are (torch.cat copies) and the lengths through numpy:
    # torch calls cost several times more amid the media work.
    if len(features) == 1:
        stacked = features[0]
    else:
        stacked = (torch.cat(features) if features
                   else torch.empty(0, cfg.n_mels, dtype=torch.float32))
    return {"input_features": stacked,
            "feature_lens": torch.from_numpy(np.array([len(f) for f in features], np.int64))}


def audio_rows_to_tokens(inputs: dict[str, torch.Tensor], cfg: AudioConfig) -> list[int]:
    """Per-clip token counts the encoder emits for ``audio_encoder_inputs`` output."""
    return [audio_tokens_from_frames(frames, cfg) for frames in inputs["feature_lens"].tolist()]
