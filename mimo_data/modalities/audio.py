"""The audio modality: probing at build time, token counts, decoding, encoder inputs, views.

Clips are probed and decoded with soundfile (torchaudio.load needs extra libraries), downmixed,
resampled with ``torchaudio.functional.resample`` (FFmpeg's resampler for rates whose ratio
would make its kernel huge) and featurized as transformers' WhisperFeatureExtractor does
without its 30 s padding. Token counts are pure functions of the
probed metadata (frames, sample rate) and the config, and match what the features give.
"""

from __future__ import annotations

import functools
import io
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TYPE_CHECKING

import av
import numpy as np
import soundfile

from mimo_data.errors import ConfigError
from mimo_data.modalities.base import (MediaError, MediaItem, Modality, item_name,
                                       require_positive)

if TYPE_CHECKING:     # torch is imported where used: metadata commands start without it
    import torch


# soundfile's format names mimo takes, with their member file extensions. WAVEX is WAV with
# WAVE_FORMAT_EXTENSIBLE (what FFmpeg writes for 24-bit or multichannel PCM); RF64 and W64 are
# WAV's 64-bit-size variants.
AUDIO_EXTENSIONS = {"wav": "wav", "wavex": "wav", "rf64": "wav", "w64": "w64", "flac": "flac",
                    "ogg": "ogg", "mp3": "mp3"}
_CONVERT = ("not a format mimo reads (WAV, FLAC, Ogg Vorbis or Opus, MP3): convert it first, "
            "e.g. `ffmpeg -i INPUT clip.flac`")

# libsndfile's SF_ERR_UNRECOGNISED_FORMAT: no format it reads.
_SF_UNRECOGNISED_FORMAT = 1


@dataclass(frozen=True)
class AudioConfig:
    """Audio decoding and Whisper-style log-mel features.

    Clips are downmixed and resampled to ``sample_rate``; features have one frame per
    ``hop_length`` samples; the encoder reduces the frame count by each of ``reductions``
    (ceil division), so tokens = a pure function of duration. Longer than ``max_duration``:
    ``long_audio`` drop (the sample) or truncate (the clip).
    """
    token: str = "<|audio_pad|>"
    wrap: tuple = ()                  # [start, end]: tokens around each clip's placeholders
    sample_rate: int = 16000
    n_mels: int = 80
    hop_length: int = 160
    reductions: tuple = (2, 2)
    max_duration: float = 30.0
    long_audio: str = "drop"

    def validate(self) -> None:
        require_positive("audio", self, "sample_rate", "hop_length", "reductions",
                         "max_duration")
        if self.n_mels not in (80, 128):
            raise ConfigError(f"modalities.audio.n_mels is {self.n_mels}: Whisper uses 80 or 128")
        if self.long_audio not in ("drop", "truncate"):
            raise ConfigError(f"modalities.audio.long_audio is {self.long_audio!r}: "
                              "use drop or truncate")


# libsndfile's frame count for a stream whose header states no length (SF_COUNT_MAX)
UNKNOWN_LENGTH = 2 ** 63 - 1


