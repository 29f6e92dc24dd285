"""The preprocessing config shared by the preprocessor, the loader, the trainer and mimo-inspect.

Loadable from YAML (``PreprocessConfig.from_yaml``) or a dict::

    tokenizer: ../assets/tokenizer/smollm2   # local HF tokenizer dir or hub name
    chat_template: null                      # override: inline Jinja or a path to a .jinja file
    mode: chat                               # chat | caption
    seq_length: 1024
    length_policy: drop                      # drop | truncate_turns
    modalities:
      image: {token: "<|image_pad|>", encoder: vision, policy: dynamic,
              patch_size: 14, merge_size: 2, temporal_patch_size: 2,
              min_pixels: 3136, max_pixels: 200704}
      audio: {token: "<|audio_pad|>", encoder: whisper, n_mels: 80, max_duration: 30.0}

In a YAML, ``tokenizer:`` and a ``chat_template:`` file are relative to the YAML's folder, not
to the working directory. A value is a path when it starts with ``.``, ``/`` or ``~``, has
more than one ``/`` (a hub name has one at most) or exists beside the YAML; otherwise the
tokenizer is a hub name (``HuggingFaceTB/SmolLM2-135M-Instruct``) and the template inline Jinja.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace

import os

import yaml

from mimo_data.shards.format import MARKERS

# OpenAI CLIP normalization, the default of Qwen2-VL and CLIP image processors.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class ConfigError(ValueError):
    """A config value that cannot work; the message names the field and what to change."""


@dataclass(frozen=True)
class ImageConfig:
    """Image decoding and the encoder's input layout.

    ``dynamic`` (Qwen2-VL): resize so both sides are multiples of ``patch_size * merge_size``
    within [min_pixels, max_pixels]; ``(h/(patch*merge)) * (w/(patch*merge))`` tokens.
    ``fixed`` (CLIP/SigLIP): resize to ``image_size`` square; ``(image_size/patch)^2`` tokens.
    """
    token: str = "<|image_pad|>"
    encoder: str = "vision"
    policy: str = "dynamic"
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 256 * 28 * 28
    image_size: int = 224
    mean: tuple = CLIP_MEAN
    std: tuple = CLIP_STD
    max_image_pixels: int = 89_478_485   # decode refuses larger images (decompression bombs)

    def validate(self) -> None:
        if self.policy not in ("dynamic", "fixed"):
            raise ConfigError(f"modalities.image.policy is {self.policy!r}: use dynamic or fixed")
        if self.policy == "fixed" and self.image_size % self.patch_size:
            raise ConfigError(f"modalities.image.image_size {self.image_size} is not a multiple "
                              f"of patch_size {self.patch_size}")
        if self.policy == "dynamic" and self.min_pixels > self.max_pixels:
            raise ConfigError("modalities.image.min_pixels is above max_pixels")


@dataclass(frozen=True)
class AudioConfig:
    """Audio decoding and Whisper-style log-mel features.

    Clips are downmixed and resampled to ``sample_rate``; features have one frame per
    ``hop_length`` samples; the encoder reduces the frame count by each of ``reductions``
    (ceil division), so tokens = a pure function of duration. Longer than ``max_duration``:
    ``long_audio`` drop (the sample) or truncate (the clip).
    """
    token: str = "<|audio_pad|>"
    encoder: str = "whisper"
    sample_rate: int = 16000
    n_mels: int = 80
    hop_length: int = 160
    reductions: tuple = (2, 2)
    max_duration: float = 30.0
    long_audio: str = "drop"

    def validate(self) -> None:
        if self.n_mels not in (80, 128):
            raise ConfigError(f"modalities.audio.n_mels is {self.n_mels}: Whisper uses 80 or 128")
        if self.long_audio not in ("drop", "truncate"):
            raise ConfigError(f"modalities.audio.long_audio is {self.long_audio!r}: "
                              "use drop or truncate")


_MODALITY_CONFIGS = {"image": ImageConfig, "audio": AudioConfig}


@dataclass(frozen=True)
class PreprocessConfig:
    tokenizer: str
    seq_length: int = 1024
    mode: str = "chat"
    chat_template: str | None = None
    length_policy: str = "drop"
    modalities: dict = field(default_factory=lambda: {"image": ImageConfig(),
                                                      "audio": AudioConfig()})

    def __post_init__(self):
        if self.mode not in ("chat", "caption"):
            raise ConfigError(f"mode is {self.mode!r}: use chat or caption")
        if self.length_policy not in ("drop", "truncate_turns"):
            raise ConfigError(f"length_policy is {self.length_policy!r}: "
                              "use drop or truncate_turns")
        if self.seq_length < 2:
            raise ConfigError(f"seq_length is {self.seq_length}: it must be at least 2")
        unknown = set(self.modalities) - set(_MODALITY_CONFIGS)
        if unknown:
            raise ConfigError(f"modalities {sorted(unknown)} unknown: use image and/or audio")
        tokens = [m.token for m in self.modalities.values()]
        if len(set(tokens)) != len(tokens):
            raise ConfigError("each modality needs its own special token")
        if set(tokens) & set(MARKERS.values()):
            raise ConfigError(f"a modality token cannot be a text marker {sorted(MARKERS.values())}"
                              "; use e.g. <|image_pad|>")
        for modality in self.modalities.values():
            modality.validate()

    @classmethod
    def from_dict(cls, data: dict) -> "PreprocessConfig":
        """Build from plain data (e.g. parsed YAML); unknown keys are errors, not ignored."""
        data = dict(data)
        modalities = {}
        for name, values in (data.pop("modalities", None) or {}).items():
            kind = _MODALITY_CONFIGS.get(name)
            if kind is None:
                raise ConfigError(f"modalities.{name}: unknown modality (use image or audio)")
            modalities[name] = _make(kind, values or {}, f"modalities.{name}")
        config = _make(cls, data, "preprocess")
        return config if not modalities else replace(config, modalities=modalities)

    @classmethod
    def from_yaml(cls, path: str) -> "PreprocessConfig":
        """Load a YAML; its tokenizer and chat_template paths resolve against its folder."""
        with open(path) as handle:
            data = yaml.safe_load(handle) or {}
        if isinstance(data, dict):
            data = dict(data)
            for key, kind in (("tokenizer", "directory"), ("chat_template", "file")):
                if isinstance(data.get(key), str):
                    data[key] = _resolve(data[key], key, kind, path)
        return cls.from_dict(data)

    def to_dict(self) -> dict:
        return asdict(self)


def _make(kind, values: dict, where: str):
    names = {f.name for f in fields(kind)}
    unknown = set(values) - names
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)}; known: {sorted(names)}")
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    return kind(**values)


def looks_like_path(value: str, base: str = ".") -> bool:
    """Whether a tokenizer or chat_template value is a path (see the module docstring)."""
    if "\n" in value or "{" in value:                  # inline Jinja
        return False
    return (value.startswith((".", "/", "~")) or value.count("/") > 1 or value.endswith(".jinja")
            or os.path.exists(os.path.join(base, os.path.expanduser(value))))


def _resolve(value: str, key: str, kind: str, yaml_path: str) -> str:
    """``value`` of ``key`` as an absolute path when it is one (against the YAML's folder)."""
    base = os.path.dirname(os.path.abspath(yaml_path))
    if not looks_like_path(value, base):
        return value
    resolved = os.path.normpath(os.path.join(base, os.path.expanduser(value)))
    exists = os.path.isdir(resolved) if kind == "directory" else os.path.isfile(resolved)
    if not exists:
        raise ConfigError(f"{key}: {value!r} in {yaml_path} is {resolved}, which is not a "
                          f"{kind}; paths are relative to the YAML's folder"
                          + (" (or give a hub name such as HuggingFaceTB/SmolLM2-135M-Instruct)"
                             if key == "tokenizer" else ""))
    return resolved
