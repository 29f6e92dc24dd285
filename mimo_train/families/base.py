"""What every family module shares: the encoder contract and its errors, the projection, the
weights of a transformers checkpoint read by name, and ``VLM``, what mimo takes from a whole
vision-language checkpoint (``preprocessing_fit`` checks a run's preprocessing against it).

The encoder contract (docs/architecture.md, "One sample"): an encoder class is built as
``cls(modality_config, hidden_size, num_layers, num_attention_heads, pretrained)`` (random init
from the dims, or the transformers model at ``pretrained``), reads its weights in fp32 whatever
dtype the checkpoint stores (``precision.cast`` later moves it to the run's dtype), has
``output_size``, takes exactly the inputs ``mimo_data`` produces for its modality and emits one
row per placeholder token, item by item. ``takes`` names those inputs: ``(modality, form)``,
the form being the image policy (``dynamic`` / ``fixed``) or ``log-mel``. Pixel normalization
happens in the encoder, on its device (``image.normalize_pixels``). A transformers processor
saved beside the model (``processor_settings``: transformers' own readers) must agree with
the preprocessing config (``check_preprocessor``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mimo_data.errors import listed
from mimo_data.modalities.image import ImageConfig
from mimo_train.errors import EncoderBuildError, TrainConfigError


# Encoder inputs an encoder reads on the host (clip lengths that cut its batch, the grids the
# Qwen-family towers derive positions and boundaries from): they stay in host memory, so
# reading them never waits for the device.
HOST_INPUTS = frozenset({"feature_lens", "image_grid_thw", "video_grid_thw"})


def input_form(modality: str, modality_config) -> tuple[str, str]:
    """What the preprocessing gives an encoder of ``modality``: ``(modality, form)``."""
    return (modality, "log-mel" if modality == "audio" else modality_config.policy)


def param_dtype(module: torch.nn.Module) -> torch.dtype:
    return next(module.parameters()).dtype


class Encoder(torch.nn.Module):
    """The encoder contract (above): ``takes``, ``output_size``, ``deepstack``, and the width
    a pretrained model's config gives before the encoder is built. An encoder whose weights
    also encode other modalities (Qwen2-VL's tower: video) lists them in ``also_takes``; one encoder
    module then serves them all (``take_also`` gives it their configs, ``encode_together``
    their inputs: one ``encode`` per modality unless the encoder takes them in one call)."""
    takes: tuple[str, str]
    also_takes: tuple[str, ...] = ()
    output_size: int
    # rows carry deepstack features after the main ``output_size`` columns (Qwen3-VL:
    # ``mcore.deepstack``), which no projection but ``none`` passes on
    deepstack: bool = False
    # each item is encoded on its own, and each temporal patch of a clip (attention, positions
    # and windows within the frame; a tower of images alone: each image): a micro-batch's
    # media cut between items or temporal patches give the same rows, so ``data.split_media``
    # may spread them over the module's ranks
    frame_independent: bool = False
    # its transformers tower attends within items given their boundaries (``cu_seqlens``) in
    # one call: ``model.tower_attention``'s varlen kernel serves it on GPUs
    attends_by_boundaries: bool = False
    # a randomly initialized tower's head size (hidden / heads) is a multiple of this (its
    # rotary position embedding's pairs over the patch rows and columns: Qwen2-VL's, 4)
    head_dim_multiple: int = 1

    @property
    def row_width(self) -> int:
        """The width of the rows it emits (``output_size`` but with deepstack features)."""
        return self.output_size

    @classmethod
    def check_processor(cls, pretrained: str | None, modality_config) -> None:
        """EncoderBuildError where the processor saved beside the checkpoint ``pretrained``
        preprocesses otherwise than ``modality_config`` (``check_preprocessor``): called when
        the encoder is built, and by the run's start-up checks before (``check_fit``)."""

    def take_also(self, modality: str, modality_config) -> None:
        """Serve ``modality`` (one of ``also_takes``) as preprocessed by ``modality_config``
        (EncoderBuildError if its geometry cannot give the preprocessor's token counts)."""
        raise EncoderBuildError(f"{type(self).__name__} encodes {self.takes[0]} only, "
                                f"not {modality}")

    def encode(self, modality: str, **inputs: torch.Tensor) -> torch.Tensor:
        """One row per placeholder token of the ``modality`` items in ``inputs``."""
        return self(**inputs)

    def encode_together(self, inputs: dict[str, dict]) -> torch.Tensor:
        """The rows of several modalities' items (``{modality: its inputs}``), one modality
        after another in ``inputs``' order: each ``encode``d (a tower that can take them in
        one call does)."""
        return torch.cat([self.encode(modality, **kwargs) for modality, kwargs in inputs.items()])

    @staticmethod
    def random_config(modality_config, hidden_size: int, num_layers: int,
                      num_attention_heads: int):
        """The transformers config of a randomly initialised encoder of these dims."""
        raise EncoderBuildError("this encoder kind is built from a checkpoint only")

    @classmethod
    def build_tower(cls, config, dtype: torch.dtype | None = None) -> torch.nn.Module:
        """The transformers tower (``model``) this encoder holds for ``config`` (a checkpoint's
        transformers config or ``random_config``'s), randomly initialised, in ``dtype`` (None:
        as transformers builds it)."""
        raise NotImplementedError

    @classmethod
    def checkpoint_types(cls) -> tuple[str, ...]:
        """The ``model_type`` of the checkpoints (or of their ``vision_config``) this encoder
        is built from, besides its family's whole VLM; () where not checked."""
        return ()

    @staticmethod
    def pretrained_output_size(config) -> int:
        """The rows' width of the encoder built from ``config`` (its transformers config)."""
        config = getattr(config, "vision_config", None) or config
        return getattr(config, "d_model", None) or config.hidden_size


def check_preprocessor(pretrained: str | None, expected: dict[str, tuple[str, Any]],
                       part: str = "image") -> None:
    """Refuse a ``pretrained`` checkpoint whose processor ``part`` (``processor_settings``: the
    transformers processor saved beside the model) disagrees with mimo's preprocessing:
    ``expected`` maps its field to (our config key, our value). Without such a file, nothing
    to check."""
    found = processor_settings(model_directory(pretrained), part) if pretrained else None
    if found is None:
        return
    where, saved = found
    differ = [(field, key, value) for field, (key, value) in expected.items()
              if field in saved and not (np.shape(saved[field]) == np.shape(value)
                                         and np.allclose(saved[field], value, rtol=0,
                                                         atol=1e-6))]
    if differ:
        wrong = [f"{field} {saved[field]} (ours: {key} {value})" for field, key, value in differ]
        # the config's own keys (not a constant of mimo's, "the uint8 scale")
        settable = [f"{key}: {saved[field]}" for field, key, _ in differ
                    if key.startswith("modalities.")]
        raise EncoderBuildError(f"{where} preprocesses differently: {'; '.join(wrong)}: the "
                                "encoder would see other inputs than it was trained on; align "
                                "the preprocessing config" + (
                                    f": set {'; '.join(settable)}" if settable else ""))


def check_fixed_geometry(image_size: int, patch_size: int, image: ImageConfig,
                         what: str) -> None:
    """``EncoderBuildError`` unless a fixed-size tower (``what``) takes the preprocessing's
    image and patch sizes."""
    if (image_size, patch_size) != (image.image_size, image.patch_size):
        raise EncoderBuildError(
            f"{what} takes {image_size}px images in {patch_size}px patches; the preprocessing "
            f"config gives {image.image_size}px / {image.patch_size}px: align modalities.image")


def normalization(image: ImageConfig) -> dict[str, tuple[str, Any]]:
    """The image processor's normalization fields and ours (``normalize_pixels``)."""
    return {"image_mean": ("modalities.image.mean", list(image.mean)),
            "image_std": ("modalities.image.std", list(image.std)),
            "rescale_factor": ("the uint8 scale", 1 / 255)}


class Projection(torch.nn.Sequential):
    """Encoder hidden size -> language hidden size (``model.projection``): one Linear
    (``linear``), Linear-GELU-Linear (``mlp``, LLaVA's projector), or nothing (``none``: the
    identity, for a tower that already emits the language width, as Qwen2-VL's merger does).
    ``initial``: weights to start from (a whole VLM's projector), else the seeded init."""

    def __init__(self, in_features: int, out_features: int, kind: str,
                 initial: dict[str, torch.Tensor] | None = None):
        if kind == "none":              # the tower already outputs the language width
            if in_features != out_features:
                raise EncoderBuildError(f"projection none, but the encoder emits "
                                        f"{in_features} features for a language width of "
                                        f"{out_features}: use linear or mlp")
            super().__init__()
        elif kind == "mlp":
            super().__init__(torch.nn.Linear(in_features, out_features), torch.nn.GELU(),
                             torch.nn.Linear(out_features, out_features))
        else:
            super().__init__(torch.nn.Linear(in_features, out_features))
        if initial is not None:
            self.load_state_dict(initial)


def checkpoint_value(config, name: str, path: str, key: str):
    """The checkpoint config's value ``name``, read where its format keeps it: the text
    config a whole VLM's transformers config holds (built from the top-level keys of a flat
    config, as Qwen2-VL publishes it), else the top config; with transformers' defaults. A
    value neither has is a ``TrainConfigError`` naming the file and the key."""
    for where in (config.get_text_config(), config):
        value = getattr(where, name, None)
        if value is not None:
            return value
    raise TrainConfigError(f"{key}: {os.path.join(path, 'config.json')} has no {name!r} (at "
                           "the top level or in text_config), and transformers gives it no "
                           "default: add it to the checkpoint's config.json")


def model_directory(path: str) -> str:
    """The local directory of the model at ``path``: ``path`` itself, or the local hub cache's
    snapshot of the hub name ``path`` (never a download: run time has no network)."""
    if os.path.isdir(path):
        return path
    from huggingface_hub import snapshot_download
    return snapshot_download(path, local_files_only=True)


def processor_settings(directory: str, part: str) -> tuple[str, dict] | None:
    """The settings transformers builds the checkpoint's processor ``part`` (``image``,
    ``video``, ``audio``) from, read by transformers' own readers from the model
    ``directory`` (transformers 5's nested ``processor_config.json`` first, then the part's
    file; a video processor's: then the image processor's): (what they are, the settings),
    or None where none is saved. ``TrainConfigError`` where a file is no JSON."""
    from transformers.feature_extraction_utils import FeatureExtractionMixin
    from transformers.image_processing_base import ImageProcessingMixin
    from transformers.video_processing_utils import BaseVideoProcessor
    read = {"image": ImageProcessingMixin.get_image_processor_dict,
            "video": BaseVideoProcessor.get_video_processor_dict,
            "audio": FeatureExtractionMixin.get_feature_extractor_dict}[part]
    try:
        settings, _ = read(directory, local_files_only=True)
    except OSError as error:
        if "valid JSON" in str(error):      # transformers' words for a file it cannot parse
            raise TrainConfigError(f"{error}: transformers cannot build the checkpoint's "
                                   "processor from it; save the processor again") from None
        # none saved; for videos, a nested image processor stands in as its file would
        return processor_settings(directory, "image") if part == "video" else None
    return f"the {part} processor saved in {directory}", settings


class Tensors:
    """Tensors by name, read in part: ``part(name, index)`` gives the basic slices ``index``
    of tensor ``name`` (the whole without one), ``shape(name)`` its shape. Built on a function
    reading a whole tensor (a dict's ``__getitem__``), a part is cut from the whole;
    ``CheckpointWeights`` reads only the part."""

    def __init__(self, read: Callable[[str], torch.Tensor]):
        self.read = read

    def part(self, name: str, index: tuple[slice, ...] = ()) -> torch.Tensor:
        # a part cut from a whole is cloned, so the whole is freed when the part is kept
        return self.read(name)[index].clone() if index else self.read(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.read(name).shape)


# the weight files transformers loads, in its order of preference: a single file before an
# index naming shards (a sharded save into a folder that held a single file leaves it there),
# safetensors before pickles
_WEIGHT_FILES = (("model.safetensors", "model.safetensors.index.json"),
                 ("pytorch_model.bin", "pytorch_model.bin.index.json"))


def loaded_weight_files(directory: str) -> list[str]:
    """The weight files transformers loads from the model ``directory``, sorted ([]: none of
    its names is there)."""
    for single, index in _WEIGHT_FILES:
        if os.path.isfile(os.path.join(directory, single)):
            return [single]
        path = os.path.join(directory, index)
        if os.path.isfile(path):
            with open(path) as f:
                shards = json.load(f).get("weight_map")
            if not isinstance(shards, dict):
                raise TrainConfigError(f"{path} has no weight_map: download the checkpoint's "
                                       "files again")
            return sorted(set(shards.values()))
    return []


def unreadable_weights(key: str, path: str, files: list[str]) -> str | None:
    """Why the weight ``files`` (``loaded_weight_files``) of the model at ``path``, which
    ``key`` names, cannot be read (mimo reads safetensors), None where they can."""
    if files and files[0].endswith(".safetensors"):
        return None
    return (f"{key} {path} holds no model.safetensors (nor an index of safetensors shards)"
            + (f", only {files[0]}: save it as safetensors (transformers' from_pretrained, "
               "then save_pretrained)" if files else ""))


class CheckpointWeights(Tensors):
    """The tensors of a transformers checkpoint directory (safetensors), read on demand:
    whole in fp32 (``weights(name)``), or a part in the dtype stored (``part``: safetensors'
    ``get_slice``, no read of the rest); ``key``: the config key that named it (for
    errors)."""

    def __init__(self, path: str, key: str = "model.language.pretrained"):
        path = model_directory(path)
        files = loaded_weight_files(path)
        if why := unreadable_weights(key, path, files):
            raise TrainConfigError(why)
        super().__init__(self.__call__)
        self.key, self.path = key, path
        self.files = {}
        for name in files:
            self.files.update(dict.fromkeys((handle := self._open(name)).keys(), handle))

    def _open(self, name: str):
        from safetensors import SafetensorError, safe_open
        try:
            return safe_open(os.path.join(self.path, name), framework="pt")
        except FileNotFoundError:
            raise TrainConfigError(f"{self.key} {self.path}: {name}, which its "
                                   "model.safetensors.index.json names, is missing: download "
                                   "the checkpoint's files again") from None
        except SafetensorError as exc:      # a git-lfs pointer, a download cut short
            raise TrainConfigError(f"{self.key} {self.path}: {name} is not a whole safetensors "
                                   f"file ({exc}): a git-lfs pointer, or a download cut short; "
                                   "download it again") from None

    def __call__(self, name: str) -> torch.Tensor:
        return self._file(name).get_tensor(name).float()

    def part(self, name: str, index: tuple[slice, ...] = ()) -> torch.Tensor:
        # safetensors gives a view of the mapped file: contiguous() copies only a strided part
        return self._file(name).get_slice(name)[index].contiguous()

    def _file(self, name: str):
        if name not in self.files:
            raise TrainConfigError(f"{self.key} {self.path} holds no tensor {name}: not a "
                                   "checkpoint of the architecture its config.json names")
        return self.files[name]

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape of ``name`` (its data not read)."""
        return tuple(self._file(name).get_slice(name).get_shape())

    def prefix_of(self, prefixes: Iterable[str], name: str) -> str:
        """The first of ``prefixes`` under which the checkpoint holds ``name``."""
        for prefix in prefixes:
            if prefix + name in self:
                return prefix
        raise TrainConfigError(f"{self.key} {self.path} holds no {name} under any of "
                               f"{listed(prefixes)}: not a checkpoint of the family its config "
                               "names")

    def load_into(self, module: torch.nn.Module, prefix: str, what: str) -> None:
        """Every weight of ``module`` from the checkpoint's ``prefix`` + its name (read in the
        dtype stored, copied into the module's)."""
        own = module.state_dict()
        found = {name: self.part(prefix + name) for name in own if prefix + name in self}
        missing = sorted(set(own) - set(found))
        wrong = [f"{k} {tuple(v.shape)} vs {tuple(own[k].shape)}" for k, v in found.items()
                 if v.shape != own[k].shape]
        if missing or wrong:
            raise TrainConfigError(f"{self.key} {self.path}: the {what}'s weights under "
                                   f"{prefix} do not fit it: missing {missing[:3]}, "
                                   f"shapes {wrong[:3]}")
        module.load_state_dict(found)


@dataclass(frozen=True)
class VLM:
    """What mimo takes from a whole vision-language checkpoint, as its family module reads
    it: the tower becomes the image encoder (``encoder_kind``), the projector mimo's
    ``projection``, the language model ``causal_lm``'s."""
    path: str
    family: str                       # the checkpoint's model_type
    image_token_id: int               # the placeholder the language model expects
    image_wrap_ids: tuple[int, ...]   # () or the (start, end) tokens around each image
    positions: str                    # sequential | mrope
    encoder_kind: str                 # mimo's encoder kind for the tower
    vision_prefixes: tuple[str, ...]  # where the tower's weights may sit, in either layout
    projection: str                   # mimo's projection: none | mlp
    # where the language model's decoder weights may sit, and its output layer's name
    language_prefixes: tuple[str, ...] = ("model.language_model.", "model.")
    head_names: tuple[str, ...] = ("lm_head.weight",)
    # mimo projection weight -> the checkpoint's name after the projector prefix
    projector_names: tuple[tuple[str, str], ...] = ()
    projector_prefixes: tuple[str, ...] = ()
    # videos through the same tower (Qwen2-VL): their placeholder, between image_wrap_ids
    video_token_id: int | None = None
    tokens_per_second: float | None = None  # Qwen2.5-VL's M-RoPE time positions per second
    # its video processor's settings that change what the tower sees (modalities.video key ->
    # value: normalization, frame sampling, timestamps), where its processor files say them
    video_inputs: tuple[tuple[str, Any], ...] = ()
    # the modalities.image settings (key -> value) that decide an image's tokens, as its tower
    # takes them (a video's too, through the same tower, but for the policy)
    image_tokens_by: tuple[tuple[str, Any], ...] = ()

    @property
    def modalities(self) -> tuple[str, ...]:
        """What its own tower encodes."""
        return ("image",) if self.video_token_id is None else ("image", "video")

    def weights(self) -> CheckpointWeights:
        return CheckpointWeights(self.path, key="model.pretrained")

    def tower_prefix(self, weights: CheckpointWeights) -> str:
        """The prefix the tower's names have in this checkpoint's layout."""
        return _first_prefix(weights, self.vision_prefixes)

    def projector_prefix(self, weights: CheckpointWeights) -> str:
        return weights.prefix_of(self.projector_prefixes, self.projector_names[0][1])

    def checkpoint_names(self, weights: CheckpointWeights) -> list[tuple[str, str]]:
        """mimo's image encoder module's parameter-name prefixes -> the checkpoint's: the
        tower, then each projector weight."""
        renames = [("encoders.image.encoder.model.", self.tower_prefix(weights))]
        if self.projector_names:
            prefix = self.projector_prefix(weights)
            renames += [(f"input_projections.0.{ours}", prefix + theirs)
                        for ours, theirs in self.projector_names]
        return renames

    def projector(self) -> dict[str, torch.Tensor] | None:
        """The projector's weights under mimo's ``Projection`` names, in the dtype stored
        (None: no projector)."""
        if not self.projector_names:
            return None
        weights = self.weights()
        prefix = self.projector_prefix(weights)
        return {ours: weights.part(prefix + theirs) for ours, theirs in self.projector_names}

    def load_tower(self, tower: torch.nn.Module) -> None:
        """The tower's weights (fp32) into ``tower``, built from the checkpoint's
        ``vision_config``; every weight must come from the checkpoint."""
        weights = self.weights()
        weights.load_into(tower, self.tower_prefix(weights), "vision tower")


def _first_prefix(weights: CheckpointWeights, prefixes: Iterable[str]) -> str:
    prefixes = list(prefixes)
    for prefix in prefixes:
        if any(name.startswith(prefix) for name in weights.files):
            return prefix
    raise TrainConfigError(f"{weights.key} {weights.path} holds no weights under any of "
                           f"{prefixes}: not a checkpoint of the family its config names")