def probe_audio(data: bytes, check: str = "decode") -> dict:
    """Validate encoded audio; return ``{format, sample_rate, channels, frames, duration}``.

    With ``check="decode"`` every frame is decoded as ``decode_audio`` reads them, and fewer
    than the header states (a truncated file) is ``corrupt_audio``; ``"header"`` takes the
    header's count. An MP3 that states no length (``_length_estimated``) is decoded either way
    and its frames are the decoded ones. Either way a WAV or Ogg file cut short, or chained Ogg
    streams (``_cut_short``: libsndfile reads less than was recorded, as a whole clip), is
    ``corrupt_audio``, as a float WAV holding a NaN or infinite sample is (decoded either way:
    its log-mel features, and every step's loss it is in, would be NaN).
    Raises MediaError(``corrupt_audio`` | ``empty_audio`` | ``unsupported_format``).
    """
    if not data:
        raise MediaError("empty_audio", "empty audio file (0 bytes)")
    try:
        with soundfile.SoundFile(io.BytesIO(data)) as sound:
            fmt = sound.format.lower()
            sample_rate, channels, frames = sound.samplerate, sound.channels, sound.frames
            if frames == UNKNOWN_LENGTH:        # libsndfile then fails to read it at all
                raise MediaError("unsupported_format", f"its {fmt.upper()} header states no "
                                 "length (written to a pipe, as ffmpeg ... -f flac pipe: "
                                 "writes it), which soundfile cannot read; write it to a file "
                                 "again: ffmpeg -i IN OUT.flac")
            estimated = _length_estimated(data, fmt)
            floats = sound.subtype in ("FLOAT", "DOUBLE")    # the only ones holding NaN / inf
            if check == "decode" or estimated or floats:
                # read() returns the frames that decode; blocks() would pad a short last read
                decoded = 0
                while len(chunk := sound.read(1 << 16, dtype="float32", always_2d=True)):
                    if floats and not (finite := np.isfinite(chunk).all(axis=1)).all():
                        first = decoded + int(np.argmin(finite))
                        raise MediaError("corrupt_audio", "float samples that are NaN or "
                                         f"infinite (frame {first} the first): the log-mel "
                                         "features, and the loss, would be NaN; re-export the "
                                         "clip")
                    decoded += len(chunk)
                if estimated:
                    frames = decoded
                elif decoded != frames:
                    raise MediaError("corrupt_audio", _truncated(decoded, frames))
    except MediaError:
        raise
    except Exception as exc:  # libsndfile errors come as soundfile.LibsndfileError / RuntimeError
        raise _undecodable(exc, data) from None
    if fmt not in AUDIO_EXTENSIONS:
        raise MediaError("unsupported_format", f"audio format {fmt!r} is {_CONVERT}")
    if frames == 0:
        raise MediaError("empty_audio", "audio decodes to 0 frames")
    if why := _cut_short(data, fmt):
        raise MediaError("corrupt_audio", f"{why}: it would be read as a shorter clip than was "
                         "recorded, the model hearing part of it; copy the file again "
                         "whole, or re-encode it (e.g. `ffmpeg -i INPUT clip.flac`)")
    return {"format": fmt, "sample_rate": sample_rate, "channels": channels, "frames": frames,
            "duration": round(frames / sample_rate, 6)}


# libsndfile reads a WAV or an Ogg stream cut short to where its bytes end, and chained Ogg
# streams to the end of the first, and states that length as the file's; FFmpeg says nothing
# either, so no frame count tells. What does is in the bytes: a WAV's data chunk states its
# size; an Ogg stream's last page is whole and flagged as its end, and no stream begins after
# one has ended. Hence these checks by hand.

# a 32-bit WAV data size from here on is a writer's placeholder for "unknown" (0xFFFFFFFF by
# most, 0x7fffff00 and 0x80000000 by arecord, 0x7ffff000 by sox writing to a pipe)
_WAV_PLACEHOLDER = 0x7FFF0000
_WAVE64_RIFF = b"riff\x2e\x91\xcf\x11\xa5\xd6\x28\xdb\x04\xc1\x00\x00"


def _cut_short(data: bytes, fmt: str) -> str | None:
    """What shows that libsndfile reads less of a WAV or Ogg file than was recorded, else
    None."""
    if fmt in ("wav", "wavex", "rf64", "w64"):
        return _wav_cut_short(data)
    if fmt == "ogg":
        return _ogg_cut_short(data)
    return None


