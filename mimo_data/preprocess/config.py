"""The preprocessing config shared by the preprocessor, the loader, the trainer and mimo-inspect.

Loadable from YAML (``PreprocessConfig.from_yaml``) or a dict::

    tokenizer: ../assets/tokenizer/smollm2   # local HF tokenizer dir or hub name
    chat_template: null                      # override: inline Jinja or a path to a .jinja file
    mode: chat                               # chat | caption
    seq_length: 1024
    length_policy: drop                      # drop | truncate_turns
    positions: sequential                    # sequential | mrope (preprocess/positions.py)
    append_eos: auto                         # auto | true | false (preprocess/end_of_turn.py)
    modalities:
      image: {token: "<|image_pad|>", policy: dynamic,
              patch_size: 14, merge_size: 2, temporal_patch_size: 2,
              min_pixels: 3136, max_pixels: 200704}
      audio: {token: "<|audio_pad|>", n_mels: 80, max_duration: 30.0}

``append_eos``: a trained EOS token after each answer whose turn the template does not end with
it; ``auto`` does so when the chat template writes no end-of-turn token (llava-hf's LLaVA-1.5,
as LLaVA's own training does), ``true`` always, ``false`` never.

A modality's ``wrap: [start, end]`` puts those tokens around each item's placeholders (Qwen2-VL:
``[<|vision_start|>, <|vision_end|>]``); they are text tokens, never trained.

Without ``modalities:`` images and audio take their defaults (video is configured by name: its
encoder is a Qwen2-VL tower); ``modalities: {}`` is text only (samples with media markers of
a modality the config lacks are then dropped and counted).

In a YAML, ``tokenizer:`` and a ``chat_template:`` file are relative to the YAML's folder, not
to the working directory. A value is a path when it starts with ``.``, ``/`` or ``~``, has
more than one ``/`` (a hub name has one at most) or exists beside the YAML; otherwise the
tokenizer is a hub name (``HuggingFaceTB/SmolLM2-135M-Instruct``) and the template inline Jinja.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace

import os
import sys

import yaml

from mimo_data.errors import ConfigError
from mimo_data.modalities import MARKERS, MODALITIES
from mimo_data.preprocess.positions import POSITIONS

# What a config without ``modalities:`` expands.
DEFAULT_MODALITIES = ("image", "audio")



@dataclass(frozen=True)
class PreprocessConfig:
    tokenizer: str
    seq_length: int = 1024
    mode: str = "chat"
    chat_template: str | None = None
    length_policy: str = "drop"
    positions: str = "sequential"
    append_eos: str | bool = "auto"
    modalities: dict = field(default_factory=lambda: {
        name: MODALITIES[name].config_class() for name in DEFAULT_MODALITIES})

    def __post_init__(self):
        if self.mode not in ("chat", "caption"):
            raise ConfigError(f"mode is {self.mode!r}: use chat or caption")
        if self.length_policy not in ("drop", "truncate_turns"):
            raise ConfigError(f"length_policy is {self.length_policy!r}: "
                              "use drop or truncate_turns")
        if self.positions not in POSITIONS:
            raise ConfigError(f"positions is {self.positions!r}: use {' or '.join(POSITIONS)}")
        if not (self.append_eos == "auto" or isinstance(self.append_eos, bool)):
            raise ConfigError(f"append_eos is {self.append_eos!r}: use auto, true or false")
        if self.seq_length < 2:
            raise ConfigError(f"seq_length is {self.seq_length}: it must be at least 2")
        unknown = set(self.modalities) - set(MODALITIES)
        if unknown:
            raise ConfigError(f"modalities {sorted(unknown)} unknown: use "
                              f"{' and/or '.join(MODALITIES)}")
        tokens = [m.token for m in self.modalities.values()]
        if len(set(tokens)) != len(tokens):
            raise ConfigError("each modality needs its own special token")
        # a modality's token may be its own marker (LLaVA's <image>): each marker then expands
        # into runs of itself; another modality's marker would be read as that modality's
        others = [(name, m.token) for name, m in self.modalities.items()
                  if m.token in MARKERS.values() and m.token != MARKERS[name]]
        if others:
            name, token = others[0]
            raise ConfigError(f"modalities.{name}.token {token!r} is another modality's text "
                              f"marker; use e.g. <|image_pad|>")
        for name, modality in self.modalities.items():
            wrap = modality.wrap
            if wrap and (len(wrap) != 2 or set(wrap) & (set(tokens) | set(MARKERS.values()))):
                raise ConfigError(f"modalities.{name}.wrap is {list(wrap)}: give two tokens "
                                  "(start, end) other than the modality tokens and the markers")
            modality.validate()

    @classmethod
    def from_dict(cls, data: dict) -> PreprocessConfig:
        """Build from plain data (e.g. parsed YAML); unknown keys are errors, not ignored."""
        data = dict(data)
        given = data.get("modalities") is not None    # `modalities: {}` means text only
        modalities = {}
        for name, values in (data.pop("modalities", None) or {}).items():
            if name not in MODALITIES:
                raise ConfigError(f"modalities.{name}: unknown modality (use "
                                  f"{' or '.join(MODALITIES)})")
            values = dict(values or {})
            if "encoder" in values:
                encoder = values.pop("encoder")
                print(f"mimo: modalities.{name}.encoder ({encoder!r}) is deprecated and "
                      f"ignored: the encoder inputs are keyed by the modality name ({name!r}); "
                      "remove the key", file=sys.stderr)
            modalities[name] = _make(MODALITIES[name].config_class, values,
                                     f"modalities.{name}")
        config = _make(cls, data, "preprocess")
        return replace(config, modalities=modalities) if given else config

    @classmethod
    def from_yaml(cls, path: str) -> PreprocessConfig:
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
