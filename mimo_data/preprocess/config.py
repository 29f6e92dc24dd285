"""The preprocessing config shared by the preprocessor, the loader, the trainer and mimo-inspect.

Loadable from YAML (``PreprocessConfig.from_yaml``) or a dict::

    tokenizer: ../assets/tokenizer/smollm2   # local HF tokenizer dir or hub name
    chat_template: null                      # override: inline Jinja or a path to a .jinja file
    mode: chat                               # chat | caption
    seq_length: 1024
    length_policy: drop                      # drop | truncate_turns
    positions: sequential                    # sequential | mrope (preprocess/positions.py)
    append_eos: auto                         # auto | true | false (preprocess/end_of_turn.py)
    captions:                                # caption records (record_kinds.py)
      format: plain                          # plain | chat
      prompts: {image: "<image>\nDescribe the image."}   # per modality, for format chat
    documents:                               # interleaved document records (record_kinds.py)
      train_media_wraps: false               # the wrap tokens around each item as targets
    modalities:
      image: {token: "<|image_pad|>", policy: dynamic,
              patch_size: 14, merge_size: 2, temporal_patch_size: 2,
              min_pixels: 3136, max_pixels: 200704}
      audio: {token: "<|audio_pad|>", n_mels: 80, max_duration: 30.0}

``append_eos``: a trained EOS token after each answer whose turn the template does not end with
it; ``auto`` does so when the chat template writes no end-of-turn token (llava-hf's LLaVA-1.5,
as LLaVA's own training does), ``true`` always, ``false`` never.

``captions.format``: how a caption record (one media item and its caption) trains. ``plain``
(the default, as LLaVA's pre-training ``plain`` conversation and Qwen-VL's stage 1 do): the
item's tokens, then the caption and the EOS, only the caption and the EOS trained, no chat
template. ``chat``: as the conversation of ``captions.prompts[modality]`` (a user turn holding
the item's marker where it is to go) and the caption as the answer, rendered as every
conversation is (``mode``, the chat template, ``append_eos``). The default prompts:
``DEFAULT_CAPTION_PROMPTS``; a config gives some and keeps the others.

``documents.train_media_wraps``: an interleaved document trains on its whole text and the EOS
after it; an item's placeholder tokens are never targets, and its wrap tokens are not either
unless this is true (then the model learns where media go).

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

from dataclasses import MISSING, asdict, dataclass, field, fields

import json
import math
import os
import sys
import types
import typing

import yaml

from mimo_data.errors import ConfigError, UnreadableConfig, listed, meant
from mimo_data.files import load_yaml
from mimo_data.hub import shadowed
from mimo_data.modalities import MARKERS, MODALITIES
from mimo_data.preprocess.positions import POSITIONS

# What a config without ``modalities:`` expands.
DEFAULT_MODALITIES = ("image", "audio")
CAPTION_FORMATS = ("plain", "chat")
# The user turn a caption answers in ``captions.format: chat`` (the speech manifests' default
# instruction for audio).
DEFAULT_CAPTION_PROMPTS = {"image": "<image>\nDescribe the image.",
                           "audio": "<audio>\nTranscribe the audio.",
                           "video": "<video>\nDescribe the video."}


@dataclass(frozen=True)
class CaptionConfig:
    """How caption records train (the module docstring)."""
    format: str = "plain"
    prompts: dict = field(default_factory=lambda: dict(DEFAULT_CAPTION_PROMPTS))

    def validate(self) -> None:
        if self.format not in CAPTION_FORMATS:
            raise ConfigError(f"captions.format is {self.format!r}: use "
                              f"{' or '.join(CAPTION_FORMATS)}")
        for name, prompt in self.prompts.items():
            if name not in MARKERS:
                raise ConfigError(f"captions.prompts.{name}: unknown modality (use "
                                  f"{' or '.join(MARKERS)})")
            found = {m: prompt.count(marker) for m, marker in MARKERS.items()
                     if isinstance(prompt, str) and marker in prompt}
            if found != {name: 1}:
                raise ConfigError(f"captions.prompts.{name} is {prompt!r}: it must hold the "
                                  f"marker {MARKERS[name]} once (where the {name} goes) and "
                                  "no other marker")


@dataclass(frozen=True)
class DocumentConfig:
    """How interleaved document records train (the module docstring)."""
    train_media_wraps: bool = False



@dataclass(frozen=True)
class PreprocessConfig:
    tokenizer: str
    seq_length: int = 1024
    mode: str = "chat"
    chat_template: str | None = None
    length_policy: str = "drop"
    positions: str = "sequential"
    append_eos: str | bool = "auto"
    captions: CaptionConfig = field(default_factory=CaptionConfig)
    documents: DocumentConfig = field(default_factory=DocumentConfig)
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
            raise ConfigError(f"modalities {listed(sorted(unknown))} unknown: use "
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
        self.captions.validate()
        if not isinstance(self.documents.train_media_wraps, bool):
            raise ConfigError(f"documents.train_media_wraps is "
                              f"{self.documents.train_media_wraps!r}: use true or false")
        if self.documents.train_media_wraps and not any(m.wrap for m in
                                                        self.modalities.values()):
            raise ConfigError("documents.train_media_wraps is true but no modality has wrap "
                              "tokens (modalities.NAME.wrap) to train")

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
        for key, kind in (("captions", CaptionConfig), ("documents", DocumentConfig)):
            values = data.get(key)
            if isinstance(values, dict):
                values = dict(values)
                if key == "captions" and isinstance(values.get("prompts"), dict):
                    values["prompts"] = {**DEFAULT_CAPTION_PROMPTS, **values["prompts"]}
                data[key] = _make(kind, values, key)
            elif values is None:            # the key alone (its settings commented out)
                data.pop(key, None)
            elif not isinstance(values, kind):
                raise ConfigError(f"{key} is {values!r}: give a mapping of its settings")
        if given:             # (the rules between fields see the modalities given)
            data["modalities"] = modalities
        return _make(cls, data, "preprocess")

    @classmethod
    def from_yaml(cls, path: str, *, paths_exist: bool = True) -> PreprocessConfig:
        """Load a YAML; its tokenizer and chat_template paths resolve against its folder (and
        must exist there unless ``paths_exist`` is False: the YAML only read, not used)."""
        derive = ("a preprocessing config YAML is made from a model's folder with `mimo-train "
                  "--preprocessing-for MODEL_DIR > preprocess.yaml`")
        if os.path.isdir(path):
            raise ConfigError(f"{path} is a folder (a model's?), not a preprocessing config: "
                              f"{derive}")
        try:
            with open(path) as handle:
                data = load_yaml(handle)
        except OSError as error:
            raise UnreadableConfig(f"cannot read the preprocessing config {path}: "
                                   f"{error.strerror or error}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{path} is not a text file, so no YAML: {derive}") from None
        except yaml.YAMLError as error:
            raise ConfigError(f"{path} is not valid YAML: {error}") from None
        if data is None:          # the file of a `--preprocessing-for MODEL > it` that failed
            raise ConfigError(f"{path} holds no setting (an empty file): {derive}")
        if not isinstance(data, dict):
            raise ConfigError(f"{path} holds a {type(data).__name__}, not the mapping of "
                              f"settings a preprocessing config is: {derive}")
        if {"model_type", "architectures"} & data.keys():
            raise ConfigError(f"{path} is a transformers model config, not a preprocessing "
                              f"config: {derive}")
        if "data" in data and {"model", "train", "layout", "optimizer"} & data.keys():
            named = (data["data"] or {}).get("preprocess") \
                if isinstance(data["data"], dict) else None
            if isinstance(named, str):          # as the training config reads it
                named = os.path.normpath(os.path.join(os.path.dirname(path),
                                                      os.path.expanduser(named)))
            raise ConfigError(f"{path} is a training config, not a preprocessing config: give "
                              "the one its data.preprocess names" + (
                                  f", {named}" if named else f"; {derive}"))
        data = dict(data)
        for key, kind in (("tokenizer", "directory"), ("chat_template", "file")):
            if isinstance(data.get(key), str):
                data[key] = _resolve(data[key], key, kind if paths_exist else None, path)
        try:
            return cls.from_dict(data)
        except ConfigError as error:
            raise ConfigError(f"{path}: {error}") from None

    def to_dict(self) -> dict:
        return asdict(self)

    def changes_from(self, saved: dict) -> list[str]:
        """Each setting that differs from ``saved`` (a ``to_dict`` as JSON kept it, perhaps
        by an older mimo: read again, so a setting it did not have is its default), as
        ``modalities.image.max_pixels 200704 (was 12845056)``, in the config's order."""
        try:
            saved = PreprocessConfig.from_dict(saved).to_dict()
        except ConfigError:         # a setting this mimo no longer reads: compared as kept
            pass
        now, was = json.loads(json.dumps([self.to_dict(), saved]))     # tuples as lists
        return [f"{key} {value!r} (was {before!r})" for key, value, before in
                _differing(now, was, "")]