def _wav_cut_short(data: bytes) -> str | None:
    """A WAV's data chunk stating more bytes than follow it: RIFF, RF64 (whose ds64 chunk holds
    the size) or Wave64 (16-byte chunk ids named by their first four bytes, 8-byte sizes that
    count the 24-byte chunk header, chunks 8-byte aligned). A 32-bit size of 0 or from
    ``_WAV_PLACEHOLDER`` on is a streaming writer's placeholder, not a size."""
    wave64 = data[:16] == _WAVE64_RIFF
    if not wave64 and (data[:4] not in (b"RIFF", b"RF64") or data[8:12] != b"WAVE"):
        return None
    head, align, at, ds64_size = (24, 8, 40, None) if wave64 else (8, 2, 12, None)
    while at + head <= len(data):
        name = data[at:at + 4]
        size = int.from_bytes(data[at + 16:at + 24], "little") - head if wave64 else \
            int.from_bytes(data[at + 4:at + 8], "little")
        if size < 0:
            return None
        if name == b"ds64" and not wave64:
            ds64_size = int.from_bytes(data[at + 16:at + 24], "little")
        if name == b"data":
            stated = wave64 or (size == 0xFFFFFFFF and ds64_size is not None)   # 64-bit sizes
            if size == 0xFFFFFFFF and ds64_size is not None:
                size = ds64_size
            follow = len(data) - at - head
            if follow < size and (stated or 0 < size < _WAV_PLACEHOLDER):
                return f"its data chunk states {size} bytes and {follow} follow"
            return None
        at += head + size + (-size % align)
    return None


def _ogg_cut_short(data: bytes) -> str | None:
    """An Ogg file whose last page is cut, or whole but not flagged as the end of its stream,
    or that chains streams (a stream begins after one ended: ``cat a.ogg b.ogg``, a radio
    rip), of which libsndfile reads the first alone. Its pages are walked from the start
    (they follow one another); bytes after the last whole page that are no page (a tagger's
    ID3v1 tag, say) are left alone."""
    at, flags, ended = 0, None, False
    while at + 27 <= len(data) and data[at:at + 4] == b"OggS" and data[at + 4] == 0:
        flags, body = data[at + 5], at + 27 + data[at + 26]
        end = body + sum(data[at + 27:body]) if body <= len(data) else body
        if end > len(data):
            return "its last Ogg page is cut"
        if flags & 0x02 and ended:
            return ("it chains Ogg streams one after another, of which libsndfile reads the "
                    "first alone")
        ended, at = ended or bool(flags & 0x04), end
    if flags is None:
        return None
    if at < len(data) and data[at:at + 4] == b"OggS"[:len(data) - at]:
        return "its last Ogg page is cut"
    return None if flags & 0x04 else ("its last Ogg page does not end its stream (cut at a "
                                      "page's end, or never closed by its writer)")


def _truncated(decoded: int, stated: int) -> str:
    return f"{decoded} of the {stated} frames its header states decode (a truncated file)"


def _length_estimated(data: bytes, fmt: str) -> bool:
    """Whether libsndfile's frame count of this file is an estimate: an MP3 that states no
    length libsndfile reads (no Xing or Info header in its first frame: a constant-bitrate
    stream written to a pipe, say; libsndfile's mpg123 ignores a VBRI header) is counted from
    its size and first frame's bitrate, a leading ID3 tag's bytes (cover art) taken for audio.
    Such a file's frames are the decoded ones; read by hand (the MPEG frame header), as neither
    soundfile nor PyAV says which count it gives."""
    if fmt != "mp3":
        return False
    audio = 0
    while data[audio:audio + 3] == b"ID3" and len(data) >= audio + 10:   # syncsafe sizes
        audio += 10 + ((data[audio + 6] & 0x7F) << 21 | (data[audio + 7] & 0x7F) << 14 |
                       (data[audio + 8] & 0x7F) << 7 | data[audio + 9] & 0x7F) + \
            (10 if data[audio + 5] & 0x10 else 0)
    for at in range(audio, min(len(data) - 40, audio + (1 << 16))):
        if data[at] == 0xFF and data[at + 1] & 0xE6 in (0xE2, 0xE4, 0xE6) and \
                data[at + 2] >> 4 not in (0, 15) and (data[at + 2] >> 2) & 3 != 3:
            mpeg1, mono = (data[at + 1] >> 3) & 3 == 3, data[at + 3] >> 6 == 3
            side = (17 if mono else 32) if mpeg1 else (9 if mono else 17)
            return data[at + 4 + side:at + 8 + side] not in (b"Xing", b"Info")
    return True


def _undecodable(exc: Exception, data: bytes) -> MediaError:
    """The MediaError for bytes soundfile cannot read: ``unsupported_format`` where FFmpeg finds
    an audio stream in them (AAC in an .m4a, say), or where they are an image or a video
    without sound given as audio (the mix-up named, not corrupt bytes); else
    ``corrupt_audio`` with libsndfile's message (without the in-memory file's name: a memory
    address)."""
    if isinstance(exc, soundfile.LibsndfileError):
        if exc.code == _SF_UNRECOGNISED_FORMAT:
            if image := _image_format(data):
                return MediaError("unsupported_format", f"a {image} image, not audio: give it "
                                  "as an image (the record's image field), not as audio")
            try:
                with av.open(io.BytesIO(data)) as container:
                    # a stream of a codec FFmpeg has no decoder for has no codec context
                    found, video = ([f"{_codec_name(stream)} in {container.format.name}"
                                     for stream in streams]
                                    for streams in (container.streams.audio,
                                                    container.streams.video))
            except av.FFmpegError:
                found = video = []
            if found:
                return MediaError("unsupported_format", f"the audio, {found[0]}, is {_CONVERT}")
            if video:
                return MediaError("unsupported_format", f"a video without sound ({video[0]}), "
                                  "not audio: give it as a video (the record's video field)")
        exc = exc.error_string
    return MediaError("corrupt_audio", f"soundfile cannot decode the audio: {exc}")


def _codec_name(stream) -> str:
    """A stream's codec as FFmpeg names it, or said to be one it has no decoder for."""
    context = stream.codec_context
    return context.name if context is not None else "a codec FFmpeg has no decoder for"


def _image_format(data: bytes) -> str | None:
    """The format Pillow recognizes ``data`` as (its header only), or None."""
    from PIL import Image, UnidentifiedImageError
    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.format
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError,
            SyntaxError):
        return None


def resampled_length(frames: int, sample_rate: int, target_rate: int) -> int:
    """Samples ``torchaudio.functional.resample`` returns for ``frames`` samples.

    torchaudio computes ``ceil(new * frames / orig)`` (rates divided by their gcd) on a float32
    tensor, so for long clips the result can be one below the exact ceiling (e.g. 99830 frames
    at 22050 Hz give 72439 samples at 16 kHz, not 72440); we repeat its float32 arithmetic.
    """
    if sample_rate == target_rate:
        return frames
    gcd = math.gcd(sample_rate, target_rate)
    orig, new = sample_rate // gcd, target_rate // gcd
    return int(np.ceil(np.float32(new * frames / orig)))


def max_audio_samples(cfg: AudioConfig) -> int:
    """Longest clip kept, in samples at ``cfg.sample_rate``."""
    return round(cfg.max_duration * cfg.sample_rate)


def audio_too_long(frames: int, sample_rate: int, cfg: AudioConfig) -> bool:
    """Whether a clip (source frames and rate) makes its sample be dropped.

    True when it resamples to more than ``max_duration`` and ``long_audio`` is ``drop``; with
    ``truncate`` the clip is cut instead (``audio_tokens`` counts the cut clip).
    """
    return (cfg.long_audio == "drop" and
            resampled_length(frames, sample_rate, cfg.sample_rate) > max_audio_samples(cfg))


def audio_frames(num_samples: int, cfg: AudioConfig) -> int:
    """Log-mel frames for ``num_samples`` samples at ``cfg.sample_rate``.

    WhisperFeatureExtractor's centered STFT gives ``num_samples // hop + 1`` frames and drops
    the last one.
    """
    return num_samples // cfg.hop_length