def _differing(now, was, key: str):
    """``(dotted key, now, was)`` of each leaf where ``now`` and ``was`` differ."""
    if isinstance(now, dict) and isinstance(was, dict):
        for name in [*now, *(k for k in was if k not in now)]:
            yield from _differing(now.get(name), was.get(name), f"{key}.{name}" if key else name)
    elif now != was:
        yield key, now, was


def _make(kind, values: dict, where: str):
    """Dataclass ``kind`` from a section's ``values``, each of its field's type (a YAML list
    for a tuple; a number's text, ``1e-4``, for a float): ConfigError naming the key, never a
    traceback from the code that uses it or a wrong count from a ``merge_size: 2.5``."""
    names = {f.name for f in fields(kind)}
    unknown = set(values) - names
    if unknown:
        # the file's own keys are its top level, not a section named "preprocess"
        raise ConfigError(("unknown top-level key(s)" if where == "preprocess" else
                           f"{where}: unknown key(s)") + f" {listed(sorted(unknown))}"
                          f"{meant(sorted(unknown), sorted(names))}; known: "
                          f"{listed(sorted(names))}")
    missing = sorted(f.name for f in fields(kind) if f.name not in values
                     and f.default is MISSING and f.default_factory is MISSING)
    prefix = "" if where == "preprocess" else f"{where}."
    if missing:
        raise ConfigError(f"{prefix}{missing[0]} is missing" + (
            ": give the model's tokenizer (a local folder or a hub name)"
            if missing[0] == "tokenizer" else ""))
    hints = typing.get_type_hints(kind)
    return kind(**{name: _typed(hints[name], value, prefix + name)
                   for name, value in values.items()})