def audio_tokens_from_frames(frames: int, cfg: AudioConfig) -> int:
    """Tokens the audio encoder emits for ``frames`` feature frames (ceil by each reduction)."""
    for reduction in cfg.reductions:
        frames = -(-frames // reduction)
    return frames


def audio_tokens(frames: int, sample_rate: int, cfg: AudioConfig) -> int:
    """Tokens for a clip of ``frames`` source frames at ``sample_rate`` (shard metadata)."""
    samples = resampled_length(frames, sample_rate, cfg.sample_rate)
    if cfg.long_audio == "truncate":
        samples = min(samples, max_audio_samples(cfg))
    return audio_tokens_from_frames(audio_frames(samples, cfg), cfg)


# torchaudio's sinc resampler builds a kernel of new x (orig + 2 * width) floats, the rates
# divided by their gcd: under 300 thousand for the usual rates (44100 -> 16000: 160 x 475,
# 11025 -> 16000: 640 x 455), but rates sharing no large factor make it huge (16001 -> 16000:
# 16000 x 16015 floats, a GiB and seconds a clip). Above this product of the reduced rates
# FFmpeg's resampler (swresample through PyAV, as Whisper's own loader resamples through
# ffmpeg) takes over: a fixed-size filter whatever the rates.
TORCHAUDIO_MAX_RATES_PRODUCT = 1 << 20


def resampler(sample_rate: int, target_rate: int) -> str:
    """Which resampler ``resample`` uses between these rates: ``torchaudio`` or ``ffmpeg``."""
    gcd = math.gcd(sample_rate, target_rate)
    small = (sample_rate // gcd) * (target_rate // gcd) <= TORCHAUDIO_MAX_RATES_PRODUCT
    return "torchaudio" if small else "ffmpeg"


def resample(waveform: np.ndarray, sample_rate: int, target_rate: int) -> np.ndarray:
    """Mono float32 samples at ``target_rate``, ``resampled_length`` of them."""
    import torch
    import torchaudio.functional
    if resampler(sample_rate, target_rate) == "torchaudio":
        return torchaudio.functional.resample(torch.from_numpy(waveform), sample_rate,
                                              target_rate).numpy()
    converter = av.AudioResampler(format="flt", layout="mono", rate=target_rate)
    frame = av.AudioFrame.from_ndarray(waveform[None], format="flt", layout="mono")
    frame.sample_rate = sample_rate
    out = np.concatenate([f.to_ndarray()[0] for f in converter.resample(frame) +
                          converter.resample(None)])
    # swresample ends within a sample of torchaudio's length, which the token counts follow
    length = resampled_length(len(waveform), sample_rate, target_rate)
    return np.pad(out[:length], (0, max(0, length - len(out))))


# The extractor's centered STFT reflect-pads by n_fft // 2 and needs more samples than that.
WHISPER_N_FFT = 400


MIN_AUDIO_SAMPLES = WHISPER_N_FFT // 2 + 1


# Frames decoded past a truncated clip's cut: the resampler's filter reads this far beyond an
# output sample (torchaudio's sinc window and swresample's filter are far shorter), so the kept
# samples are those of the whole clip resampled.
RESAMPLE_MARGIN = 2048


def decode_audio(data: bytes, cfg: AudioConfig, frames: int | None = None) -> np.ndarray:
    """Encoded audio → mono float32 samples at ``cfg.sample_rate``.

    A clip longer than ``max_duration`` is cut with ``long_audio="truncate"`` (its frames past
    the cut, and ``RESAMPLE_MARGIN``, not decoded); with ``"drop"`` it raises
    MediaError(``audio_too_long``) for the caller to count. Undecodable bytes, or another
    frame count than ``frames`` (the shard metadata's; default the header's), raise
    MediaError(``corrupt_audio``): the token counts follow the metadata.
    """
    try:
        with soundfile.SoundFile(io.BytesIO(data)) as sound:
            # libsndfile 1.2 skips an Ogg Opus stream's pre-skip (its encoder's warm-up, 312
            # samples at 48 kHz from libopus/ffmpeg) only after a seek: a read straight after
            # opening starts 6.5 ms early, as soundfile.read and ffmpeg do not
            sound.seek(0)
            rate, stated, fmt = sound.samplerate, sound.frames, sound.format.lower()
            # a clip the cut shortens, of a length its header states: read up to the cut (a
            # 20-minute clip whole took seconds and its waveform's memory, for 30 s kept)
            keep = math.ceil(cfg.max_duration * rate) + RESAMPLE_MARGIN
            cut = cfg.long_audio == "truncate" and stated > keep and \
                not _length_estimated(data, fmt)
            samples = sound.read(keep if cut else -1, dtype="float32", always_2d=True)
    except Exception as exc:  # libsndfile errors come as soundfile.LibsndfileError / RuntimeError
        raise _undecodable(exc, data) from None
    decoded = stated if cut and len(samples) == keep else len(samples)
    if frames is None and decoded != stated and not _length_estimated(data, fmt):
        raise MediaError("corrupt_audio", _truncated(decoded, stated))
    if frames is not None and decoded != frames:
        raise MediaError("corrupt_audio", f"{decoded} frames decode, the shard metadata "
                         f"says {frames}: the file is cut short (a build's --check decode "
                         "refuses it) or changed since the build")
    if audio_too_long(len(samples), rate, cfg):
        raise MediaError("audio_too_long", f"clip of {len(samples) / rate:.2f} s is longer than "
                         f"max_duration = {cfg.max_duration} s; raise modalities.audio."
                         "max_duration or set long_audio: truncate to keep it")
    waveform = samples.mean(axis=1, dtype=np.float32)
    if rate != cfg.sample_rate:
        waveform = resample(waveform, rate, cfg.sample_rate)
    return waveform[:max_audio_samples(cfg)]


@functools.lru_cache(maxsize=8)
def _log_mel_constants(n_mels: int, sample_rate: int, hop_length: int):
    """The extractor's STFT window and mel filter bank ``[n_fft // 2 + 1, n_mels]``, as float32
    tensors, and the samples it pads every clip to (30 s), built once per config."""
    import torch
    from transformers import WhisperFeatureExtractor    # where used (``libraries``)
    extractor = WhisperFeatureExtractor(feature_size=n_mels, sampling_rate=sample_rate,
                                        hop_length=hop_length, n_fft=WHISPER_N_FFT)
    return (torch.hann_window(WHISPER_N_FFT),
            torch.from_numpy(extractor.mel_filters).to(torch.float32), extractor.n_samples)


def audio_features(waveform: np.ndarray, cfg: AudioConfig) -> torch.Tensor:
    """Log-mel features ``float32 [len // hop_length, n_mels]`` (time-major) of one clip.

    The steps of ``WhisperFeatureExtractor._torch_extract_fbank_features`` with its window and
    filter bank (equal up to float rounding, tested), minus its per-call set-up and batching,
    with the power as ``re² + im²`` instead of the slower complex ``abs() ** 2``, and the
    product ordered to come out time-major.
    """
    import torch
    if len(waveform) < MIN_AUDIO_SAMPLES:
        raise MediaError("audio_too_short", f"clip of {len(waveform)} samples is shorter than the "
                         f"{MIN_AUDIO_SAMPLES} samples the log-mel features need")
    window, filters, window_samples = _log_mel_constants(cfg.n_mels, cfg.sample_rate,
                                                         cfg.hop_length)
    # torch.stft(center=True)'s own steps, the same floats: its reflect pad kernel (and np.pad's
    # Python set-up) costs several times these three copies, and it transforms a last frame
    # that the extractor drops. Frames come out frame-major, so the product is time-major.
    # After the clip, the extractor's STFT sees the zeros it pads the clip with to 30 s (a
    # reflection only where the clip fills them): the clip's last frames as Whisper has them.
    waveform = np.asarray(waveform, np.float32)
    half = WHISPER_N_FFT // 2
    padded = np.empty(len(waveform) + 2 * half, np.float32)
    padded[half:-half] = waveform
    padded[:half] = waveform[half:0:-1]
    padded[-half:] = waveform[-2:-half - 2:-1] if len(waveform) >= window_samples else 0.0
    frames = torch.from_numpy(padded).unfold(0, WHISPER_N_FFT, cfg.hop_length)[:-1] * window
    spectrum = torch.fft.rfft(frames).numpy()
    power = np.square(spectrum.real)
    power += np.square(spectrum.imag)
    features = (torch.from_numpy(power) @ filters).clamp_(min=1e-10).log10_()
    return features.clamp_(min=features.max().item() - 8.0).add_(4.0).div_(4.0)


def audio_encoder_inputs(clips: list[np.ndarray], cfg: AudioConfig) -> dict[str, torch.Tensor]:
    """``{"input_features": float32 [Σ frames, n_mels], "feature_lens": int64 [n]}``,
    clip by clip."""
    import torch
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


class AudioModality(Modality):
    name = "audio"
    marker = "<audio>"
    member_prefix = "aud"
    extensions = AUDIO_EXTENSIONS
    config_class = AudioConfig
    libraries = ("transformers.models.whisper.feature_extraction_whisper",)
    item_fields = ("member", "frames", "sample_rate", "duration")
    verified_fields = ("format", "sample_rate", "channels", "frames")
    summary_fields = {"duration": "float64"}
    ansi_color = "\033[1;36m"
    html_color = "#0969da"

    def probe(self, data: bytes, check: str, max_image_pixels: int) -> dict[str, Any]:
        return probe_audio(data, check)

    def decoded_metadata(self, data: bytes) -> dict[str, Any]:
        return probe_audio(data)

    def tokens(self, item: Mapping[str, Any], config: AudioConfig) -> int:
        return audio_tokens(item["frames"], item["sample_rate"], config)

    def item_tokens(self, item: MediaItem, config: AudioConfig) -> int:
        if audio_too_long(item["frames"], item["sample_rate"], config):
            raise MediaError("audio_too_long", f"{item_name(item)} lasts {item['duration']} s, "
                             f"above max_duration {config.max_duration} s (modalities.audio."
                             "long_audio: truncate keeps its first max_duration seconds; a "
                             "pretrained Whisper hears 30 s at most)")
        resampled = resampled_length(item["frames"], item["sample_rate"], config.sample_rate)
        if resampled < MIN_AUDIO_SAMPLES:
            raise MediaError("audio_too_short", f"{item_name(item)} lasts "
                             f"{item['frames'] / item['sample_rate'] * 1000:.1f} ms, "
                             f"{resampled} samples at {config.sample_rate} Hz: fewer than the "
                             f"{MIN_AUDIO_SAMPLES} one log-mel frame needs (Whisper's window)")
        return self.tokens(item, config)

    def variable_tokens(self, config: AudioConfig) -> bool:
        return True

    def decode(self, data: bytes, item: MediaItem, config: AudioConfig) -> np.ndarray:
        return decode_audio(data, config, item["frames"])

    def encoder_inputs(self, decoded: list, config: AudioConfig) -> dict[str, torch.Tensor]:
        return audio_encoder_inputs(decoded, config)

    def rows_to_tokens(self, inputs: dict[str, torch.Tensor], config: AudioConfig) -> list[int]:
        return audio_rows_to_tokens(inputs, config)

    def describe(self, item: Mapping[str, Any]) -> str:
        return (f"{item.get('sample_rate')} Hz {item.get('channels')} ch "
                f"{item.get('duration', 0):.2f} s")

    def preview_png(self, data: bytes, item: Mapping[str, Any], config: AudioConfig
                    ) -> tuple[bytes, str]:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        features = audio_features(decode_audio(data, config), config).numpy()
        figure, axis = plt.subplots(figsize=(3.2, 1.4))
        axis.imshow(features.T, origin="lower", aspect="auto", cmap="magma",
                    extent=(0, len(features) * config.hop_length / config.sample_rate, 0,
                            config.n_mels))
        axis.set_xlabel("s", fontsize=7)
        axis.set_ylabel("mel", fontsize=7)
        axis.tick_params(labelsize=6)
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", dpi=80, bbox_inches="tight")
        plt.close(figure)
        return buffer.getvalue(), ""


AUDIO = AudioModality()