_KIND_NAMES = {int: "a whole number", float: "a number", str: "text", bool: "true or false",
               tuple: "a list", dict: "a mapping", type(None): "null"}


def _typed(hint, value, key: str):
    """``value`` as a field of type ``hint`` (a class, or a union of them); a list's ``null``
    is an empty one (``wrap: null``: no wrap)."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    for option in options:
        if option is float and isinstance(value, (str, float)):     # YAML's .nan, .inf too
            try:
                number = float(value)
            except ValueError:
                continue
            if math.isfinite(number):
                return number
            continue
        if option is tuple and isinstance(value, list):
            return tuple(value)
        if option is tuple and value is None:
            return ()
        if option is float and isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, option) and not (isinstance(value, bool) and option is not bool):
            return value
    wanted = " or ".join(_KIND_NAMES.get(option, option.__name__) for option in options)
    written = _whole(value) if int in options else None
    example = (f", e.g. [{value}, ...]" if tuple in options and isinstance(value, str) else
               f" (write {written}" + ((", without quotes)" if _number_unquoted(value) else
                                         f": YAML reads {value} as text)")
                                        if isinstance(value, str) else ")")
               if written is not None else "")
    raise ConfigError(f"{key} is {value!r} ({type(value).__name__}): it must be "
                      f"{wanted}{example}")


def _whole(value) -> int | None:
    """The whole number a float or a number's text (``1e6``, which YAML reads as text) is;
    None where it is none."""
    try:
        number = float(value) if isinstance(value, (str, float)) else None
    except ValueError:
        return None
    return int(number) if number is not None and number.is_integer() else None


def _number_unquoted(text: str) -> bool:
    """Whether YAML reads ``text`` written without quotes as a number (``1024``, ``1.0e+6``;
    not ``1e6``, which it reads as text)."""
    try:
        return isinstance(yaml.safe_load(text), (int, float))
    except yaml.YAMLError:
        return False


def looks_like_path(value: str, base: str = ".") -> bool:
    """Whether a tokenizer or chat_template value is a path (see the module docstring)."""
    if "\n" in value or "{" in value:                  # inline Jinja
        return False
    return (value.startswith((".", "/", "~")) or value.count("/") > 1 or value.endswith(".jinja")
            or os.path.exists(os.path.join(base, os.path.expanduser(value))))


def wrong_path(named: str, value: str, resolved: str, kind: str, relative_hint: str) -> str:
    """The refusal of a path ``value`` that is no ``kind`` ("directory", "file") at
    ``resolved``: ``named`` (the key and value), then, for a relative one, where it led and
    ``relative_hint``, for an absolute one (``~`` expanded) that alone."""
    state = f"is not a {kind}" if os.path.exists(resolved) else "is not there"
    expanded = os.path.expanduser(value)
    if os.path.isabs(expanded):
        return f"{named} {state}" if expanded == value else f"{named} ({expanded}) {state}"
    return f"{named} is {resolved}, which {state}{relative_hint}"


def _resolve(value: str, key: str, kind: str | None, yaml_path: str) -> str:
    """``value`` of ``key`` as an absolute path when it is one (against the YAML's folder),
    which must be a ``kind`` ("directory" or "file"; None: not checked)."""
    base = os.path.dirname(os.path.abspath(yaml_path))
    if not looks_like_path(value, base):
        found = shadowed(value, key, os.path.join(base, value)) if key == "tokenizer" else None
        if found is not None:
            raise ConfigError(f"{yaml_path}: {found}")
        return value
    resolved = os.path.normpath(os.path.join(base, os.path.expanduser(value)))
    if kind is None:
        return resolved
    exists = os.path.isdir(resolved) if kind == "directory" else os.path.isfile(resolved)
    if not exists:
        raise ConfigError(wrong_path(f"{key}: {value!r} in {yaml_path}", value, resolved, kind,
                                     "; paths are relative to the YAML's folder")
                          + (" (or give a hub name such as HuggingFaceTB/SmolLM2-135M-Instruct)"
                             if key == "tokenizer" else ""))
    return resolved
